"""Nesting orders (``S10``) as DTensor ``_StridedShard`` placements and ``shard_order``, both
ways, against DTensor's own slicing of the full tensor: ``distribute_tensor(...).to_local()``
and torch's local-shape computation, every rank simulated in one process (a fake process
group and ``LocalTensorMode``); and layouts on sub-meshes lifted to the whole mesh."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardlang import InteropError, Layout, Mesh, parse_layout
from shardlang.interop import (
    from_dtensor,
    from_dtensor_placements,
    lift_layout,
    mesh_from_device_mesh,
    to_dtensor_placements,
    to_dtensor_shard_order,
)
from tests.optim_support import hand_piece

MESHES = [(2, 2), (4, 2), (2, 3), (2, 2, 2)]
LENGTHS = (0, 1, 2, 3, 5, 7, 9, 10)


@pytest.fixture
def simulated() -> Iterator[None]:
    """Runs DTensor code for every rank of the meshes below in this process."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def device_mesh(shape: tuple[int, ...]) -> DeviceMesh:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=int(torch.tensor(shape).prod()))
    return init_device_mesh("cpu", shape)


def nestings(mesh_shape: tuple[int, ...]) -> list[Layout]:
    """Every layout of a 2-d tensor whose dim 0 is split over two or more mesh axes in an
    order other than ascending (dim 1 split by the axes left, if any)."""
    mesh = Mesh(shape=mesh_shape)
    out = []
    for k in range(2, mesh.ndim + 1):
        for order in itertools.permutations(range(mesh.ndim), k):
            if list(order) != sorted(order):
                rest = tuple(a for a in range(mesh.ndim) if a not in order)
                out.append(Layout(dims=(order, rest), mesh=mesh))
    return out


def locals_of(dt: DTensor, n: int) -> list[torch.Tensor]:
    local = dt.to_local()
    assert isinstance(local, LocalTensor)
    return [local._local_tensors[r] for r in range(n)]


def test_nesting_orders_are_dtensor_slices_or_refused(simulated: None) -> None:
    """Where to_dtensor_placements writes a nesting order as _StridedShard, DTensor slices the
    full tensor as the layout does on every rank, torch's local-shape computation agrees and
    the placements read back; where it refuses, DTensor does slice it differently."""
    total = refused = 0
    for mesh_shape in MESHES:
        n = int(torch.tensor(mesh_shape).prod())
        mesh = device_mesh(mesh_shape)
        written = []
        with LocalTensorMode(n):
            for layout in nestings(mesh_shape):
                for length in LENGTHS:
                    shape = (length, 3)
                    full = torch.arange(length * 3).reshape(shape)
                    hand = [hand_piece(full, layout.dims, mesh_shape, layout.mesh.coordinate(r)) for r in range(n)]
                    plain, order = to_dtensor_shard_order(layout)
                    theirs = DTensorSpec._convert_shard_order_to_StridedShard(order, plain, mesh)
                    try:
                        placements = to_dtensor_placements(layout, shape)
                    except InteropError as e:
                        assert "there _StridedShard is no nesting order" in e.message
                        dt = distribute_tensor(full, mesh, theirs, src_data_rank=None)
                        assert any(not torch.equal(a, b) for a, b in zip(locals_of(dt, n), hand, strict=True))
                        refused += 1
                        continue
                    assert placements == theirs  # torch's own encoding of the nesting order
                    dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
                    for r, (got, want) in enumerate(zip(locals_of(dt, n), hand, strict=True)):
                        assert torch.equal(got, want), (str(layout), shape, r)
                    assert from_dtensor(dt) == layout
                    written.append((layout, shape, placements, [tuple(h.shape) for h in hand]))
        # torch's local-shape computation, outside LocalTensorMode (fifty times faster there)
        for layout, shape, placements, want in written:
            for r in range(n):
                coordinate = list(layout.mesh.coordinate(r))
                local_shape, _ = _compute_local_shape_and_global_offset(shape, mesh_shape, coordinate, placements)
                assert local_shape == want[r], (str(layout), shape, r)
        total += len(written)
    assert total > 50 and refused > 5  # both outcomes are exercised


def test_pytorch_uneven_strided_shard_case(simulated: None) -> None:
    """_StridedShard's own docstring case, 9 elements as [_StridedShard(0, sf=2), Shard(0)] on
    a [4, 2] mesh: DTensor gives mesh coordinate (3, 0) element 8, where the nesting tp-then-dp
    gives it (3, 1); the same placements on a [2, 2] mesh are that nesting for every length."""
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    mesh = device_mesh((4, 2))
    with LocalTensorMode(8):
        dt = distribute_tensor(torch.arange(9), mesh, placements, src_data_rank=None)
        assert locals_of(dt, 8)[6].tolist() == [8]
    with pytest.raises(InteropError, match=r"DTensor gives mesh coordinate 0=3, 1=0 the elements \[8:9\]"):
        from_dtensor_placements(placements, 1, Mesh(shape=(4, 2)), shape=(9,))
    with pytest.raises(InteropError, match="reading it needs the tensor's shape"):
        from_dtensor_placements(placements, 1, Mesh(shape=(4, 2)))
    for length in range(12):
        layout = from_dtensor_placements(placements, 2, Mesh(shape=(2, 2)), shape=(length, 5))
        assert layout == parse_layout("S10,R over mesh[2,2]")


