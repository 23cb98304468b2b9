"""Objects with a ``state_dict``: an lr scheduler, a data loader, in the checkpoint beside the tensors.

    checkpoint.save(path, optimizer=optimizer, objects={"scheduler": scheduler, "data": loader})
    checkpoint.load(path, optimizer=optimizer, objects={"scheduler": scheduler, "data": loader})

Each object's ``state_dict()`` is taken on every rank and stored in the metadata (JSON, so
covered by its checksum), encoded so that it reads back exactly what was saved: every list,
tuple and dict is tagged with its kind (``{"tuple": [...]}``, ``{"dict": [[key, value], ...]}``),
so tuples stay tuples and integer keys stay integers. A state that is the same on every rank
(a scheduler's; a data loader's that counts global samples) is stored once and loads on any
number of ranks; one that differs by rank (a sampler's position in its rank's share) is stored
per rank and loads only on as many ranks, each rank its own. Values are numbers, strings,
booleans, ``None`` and those containers; anything else (a tensor, a function) is a
:class:`CheckpointError` naming where it lies. See docs/tutorials/checkpoints.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.fields import Fields, field

SAME = "same"  # one state for every rank
PER_RANK = "ranks"  # the states of ranks 0, 1, ... in order
_CONTAINERS = ("list", "tuple", "dict")


class Stateful(Protocol):
    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> Any: ...


def encode(value: object, path: str) -> object:
    """``value`` as JSON that :func:`decode` gives back exactly; ``path`` names it in errors."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return {"float": repr(value)}  # JSON has no inf or nan
        return value
    if isinstance(value, list | tuple):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [encode(v, field(path, i)) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {"dict": [[encode(k, path), encode(v, field(path, str(k)))] for k, v in value.items()]}
    raise CheckpointError(
        f"{path} is a {type(value).__name__}, which a checkpoint's objects cannot hold (numbers, strings, "
        "booleans, None, lists, tuples and dicts of them)"
    )


def decode(value: object, fields: Fields, path: str) -> object:
    """The value :func:`encode` encoded; a malformed one is an error naming ``path``."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    entry = fields.object(value, path)
    if len(entry) != 1:
        raise fields.fail(path, f"must have one key (the kind of value), not {sorted(entry)}")
    kind, inner = next(iter(entry.items()))
    if kind == "float":
        text = fields.string(inner, field(path, kind))
        if text not in ("inf", "-inf", "nan"):
            raise fields.fail(field(path, kind), f"is {text!r}, not inf, -inf or nan")
        return float(text)
    if kind not in _CONTAINERS:
        raise fields.fail(path, f"has the kind {kind!r}, not one of float, {', '.join(_CONTAINERS)}")
    items = fields.list(inner, field(path, kind))
    if kind != "dict":
        decoded = [decode(v, fields, field(field(path, kind), i)) for i, v in enumerate(items)]
        return decoded if kind == "list" else tuple(decoded)
    out = {}
    for i, pair in enumerate(items):
        pair = fields.list(pair, field(field(path, kind), i))
        if len(pair) != 2:
            raise fields.fail(field(field(path, kind), i), "must be [key, value]")
        key = decode(pair[0], fields, field(field(path, kind), i))
        try:
            out[key] = decode(pair[1], fields, field(field(path, kind), i))
        except TypeError:  # an unhashable key
            raise fields.fail(field(field(path, kind), i), "has a key that is a list or dict") from None
    return out


def states_of(objects: Mapping[str, Stateful] | None) -> dict[str, object]:
    """This rank's encoded states of ``objects``."""
    out = {}
    for name, obj in sorted((objects or {}).items()):
        if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
            raise CheckpointError(
                f"objects: '{name}' is a {type(obj).__name__}, which has no state_dict/load_state_dict"
            )
        out[name] = encode(obj.state_dict(), f"objects['{name}']")
    return out


def merged(per_rank: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    """The ranks' encoded states, each object's stored once where every rank's is the same."""
    names = set(per_rank[0])
    for rank, states in enumerate(per_rank):
        if set(states) != names:
            raise CheckpointError(f"rank {rank} saves the objects {sorted(states)}, rank 0 {sorted(names)}")
    out: dict[str, dict[str, object]] = {}
    for name in sorted(names):
        values = [states[name] for states in per_rank]
        out[name] = {SAME: values[0]} if all(v == values[0] for v in values) else {PER_RANK: values}
    return out


def parse(raw: object, fields: Fields, world_size: int) -> dict[str, dict[str, object]]:
    """The metadata's ``objects`` field, checked (values are decoded at load)."""
    out = {}
    for name, entry in fields.object(raw, "objects").items():
        path = field("objects", name)
        entry = fields.object(entry, path)
        if set(entry) == {SAME} or (
            set(entry) == {PER_RANK} and len(fields.list(entry[PER_RANK], field(path, PER_RANK))) == world_size
        ):
            out[name] = entry
        else:
            raise fields.fail(path, f"must be {{{SAME!r}: state}} or {{{PER_RANK!r}: one state per saving rank}}")
    return out


def to_load(
    stored: Mapping[str, Mapping[str, object]],
    objects: Mapping[str, Stateful],
    rank: int,
    world_size: int,
    source: str,
) -> list[tuple[Stateful, object]]:
    """Each object with the state it loads on this rank (decoded); errors before any loads."""
    fields = Fields(source)
    out = []
    for name, obj in sorted(objects.items()):
        entry = stored.get(name)
        if entry is None:
            raise CheckpointError(f"{source}: the checkpoint holds no object '{name}' (it holds {sorted(stored)})")
        path = field("objects", name)
        if SAME in entry:
            out.append((obj, decode(entry[SAME], fields, field(path, SAME))))
            continue
        states = entry[PER_RANK]
        assert isinstance(states, list)
        if len(states) != world_size:
            raise CheckpointError(
                f"{source}: object '{name}' was saved with a state per rank, which differ, on {len(states)} ranks; "
                f"it cannot load on {world_size}: save a state that is the same on every rank (a count of global "
                "samples, not a position in the rank's share) to resume on another number of ranks"
            )
        out.append((obj, decode(states[rank], fields, field(field(path, PER_RANK), rank))))
    return out
