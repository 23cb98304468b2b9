"""Conversions to and from DTensor placements, Paddle dims_mapping and ColossalAI sharding
sequences, both ways and every error; the DTensor mapping is checked against torch itself
(its local-shape computation, and real DTensors on 4 gloo ranks)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset, assert_no_mixed_partial_types
from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard

from runtime.testing import run_ranks
from shardlang import InteropError, Layout, Mesh, ShardlangError, parse_layout
from shardlang.interop import (
    from_colossalai,
    from_dtensor_placements,
    from_paddle,
    mesh_from_device_mesh,
    to_colossalai,
    to_dtensor_placements,
    to_paddle,
)
from tests.test_language import layouts, meshes

M22 = Mesh(shape=(2, 2))
M222 = Mesh(shape=(2, 2, 2))
DPTP = Mesh(shape=(2, 2), axis_names=("dp", "tp"))


def refused(words: str, convert: Callable[..., object], *args: object) -> str:
    """``convert(*args)`` raises an InteropError whose message holds ``words``: that message."""
    with pytest.raises(InteropError) as caught:
        convert(*args)
    assert words in caught.value.message
    return caught.value.message


# --- DTensor -------------------------------------------------------------------------------
DTENSOR_CASES = [
    ("S0,R over mesh[2,2]", (Shard(0), Replicate())),
    ("R,S1 over mesh[2,2]", (Replicate(), Shard(1))),
    ("R,S0 over mesh[2,2]", (Shard(1), Replicate())),
    ("S01,R over mesh[2,2]", (Shard(0), Shard(0))),
    ("S02,S1 over mesh[2,2,2]", (Shard(0), Shard(1), Shard(0))),
    ("R,S1 | P0 over mesh[2,2]", (Partial("sum"), Shard(1))),
    ("R,R | P0:avg,P1 over mesh[2,4]", (Partial("avg"), Partial("sum"))),
    ("R | P01:max over mesh[2,2]", (Partial("max"), Partial("max"))),
    ("S1 | P0:min over mesh[2,2]", (Partial("min"), Shard(0))),
    ("() over mesh[2,2]", (Replicate(), Replicate())),
    ("S(dp,tp),R over mesh[dp=2,tp=2]", (Shard(0), Shard(0))),
    ("R,S(tp) | P(dp):avg over mesh[dp=2,tp=2]", (Partial("avg"), Shard(1))),
]


@pytest.mark.parametrize(("text", "placements"), DTENSOR_CASES)
def test_dtensor_placements_both_ways(text: str, placements: tuple) -> None:
    layout = parse_layout(text)
    assert to_dtensor_placements(layout) == placements
    assert from_dtensor_placements(placements, layout.ndim, layout.mesh) == layout


def test_dtensor_negative_shard_dims_count_from_the_end() -> None:
    assert from_dtensor_placements([Shard(-1), Shard(-2)], 2, M22) == parse_layout("S1,S0 over mesh[2,2]")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("S10,R over mesh[2,2]", "layout 'S10,R over mesh[2,2]' nests dim 0 over mesh axes in the order 1, 0"),
        ("R,S(tp,dp) over mesh[dp=2,tp=2]", "nests dim 1 over mesh axes in the order tp, dp"),
        ("S021 over mesh[2,2,2]", "in the order 0, 2, 1"),
        ("R | P0,P1:max over mesh[2,2]", "mixes partial reduce ops max, sum, which do not commute"),
        ("R | P0:min,P1:max over mesh[2,2]", "mixes partial reduce ops max, min"),
        ("R | P0:avg,P1:min over mesh[2,2]", "mixes partial reduce ops avg, min"),
    ],
)
def test_what_dtensor_placements_cannot_express(text: str, words: str) -> None:
    refused(words, to_dtensor_placements, parse_layout(text))


def test_the_mixes_we_refuse_are_the_ones_dtensor_refuses() -> None:
    for a, b in itertools.product(["sum", "avg", "max", "min"], repeat=2):
        layout = Layout(dims=(), mesh=M22, partial={0: a, 1: b})
        try:
            placements = to_dtensor_placements(layout)
        except InteropError:
            with pytest.raises(ValueError, match="Mixed Partial reduce types"):
                assert_no_mixed_partial_types([Partial(a), Partial(b)])
        else:
            assert_no_mixed_partial_types(placements)


@pytest.mark.parametrize(
    ("placements", "ndim", "mesh", "words"),
    [
        ((Shard(0),), 1, M22, "have 1 entries for the 2-axis mesh[2,2]"),
        ((Shard(2), Replicate()), 2, M22, "mesh axis 0 shards dim 2 of a 2-d tensor"),
        ((Shard(-3), Replicate()), 2, M22, "mesh axis 0 shards dim -3 of a 2-d tensor"),
        ((Replicate(), _StridedShard(0, split_factor=2)), 1, M22, "mesh axis 1 is _StridedShard"),
        ((Partial("product"), Replicate()), 1, M22, "reduce op 'product', which shardlang refuses"),
        ((_MaskPartial(), Replicate()), 1, M22, "mesh axis 0 has placement"),
        ((Replicate(), "S0"), 1, M22, "mesh axis 1 has placement 'S0'"),
        ((Partial("sum"), Partial("max")), 1, M22, "mixes partial reduce ops max, sum"),
    ],
)
def test_placements_shardlang_cannot_read(placements: tuple, ndim: int, mesh: Mesh, words: str) -> None:
    message = refused(words, from_dtensor_placements, placements, ndim, mesh)
    assert "DTensor placements" in message


def dtensor_expressible(layout: Layout) -> bool:
    ops = set(layout.partial_ops.values())
    return all(list(a) == sorted(a) for a in layout.dims) and (len(ops) <= 1 or ops == {"sum", "avg"})


DTENSOR_LAYOUTS = layouts(meshes(max_axes=3, max_size=3).map(Mesh.anonymous), max_dims=3)  # built once


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_dtensor_chunking_matches_torch(data: st.DataObject) -> None:
    """Every layout either converts, and then torch's own local-shape-and-offset
    computation agrees with Layout.piece on every rank, or raises InteropError exactly when
    DTensor cannot express it."""
    layout = data.draw(DTENSOR_LAYOUTS)
    shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=layout.ndim, max_size=layout.ndim)))
    if not dtensor_expressible(layout):
        with pytest.raises(InteropError):
            to_dtensor_placements(layout)
        return
    placements = to_dtensor_placements(layout)
    assert from_dtensor_placements(placements, layout.ndim, layout.mesh) == layout
    for coordinate in itertools.product(*(range(n) for n in layout.mesh.shape)):
        local_shape, offset = _compute_local_shape_and_global_offset(
            shape, layout.mesh.shape, list(coordinate), placements
        )
        bounds = layout.piece(shape, coordinate)
        assert local_shape == tuple(hi - lo for lo, hi in bounds)
        if all(local_shape):  # an empty piece has no meaningful offset (torch puts it at the end)
            assert offset == tuple(lo for lo, _ in bounds)


def test_mesh_from_device_mesh() -> None:
    # A DeviceMesh needs no process group when it is told not to create one.
    permuted = DeviceMesh(
        "cpu", torch.tensor([[3, 1], [0, 2]]), mesh_dim_names=("dp", "tp"), _init_backend=False, _rank=0
    )
    assert mesh_from_device_mesh(permuted) == Mesh(shape=(2, 2), ranks=(3, 1, 0, 2), axis_names=("dp", "tp"))
    cube = DeviceMesh("cpu", torch.arange(4, 12).reshape(2, 1, 4), _init_backend=False, _rank=4)
    assert mesh_from_device_mesh(cube) == Mesh(shape=(2, 1, 4), ranks=tuple(range(4, 12)))
    reserved = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("over",), _init_backend=False, _rank=0)
    with pytest.raises(InteropError, match="axis name 'over' is a reserved word"):
        mesh_from_device_mesh(reserved)


# Real DTensors on 4 gloo ranks: distribute_tensor must give every rank the block Layout.piece
# names, and from_local of partial values must reduce to the full tensor.
REAL_CASES = [
    ("S(dp),S(tp) over MESH", (5, 3)),
    ("S(dp,tp),R over MESH", (7, 2)),
    ("S(dp,tp),R over MESH", (2, 3)),  # two empty pieces
    ("R,S(tp) | P(dp) over MESH", (3, 5)),
    ("S(tp) | P(dp):avg over MESH", (3,)),
    ("R | P(dp):avg,P(tp) over MESH", (4,)),
    ("S(dp),R | P(tp):max over MESH", (3, 2)),
    ("R,S(dp) | P(tp):min over MESH", (2, 5)),
    ("() over MESH", ()),
]


def partial_values(target: torch.Tensor, layout: Layout, coordinate: tuple[int, ...]) -> torch.Tensor:
    """A rank's local value of a partial layout: the target block, perturbed along each partial
    axis so that reducing the axes in ascending order gives the target back exactly."""
    value = target
    for axis, op in sorted(layout.partial, reverse=True):  # the last reduced is the first undone
        k, n = coordinate[axis], layout.mesh.shape[axis]
        if op == "sum":
            value = value * (k == 0) + (k - (n - 1) / 2)
        elif op == "avg":
            value = value + (k - (n - 1) / 2)
        elif op == "max":
            value = value - k
        else:
            value = value + k
    return value


def check_real_dtensors(rank: int, world_size: int, cases: list[tuple[str, tuple[int, ...]]]) -> int:
    from torch.distributed.tensor import DTensor, distribute_tensor

    checked = 0
    # Explicit ranks too, but only with every axis's rank group ascending: torch 2.13's
    # DeviceMesh builds its groups with new_group, which sorts ranks, so DTensor places blocks
    # by sorted rank on a mesh like [[3,1],[0,2]] (pytorch/pytorch#193224).
    for ranks, mesh_text in [((0, 1, 2, 3), "mesh[dp=2,tp=2]"), ((0, 2, 1, 3), "mesh[dp=2,tp=2] ranks [0,2,1,3]")]:
        device_mesh = DeviceMesh("cpu", torch.tensor(ranks).reshape(2, 2), mesh_dim_names=("dp", "tp"))
        mesh = mesh_from_device_mesh(device_mesh)
        assert mesh == parse_layout(f"R over {mesh_text}").mesh
        for text, shape in cases:
            layout = parse_layout(text.replace("MESH", mesh_text))
            placements = to_dtensor_placements(layout)
            full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
            block = full[tuple(slice(lo, hi) for lo, hi in layout.rank_piece(shape, rank))]
            if layout.is_partial:
                local = partial_values(block, layout, mesh.coordinate(rank))
                stride = torch.empty(shape).stride()
                dt = DTensor.from_local(local, device_mesh, placements, shape=torch.Size(shape), stride=stride)
                assert torch.equal(dt.full_tensor(), full), (text, shape)
            else:
                dt = distribute_tensor(full, device_mesh, placements)
                assert torch.equal(dt.to_local(), block), (text, shape, rank)
            assert from_dtensor_placements(dt.placements, len(shape), mesh) == layout
            checked += 1
    return checked


@pytest.mark.slow
def test_real_dtensors_agree() -> None:
    assert run_ranks(check_real_dtensors, 4, (REAL_CASES,), timeout=120) == [2 * len(REAL_CASES)] * 4


# --- Paddle ---------------------------------------------------------------------------------
PADDLE_CASES = [
    ("R,S1 over mesh[2,2]", [-1, 1], {}),
    ("R,S1 | P0 over mesh[2,2]", [-1, 1], {0: "kRedSum"}),
    ("S0,S1 over mesh[2,2]", [0, 1], {}),
    ("S1,S0 over mesh[2,2]", [1, 0], {}),
    ("R | P0:avg,P1 over mesh[2,2]", [-1], {0: "kRedAvg", 1: "kRedSum"}),
    ("S2 | P01:max over mesh[2,2,2]", [2], {0: "kRedMax", 1: "kRedMax"}),
    ("R,R | P1:min over mesh[2,2]", [-1, -1], {1: "kRedMin"}),
    ("() over mesh[2,2]", [], {}),
    ("S(tp),R | P(dp):avg over mesh[dp=2,tp=2]", [1, -1], {0: "kRedAvg"}),
]


@pytest.mark.parametrize(("text", "dims_mapping", "partial_status"), PADDLE_CASES)
def test_paddle_both_ways(text: str, dims_mapping: list[int], partial_status: dict[int, str]) -> None:
    layout = parse_layout(text)
    assert to_paddle(layout) == (dims_mapping, partial_status)
    assert from_paddle(dims_mapping, layout.mesh, partial_status) == layout


def test_paddle_seed_dist_attrs() -> None:
    # The dist attrs printed in the Paddle PR (../shared/seeds/), for the embedding on mesh [2,2].
    assert from_paddle([-1, 1], M22) == parse_layout("R,S1 over mesh[2,2]")
    assert from_paddle([0, 1], M22) == parse_layout("S0,S1 over mesh[2,2]")
    assert from_paddle([-1, 1], M22, {0: "kRedSum"}) == parse_layout("R,S1 | P0 over mesh[2,2]")
    assert from_paddle([-1], M22) == parse_layout("R over mesh[2,2]")  # beta1_pow_acc


class ReduceType:
    """Stands for a member of paddle's ReduceType enum, which has a ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name


