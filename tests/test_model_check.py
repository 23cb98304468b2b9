"""A spec against its model before training (shardlang.model_check, `shardlang check --model`):
missing parameters, declarations and rules that match nothing, misspellings, wrappers'
prefixes, shapes, dtypes and meshes against the job's rank count."""

from __future__ import annotations

import doctest
import io
import os
import pickle
import shlex
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import pytest

import shardlang.model_check
from cli.main import main
from shardlang import ShardlangError, SpecError, parse_spec
from shardlang.model_check import ERROR, WARNING, ModelMismatchError, bare, check_model

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden" / "check_model.txt"

SPEC = parse_spec(
    """
mesh world = [dp=2]
tensor wte.weight : f32[64, 16] { param = S(dp),R over world }
tensor h.{0..1}.attn.weight : f32[16, 16] { param = R,R over world  state = S(dp),R over world }
rule "h.*.ln.*" { param = R over world }
""",
    "model.shard",
)
PARAMS = [
    ("wte.weight", (64, 16), "f32"),
    ("h.0.attn.weight", (16, 16), "f32"),
    ("h.1.attn.weight", (16, 16), "f32"),
    ("h.0.ln.weight", (16,), "f32"),
    ("h.1.ln.bias", (16,), "f32"),
]


def _kinds(check: shardlang.model_check.ModelCheck) -> list[tuple[str, str]]:
    return [(f.severity, f.kind) for f in check.findings]


def test_a_spec_that_fits_its_model_has_no_findings() -> None:
    check = check_model(SPEC, PARAMS, world_size=2)
    assert check.findings == () and check.ok and check.parameters == 5
    check.raise_errors()  # nothing to raise


@pytest.mark.parametrize(
    ("rename", "segment", "who"),
    [
        (lambda n: "module." + n, "'module.'", "DDP"),
        (lambda n: "module.module." + n, "'module.'", "DDP"),
        (lambda n: "_orig_mod." + n, "'_orig_mod.'", "torch.compile"),
        (lambda n: n.replace("h.", "h._fsdp_wrapped_module."), "'_fsdp_wrapped_module.'", "FSDP"),
        (lambda n: "_orig_mod.module." + n, "'module.'", "torch.compile"),
        (lambda n: n.replace("attn.", "_checkpoint_wrapped_module.attn."), "_checkpoint_wrapped_module", "checkpoint"),
    ],
)
def test_a_wrappers_prefix_is_named_once_not_as_missing_parameters(rename: object, segment: str, who: str) -> None:
    params = [(rename(n), s, d) for n, s, d in PARAMS]  # type: ignore[operator]
    changed = [p for p, q in zip(params, PARAMS, strict=True) if p[0] != q[0]]
    check = check_model(SPEC, params)
    assert _kinds(check) == [(ERROR, "prefix")]
    (finding,) = check.findings
    assert segment in finding.message and who in finding.message
    # Every renamed parameter of a declared tensor is in it; a renamed one the rule's glob
    # still matches (h.*.ln.* matches h._fsdp_wrapped_module.0.ln.weight) is not.
    declared = {t.name for t in SPEC.tensors}
    must = {p[0] for p, q in zip(params, PARAMS, strict=True) if p in changed and q[0] in declared}
    assert must <= set(finding.parameters) <= {n for n, _, _ in changed}
    assert f"{len(finding.parameters)} parameter" in finding.message


def test_a_prefix_in_the_spec_that_the_model_lacks_is_named() -> None:
    spec = parse_spec("tensor module.w : f32[4] { param = R over mesh[2] }", "m.shard")
    check = check_model(spec, [("w", (4,), "f32")])
    assert _kinds(check) == [(ERROR, "prefix")]
    assert "the spec's names carry the prefix 'module.'" in check.findings[0].message


def test_a_catch_all_rule_does_not_hide_a_prefix() -> None:
    spec = parse_spec('tensor w : f32[4] { param = S0 over mesh[2] }\nrule "*" { param = R over mesh[2] }')
    check = check_model(spec, [("module.w", (4,), "f32"), ("module.b", (4,), "f32")])
    assert _kinds(check) == [(ERROR, "prefix")]
    assert "'module.w'" in check.findings[0].message and "would take a rule's layouts" in check.findings[0].message


