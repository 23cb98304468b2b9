"""The greedy baseline of ``shardlang explain`` against the real thing: torch's own default
(greedy) redistribute planner, asked in one process with a fake process group, must pick the
same mesh-axis changes in the same order; each baseline step must cost what the cost table
says (worked out here from the layouts' local shapes); and the exact planner is never worse.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from cli.greedy import NoGreedyOrder, greedy_order, greedy_plan
from planner import CostModel, OpCost, plan
from shardlang import Layout, Mesh
from shardlang.dtypes import itemsize

MESHES = [(4,), (2, 2), (2, 3), (3, 2), (2, 4), (2, 2, 2)]
OPS = ("sum", "avg", "max", "min")


@pytest.fixture(scope="module")
def torch_planner() -> Iterator[Callable[..., list[tuple[int, tuple]]]]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import get_redistribute_planner
    from torch.testing._internal.distributed.fake_pg import FakeStore

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    meshes = {shape: DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape)) for shape in MESHES}

    def torch_changes(
        placements_src: list[tuple], placements_dst: list[tuple], mesh_shape: tuple[int, ...], shape: tuple[int, ...]
    ) -> list[tuple[int, tuple]]:
        def to_torch(p: tuple) -> object:
            return {"R": Replicate, "S": lambda: Shard(p[1]), "P": lambda: Partial(p[1])}[p[0]]()

        mesh = meshes[mesh_shape]
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        meta = TensorMeta(torch.Size(shape), stride, torch.float32)
        src = DTensorSpec(mesh, tuple(to_torch(p) for p in placements_src), tensor_meta=meta)
        dst = DTensorSpec(mesh, tuple(to_torch(p) for p in placements_dst), tensor_meta=meta)
        infos = get_redistribute_planner(mesh, meta).generate_greedy_transform_infos(src, dst)
        out = []
        for info in infos:
            target = info.src_dst_placements[1]
            if target.is_shard():
                out.append((info.mesh_dim, ("S", target.dim)))
            elif target.is_partial():
                out.append((info.mesh_dim, ("P", target.reduce_op)))
            else:
                out.append((info.mesh_dim, ("R",)))
        return out

    yield torch_changes
    if started:
        dist.destroy_process_group()


def _random_placements(rng: random.Random, ndim_mesh: int, ndim: int, partial_op: str | None) -> list[tuple]:
    choices: list[tuple] = [("R",)] + [("S", d) for d in range(ndim)]
    if partial_op is not None:
        choices.append(("P", partial_op))
    return [rng.choice(choices) for _ in range(ndim_mesh)]


def _layout(placements: list[tuple], mesh: Mesh, ndim: int) -> Layout:
    # DTensor nests the splits of a dim in mesh-axis order.
    dims = [tuple(a for a, p in enumerate(placements) if p == ("S", d)) for d in range(ndim)]
    return Layout(dims=dims, mesh=mesh, partial=[(a, p[1]) for a, p in enumerate(placements) if p[0] == "P"])


def _table_cost(
    op: str,
    axis: int,
    to_dim: int | None,
    before: Layout,
    after: Layout,
    shape: tuple[int, ...],
    dtype: str,
    alpha: float,
    beta: float,
) -> tuple[int, float]:
    """The cost table of ``planner.cost``'s docstring, by hand."""
    n = before.mesh.shape[axis]
    size = itemsize(dtype)
    local = before.local_shape(shape)
    if op in ("slice", "partial") or n == 1:
        return 0, 0.0
    if op == "all_gather":
        nbytes, rounds = (n - 1) * math.prod(local) * size, n - 1
    elif op == "reduce_scatter":
        nbytes, rounds = (n - 1) * math.prod(after.local_shape(shape)) * size, n - 1
    elif op == "all_reduce":
        nbytes, rounds = 2 * (n - 1) * math.ceil(math.prod(local) / n) * size, 2 * (n - 1)
    else:
        assert op == "all_to_all" and to_dim is not None
        cut = [math.ceil(length / n) if d == to_dim else length for d, length in enumerate(local)]
        nbytes, rounds = (n - 1) * math.prod(cut) * size, n - 1
    return nbytes, rounds * alpha + nbytes / beta


