"""The states a sharded optimizer keeps on this rank, and their state dicts: the state store.

Every state in a tensor's state layout lies in one flat buffer per state name, dtype and device
(``runtime.optim.flat``: whole-buffer math), made at the first step; a state the spec keeps in
a layout of its own is a tensor of its own, brought into the state layout and back by the
step's buckets. The store says where each state lies (:class:`~runtime.optim.records.StateWhere`:
what checkpoints record), and saves and restores them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from runtime.optim.errors import OptimizerError
from runtime.optim.flat import FlatStates
from runtime.optim.records import STATE_DICT_FORMAT, HeldTensor, StateWhere
from runtime.optim.slots import Slot, Slots
from shardlang.layout import Layout

MASTER = "master"  # the fp32 master shard of a lower-precision parameter


def state_where(slot: Slot, name: str, rank: int) -> StateWhere:
    """Where state ``name`` of the parameter's shape lies: its own layout, or the state layout
    (a flat chunk of its base block with a flat axis)."""
    assert slot.shard is not None
    if name in slot.own_layouts:
        layout = slot.own_layouts[name]
        return StateWhere(layout, slot.shape, None, slot.own_piece_shape(name, rank))
    layout, shape = slot.shard.data_layout()
    flat_of = slot.shard.layout if slot.flat_axis is not None else None
    return StateWhere(layout, shape, flat_of, slot.shard.local_shape)


def statistic_where(slot: Slot, name: str, rows: Sequence[str], cols: Sequence[str]) -> StateWhere | None:
    """Where a factored optimizer's row (``rows``) or column (``cols``) statistic lies: the
    state layout without the last or the second-last dim (``StateShard.row_stat_layout``);
    ``None`` for any other state."""
    assert slot.shard is not None
    if name in rows:
        return StateWhere(*slot.shard.row_stat_layout(), None, slot.shard.row_stat_shape)
    if name in cols:
        return StateWhere(*slot.shard.col_stat_layout(), None, slot.shard.col_stat_shape)
    return None


def replicas_of(where: StateWhere) -> Layout:
    """A layout whose replicated axes are those along which the ranks hold equal pieces of the
    state: for a flat chunk, the base layout's, less the flat axis (the base block itself is a
    piece of the base layout)."""
    if where.flat_of is None or not where.flat_of.dims:
        return where.layout
    base = where.flat_of
    flat = tuple(a for a in where.layout.dims[0] if a not in base.dims[0])
    return Layout(dims=((*base.dims[0], *flat), *base.dims[1:]), mesh=base.mesh, partial=base.partial)


class StateStore:
    """This rank's states of ``slots``: the flat buffers and the own-layout pieces.
    ``state_shapes`` gives the local shape of every state the math keeps for a slot (master
    excluded), ``where`` where each lies; ``kind`` names the optimizer in its state dicts."""

    def __init__(
        self,
        slots: Slots,
        *,
        rank: int,
        state_shapes: Callable[[Slot], dict[str, tuple[int, ...]]],
        where: Callable[[Slot, str], StateWhere],
        kind: str,
    ) -> None:
        self._slots, self.rank, self._state_shapes, self._where, self.kind = slots, rank, state_shapes, where, kind
        self._flat: FlatStates | None = None  # made at the first step
        self._own: dict[int, dict[str, torch.Tensor]] = {}  # per slot index: the own-layout pieces

    def flat(self) -> FlatStates:
        """The flat buffers of every held slot's states, made at the first call."""
        if self._flat is None:
            entries = []
            for slot in self._slots.held():
                assert slot.shard is not None
                shapes = {k: v for k, v in self._state_shapes(slot).items() if k not in slot.own_layouts}
                if slot.needs_master:
                    shapes[MASTER] = slot.shard.local_shape
                entries.append((slot.index, shapes, slot.dtype, slot.local_param().device))
            self._flat = FlatStates(entries)
        return self._flat

    def grow(self, kept: Sequence[Slot]) -> None:
        """New slots were added: the flat buffers grow, the states of ``kept`` move along."""
        if self._flat is None:
            return
        old, self._flat = self._flat, None
        grown = self.flat()
        for slot in kept:
            for name in self.names(slot):
                if old.has(slot.index, name):
                    grown.view(slot.index, name).copy_(old.view(slot.index, name))

    def own(self, slot: Slot) -> dict[str, torch.Tensor]:
        """The slot's pieces of its states kept in their own layouts (none before its first
        step); the step writes them here."""
        own = self._own.get(slot.index)
        if own is None:
            own = self._own[slot.index] = {}
        return own

    def names(self, slot: Slot) -> set[str]:
        return set(self._state_shapes(slot)) | ({MASTER} if slot.needs_master else set())

    def states(self, slot: Slot) -> dict[str, torch.Tensor]:
        """The slot's states (views), none before its first step."""
        if slot.step == 0 or self._flat is None:
            return {}
        flat = self._flat
        out = {name: flat.view(slot.index, name) for name in self.names(slot) if flat.has(slot.index, name)}
        return out | dict(self._own.get(slot.index, {}))

    @property
    def nbytes(self) -> int:
        """Bytes of optimizer state this rank holds (master shards included)."""
        flat = 0 if self._flat is None else self._flat.nbytes
        return flat + sum(t.numel() * t.element_size() for own in self._own.values() for t in own.values())

    @property
    def spare_bytes(self) -> int:
        """Bytes of the spare flat buffers a transactional step writes."""
        return 0 if self._flat is None else self._flat.spare_bytes

    def predicted_bytes(self, slot: Slot) -> tuple[int, int, int]:
        """What the slot's states will take once made: bytes in the flat buffers, in their own
        layouts, and of its master shard."""
        assert slot.shard is not None
        flat = own = 0
        for name, shape in self._state_shapes(slot).items():
            if name in slot.own_layouts:
                own += math.prod(slot.own_piece_shape(name, self.rank)) * slot.dtype.itemsize
            else:
                flat += math.prod(shape) * slot.dtype.itemsize
        master = math.prod(slot.shard.local_shape) * slot.dtype.itemsize if slot.needs_master else 0
        return flat, own, master

    def held_tensors(self) -> list[HeldTensor]:
        """Every parameter whose states this rank keeps, with where each state lies."""
        return [
            HeldTensor(
                name=slot.name,
                shape=slot.shape,
                param_layout=slot.param_layout,
                param=slot.local_param(),
                step=slot.step,
                state_dtype=slot.dtype,
                wheres={name: self._where(slot, name) for name in sorted(self.names(slot))},
                states=self.states(slot),
            )
            for slot in self._slots.held()
        ]

    def state_dict(self, param_groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """This rank's states, each with the layout it lies in."""
        tensors = {}
        for slot in self._slots:
            states = self.states(slot) if slot.shard is not None else {}
            if not states:
                continue
            records = {name: self._where(slot, name).record() | {"tensor": t.clone()} for name, t in states.items()}
            tensors[slot.name] = {"step": slot.step, "states": records}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
        return {"format": STATE_DICT_FORMAT, "optimizer": self.kind, "param_groups": groups, "tensors": tensors}

    def load_state_dict(
        self,
        state_dict: Mapping[str, Any],
        param_groups: Sequence[dict[str, Any]],
        check: Callable[[list[tuple[str, torch.Tensor, Layout]]], None] | None = None,
    ) -> None:
        """Restore what :meth:`state_dict` saved. Every state must have been saved in the
        layout it has now; nothing changes unless all of them fit, and ``check`` (given every
        state to load as ``(tensor.state, piece, layout)``) returns."""
        if state_dict.get("format") != STATE_DICT_FORMAT or state_dict.get("optimizer") != self.kind:
            raise OptimizerError(
                f"not a {self.kind} state dict (format {state_dict.get('format')!r}, "
                f"optimizer {state_dict.get('optimizer')!r})"
            )
        saved_groups = state_dict["param_groups"]
        if [g["param_names"] for g in saved_groups] != [g["param_names"] for g in param_groups]:
            raise OptimizerError("the state dict's parameter names and groups differ from this optimizer's")
        loaded = []
        for slot in self._slots:
            entry = state_dict["tensors"].get(slot.name)
            if slot.shard is None or entry is None:
                continue
            expected = self.names(slot)
            if set(entry["states"]) != expected:
                raise OptimizerError(
                    f"tensor '{slot.name}': the state dict holds states {sorted(entry['states'])}, "
                    f"expected {sorted(expected)}"
                )
            states = {}
            for name, saved in entry["states"].items():
                where = self._where(slot, name)
                for key, value in where.record().items():
                    if saved.get(key) != value:
                        raise OptimizerError(
                            f"tensor '{slot.name}', state '{name}': saved with {key} {saved.get(key)!r}, "
                            f"but it is {value!r} now"
                        )
                tensor = saved["tensor"]
                if tuple(tensor.shape) != where.local_shape:
                    raise OptimizerError(
                        f"tensor '{slot.name}', state '{name}': the saved piece has shape {list(tensor.shape)}, "
                        f"rank {self.rank} holds {list(where.local_shape)}"
                    )
                states[name] = tensor
            loaded.append((slot, int(entry["step"]), states))
        if check is not None:
            where = self._where
            check(
                [(f"{s.name}.{n}", t, replicas_of(where(s, n))) for s, _, states in loaded for n, t in states.items()]
            )
        flat = self.flat()
        for slot, step, states in loaded:
            slot.step = step
            for name, tensor in states.items():
                if name in slot.own_layouts:
                    self.own(slot)[name] = tensor.to(dtype=slot.dtype, device=slot.local_param().device, copy=True)
                else:
                    flat.view(slot.index, name).copy_(tensor)
        for group, saved in zip(param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "param_names"})


class ShardedStates(dict):
    """What a sharded optimizer shows as torch's ``optimizer.state``: nothing, since its states
    are sharded in its own buffers (``state_dict()``, ``runtime.optim.dcp``). Asking whether it
    is empty is an error, not ``False``: ``torch.distributed.checkpoint.state_dict`` reads an
    empty ``.state`` as "not initialized yet" and steps the optimizer with zero gradients, which
    would move its moments and step counts (docs/stacks/dcp.md)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self._kind = kind

    def __bool__(self) -> bool:
        raise OptimizerError(
            f"{self._kind} keeps its states sharded, not in .state: read them with state_dict() or "
            "runtime.optim.dcp.get_optimizer_state_dict (torch.distributed.checkpoint.state_dict's function of "
            "that name would step the optimizer to fill .state)"
        )