def test_a_misspelling_is_one_error_with_did_you_mean_at_the_declaration() -> None:
    spec = parse_spec("tensor h.0.attn.weigth : f32[4] { param = R over mesh[2] }\n", "m.shard")
    check = check_model(spec, [("h.0.attn.weight", (4,), "f32")])
    assert _kinds(check) == [(ERROR, "missing")]
    (finding,) = check.findings
    assert "parameter 'h.0.attn.weight' f32[4] has no layouts: did you mean 'h.0.attn.weigth'?" in finding.message
    assert finding.position is not None and (finding.position.line, finding.position.column) == (1, 1)


def test_missing_parameters_unused_declarations_and_rules() -> None:
    params = [*PARAMS[:3], ("lm_head.weight", (64, 16), "f32")]
    check = check_model(SPEC, params)
    assert _kinds(check) == [(ERROR, "missing"), (WARNING, "unused")]
    assert "parameter 'lm_head.weight' f32[64, 16] has no layouts" in check.findings[0].message
    assert 'rule "h.*.ln.*" matches no parameter' in check.findings[1].message
    spec = parse_spec(
        "tensor a : f32[4] { param = R over mesh[2] }\ntensor lm_head.wieght : f32[4] { param = R over mesh[2] }"
    )
    check = check_model(spec, [("a", (4,), "f32"), ("lm_head.weight", (8,), "f32")])
    # lm_head.weight is missing and close to the unused declaration: one error, not an error and a warning
    assert _kinds(check) == [(ERROR, "missing")]
    check = check_model(spec, [("a", (4,), "f32")])
    assert _kinds(check) == [(WARNING, "unused")] and check.ok


def test_shapes_and_rank_free_rules_against_the_parameters() -> None:
    params = [(n, (32, 16) if n == "wte.weight" else s, d) for n, s, d in PARAMS] + [("h.0.ln.x", (2, 3, 4), "f32")]
    check = check_model(SPEC, params)
    assert _kinds(check) == [(ERROR, "shape")]
    assert "declared with shape [64, 16] but the model's parameter has shape [32, 16]" in check.findings[0].message
    spec = parse_spec('rule "*" { param = R,S0 over mesh[2] }')
    check = check_model(spec, [("b", (4,), "f32"), ("w", (4, 4, 4), "f32")])
    assert _kinds(check) == [(ERROR, "shape")] and check.findings[0].parameters == ("b",)


def test_a_ranks_pieces_fit_with_rank() -> None:
    """An optimizer's parameters are its rank's pieces: with ``rank`` a declared tensor's shape
    may be the piece (torch.chunk's, by hand: 7 rows in 2 are 4 and 3) or the whole."""
    spec = parse_spec("tensor w : f32[7, 6] { param = S0,R over mesh[2] }")
    for rank, piece, other in ((0, (4, 6), (3, 6)), (1, (3, 6), (4, 6))):
        for shape in (piece, (7, 6)):
            assert check_model(spec, [("w", shape, "f32")], rank=rank).findings == ()
        assert _kinds(check_model(spec, [("w", other, "f32")], rank=rank)) == [(ERROR, "shape")]
        assert _kinds(check_model(spec, [("w", piece, "f32")])) == [(ERROR, "shape")]  # without rank: the whole
    outside = parse_spec("tensor w : f32[8] { param = S0 over mesh[2] ranks 2..3 }")
    assert _kinds(check_model(outside, [("w", (4,), "f32")], rank=0)) == [(ERROR, "shape")]
    with pytest.raises(SpecError, match="rank must be a non-negative integer"):
        check_model(spec, [("w", (7, 6), "f32")], rank=-1)


def test_a_dtype_that_is_not_the_parameters_is_a_warning() -> None:
    torch = pytest.importorskip("torch")
    params = [(n, torch.zeros(s, dtype=torch.bfloat16)) for n, s, _ in PARAMS]  # as named_parameters() gives them
    check = check_model(SPEC, params)
    assert _kinds(check) == [(WARNING, "dtype")] * 3 and check.ok
    assert "declared f32 but the model's parameter is bf16" in check.findings[0].message
    assert check_model(SPEC, [(n, s, "torch.float32") for n, s, _ in PARAMS]).findings == ()


