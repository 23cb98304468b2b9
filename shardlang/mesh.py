"""Device meshes: an n-dimensional grid of ranks."""

from __future__ import annotations

import itertools
import math
import re

import attrs

from shardlang.errors import LayoutError

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Words the grammar owns; a mesh or axis named like one could not be read back.
RESERVED_WORDS = frozenset({"R", "S", "P", "mesh", "over", "ranks", "tensor", "rule"})


def _as_int_tuple(values: object) -> tuple[int, ...]:
    return tuple(int(v) for v in values)  # type: ignore[union-attr]


def _optional_names(values: object) -> tuple[str, ...] | None:
    return None if values is None else tuple(str(v) for v in values)  # type: ignore[union-attr]


@attrs.frozen
class Mesh:
    """A grid of ``prod(shape)`` ranks, row-major over ``ranks``.

    ``axis_names`` is ``None`` for an anonymous mesh (axes are referred to by number), and
    ``name`` is set for a mesh declared in a spec file (``mesh world = [dp=2, tp=2]``), which
    layouts print as ``over world``.
    """

    shape: tuple[int, ...] = attrs.field(converter=_as_int_tuple)
    ranks: tuple[int, ...] = attrs.field(converter=_as_int_tuple)
    axis_names: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_names)
    name: str | None = None
    # rank -> its row-major position in ``ranks``, built once by __attrs_post_init__ (derived, so
    # left out of equality, hashing and repr): rank lookups are on every planning and runtime path.
    _flat_index: dict[int, int] = attrs.field(init=False, eq=False, hash=False, repr=False)

    @ranks.default
    def _row_major_ranks(self) -> tuple[int, ...]:
        return tuple(range(math.prod(self.shape)))

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
        flat_index: dict[int, int] = {}
        for flat, r in enumerate(self.ranks):
            if r < 0:
                raise LayoutError(f"rank {r} is negative")
            if r in flat_index:
                raise LayoutError(f"rank {r} appears twice in the mesh")
            flat_index[r] = flat
        object.__setattr__(self, "_flat_index", flat_index)
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
        flat = self._flat_index.get(rank)
        if flat is None:
            raise LayoutError(f"rank {rank} is not in {self.describe()}")
        coord = []
        for size in reversed(self.shape):
            coord.append(flat % size)
            flat //= size
        return tuple(reversed(coord))

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
        if self.ranks != tuple(range(self.size)):
            text += " ranks " + format_ranks(self.ranks)
        return text

    def __str__(self) -> str:
        return self.name if self.name is not None else self.describe()


def format_ranks(ranks: tuple[int, ...]) -> str:
    """``4..7`` for an ascending run of two or more ranks, else ``[3,1]``."""
    if len(ranks) >= 2 and all(b == a + 1 for a, b in itertools.pairwise(ranks)):
        return f"{ranks[0]}..{ranks[-1]}"
    return "[" + ",".join(str(r) for r in ranks) + "]"


def check_identifier(name: str, what: str) -> None:
    if not _IDENT.match(name):
        raise LayoutError(f"{what} name '{name}' is not an identifier")
    if name in RESERVED_WORDS:
        raise LayoutError(f"{what} name '{name}' is a reserved word of the language")