def test_paddle_reduce_types_by_enum_member_or_by_our_name() -> None:
    assert from_paddle([-1], M22, {0: ReduceType("kRedAvg")}) == parse_layout("R | P0:avg over mesh[2,2]")
    assert from_paddle([-1], M22, {1: "max"}) == parse_layout("R | P1:max over mesh[2,2]")


def test_paddle_accepts_numpy_integers() -> None:
    # Paddle code often holds dims_mapping as numpy arrays.
    mapping = np.array([-1, 1])
    assert from_paddle(list(mapping), M22, {np.int64(0): "kRedSum"}) == parse_layout("R,S1 | P0 over mesh[2,2]")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("S01 over mesh[2,2]", "splits dim 0 over 2 mesh axes; Paddle's dims_mapping gives one mesh axis per dim"),
        ("R,S10 over mesh[2,2]", "splits dim 1 over 2 mesh axes"),
        ("R | P0,P1:max over mesh[2,2]", "mixes partial reduce ops max, sum, which do not commute"),
    ],
)
def test_what_paddle_cannot_express(text: str, words: str) -> None:
    refused(words, to_paddle, parse_layout(text))


@pytest.mark.parametrize(
    ("dims_mapping", "partial_status", "words"),
    [
        ([2, -1], None, "Paddle dims_mapping [2, -1]: 2 is not a mesh axis of mesh[2,2]"),
        ([-2], None, "-2 is not a mesh axis"),
        ([0, 0], None, "is not a valid layout: mesh axis 0 is used twice (by dim 0 and by dim 1)"),
        ([0], {0: "kRedSum"}, "mesh axis 0 is used twice (by dim 0 and by a partial)"),
        ([-1], {2: "kRedSum"}, "Paddle partial_status: 2 is not a mesh axis"),
        ([-1], {0: "kRedProd"}, "reduce type 'kRedProd' is not one of kRedSum, kRedAvg, kRedMax, kRedMin, sum"),
        ([-1], {0: ["sum"]}, "reduce type ['sum'] is not one of"),
        ([-1], {0: "kRedSum", 1: "kRedMax"}, "mixes partial reduce ops max, sum"),
        (["0"], None, "'0' is not a mesh axis"),
        ([True], None, "True is not a mesh axis"),
        ([0.0], None, "0.0 is not a mesh axis"),
    ],
)
def test_paddle_attrs_shardlang_cannot_read(dims_mapping: list, partial_status: dict | None, words: str) -> None:
    refused(words, from_paddle, dims_mapping, M22, partial_status)


