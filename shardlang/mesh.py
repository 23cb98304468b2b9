"""Device meshes: an n-dimensional grid of ranks."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator, Sequence
from typing import overload

import attrs

from shardlang.errors import LayoutError

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Words the grammar owns; a mesh or axis named like one could not be read back.
RESERVED_WORDS = frozenset({"R", "S", "P", "mesh", "over", "ranks", "tensor", "rule"})


def _as_int_tuple(values: object) -> tuple[int, ...]:
    return tuple(int(v) for v in values)  # type: ignore[union-attr]


class RowMajorRanks(Sequence[int]):
    """The ranks ``start..start+n-1`` in order (``0..n-1`` by default), as a sequence that holds
    only ``n`` and ``start``: the ranks of a mesh declared without a ``ranks`` clause, or with a
    range (``ranks 4096..8191``), so that a mesh of a million ranks costs O(axes) memory and
    prints in O(1). It compares equal to any sequence of the same ranks in the same order (a
    tuple included); its hash is its own, so a :class:`Mesh` always stores an ascending run of
    ranks this way (its converter turns such a tuple into one) and meshes hash as they compare."""

    __slots__ = ("_n", "_start")

    def __init__(self, n: int, start: int = 0) -> None:
        self._n = int(n)
        self._start = int(start)

    @property
    def start(self) -> int:
        return self._start

    def _range(self) -> range:
        return range(self._start, self._start + self._n)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            return tuple(self._range()[index])
        return self._range()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._range())

    def __reversed__(self) -> Iterator[int]:
        return reversed(self._range())

    def __contains__(self, rank: object) -> bool:
        return rank in self._range()

    def index(self, rank: object, start: int = 0, stop: int | None = None) -> int:
        stop = self._n if stop is None else stop
        found = self._range().index(rank) if rank in self else -1
        if not max(start, 0) <= found < min(stop, self._n):
            raise ValueError(f"{rank!r} is not in the ranks")
        return found

    def count(self, rank: object) -> int:
        return int(rank in self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RowMajorRanks):
            return other._n == self._n and (other._start == self._start or not self._n)
        if isinstance(other, (tuple, list, range)):
            return len(other) == self._n and all(r == self._start + i for i, r in enumerate(other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash((RowMajorRanks, self._n, self._start if self._n else 0))

    def __repr__(self) -> str:
        return f"RowMajorRanks({self._n})" if self._start == 0 else f"RowMajorRanks({self._n}, {self._start})"

    def __reduce__(self) -> tuple[type, tuple[int, int]]:
        return RowMajorRanks, (self._n, self._start)


def _as_ranks(values: object) -> tuple[int, ...] | RowMajorRanks:
    """A mesh's ranks as stored: :class:`RowMajorRanks` when they are an ascending run."""
    if isinstance(values, RowMajorRanks):
        return values
    ranks = _as_int_tuple(values)
    start = ranks[0] if ranks else 0
    if all(r == start + i for i, r in enumerate(ranks)):
        return RowMajorRanks(len(ranks), start)
    return ranks


def _optional_names(values: object) -> tuple[str, ...] | None:
    return None if values is None else tuple(str(v) for v in values)  # type: ignore[union-attr]