def test_shard_order_is_exact_for_every_length(simulated: None) -> None:
    """A DTensor spec with the shard_order to_dtensor_shard_order writes, over the hand-sliced
    pieces, reassembles the full tensor (DTensor's own full_tensor), and reads back."""
    for mesh_shape, lengths in [((4, 2), (5, 9)), ((2, 2, 2), (9,))]:
        n = int(torch.tensor(mesh_shape).prod())
        mesh = device_mesh(mesh_shape)
        with LocalTensorMode(n):
            for layout in nestings(mesh_shape)[-3:]:  # on [2,2,2]: S(2,1,0) and the like
                for length in lengths:
                    shape = (length, 3)
                    full = torch.arange(length * 3.0).reshape(shape)
                    pieces = {r: hand_piece(full, layout.dims, mesh_shape, layout.mesh.coordinate(r)) for r in range(n)}
                    placements, order = to_dtensor_shard_order(layout)
                    spec = DTensorSpec(
                        mesh, placements, TensorMeta(full.shape, full.stride(), full.dtype), shard_order=order
                    )
                    dt = DTensor(LocalTensor(pieces), spec, requires_grad=False)
                    gathered = dt.full_tensor()
                    assert all(torch.equal(gathered._local_tensors[r], full) for r in range(n)), (str(layout), length)
                    assert from_dtensor(dt) == layout


@pytest.mark.parametrize(
    ("placements", "shard_order", "words"),
    [
        ((Replicate(), _StridedShard(0, split_factor=2)), None, "split factor 2, which is not the product"),
        ((_StridedShard(0, split_factor=3), Shard(0)), None, "split factor 3"),
        ((_StridedShard(0, split_factor=2), Shard(0)), ((0, (1, 0)),), "hold _StridedShard and a shard_order"),
        ((Shard(0), Shard(0)), ((0, (1,)),), "dim 0 is nested over mesh axes [1]"),
        ((Shard(0), Shard(1)), ((0, (0,)),), "the shard_order leaves out the sharded dims [1]"),
        ((Shard(0), Shard(0)), ((0, (1, 0)), (0, (1, 0))), "names dim 0 twice"),
    ],
)
def test_strided_shards_and_shard_orders_shardlang_cannot_read(
    placements: tuple, shard_order: tuple | None, words: str
) -> None:
    with pytest.raises(InteropError) as caught:
        from_dtensor_placements(placements, 2, Mesh(shape=(2, 2)), shape=(4, 4), shard_order=shard_order)
    assert words in caught.value.message


def test_shard_order_reads_any_nesting() -> None:
    layout = from_dtensor_placements(
        (Shard(0), Shard(0), Shard(1)), 2, Mesh(shape=(2, 3, 2)), shard_order=((0, (1, 0)), (1, (2,)))
    )
    assert layout == parse_layout("S10,S2 over mesh[2,3,2]")
    assert to_dtensor_shard_order(layout)[1] == (ShardOrderEntry(0, (1, 0)), ShardOrderEntry(1, (2,)))


def test_writing_a_nesting_order_needs_the_shape() -> None:
    with pytest.raises(InteropError, match="pass shape=, or use to_dtensor_shard_order"):
        to_dtensor_placements(parse_layout("S10 over mesh[2,2]"))


# --- sub-meshes ---------------------------------------------------------------------------
DPTP = parse_layout("R over mesh[dp=2,tp=2]").mesh


def test_a_sub_mesh_layout_lifts_to_the_whole_mesh() -> None:
    tp_of_dp1 = Mesh(shape=(2,), ranks=(2, 3), axis_names=("tp",))
    dp_of_tp0 = Mesh(shape=(2,), ranks=(0, 2), axis_names=("dp",))
    assert lift_layout(Layout(dims=((0,), ()), mesh=tp_of_dp1), DPTP) == parse_layout("S(tp),R over mesh[dp=2,tp=2]")
    lifted = lift_layout(Layout(dims=((),), mesh=dp_of_tp0, partial={0: "avg"}), DPTP)
    assert lifted == parse_layout("R | P(dp):avg over mesh[dp=2,tp=2]")
    # The DeviceMesh slices torch makes are such sub-meshes.
    root = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"), _init_backend=False, _rank=3)
    assert mesh_from_device_mesh(root) == DPTP


@pytest.mark.parametrize(
    ("sub", "words"),
    [
        (Mesh(shape=(2,), ranks=(2, 3)), "found by its axis names"),
        (Mesh(shape=(2,), ranks=(2, 3), axis_names=("pp",)), "found by its axis names"),
        (Mesh(shape=(2,), ranks=(0, 3), axis_names=("tp",)), "not a slice of the mesh (rank 3)"),
        (Mesh(shape=(2,), ranks=(4, 5), axis_names=("tp",)), "not a slice of the mesh"),
    ],
)
def test_what_is_no_sub_mesh(sub: Mesh, words: str) -> None:
    with pytest.raises(InteropError) as caught:
        lift_layout(Layout(dims=((0,),), mesh=sub), DPTP)
    assert words in caught.value.message