# --- ColossalAI -----------------------------------------------------------------------------
COLOSSAL_CASES = [
    ("S0,R over mesh[2,2]", ["S0", "R"]),
    ("R,S1 over mesh[2,2]", ["R", "S1"]),
    ("S01,R over mesh[2,2]", ["S01", "R"]),
    ("S10,R over mesh[2,2]", ["S10", "R"]),
    ("R,S021 over mesh[2,2,2]", ["R", "S021"]),
    ("S(tp),S(dp) over mesh[dp=2,tp=2]", ["S1", "S0"]),
    ("() over mesh[2,2]", []),
]


@pytest.mark.parametrize(("text", "sequence"), COLOSSAL_CASES)
def test_colossalai_both_ways(text: str, sequence: list[str]) -> None:
    layout = parse_layout(text)
    assert to_colossalai(layout) == sequence
    assert from_colossalai(sequence, layout.mesh) == layout


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("R,S1 | P0 over mesh[2,2]", "is partial; ColossalAI sharding sequences cannot express partials"),
        ("S(10) over mesh[1,1,1,1,1,1,1,1,1,1,2]", "splits over a mesh axis above 9"),
    ],
)
def test_what_colossalai_cannot_express(text: str, words: str) -> None:
    refused(words, to_colossalai, parse_layout(text))


