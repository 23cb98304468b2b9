"""Device meshes: an n-dimensional grid of ranks."""

from __future__ import annotations

import itertools
import math
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from typing import overload

import attrs

from shardlang.errors import LayoutError

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Words the grammar owns; a mesh or axis named like one could not be read back.
RESERVED_WORDS = frozenset({"R", "S", "P", "mesh", "over", "ranks", "tensor", "rule"})


def _as_int_tuple(values: object) -> tuple[int, ...]:
    return tuple(int(v) for v in values)  # type: ignore[union-attr]


class RankRuns(Sequence[int]):
    """Ranks held as runs instead of one by one: ``start + i_1*stride_1 + ... + i_k*stride_k``
    for every ``0 <= i_j < count_j``, row-major (the first run outermost), so that a group of
    any size costs O(runs) memory, and its length, membership, position and hash O(runs) time.
    :class:`StridedRanks` is one run (the ranks of one group along a mesh axis),
    :class:`GridRanks` several (a group along several axes, or along one axis of a mesh whose
    ranks are themselves strided). Runs compare equal to any sequence of the same ranks in the
    same order (a tuple included), and order against one as tuples do; equal runs hash alike
    whichever class holds them, but not as the tuple of their ranks: :func:`as_ranks` gives
    every set of ranks one form, so that keys built through it meet (docs/reference/planner.md)."""

    __slots__ = ("_dims", "_hash", "_key", "_n", "_order", "_start")

    def _set(self, start: int, dims: Sequence[tuple[int, int]]) -> None:
        self._dims = _canonical_dims(dims)
        self._n = math.prod(count for count, _ in self._dims)
        self._start = int(start)
        if self._n < 2:
            self._dims = ()
        # Largest stride first: where position() reads the digits.
        self._order = tuple(sorted(range(len(self._dims)), key=lambda a: -self._dims[a][1]))
        self._key = (self._n, self._start if self._n else 0, self._dims)
        # Meshes and groups are keys of every plan, bucket and process group: hashed once.
        self._hash = hash((RankRuns, *self._key))

    @property
    def start(self) -> int:
        return self._start

    @property
    def dims(self) -> tuple[tuple[int, int], ...]:
        """The runs as ``(count, stride)``, outermost first; none for fewer than two ranks."""
        return self._dims

    def position(self, rank: int) -> int | None:
        """Where ``rank`` is in the ranks, ``None`` if it is not there; O(runs)."""
        offset = rank - self._start
        if self._n == 0 or offset < 0:
            return None
        digits = [0] * len(self._dims)
        # Each stride exceeds the span of the smaller ones (GridRanks checks it): the digit of
        # the largest is the only one possible, and so on down.
        for axis in self._order:
            count, stride = self._dims[axis]
            digits[axis] = offset // stride
            if digits[axis] >= count:
                return None
            offset -= digits[axis] * stride
        if offset:
            return None
        index = 0
        for digit, (count, _) in zip(digits, self._dims, strict=True):
            index = index * count + digit
        return index

    def __len__(self) -> int:
        return self._n

    def _at(self, index: int) -> int:
        if not -self._n <= index < self._n:
            raise IndexError(f"rank index {index} is out of range for {self._n} ranks")
        index %= self._n
        rank = self._start
        for count, stride in reversed(self._dims):
            index, digit = divmod(index, count)
            rank += digit * stride
        return rank

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            return tuple(self._at(i) for i in range(self._n)[index])
        return self._at(operator.index(index))

    def __iter__(self) -> Iterator[int]:
        if self._n < 2:
            return iter((self._start,) * self._n)
        return _walk(self._start, self._dims)

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and self.position(rank) is not None

    def index(self, rank: object, start: int = 0, stop: int | None = None) -> int:
        stop = self._n if stop is None else stop
        found = self.position(rank) if isinstance(rank, int) else None
        if found is None or not max(start, 0) <= found < min(stop, self._n):
            raise ValueError(f"{rank!r} is not in the ranks")
        return found

    def count(self, rank: object) -> int:
        return int(rank in self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankRuns):
            return other._key == self._key
        if isinstance(other, (tuple, list, range)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return self._hash

    # Ordered as the tuple of the ranks would be (sorting meshes and groups by their ranks).
    def __lt__(self, other: object) -> bool:
        return _compare(self, other, operator.lt)

    def __le__(self, other: object) -> bool:
        return _compare(self, other, operator.le)

    def __gt__(self, other: object) -> bool:
        return _compare(self, other, operator.gt)

    def __ge__(self, other: object) -> bool:
        return _compare(self, other, operator.ge)


def _compare(a: RankRuns, b: object, op: Callable[[object, object], bool]) -> bool:
    """``op`` between the tuples of ``a``'s and ``b``'s ranks, reading them only up to the first
    difference."""
    if not isinstance(b, (RankRuns, tuple)):
        return NotImplemented
    for x, y in zip(a, b, strict=False):
        if x != y:
            return op(x, y)
    return op(len(a), len(b))


def _walk(base: int, dims: tuple[tuple[int, int], ...]) -> Iterator[int]:
    (count, stride), *inner = dims
    if not inner:
        yield from range(base, base + count * stride, stride)
        return
    for k in range(count):
        yield from _walk(base + k * stride, tuple(inner))


def _canonical_dims(dims: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The runs of one sequence, one way: runs of one rank dropped, a run that continues the
    one inside it merged with it (``(2, 4), (4, 1)`` is ``(8, 1)``); of no rank, ``((0, 1),)``."""
    merged: list[tuple[int, int]] = []
    for count, stride in dims:
        count, stride = int(count), int(stride)
        if count < 0:
            raise LayoutError(f"a run of ranks has count {count}; counts are at least 0")
        if count == 0:
            return ((0, 1),)
        if count > 1:
            merged.append((count, stride))
    k = len(merged) - 1
    while k > 0:
        (outer, o_stride), (inner, i_stride) = merged[k - 1], merged[k]
        if o_stride == inner * i_stride:
            merged[k - 1 : k + 1] = [(outer * inner, i_stride)]
        k -= 1
    return tuple(merged)


class StridedRanks(RankRuns):
    """The ranks ``start, start+step, ..., start+(n-1)*step``, as a sequence that holds only
    ``n``, ``start`` and ``step``: the ranks of one group along a mesh axis (every
    ``tp``-th rank of a ``[dp, tp]`` mesh, say), so that a group of any size costs O(1) memory
    and prints in O(1) (``ranks 0..4088 step 8``). A :class:`Mesh` always stores an arithmetic
    run of ranks this way (its converter turns such a tuple into one), so that meshes hash as
    they compare. ``step`` is at least 1; a run of consecutive ranks is a :class:`RowMajorRanks`."""

    __slots__ = ("_step",)

    def __init__(self, n: int, start: int = 0, step: int = 1) -> None:
        self._step = int(step)
        if self._step < 1:
            raise LayoutError(f"a rank run's step must be at least 1, not {self._step}")
        if int(n) < 0:
            raise LayoutError(f"a rank run holds {int(n)} ranks; at least 0")
        self._set(start, ((int(n), self._step),))

    @property
    def step(self) -> int:
        return self._step

    def _range(self) -> range:
        return range(self._start, self._start + self._n * self._step, self._step)

    def position(self, rank: int) -> int | None:
        offset, off_step = divmod(rank - self._start, self._step)
        return offset if off_step == 0 and 0 <= offset < self._n else None

    def _at(self, index: int) -> int:
        return self._range()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._range())

    def __reversed__(self) -> Iterator[int]:
        return reversed(self._range())

    def __repr__(self) -> str:
        return f"StridedRanks({self._n}, {self._start}, {self._step})"

    def __reduce__(self) -> tuple[type, tuple[int, ...]]:
        return StridedRanks, (self._n, self._start, self._step)


class RowMajorRanks(StridedRanks):
    """The ranks ``start..start+n-1`` in order (``0..n-1`` by default): the ranks of a mesh
    declared without a ``ranks`` clause, or with a range (``ranks 4096..8191``), so that a mesh
    of a million ranks costs O(axes) memory and prints in O(1)."""

    __slots__ = ()

    def __init__(self, n: int, start: int = 0) -> None:
        super().__init__(n, start, 1)

    def __repr__(self) -> str:
        return f"RowMajorRanks({self._n})" if self._start == 0 else f"RowMajorRanks({self._n}, {self._start})"

    def __reduce__(self) -> tuple[type, tuple[int, ...]]:
        return RowMajorRanks, (self._n, self._start)


class GridRanks(RankRuns):
    """Ranks in several nested runs, ``dims`` giving ``(count, stride)`` outermost first (see
    :class:`RankRuns`): the group of a rank along several mesh axes (``axes (0, 2)`` of
    ``[4, 2, 8]``: ``GridRanks(r, ((4, 16), (8, 1)))``), or along any axes of a mesh whose
    ranks are a strided run. Every stride must exceed what the smaller strides span together, as
    the strides of a mesh's axes do, so that the ranks are distinct and each is found in
    O(runs). Built by :func:`as_ranks` (which gives one run as a :class:`StridedRanks`)."""

    __slots__ = ()

    def __init__(self, start: int, dims: Sequence[tuple[int, int]]) -> None:
        self._set(start, dims)
        span = 0
        for count, stride in sorted(self._dims, key=lambda dim: dim[1]):
            if stride <= span:
                raise LayoutError(
                    f"rank runs {list(self._dims)}: a stride of {stride} does not exceed {span}, the span of "
                    "the runs of smaller strides, so ranks would repeat or interleave"
                )
            span += (count - 1) * stride

    def __repr__(self) -> str:
        return f"GridRanks({self._start}, {self._dims!r})"

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return GridRanks, (self._start, self._dims)


# A group of ranks in its one form (:func:`as_ranks`): what rank groups are typed as.
RankGroup = tuple[int, ...] | RankRuns


def as_ranks(values: Sequence[int]) -> RankGroup:
    """Ranks in their one form: a :class:`RowMajorRanks` for consecutive ones, a
    :class:`StridedRanks` for one run of a step of 2 or more, a :class:`GridRanks` for several
    nested runs (rank groups along several mesh axes), else a tuple. O(runs) for runs, O(ranks)
    for any other sequence. Equal sequences get equal values with equal hashes, so that groups
    and meshes are keys however their ranks came (listed, from a mesh's strides)."""
    return _one_form(values, nested=True)


def _one_form(values: Sequence[int], *, nested: bool) -> RankGroup:
    """:func:`as_ranks`, or without ``nested`` a tuple where that is a :class:`GridRanks`."""
    if isinstance(values, RankRuns):
        if isinstance(values, RowMajorRanks):
            return values
        if len(values.dims) > 1:
            if not nested:
                return tuple(values)
            return values if isinstance(values, GridRanks) else GridRanks(values.start, values.dims)
        step = values.dims[0][1] if values.dims else 1
        return RowMajorRanks(len(values), values.start) if step == 1 else StridedRanks(len(values), values.start, step)
    ranks = _as_int_tuple(values)
    if len(ranks) < 2:
        return RowMajorRanks(len(ranks), ranks[0] if ranks else 0)
    dims = _runs_of(ranks)
    if dims is None or (len(dims) > 1 and not nested):
        return ranks
    try:
        runs = _one_form(GridRanks(ranks[0], dims), nested=nested)
    except LayoutError:  # nested, but with ranks that interleave: not runs this module holds
        return ranks
    return runs if runs == ranks else ranks


def _runs_of(ranks: tuple[int, ...]) -> list[tuple[int, int]] | None:
    """The runs ``ranks`` would be, read innermost first: the run of equal steps from the
    first rank, then the same for the starts of its repeats (checked against ``ranks`` by the
    caller); ``None`` where no such reading exists. O(ranks)."""
    dims: list[tuple[int, int]] = []
    level = ranks
    while len(level) > 1:
        stride = level[1] - level[0]
        if stride < 1:
            return None
        count = 2
        while count < len(level) and level[count] - level[count - 1] == stride:
            count += 1
        if len(level) % count:
            return None
        dims.append((count, stride))
        level = level[::count]
    return dims[::-1]


def highest_rank(ranks: Sequence[int]) -> int:
    """The largest of ``ranks`` (at least one); O(runs) for :class:`RankRuns`."""
    if isinstance(ranks, RankRuns):
        if not ranks:
            raise ValueError("no ranks")
        return ranks.start + sum((count - 1) * stride for count, stride in ranks.dims)
    return max(ranks)


def _mesh_ranks(values: object) -> tuple[int, ...] | StridedRanks:
    """A mesh's ranks as stored: as :func:`as_ranks` gives them, but nested runs as a tuple
    (a mesh's text and its planning read one run or a list; a mesh declares its ranks as a
    range or listed, docs/language.md)."""
    return _one_form(values, nested=False)  # type: ignore[arg-type,return-value]


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
    ranks: tuple[int, ...] | StridedRanks = attrs.field(converter=_mesh_ranks)
    axis_names: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_names)
    name: str | None = None
    # rank -> its row-major position in ``ranks``, built once by __attrs_post_init__ (derived, so
    # left out of equality, hashing and repr): rank lookups are on every planning and runtime
    # path. ``None`` for a run of ranks, whose position is arithmetic.
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
        object.__setattr__(self, "_flat_index", None if isinstance(self.ranks, StridedRanks) else _index(self.ranks))
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
            return self.ranks.position(rank)  # type: ignore[union-attr]
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
    def geometry(self) -> tuple[tuple[int, ...], tuple[int, ...] | StridedRanks]:
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
    """``4..7`` for an ascending run of two or more consecutive ranks, ``0..56 step 8`` for one
    of three or more of a larger step, else ``[3,1]``; O(1) for a :class:`StridedRanks`."""
    run = ranks if isinstance(ranks, StridedRanks) else _mesh_ranks(ranks)
    if not isinstance(run, StridedRanks) or len(run) < (2 if run.step == 1 else 3):
        return "[" + ",".join(str(r) for r in ranks) + "]"
    return f"{run[0]}..{run[-1]}" + ("" if run.step == 1 else f" step {run.step}")


def check_identifier(name: str, what: str) -> None:
    if not _IDENT.match(name):
        raise LayoutError(f"{what} name '{name}' is not an identifier")
    if name in RESERVED_WORDS:
        raise LayoutError(f"{what} name '{name}' is a reserved word of the language")