def test_greedy_order_is_torchs_and_costs_the_table(torch_planner: Callable[..., list[tuple[int, tuple]]]) -> None:
    rng = random.Random(20240611)
    compared = cheaper = 0
    for _ in range(600):
        mesh_shape = rng.choice(MESHES)
        mesh = Mesh(shape=mesh_shape)
        ndim = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 9) for _ in range(ndim))
        dtype = rng.choice(["f32", "bf16"])
        src_p = _random_placements(rng, len(mesh_shape), ndim, rng.choice([None, *OPS]))
        # DTensor forbids mixing partial ops in one layout and reshaping one partial op into another.
        src_ops = {p[1] for p in src_p if p[0] == "P"}
        dst_p = _random_placements(rng, len(mesh_shape), ndim, next(iter(src_ops), rng.choice([None, "sum"])))
        src, dst = _layout(src_p, mesh, ndim), _layout(dst_p, mesh, ndim)

        assert greedy_order(src, dst) == torch_planner(src_p, dst_p, mesh_shape, shape), (src, dst, shape)
        compared += 1

        alphas = tuple(rng.choice([1e-6, 5e-6]) for _ in mesh_shape)
        betas = tuple(rng.choice([25e9, 1e11, 3e11]) for _ in mesh_shape)
        cost = CostModel(alpha=alphas, bandwidth=betas)
        greedy = greedy_plan(src, dst, shape, dtype, cost)
        assert greedy.layouts()[-1] == dst
        for before, step in zip(greedy.layouts(), greedy.steps, strict=False):
            nbytes, seconds = _table_cost(
                step.op, step.axis, step.to_dim, before, step.layout, shape, dtype, alphas[step.axis], betas[step.axis]
            )
            assert step.bytes == nbytes, (src, dst, step)
            assert math.isclose(step.seconds, seconds, rel_tol=1e-9, abs_tol=1e-15), (src, dst, step)
        exact = plan(src, dst, shape, dtype, cost)
        assert exact.total_seconds <= greedy.total_seconds * (1 + 1e-12)
        cheaper += exact.total_seconds < greedy.total_seconds * (1 - 1e-9)
    assert compared == 600
    assert cheaper > 0  # the baseline does lose somewhere, or explain would have nothing to show


def test_each_greedy_step_costs_its_own_collective_under_per_collective_figures() -> None:
    """With a figure of its own per collective kind, the cheapest way through one placement
    change can be two collectives (a reduce_scatter and an all_gather for an all_reduce); the
    baseline's step is the one collective DTensor runs, and costs that kind's figures."""
    rng = random.Random(20261201)
    kinds = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
    dear = 0
    for _ in range(200):
        mesh = Mesh(shape=rng.choice(MESHES))
        ndim = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 9) for _ in range(ndim))
        src_p = _random_placements(rng, mesh.ndim, ndim, rng.choice([None, "sum"]))
        dst_p = _random_placements(rng, mesh.ndim, ndim, rng.choice([None, "sum"]))
        src, dst = _layout(src_p, mesh, ndim), _layout(dst_p, mesh, ndim)
        figures = {k: (rng.choice([1e-6, 1e-3]), rng.choice([1e8, 1e11])) for k in kinds}
        cost = CostModel(alpha=1e-6, bandwidth=1e11, ops=[OpCost(k, *figures[k]) for k in kinds])
        try:
            greedy = greedy_plan(src, dst, shape, "f32", cost)
        except NoGreedyOrder:
            continue
        for before, step in zip(greedy.layouts(), greedy.steps, strict=False):
            alpha, beta = figures.get(step.op, (0.0, 1.0))
            nbytes, seconds = _table_cost(
                step.op, step.axis, step.to_dim, before, step.layout, shape, "f32", alpha, beta
            )
            assert step.bytes == nbytes, (src, dst, step)
            assert math.isclose(step.seconds, seconds, rel_tol=1e-9, abs_tol=1e-15), (src, dst, step)
            dear += step.op == "all_reduce" and alpha > figures["reduce_scatter"][0] + figures["all_gather"][0]
    assert dear > 0  # some all_reduce was dearer than the reduce_scatter and all_gather it stands for


def test_no_greedy_order_for_nestings_dtensor_cannot_express() -> None:
    mesh = Mesh(shape=(2, 2))
    with pytest.raises(NoGreedyOrder, match="order"):
        greedy_plan(Layout(dims=[(1, 0)], mesh=mesh), Layout(dims=[()], mesh=mesh), (8,))