def test_meshes_against_the_world_size() -> None:
    check = check_model(SPEC, PARAMS, world_size=1)
    assert _kinds(check) == [(ERROR, "mesh")]
    assert "mesh 'world' (mesh[dp=2]) holds 2 ranks (up to rank 1) but the job has 1" in check.findings[0].message
    check = check_model(SPEC, PARAMS, world_size=8)
    assert _kinds(check) == [(WARNING, "idle_ranks")] and "ranks 2..7" in check.findings[0].message
    spec = parse_spec('rule "*" { param = R over mesh[2] ranks 4..5 }')
    assert _kinds(check_model(spec, [("w", (4,), "f32")], world_size=5)) == [(ERROR, "mesh"), (WARNING, "idle_ranks")]
    with pytest.raises(SpecError, match="world_size must be a positive integer"):
        check_model(SPEC, PARAMS, world_size=0)


def test_raise_errors_lists_every_error_and_is_a_shardlang_error() -> None:
    params = [("module.wte.weight", (64, 16), "bf16"), ("lm_head.weight", (4,), "f32")]
    check = check_model(SPEC, params, world_size=1)
    with pytest.raises(ModelMismatchError) as caught:
        check.raise_errors()
    assert isinstance(caught.value, ShardlangError) and caught.value.check is check
    lines = str(caught.value).splitlines()
    assert lines[0] == f"the spec does not fit the model ({len(check.errors)} errors, {len(check.warnings)} warnings)"
    placed = [f"{f.position.prefix()}: " if f.position else "" for f in check.errors]
    expected = [p + f.message for p, f in zip(placed, check.errors, strict=True)]
    assert [line.removeprefix("  - ") for line in lines[1:]] == expected
    assert placed == ["", "", "model.shard:2:1: "]  # the prefix, lm_head.weight (no line), the mesh's declaration
    assert len(check.errors) == 3  # the prefix, lm_head.weight, the mesh
    again = pickle.loads(pickle.dumps(caught.value))  # as a rank's error reaches the others
    assert str(again) == str(caught.value) and again.check == check


def test_bare_names() -> None:
    assert bare("module.module.h.0.w") == ("h.0.w", ("module.",))
    assert bare("h.module.w") == ("h.module.w", ())  # 'module.' only leads a name
    assert bare("_orig_mod.a._fsdp_wrapped_module.b._fsdp_wrapped_module.c") == (
        "a.b.c",
        ("_fsdp_wrapped_module.", "_orig_mod."),
    )


def test_the_modules_example() -> None:
    result = doctest.testmod(shardlang.model_check, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 4 and result.failed == 0


def test_the_language_layer_imports_neither_torch_nor_the_planner() -> None:
    code = (
        "import sys, shardlang.model_check; "
        "print(sorted(m for m in ('torch', 'planner', 'runtime') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


# --- the command --------------------------------------------------------------------------------
def _golden_cases() -> list[tuple[str, int, str, str]]:
    cases = []
    for block in GOLDEN.read_text().split("\n# RUN: ")[1:]:
        lines = block.rstrip("\n").split("\n")
        command, code = lines[0], int(lines[1].removeprefix("# EXIT: "))
        at = lines.index("# STDERR")
        cases.append(
            (command, code, "".join(f"{x}\n" for x in lines[3:at]), "".join(f"{x}\n" for x in lines[at + 1 :]))
        )
    return cases


def test_there_are_golden_commands() -> None:
    assert len(_golden_cases()) >= 5


@pytest.mark.parametrize(("command", "code", "stdout", "stderr"), _golden_cases(), ids=lambda v: None)
def test_check_model_prints_the_golden_text(command: str, code: int, stdout: str, stderr: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    here = Path.cwd()
    with mock.patch.dict(os.environ, {"NO_COLOR": "1", "COLUMNS": "100"}), redirect_stdout(out), redirect_stderr(err):
        try:
            os.chdir(REPO)
            got = main(shlex.split(command)[1:])
        except SystemExit as e:
            got = e.code
        finally:
            os.chdir(here)
    assert "Traceback" not in err.getvalue()
    assert (got, out.getvalue(), err.getvalue()) == (code, stdout, stderr)
