"""Where a rank's optimizer-state data lies in a tensor, and the partial sums CAME takes over it.

A rank holds one of two things, and in both no padding is stored, so padding never counts:

- a *block*: its piece of the tensor under the state layout (``Layout.rank_piece``);
- a *flat chunk*: with flat sharding over mesh axis ``a``, the piece under the state layout
  without ``a`` (the *base block*) is flattened and cut into equal chunks over ``a``
  (``chunk_bounds``, as ZeRO cuts its flat buffers); rows and columns straddle chunks.

CAME factors a tensor of shape ``[*batch, H, W]`` as a batch of ``H x W`` matrices. The mesh
axes over which a local partial sum must be completed follow from the layout alone: the axes
splitting dim -1 (``Ac``) leave row sums partial, those splitting dim -2 (``Ar``) leave column
sums partial, and a flat axis leaves both partial. Batch axes never mix matrices.
"""

from __future__ import annotations

import functools
import math

import attrs
import torch

from planner.statistics import Axes, FactoredAxes
from shardlang.layout import Layout, chunk_bounds

__all__ = ["Axes", "StateShard"]


@attrs.frozen(eq=False)
class StateShard(FactoredAxes):
    """This rank's part of a tensor of ``shape`` under ``layout`` (the state layout, or for
    flat sharding the state layout without ``flat_axis``): the block ``bounds`` and, when flat,
    the range ``flat_range`` of that block flattened. The axes of its statistics' sums are
    :class:`~planner.statistics.FactoredAxes`' (torch-free, for the planner's memory too)."""

    shape: tuple[int, ...]
    layout: Layout
    bounds: tuple[tuple[int, int], ...]
    flat_axis: int | None = None
    flat_range: tuple[int, int] | None = None

    @classmethod
    def of(cls, shape: tuple[int, ...], layout: Layout, rank: int, flat_axis: int | None = None) -> StateShard:
        bounds = layout.rank_piece(shape, rank)
        if flat_axis is None:
            return cls(shape=shape, layout=layout, bounds=bounds)
        block = bounds.shape
        lo, hi = chunk_bounds(math.prod(block), layout.mesh.shape[flat_axis], layout.mesh.coordinate(rank)[flat_axis])
        return cls(shape=shape, layout=layout, bounds=bounds, flat_axis=flat_axis, flat_range=(lo, hi))

    # --- flat only: for every local element, its row, column and matrix in the base block ----
    def flat_indices(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Made anew on every call: three int64 per element, six times an f32 state's bytes
        (CAME copies them into its run's own narrower indices; ``row_sums`` and the rest keep
        them, made on their first use: Adafactor's)."""
        if self.flat_range is None or len(self.shape) < 2 or self.flat_range[1] <= self.flat_range[0]:
            return None, None, None  # a non-empty range implies h, w > 0
        lo, hi = self.flat_range
        h, w = self.block_shape[-2], self.block_shape[-1]
        flat = torch.arange(lo, hi, dtype=torch.int64)
        return flat // w, (flat // (h * w)) * w + flat % w, flat // (h * w)

    @functools.cached_property
    def _indices(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        return self.flat_indices()

    @property
    def row_index(self) -> torch.Tensor | None:
        return self._indices[0]

    @property
    def col_index(self) -> torch.Tensor | None:
        return self._indices[1]

    @property
    def batch_index(self) -> torch.Tensor | None:
        return self._indices[2]

    # --- shapes (cached: the step reads them for every tensor) ---------------------------
    @functools.cached_property
    def block_shape(self) -> tuple[int, ...]:
        return self.bounds.shape

    @functools.cached_property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the local state data: the block, or the flat chunk."""
        if self.flat_range is None:
            return self.block_shape
        return (self.flat_range[1] - self.flat_range[0],)

    @property
    def numel(self) -> int:
        """Elements of the whole tensor (the count every mean divides by)."""
        return math.prod(self.shape)

    # --- the layouts of what the rank holds (for state dicts) ----------------------------
    def data_layout(self) -> tuple[Layout, tuple[int, ...]]:
        """The layout and global shape of the local state data; for a flat chunk, the 1-d
        view of the base block split over the flat axis."""
        if self.flat_axis is None:
            return self.layout, self.shape
        return Layout(dims=((self.flat_axis,),), mesh=self.layout.mesh), (math.prod(self.block_shape),)

    def row_stat_layout(self) -> tuple[Layout, tuple[int, ...]]:
        return Layout(dims=self.layout.dims[:-1], mesh=self.layout.mesh), self.shape[:-1]

    def col_stat_layout(self) -> tuple[Layout, tuple[int, ...]]:
        dims = self.layout.dims[:-2] + self.layout.dims[-1:]
        return Layout(dims=dims, mesh=self.layout.mesh), self.shape[:-2] + self.shape[-1:]

    # --- partial sums over the local data, and statistics broadcast back to it -----------
    def row_sums(self, x: torch.Tensor) -> torch.Tensor:
        if self.flat_range is None:
            return x.sum(-1)
        return self._index_sum(x, self.row_index, self.row_stat_shape)

    def col_sums(self, x: torch.Tensor) -> torch.Tensor:
        if self.flat_range is None:
            return x.sum(-2)
        return self._index_sum(x, self.col_index, self.col_stat_shape)

    def matrix_sums(self, x: torch.Tensor) -> torch.Tensor:
        if self.flat_range is None:
            return x.sum((-2, -1))
        return self._index_sum(x, self.batch_index, self.block_shape[:-2])

    def rows(self, r: torch.Tensor) -> torch.Tensor:
        """Row statistics ``[*batch, h]`` spread over the local data."""
        if self.flat_range is None:
            return r.unsqueeze(-1)
        return self._gather(r, self.row_index)

    def cols(self, c: torch.Tensor) -> torch.Tensor:
        if self.flat_range is None:
            return c.unsqueeze(-2)
        return self._gather(c, self.col_index)

    def matrices(self, n: torch.Tensor) -> torch.Tensor:
        """Per-matrix values ``[*batch]`` spread over the row statistics ``[*batch, h]``."""
        return n.unsqueeze(-1)

    @staticmethod
    def _index_sum(x: torch.Tensor, index: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        out = torch.zeros(math.prod(shape), dtype=x.dtype, device=x.device)
        if index is not None:
            out.index_add_(0, index.to(x.device), x)
        return out.reshape(shape)

    @staticmethod
    def _gather(values: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        if index is None:
            return values.new_zeros(0)
        return values.reshape(-1)[index.to(values.device)]