@attrs.frozen
class Mesh:
    """A grid of ``prod(shape)`` ranks, row-major over ``ranks``.

    ``axis_names`` is ``None`` for an anonymous mesh (axes are referred to by number), and
    ``name`` is set for a mesh declared in a spec file (``mesh world = [dp=2, tp=2]``), which
    layouts print as ``over world``. ``ranks`` is a tuple, or for an ascending run of ranks
    (``0..n-1`` by default) a :class:`RowMajorRanks` (the same sequence, without a per-rank table).
    """

    shape: tuple[int, ...] = attrs.field(converter=_as_int_tuple)
    ranks: tuple[int, ...] | RowMajorRanks = attrs.field(converter=_as_ranks)
    axis_names: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_names)
    name: str | None = None
    # rank -> its row-major position in ``ranks``, built once by __attrs_post_init__ (derived, so
    # left out of equality, hashing and repr): rank lookups are on every planning and runtime
    # path. ``None`` for row-major ranks, where a rank is its own position.
    _flat_index: dict[int, int] | None = attrs.field(init=False, eq=False, hash=False, repr=False)

    @ranks.default
    def _row_major_ranks(self) -> RowMajorRanks:
        return RowMajorRanks(math.prod(self.shape))

    def __attrs_post_init__(self) -> None:
        if not self.shape:
            raise LayoutError("a mesh needs at least one axis")
        for axis, size in enumerate(self.shape):
            if size < 1:
                raise LayoutError(f"mesh axis {axis} has size {size}; sizes must be at least 1")
        if len(self.ranks) != self.size:
            raise LayoutError(
                f"mesh[{','.join(map(str, self.shape))}] holds {self.size} ranks but {len(self.ranks)} are given"
            )
        object.__setattr__(self, "_flat_index", None if isinstance(self.ranks, RowMajorRanks) else _index(self.ranks))
        if self.axis_names is not None:
            if len(self.axis_names) != len(self.shape):
                raise LayoutError(f"{len(self.axis_names)} axis names for a {len(self.shape)}-axis mesh")
            for n in self.axis_names:
                check_identifier(n, "axis")
            if len(set(self.axis_names)) != len(self.axis_names):
                dup = next(n for n in self.axis_names if self.axis_names.count(n) > 1)
                raise LayoutError(f"mesh axis name '{dup}' is used twice")
        if self.name is not None:
            check_identifier(self.name, "mesh")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_label(self, axis: int) -> str:
        """How the axis is written in layouts: its name, or its number."""
        return self.axis_names[axis] if self.axis_names is not None else str(axis)

    def axis_index(self, ref: str | int) -> int:
        """The index of an axis given by number or name; a :class:`LayoutError` if none."""
        if isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit()):
            axis = int(ref)
            if not 0 <= axis < self.ndim:
                raise LayoutError(f"mesh axis {axis} is out of range for {self.describe()}")
            return axis
        if self.axis_names is None or ref not in self.axis_names:
            known = ", ".join(self.axis_names) if self.axis_names else "none: axes are numbered"
            raise LayoutError(f"unknown mesh axis '{ref}' for {self.describe()} (names: {known})")
        return self.axis_names.index(ref)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinate of a global rank id."""
        flat = self._position(rank)
        if flat is None:
            raise LayoutError(f"rank {rank} is not in {self.describe()}")
        coord = []
        for size in reversed(self.shape):
            coord.append(flat % size)
            flat //= size
        return tuple(reversed(coord))

    def _position(self, rank: int) -> int | None:
        """The row-major position of ``rank`` in ``ranks``, ``None`` if it is not there."""
        if self._flat_index is None:
            start = self.ranks.start  # type: ignore[union-attr]
            return rank - start if rank in self.ranks else None
        return self._flat_index.get(rank)

    def rank_at(self, coordinate: tuple[int, ...]) -> int:
        flat = 0
        for c, size in zip(coordinate, self.shape, strict=True):
            flat = flat * size + c
        return self.ranks[flat]

    def axis_groups(self, axis: int) -> tuple[tuple[int, ...], ...]:
        """The rank groups along ``axis``: one tuple per fixed setting of the other axes,
        ordered by coordinate along ``axis``. Every rank is in exactly one group."""
        others = [range(s) for i, s in enumerate(self.shape) if i != axis]
        groups = []
        for rest in itertools.product(*others):
            group = []
            for k in range(self.shape[axis]):
                coord = list(rest)
                coord.insert(axis, k)
                group.append(self.rank_at(tuple(coord)))
            groups.append(tuple(group))
        return tuple(groups)

    @property
    def geometry(self) -> tuple[tuple[int, ...], tuple[int, ...] | RowMajorRanks]:
        """The grid and its ranks, whatever the mesh and its axes are called: what planning and
        communication depend on, as a key (hashing it costs O(axes) for row-major ranks)."""
        return self.shape, self.ranks

    def same_geometry(self, other: Mesh) -> bool:
        """Whether ``other`` is the same grid of the same ranks, whatever either is called
        (axis and mesh names aside): what planning and communication depend on."""
        return self.geometry == other.geometry

    def anonymous(self) -> Mesh:
        """The same grid without the declared name (prints inline as ``mesh[...]``)."""
        return attrs.evolve(self, name=None)

    def describe(self) -> str:
        """The inline text of the mesh, whatever its declared name."""
        if self.axis_names is None:
            axes = ",".join(str(s) for s in self.shape)
        else:
            axes = ",".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape, strict=True))
        text = f"mesh[{axes}]"
        if not numbered_from_zero(self.ranks):
            text += " ranks " + format_ranks(self.ranks)
        return text

    def text(self) -> str:
        """The one canonical text of the mesh, name included, that ``parse_mesh`` reads back
        to an equal value: ``mesh[dp=2,tp=2]``, or ``mesh world = [dp=2,tp=2]`` for a
        declared mesh (the form of its declaration in a spec file, docs/language.md)."""
        if self.name is None:
            return self.describe()
        return f"mesh {self.name} = {self.describe().removeprefix('mesh')}"

    def __str__(self) -> str:
        return self.name if self.name is not None else self.describe()


def _index(ranks: tuple[int, ...]) -> dict[int, int]:
    """rank -> its position in ``ranks``; a :class:`LayoutError` for a negative or repeated rank."""
    flat_index: dict[int, int] = {}
    for flat, r in enumerate(ranks):
        if r < 0:
            raise LayoutError(f"rank {r} is negative")
        if r in flat_index:
            raise LayoutError(f"rank {r} appears twice in the mesh")
        flat_index[r] = flat
    return flat_index


def numbered_from_zero(ranks: Sequence[int]) -> bool:
    """Whether a mesh's stored ranks are ``0..n-1`` in order (its text needs no ``ranks`` clause)."""
    return isinstance(ranks, RowMajorRanks) and ranks.start == 0


def format_ranks(ranks: Sequence[int]) -> str:
    """``4..7`` for an ascending run of two or more ranks, else ``[3,1]``; O(1) for a
    :class:`RowMajorRanks`."""
    if isinstance(ranks, RowMajorRanks) and len(ranks) >= 2:
        return f"{ranks[0]}..{ranks[-1]}"
    if len(ranks) >= 2 and all(b == a + 1 for a, b in itertools.pairwise(ranks)):
        return f"{ranks[0]}..{ranks[-1]}"
    return "[" + ",".join(str(r) for r in ranks) + "]"


def check_identifier(name: str, what: str) -> None:
    if not _IDENT.match(name):
        raise LayoutError(f"{what} name '{name}' is not an identifier")
    if name in RESERVED_WORDS:
        raise LayoutError(f"{what} name '{name}' is a reserved word of the language")
