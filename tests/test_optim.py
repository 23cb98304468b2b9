"""The sharded optimizers in one process: the math against the references, the partial sums
of flat chunks against dense sums, the batching of sums, and every error a user can cause.
(Multi-rank runs are in test_optim_dist.py.)"""

from __future__ import annotations

import datetime
import math

import came_pytorch
import pytest
import torch

from runtime.optim import OptimizerError, ShardedAdamW, ShardedCAME
from runtime.optim.shards import StateShard
from runtime.optim.sums import SumSpec, plan_collectives
from shardlang import ShardlangError, parse_layout, parse_spec
from shardlang.spec import Layouts, TensorSpec

SHAPES = {"w": (37, 24), "b": (24,), "t": (4, 6, 5), "e": (301, 8), "s": (3, 7)}


def _replicated(shape: tuple[int, ...], mesh: str = "mesh[1]") -> Layouts:
    layout = parse_layout(f"{','.join('R' for _ in shape) or '()'} over {mesh}")
    return Layouts(param=layout, grad=layout, states=(("", layout),))


# --- flat chunks: partial sums add up to the dense sums ------------------------------------
@pytest.mark.parametrize("shape", [(37, 24), (4, 6, 5), (3, 7), (2, 3), (301, 8)])
@pytest.mark.parametrize("n", [3, 4])
def test_flat_chunk_sums_add_up_to_the_dense_sums(shape: tuple[int, ...], n: int) -> None:
    """Every rank's index_add partial sums over its flat range, summed over the ranks, are the
    dense row, column and matrix sums; statistics spread back land on the right elements.
    (2 x 3 over 4 ranks leaves the last chunk empty; 37 x 24 cuts rows mid-way.)"""
    full = torch.randn(shape, dtype=torch.float64)
    layout = parse_layout(f"{','.join('R' for _ in shape)} over mesh[dp={n}]")
    row_stat = torch.randn(shape[:-1], dtype=torch.float64)
    col_stat = torch.randn(shape[:-2] + shape[-1:], dtype=torch.float64)
    rows = cols = matrices = 0
    chunk = -(-math.prod(shape) // n)
    for rank in range(n):
        shard = StateShard.of(shape, layout, rank, flat_axis=0)
        lo, hi = min(rank * chunk, full.numel()), min((rank + 1) * chunk, full.numel())
        assert shard.local_shape == (hi - lo,)
        local = full.flatten()[lo:hi]
        rows = rows + shard.row_sums(local)
        cols = cols + shard.col_sums(local)
        matrices = matrices + shard.matrix_sums(local)
        spread_rows = row_stat.unsqueeze(-1).expand(shape).flatten()[lo:hi]
        spread_cols = col_stat.unsqueeze(-2).expand(shape).flatten()[lo:hi]
        assert torch.equal(shard.rows(row_stat), spread_rows)
        assert torch.equal(shard.cols(col_stat), spread_cols)
    torch.testing.assert_close(rows, full.sum(-1))
    torch.testing.assert_close(cols, full.sum(-2))
    torch.testing.assert_close(matrices, full.sum((-2, -1)))


def test_flat_chunks_of_a_tensor_parallel_piece() -> None:
    """With tensor parallelism the flat view is of the rank's tp piece (the base block)."""
    layout = parse_layout("R,S(tp) over mesh[dp=2,tp=2]")
    shard = StateShard.of((37, 5), layout, rank=3, flat_axis=0)  # dp 1, tp 1: columns 3..4
    assert shard.block_shape == (37, 2)
    assert shard.flat_range == (37, 74)
    assert shard.row_sum_axes == {0, 1} and shard.col_sum_axes == {0}


# --- batching the sums of one phase ----------------------------------------------------------
def _sum(mesh, axes, replicated=(), numel=3, dtype=torch.float32) -> SumSpec:
    return SumSpec(
        mesh=mesh, axes=frozenset(axes), numel=numel, dtype=dtype, owner="x", replicated=frozenset(replicated)
    )


def test_sums_share_groups_and_ride_larger_ones_only_where_replicated() -> None:
    mesh = parse_layout("R over mesh[dp=2,tp=2]").mesh
    sums = [
        _sum(mesh, {1}),  # row sums: over tp
        _sum(mesh, {0}),  # column sums: over dp
        _sum(mesh, {0, 1}),  # matrix totals: over both
        _sum(mesh, {0}, replicated={1}),  # the row normaliser: same on every tp rank
        _sum(mesh, {0}),  # another tensor's column sums
    ]
    for rank, masked in ((0, False), (1, True), (2, False), (3, True)):  # tp coordinate = rank % 2
        collectives = plan_collectives(sums, rank)
        by_axes = {c.axes: c for c in collectives}
        assert set(by_axes) == {(0, 1), (1,), (0,)}
        assert by_axes[(0, 1)].members == ((2, False), (3, masked))
        assert by_axes[(0,)].members == ((1, False), (4, False))
        assert by_axes[(0,)].numel == 6
        assert by_axes[(0, 1)].bytes == 2 * 3 * 2 * 4  # 2 (n-1) ceil(E/n) itemsize, n = 4, E = 6


def test_sums_that_need_no_communication_and_dtypes() -> None:
    mesh = parse_layout("R over mesh[dp=1,tp=4]").mesh
    assert plan_collectives([_sum(mesh, {0}), _sum(mesh, set())], 0) == ()
    collectives = plan_collectives([_sum(mesh, {1}), _sum(mesh, {0, 1}, dtype=torch.float64)], 0)
    assert [(c.axes, c.dtype) for c in collectives] == [((1,), torch.float32), ((1,), torch.float64)]


# --- one device: the math against the references ----------------------------------------------
def _run(kind: str, dtype: torch.dtype, steps: int = 20, param_dtype: torch.dtype | None = None):
    gen = torch.Generator().manual_seed(3)
    start = {n: torch.randn(s, generator=gen, dtype=dtype) for n, s in SHAPES.items()}
    ours = {n: torch.nn.Parameter(t.to(param_dtype or dtype)) for n, t in start.items()}
    ref = {n: torch.nn.Parameter(p.detach().to(dtype)) for n, p in ours.items()}
    spec = {n: _replicated(s) for n, s in SHAPES.items()}
    if kind == "adamw":
        optimizer = ShardedAdamW(list(ours.items()), spec, lr=1e-2, weight_decay=0.1)
        reference = torch.optim.AdamW(list(ref.values()), lr=1e-2, weight_decay=0.1, foreach=True)
    else:
        hyper = {"lr": 1e-2, "weight_decay": 0.1, "clip_threshold": 0.3, "betas": (0.9, 0.99, 0.999)}
        optimizer = ShardedCAME(list(ours.items()), spec, **hyper)
        reference = came_pytorch.CAME(list(ref.values()), **hyper)
    for step in range(steps):
        for name, shape in SHAPES.items():
            grad = torch.randn(shape, generator=gen, dtype=dtype)
            if step % 4 == 0 and len(shape) > 1:
                grad[..., 1, :] = 0
            ours[name].grad = grad.to(param_dtype or dtype)
            ref[name].grad = ours[name].grad.to(dtype)
        optimizer.step()
        reference.step()
    return ours, ref, optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adamw_equals_torch_adamw_bit_for_bit(dtype: torch.dtype) -> None:
    ours, ref, _ = _run("adamw", dtype)
    for name in SHAPES:
        assert torch.equal(ours[name], ref[name]), name


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_came_equals_came_pytorch(dtype: torch.dtype, tolerance: float) -> None:
    ours, ref, _ = _run("came", dtype)
    for name in SHAPES:
        error = ((ours[name] - ref[name]).abs().max() / ref[name].abs().max()).item()
        assert error <= tolerance, f"{name}: {error:.3g}"


@pytest.mark.parametrize("kind", ["adamw", "came"])
def test_bf16_parameters_step_an_fp32_master(kind: str) -> None:
    ours, ref, optimizer = _run(kind, torch.float32, param_dtype=torch.bfloat16)
    for name, entry in optimizer.state_dict()["tensors"].items():
        master = entry["states"]["master"]["tensor"]
        assert master.dtype == torch.float32 and ours[name].dtype == torch.bfloat16
        assert torch.isfinite(master).all()
        if kind == "adamw":
            assert torch.equal(master, ref[name].detach())
        else:
            torch.testing.assert_close(master, ref[name].detach(), rtol=1e-5, atol=1e-6)


def test_step_without_gradients_and_with_a_closure() -> None:
    p = torch.nn.Parameter(torch.ones(3, 4))
    optimizer = ShardedAdamW([("p", p)], {"p": _replicated((3, 4))})
    optimizer.step()
    assert torch.equal(p, torch.ones(3, 4)) and optimizer.state_bytes() == 0

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    assert optimizer.step(closure).item() == 12.0
    assert not torch.equal(p, torch.ones(3, 4))


# --- errors -------------------------------------------------------------------------------------
SPEC = """
mesh world = [dp=2]
tensor w : f32[37, 24] { param = R,R over world  grad = R,R | P(dp):avg over world  state = S(dp),R over world }
rule "*.bias" { param = R over world  grad = R | P(dp) over world  state = S(dp) over world }
"""


def _error(make) -> str:
    with pytest.raises(OptimizerError) as info:
        make()
    assert isinstance(info.value, ShardlangError)
    return str(info.value)


def test_construction_errors_name_the_tensor() -> None:
    spec = parse_spec(SPEC)
    w = torch.nn.Parameter(torch.zeros(37, 24))
    assert "named parameters" in _error(lambda: ShardedAdamW([w], spec))
    assert "'v'" in _error(lambda: ShardedAdamW([("w", w), ("v", torch.nn.Parameter(torch.zeros(3)))], spec))
    assert "'w'" in _error(lambda: ShardedAdamW([("w", torch.nn.Parameter(torch.zeros(10, 24)))], spec))
    assert "'w'" in _error(lambda: ShardedAdamW([("w", w)], spec, flat_axis="tp"))
    assert "lr" in _error(lambda: ShardedCAME([("w", w)], spec, lr=-1.0))
    assert "no parameters" in _error(lambda: ShardedAdamW([], spec))
    for timeout in (0, -1.5, "soon", float("nan"), datetime.timedelta(0)):
        assert "timeout must be positive" in _error(lambda t=timeout: ShardedCAME([("w", w)], spec, lr=0.1, timeout=t))
    wrong_rank = parse_spec(SPEC.replace("rule", 'rule "x.bias" { param = R,R over world }\nrule'))
    assert "'x.bias'" in _error(lambda: ShardedAdamW([("x.bias", torch.nn.Parameter(torch.zeros(5)))], wrong_rank))


def test_state_layouts_that_cannot_hold_states() -> None:
    partial = parse_layout("R | P0 over mesh[2]")
    layouts = Layouts(param=parse_layout("R over mesh[2]"), grad=partial, states=(("", partial),))
    p = torch.nn.Parameter(torch.zeros(6))
    assert "partial" in _error(lambda: ShardedAdamW([("p", p)], {"p": layouts}))
    unknown = parse_spec(
        "tensor p : f32[6] { param = R over mesh[2]  state = S0 over mesh[2]  state.momentum = R over mesh[2] }"
    )
    message = _error(lambda: ShardedAdamW([("p", p)], unknown))
    assert "'p'" in message and "state.momentum" in message and "exp_avg, exp_avg_sq" in message
    factored = parse_spec(
        "tensor w : f32[4, 6] { param = R,R over mesh[2]  state = S0,R over mesh[2]  "
        "state.exp_avg_sq = R,R over mesh[2] }"
    )
    w = torch.nn.Parameter(torch.zeros(4, 6))
    message = _error(lambda: ShardedCAME([("w", w)], factored, lr=0.1))
    assert "'w'" in message and "state.exp_avg_sq" in message
    assert "does not have the parameter's shape" in message or "keeps no state" in message


def test_load_state_dict_checks_every_layout_before_changing_anything() -> None:
    a, b = torch.nn.Parameter(torch.ones(5, 4)), torch.nn.Parameter(torch.ones(6))
    spec = {"a": _replicated((5, 4)), "b": _replicated((6,))}
    saved_from = ShardedCAME([("a", a), ("b", b)], spec, lr=0.1)
    a.grad, b.grad = torch.ones(5, 4), torch.ones(6)
    saved_from.step()
    saved = saved_from.state_dict()
    assert saved["tensors"]["a"]["states"]["exp_avg_sq_row"]["layout"] == "R over mesh[1]"

    other = {"a": _replicated((5, 4)), "b": _replicated((6,), "mesh[dp=1]")}
    target = ShardedCAME([("a", a), ("b", b)], other, lr=0.1)
    message = _error(lambda: target.load_state_dict(saved))
    assert "'b'" in message and "mesh[dp=1]" in message
    assert target.state_bytes() == 0  # 'a' fitted, but was not loaded either
    assert "not a ShardedAdamW state dict" in _error(
        lambda: ShardedAdamW([("a", a), ("b", b)], spec).load_state_dict(saved)
    )

    fresh = ShardedCAME([("a", a), ("b", b)], spec, lr=0.5)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["lr"] == 0.1
    assert fresh.state_bytes() == saved_from.state_bytes()


def test_declared_tensors_are_pieces_of_their_declared_shape() -> None:
    """A plain tensor the spec declares is the rank's piece: here rank 0 of a split param."""
    spec = {
        "w": TensorSpec(
            name="w",
            dtype="f32",
            shape=(5, 4),
            layouts=Layouts(
                param=parse_layout("S0,R over mesh[2]"),
                grad=parse_layout("S0,R over mesh[2]"),
                states=(("", parse_layout("S0,R over mesh[2]")),),
            ),
        )
    }
    ShardedAdamW([("w", torch.nn.Parameter(torch.zeros(3, 4)))], spec)
    assert "[3, 4]" in _error(lambda: ShardedAdamW([("w", torch.nn.Parameter(torch.zeros(2, 4)))], spec))


@pytest.mark.parametrize(("state", "flat_axis", "floats"), [("R,R", 0, 2 * (30522 + 128) + 1), ("S(dp),R", None, 261)])
def test_came_statistics_of_the_seed_embedding(state: str, flat_axis: int | None, floats: int) -> None:
    """The seed's [30522, 128] embedding at dp=8 all-gathers the whole tensor four times a
    step (~15.6M floats). Flat chunks need the row and column sums twice and the squared
    sum, 2 (H + W) + 1 floats; rows split over dp need only the column sums, each with a
    matrix total and a row-normaliser sum, twice, and the squared sum: 2 (128 + 2) + 1."""
    from runtime.optim.sums import phase_sum_specs

    layout = parse_layout(f"{state} over mesh[dp=8]")
    shard = StateShard.of((30522, 128), layout, rank=5, flat_axis=flat_axis)
    phases = phase_sum_specs(shard, "came", torch.float32, "wte")
    collectives = [plan_collectives(specs, 5) for specs in phases]
    assert [len(c) for c in collectives] == [1, 1, 1]
    assert sum(c.numel for phase in collectives for c in phase) == floats


# --- param groups added later ----------------------------------------------------------------
GROUPS_SPEC = """
mesh world = [dp=1]
rule "*.weight" { param = R,R over world  grad = R,R over world  state = S(dp),R over world }
rule "*.bias"   { param = R over world    grad = R over world    state = S(dp) over world }
"""


def _two_layers(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _layer(model: torch.nn.Module, index: int) -> list[tuple[str, torch.nn.Parameter]]:
    """The named parameters of layer ``index`` under their names in the whole model (``2.weight``)."""
    return [(n, p) for n, p in model.named_parameters() if n.startswith(f"{index}.")]


def test_an_added_param_group_is_placed_and_trained_as_torch_trains_it() -> None:
    """Two steps of the first layer alone, then the second added with its own lr, five more
    steps (the states of the first layer kept across the growth), bit for bit as torch's AdamW
    with the same add_param_group; a learning-rate scheduler sets both groups."""
    theirs, ours = _two_layers(3), _two_layers(3)
    reference = torch.optim.AdamW(theirs[0].parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    optimizer = ShardedAdamW(_layer(ours, 0), parse_spec(GROUPS_SPEC), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(4)
    for step in range(7):
        if step == 2:
            reference.add_param_group({"params": list(theirs[2].parameters()), "lr": 3e-3})
            optimizer.add_param_group({"params": _layer(ours, 2), "lr": 3e-3})
            schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (reference, optimizer)]
        x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)
        for model, opt in ((theirs, reference), (ours, optimizer)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        if step >= 2:
            for scheduler in schedulers:
                scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in reference.param_groups]
    for (name, mine), theirs_p in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(mine, theirs_p), name


def test_came_steps_two_param_groups_as_came_pytorch_does() -> None:
    """Two groups with their own lr are two runs of one step, advanced phase by phase
    together: each keeps its own working buffers (shared ones gave NaN)."""
    theirs, ours = _two_layers(6), _two_layers(6)
    hyper = {"lr": 1e-2, "weight_decay": 0.1, "clip_threshold": 0.3, "betas": (0.9, 0.99, 0.999)}
    groups = [(0, 1e-2), (2, 3e-3)]
    reference = came_pytorch.CAME([{"params": list(theirs[i].parameters()), "lr": lr} for i, lr in groups], **hyper)
    spec = parse_spec(GROUPS_SPEC)
    optimizer = ShardedCAME([{"params": _layer(ours, i), "lr": lr} for i, lr in groups], spec, **hyper)
    gen = torch.Generator().manual_seed(7)
    for _ in range(5):
        x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)
        for model, opt in ((theirs, reference), (ours, optimizer)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    for (name, mine), theirs_p in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        error = ((mine - theirs_p).abs().max() / theirs_p.abs().max()).item()
        assert error <= 1e-5, f"{name}: relative error {error:.3g} against came_pytorch"


def test_an_added_group_the_spec_cannot_place_changes_nothing() -> None:
    model = _two_layers(5)
    optimizer = ShardedAdamW(_layer(model, 0), parse_spec(GROUPS_SPEC.replace('"*.bias"', '"0.bias"')))
    for params in (_layer(model, 2), list(model[2].parameters())):
        message = _error(lambda params=params: optimizer.add_param_group({"params": params}))
        assert "'2.bias'" in message or "without names" in message, message
        assert len(optimizer.param_groups) == 1 and len(optimizer._slots) == 2
    message = _error(lambda: optimizer.add_param_group({"params": _layer(model, 0)}))
    assert "more than one parameter group" in message and len(optimizer.param_groups) == 1


def test_the_optimizer_plans_under_the_cost_model_it_is_given() -> None:
    """``cost=``: the step plan the optimizer runs is the one ``plan_spec(spec, cost=...)``
    shows; here a dear reduce_scatter makes it all-reduce the gradient instead."""
    from planner import CostModel
    from planner.spec_plan import plan_spec

    spec = parse_spec(
        "mesh world = [dp=2, tp=2]  bandwidth [25e9, 300e9]  latency [10us, 2us]\n"
        "tensor w : f32[64, 32] { param = R,R over world  grad = R,R | P(dp):sum over world  "
        "state = S(dp),R over world }\n"
    )
    model = CostModel(ops={"reduce_scatter": {"alpha": 3e-4, "bandwidth": 1e8}})
    w = torch.nn.Parameter(torch.zeros(64, 32))
    w.grad = torch.zeros(64, 32)

    def buckets(optimizer: ShardedAdamW) -> list[tuple[str, int | None, int]]:
        return [(b.op, b.axis, b.bytes) for b in optimizer.step_plan().buckets]

    hinted = buckets(ShardedAdamW([("w", w)], spec, verify=False))
    measured = buckets(ShardedAdamW([("w", w)], spec, verify=False, cost=model))
    assert hinted == [(b.op, b.axis, b.bytes) for b in plan_spec(spec).step.buckets]
    assert measured == [(b.op, b.axis, b.bytes) for b in plan_spec(spec, cost=model).step.buckets]
    assert measured != hinted and measured[0][0] == "all_reduce"
    assert "cost must be" in _error(lambda: ShardedAdamW([("w", w)], spec, cost="fast"))


def test_prefetch_params_names_the_parameters_no_unit_holds_and_changes_nothing() -> None:
    model = _two_layers(8)
    optimizer = ShardedAdamW(list(model.named_parameters()), parse_spec(GROUPS_SPEC), lr=1e-2)
    message = _error(lambda: optimizer.prefetch_params(model[0]))
    assert message == "prefetch_params: no unit given holds tensor '2.weight' and 1 more"
    message = _error(lambda: optimizer.prefetch_params(model[0], _bias_only(model[2])))
    assert message == "prefetch_params: no unit given holds tensor '2.weight'"
    assert not model[0]._forward_pre_hooks, "a refused prefetch_params left hooks behind"


def _bias_only(layer: torch.nn.Linear) -> torch.nn.Module:
    """A module holding only ``layer``'s bias."""
    unit = torch.nn.Module()
    unit.bias = layer.bias
    return unit
