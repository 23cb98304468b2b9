"""``shardlang init`` and ``shardlang.spec_for``: specs for a GPT-2-like and a LLaMA-like module
that ``shardlang check`` accepts and that train with both sharded optimizers on 4 ranks, each
rank's pieces equal to torch.optim.AdamW's and came_pytorch.CAME's on the whole model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import came_pytorch
import pytest
import torch

from cli.main import main
from runtime.testing import run_ranks
from shardlang import STRATEGIES, load_spec, parse_spec, spec_for
from shardlang.errors import ShardlangError
from shardlang.spec import expand_braces
from shardlang.writer import fold_names
from tests.conftest import REPO
from tests.init_models import CONTEXT, VOCAB, gpt2_like, llama_like, loss

MODELS = {"gpt2": "tests.init_models:gpt2_like", "llama": "tests.init_models:llama_like"}
FACTORIES = {"gpt2": gpt2_like, "llama": llama_like}
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-3}
CAME = {"lr": 1e-2, "weight_decay": 0.1, "eps": (1e-6, 1e-16)}


def _init(tmp_path: Path, model: str, strategy: str, capsys: pytest.CaptureFixture[str], rules: bool = False) -> Path:
    out = tmp_path / f"{model}_{strategy}{'_rules' * rules}.shard"
    argv = ["init", "--model", MODELS[model], "--mesh", "world = [dp=4]", "--strategy", strategy, "-o", str(out)]
    argv += ["--rules"] * rules
    assert main(argv) == 0, capsys.readouterr().err
    assert main(["check", str(out)]) == 0, capsys.readouterr().err
    return out


def test_init_specs_are_compact_complete_and_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for model, factory in FACTORIES.items():
        shapes = {n: tuple(p.shape) for n, p in factory().named_parameters()}
        for strategy in STRATEGIES:
            path = _init(tmp_path, model, strategy, capsys)
            spec = load_spec(path)
            assert {t.name: t.shape for t in spec.tensors} == shapes
            if strategy == "zero3":  # every layout splits the tensor over dp
                assert all("S(dp)" in str(t.param) and t.grad == t.param == t.state() for t in spec.tensors)
    text = (tmp_path / "gpt2_zero1.shard").read_text()
    assert "tensor h.{0..1}.mlp.c_fc.weight : f32[32, 8] {" in text
    # per rank: the whole [32, 8] f32 weight, and a quarter of it per state
    assert "# per rank each: param 1 KiB, grad 1 KiB, 256 B per optimizer state" in text
    # The docs' example is the GPT-2-like module's ZeRO-2 spec, word for word.
    page = (REPO / "docs" / "tutorials" / "specs-for-models.md").read_text().split("## What `init` writes", 1)[1]
    assert page.split("```\n", 2)[1] in (tmp_path / "gpt2_zero2.shard").read_text()
    llama = (tmp_path / "llama_zero2.shard").read_text()
    assert "tensor model.layers.{0..1}.mlp.{gate_proj,up_proj}.weight : f32[24, 8] {" in llama
    assert "  grad  = R,R | P(dp):avg over world\n  state = S(dp),R over world" in llama


def test_rank_free_rules_give_every_tensor_its_layouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for model, factory in FACTORIES.items():
        for strategy in STRATEGIES:
            declared = load_spec(_init(tmp_path, model, strategy, capsys))
            rules = load_spec(_init(tmp_path, model, strategy, capsys, rules=True))
            assert not rules.tensors and rules.rules[-1].pattern == "*" and len(rules.rules) <= 3
            for name, p in factory().named_parameters():
                assert rules.resolve(name, tuple(p.shape), "f32").layouts == declared.tensor(name).layouts
    assert len(load_spec(tmp_path / "llama_ddp_rules.shard").rules) == 1  # one rule for the whole model


def test_folded_names_expand_to_exactly_the_names() -> None:
    names = [f"h.{i}.{part}.{kind}" for i in (0, 1, 2, 4) for part in ("ln_1", "ln_2") for kind in ("weight", "bias")]
    names += ["wte", "h.3.ln_1.weight"]
    patterns = fold_names(names)
    expanded = [n for p in patterns for n in expand_braces(p)]
    assert sorted(expanded) == sorted(names) and len(expanded) == len(names)
    assert patterns == ["h.{0,1,2,4}.{ln_1,ln_2}.{weight,bias}", "wte", "h.3.ln_1.weight"]


def test_spec_for_from_shapes_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = spec_for([("a", [8, 4]), ("b", [6], "bf16"), ("c", [])], "world = [dp=2, x=2]", "zero3")
    a, b, c = (spec.tensor(n) for n in "abc")
    assert str(a.param) == "S(dp,x),R over world"
    assert str(spec_for([("d", [3, 6])], "world = [dp=2, x=2]", "zero3").tensor("d").param) == "R,S(dp,x) over world"
    assert b.dtype == "bf16" and str(b.state()) == "S(dp,x) over world" and str(c.state()) == "() over world"
    assert parse_spec(f"mesh world = [dp=2, x=2]\ntensor b : bf16[6] {{ param = {b.param} }}").tensor("b") == b
    for bad in ([("a b", [2])], [("a", [2]), ("a", [3])], [("a", "xy")]):
        with pytest.raises(ShardlangError):
            spec_for(bad, "world = [dp=2]", "ddp")
    with pytest.raises(ShardlangError, match="unknown strategy"):
        spec_for([("a", [2])], "world = [dp=2]", "zero4")
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([["w", [8, 4]], {"name": "v", "shape": [3], "dtype": "f16"}]))
    assert main(["init", "--shapes", str(shapes), "--mesh", "world = [dp=4]", "--strategy", "zero1"]) == 0
    written = parse_spec(capsys.readouterr().out)
    assert [(t.name, t.shape, t.dtype) for t in written.tensors] == [("w", (8, 4), "f32"), ("v", (3,), "f16")]
    shapes.write_text('[["w", [8, "x"]]]')
    assert main(["init", "--shapes", str(shapes), "--mesh", "world = [dp=4]"]) == 1
    assert "entry 0 ('w'): a shape is a list of integers" in capsys.readouterr().err
    assert main(["init", "--model", "tests.init_models:nothing", "--mesh", "world = [dp=4]"]) == 1
    assert "has no function nothing" in capsys.readouterr().err


# --- training on 4 ranks -------------------------------------------------------------------
def _batches(step: int) -> torch.Tensor:
    """4 micro-batches (one per rank) of 2 token rows each."""
    return torch.randint(0, VOCAB, (4, 2, CONTEXT + 1), generator=torch.Generator().manual_seed(100 + step))


def _piece(full: torch.Tensor, layout: Any, rank: int) -> torch.Tensor:
    return full[tuple(slice(lo, hi) for lo, hi in layout.rank_piece(tuple(full.shape), rank))]


def _train(rank: int, world: int, cases: list[tuple[str, str, str, str]]) -> dict[str, float]:
    """Per case, the largest difference between this rank's pieces and the whole-model
    reference, after each of 2 steps."""
    from runtime.optim import ShardedAdamW, ShardedCAME

    errors = {}
    for model_name, strategy, kind, text in cases:
        spec = parse_spec(text)
        model = FACTORIES[model_name]()  # the reference, and the forward of every step
        full = dict(model.named_parameters())
        entries = {n: spec.resolve(n, tuple(p.shape), "f32") for n, p in full.items()}  # declared, or by a rule
        pieces = {n: torch.nn.Parameter(_piece(p.detach(), entries[n].param, rank).clone()) for n, p in full.items()}
        if kind == "adamw":
            sharded = ShardedAdamW(list(pieces.items()), spec, **ADAMW)
            reference: torch.optim.Optimizer = torch.optim.AdamW(list(full.values()), foreach=False, **ADAMW)
        else:
            sharded = ShardedCAME(list(pieces.items()), spec, **CAME)
            reference = came_pytorch.CAME(list(full.values()), **CAME)
        worst = 0.0
        for step in range(2):
            batches = _batches(step)
            own = torch.autograd.grad(loss(model, batches[rank]), list(full.values()))
            mean = torch.autograd.grad(loss(model, batches.reshape(-1, CONTEXT + 1)), list(full.values()))
            for (name, piece), g_own, g_mean in zip(pieces.items(), own, mean, strict=True):
                layout = entries[name].grad  # pending a mean over dp: this rank's own gradient
                piece.grad = _piece(g_own if layout.is_partial else g_mean, layout, rank).clone()
            sharded.step()
            for p, g in zip(full.values(), mean, strict=True):
                p.grad = g
            reference.step()
            for name, piece in pieces.items():
                expected = _piece(full[name].detach(), entries[name].param, rank)
                worst = max(worst, (piece.detach() - expected).abs().max().item())
        errors[f"{model_name} {strategy} {kind}"] = worst
    return errors


# Each model with each optimizer, over three strategies (a rank's step costs seconds on a
# loaded 2-core machine, so not every combination).
TRAINED = (
    ("gpt2", "zero2", "adamw"),
    ("gpt2", "zero3", "came"),
    ("llama", "zero3", "adamw"),
    ("llama", "zero1", "came"),
)
RULES = ("llama", "zero1")  # trained from its rank-free rules


@pytest.mark.slow
def test_init_specs_train_with_both_optimizers_on_four_ranks(tmp_path: Path, capsys) -> None:
    cases = [(m, s, kind, _init(tmp_path, m, s, capsys, rules=(m, s) == RULES).read_text()) for m, s, kind in TRAINED]
    assert "rule " in cases[-1][3] and "tensor " not in cases[-1][3]
    results = run_ranks(_train, world_size=4, args=(cases,), timeout=240)
    for rank, errors in enumerate(results):
        assert len(errors) == len(cases)
        for case, error in errors.items():
            assert error < 1e-5, (rank, case, error)