@pytest.mark.parametrize(
    ("sequence", "words"),
    [
        (["S2", "R"], "2 is not a mesh axis of mesh[2,2]"),
        (["S00"], "is not a valid layout: mesh axis 0 is used twice"),
        (["S0", "S0"], "mesh axis 0 is used twice (by dim 0 and by dim 1)"),
        (["RR"], "dim 0 is 'RR'; expected 'R' or 'S' and mesh axes such as 'S01'"),
        (["S"], "dim 0 is 'S'"),
        (["R", "P0"], "dim 1 is 'P0'"),
        (["R", 0], "dim 1 is 0"),
        ("S01", "is a list of dim specs, not the string 'S01'"),
    ],
)
def test_sequences_shardlang_cannot_read(sequence: object, words: str) -> None:
    refused(words, from_colossalai, sequence, M22)


# --- every conversion, on generated layouts ---------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(layouts(meshes(max_axes=4, max_size=3)))
def test_conversions_round_trip_or_refuse(layout: Layout) -> None:
    mesh = layout.mesh
    conversions = [
        (to_dtensor_placements, lambda p: from_dtensor_placements(p, layout.ndim, mesh)),
        (to_paddle, lambda pd: from_paddle(pd[0], mesh, pd[1])),
        (to_colossalai, lambda seq: from_colossalai(seq, mesh)),
    ]
    for to, back in conversions:
        try:
            converted = to(layout)
        except InteropError as e:
            assert str(layout) in e.message  # the refusal names the layout
            continue
        assert back(converted) == layout


def test_interop_errors_are_shardlang_errors() -> None:
    assert issubclass(InteropError, ShardlangError)
