"""CAME on local shards, exact: the arithmetic of the authors' ``came_pytorch.CAME``, with every
statistic that spans ranks completed by a sum over the mesh axes the layout says it spans.

Per step, for a tensor ``[*batch, H, W]`` (factored: a batch of matrices):

    U = g^2 + eps1;  r = EMA(mean_W U), c = EMA(mean_H U) with beta2
    u = g * rsqrt(r / mean_H r) * rsqrt(c);  u /= max(1, RMS(u) / clip_threshold)
    m = EMA(u) with beta1;  Res = (u - m)^2 + eps2;  R, C = row/column EMAs of Res with beta3
    p -= lr*wd*p;  p -= lr * m * rsqrt(R / mean_H R) * rsqrt(C)

and for a 1-d tensor ``v = EMA(U)``, ``u = g * rsqrt(v)``, the update being ``m``.

Sharded, the raw sums are completed first and divided by the true global counts (``H``, ``W``,
the tensor's element count) before the EMA, so uneven and empty pieces weigh right. The row
normaliser ``mean_H r`` needs the rows of other ranks when the rows are split; because the
EMA is linear, ``sum_H r_new = beta * sum_H r_old + (1-beta) * sum_HW U / W``, whose two sums
travel with the row and column sums. A step is three phases of sums: second moment, RMS,
instability; ``planner.statistics.phase_sums`` lists them, :class:`CameRun` computes them.

The math runs over runs of consecutive tensors at once (as ShardedAdamW's, README
"Flat state buffers"): whole-range ops on flat buffers where the math is elementwise, one
``torch._foreach_*`` call per op for the per-tensor statistics, and for flat chunks one
``index_add_`` per kind of sum for the whole run; per block-sharded matrix only its row and
column sums remain ops of their own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Unpack

import attrs
import torch

from runtime.memory.buffers import KeptViews, Scratch
from runtime.optim.base import ShardedOptimizer, StepOptions
from runtime.optim.errors import OptimizerError
from runtime.optim.flat import as_flat, flat_or_copy, pieces_of, scatter_back
from runtime.optim.phases import StepWork, Update
from runtime.optim.records import StateWhere
from runtime.optim.shards import StateShard
from runtime.optim.slots import Slot, SpecLike
from runtime.optim.states import statistic_where
from runtime.optim.sums import SumSpec, phase_sum_specs

PHASES = ("the second-moment sums", "the update's RMS", "the instability sums")
# The row and column statistics of a factored tensor (runtime.optim.states.statistic_where).
ROW_STATES = ("exp_avg_sq_row", "exp_avg_res_row")
COL_STATES = ("exp_avg_sq_col", "exp_avg_res_col")


@attrs.frozen
class CameHyper:
    lr: float
    eps: tuple[float, float]
    clip_threshold: float
    betas: tuple[float, float, float]
    weight_decay: float


def came_state_shapes(shard: StateShard) -> dict[str, tuple[int, ...]]:
    """The local shape of every state, as ``came_pytorch`` names them, in the rank's part of
    the tensor."""
    if not shard.factored:
        return {"exp_avg": shard.local_shape, "exp_avg_sq": shard.local_shape}
    return {
        "exp_avg": shard.local_shape,
        "exp_avg_sq_row": shard.row_stat_shape,
        "exp_avg_sq_col": shard.col_stat_shape,
        "exp_avg_res_row": shard.row_stat_shape,
        "exp_avg_res_col": shard.col_stat_shape,
    }


@attrs.frozen(eq=False)
class RunStats:
    """Where the row, column and per-matrix statistics of a run's matrices lie in one buffer
    each: per slot its offset in each (``None`` for a 1-d tensor), and the size of each, whose
    last entry is a spare one (``1`` there) for the elements of no flat chunk. ``row_matrix``
    gives every row statistic (and the spare) its matrix, ``heights`` every matrix its row
    statistics' count, so that per-matrix sums and means of rows are one ``index_add_`` for the
    run. When some matrices are flat chunks, every element of the run has its row, column and
    matrix there (``index``): their partial sums are one ``index_add_`` each for the whole run
    and the statistics spread back to the elements one ``index_select``. ``counts`` give every
    row statistic its matrix's width and every column statistic its height, ``sides`` every
    matrix its width and height, ``spans`` every matrix whether its rows span ranks: what the
    completed sums of the whole run are divided by and which normalisers come from them, in
    one op each (per matrix, a Python float becomes a tensor for every op: four ops more)."""

    offsets: tuple[tuple[int, int, int] | None, ...]
    sizes: tuple[int, int, int]
    row_matrix: torch.Tensor
    heights: torch.Tensor
    index: tuple[torch.Tensor, ...] | None
    roots: torch.Tensor  # per slot, the square root of its tensor's element count (for the RMS)
    counts: tuple[torch.Tensor, torch.Tensor]
    sides: tuple[torch.Tensor, torch.Tensor]
    spans: torch.Tensor

    @classmethod
    def of(cls, shards: Sequence[StateShard], dtype: torch.dtype, device: torch.device) -> RunStats:
        offsets: list[tuple[int, int, int] | None] = []
        sizes = [0, 0, 0]
        for shard in shards:
            if not shard.factored:
                offsets.append(None)
                continue
            offsets.append((sizes[0], sizes[1], sizes[2]))
            sizes[0] += math.prod(shard.row_stat_shape)
            sizes[1] += math.prod(shard.col_stat_shape)
            sizes[2] += math.prod(shard.block_shape[:-2])
        kind = torch.int32 if max(sizes) < 2**31 - 1 else torch.int64
        row_matrix = torch.full((sizes[0] + 1,), sizes[2], dtype=kind)
        heights = torch.ones(sizes[2] + 1, dtype=dtype)
        # In (at least) fp32, as a Python float divisor is: bf16 divided by it rounds once.
        wide = torch.promote_types(dtype, torch.float32)
        counts = (torch.ones(sizes[0], dtype=wide), torch.ones(sizes[1], dtype=wide))
        sides = (torch.ones(sizes[2], dtype=wide), torch.ones(sizes[2], dtype=wide))
        spans = torch.zeros(sizes[2], dtype=torch.bool)
        for shard, at in zip(shards, offsets, strict=True):
            if at is not None:
                count, height = math.prod(shard.block_shape[:-2]), shard.row_stat_shape[-1]
                row_matrix[at[0] : at[0] + count * height] = torch.arange(count).repeat_interleave(height) + at[2]
                heights[at[2] : at[2] + count] = height
                counts[0][at[0] : at[0] + count * height] = shard.shape[-1]
                counts[1][at[1] : at[1] + math.prod(shard.col_stat_shape)] = shard.shape[-2]
                sides[0][at[2] : at[2] + count] = shard.shape[-1]
                sides[1][at[2] : at[2] + count] = shard.shape[-2]
                spans[at[2] : at[2] + count] = shard.rows_span_ranks
        index = None
        if any(s.flat_range is not None and s.factored for s in shards):
            numel = sum(math.prod(s.local_shape) for s in shards)
            whole = tuple(torch.full((numel,), size, dtype=kind) for size in sizes)
            start = 0
            for shard, at in zip(shards, offsets, strict=True):
                n = math.prod(shard.local_shape)
                local = shard.flat_indices() if at is not None else (None,)
                if local[0] is not None:
                    for indices, piece, offset in zip(whole, local, at, strict=True):
                        assert piece is not None
                        indices[start : start + n] = piece + offset
                start += n
            index = tuple(i.to(device) for i in whole)
        return cls(
            offsets=tuple(offsets),
            sizes=(sizes[0], sizes[1], sizes[2]),
            row_matrix=row_matrix.to(device),
            heights=heights.to(device),
            index=index,
            roots=torch.tensor([math.sqrt(s.numel) for s in shards], dtype=dtype, device=device),
            counts=(counts[0].to(device), counts[1].to(device)),
            sides=(sides[0].to(device), sides[1].to(device)),
            spans=spans.to(device),
        )


class CameRun:
    """One CAME step of a run of consecutive slots (one param group, dtype and device), on
    local data, batched over the run: the elementwise math as whole-range ops over flat
    buffers of the run (gradients, ``g^2 + eps1``, the update, ``exp_avg``, the parameters),
    the per-tensor statistics as one ``torch._foreach_*`` call per op; per matrix remain only
    its row and column sums. :meth:`advance` moves it phase by phase; nothing passed in is
    modified, results go to the work's new parameters and states. The runs of a step advance
    together, phase by phase, so each keeps buffers of its own in ``scratch``: named by its
    ``position`` among the step's runs."""

    def __init__(
        self,
        work: StepWork,
        run: Sequence[int],
        position: int,
        hyper: CameHyper,
        stats: RunStats,
        scratch: Scratch,
        views: KeptViews,
    ) -> None:
        self.work, self.run, self.hyper, self.stats, self.scratch = work, list(run), hyper, stats, scratch
        self.views, self.key = views, tuple(work.slots[i].index for i in run)
        self.prefix = f"came run {position}"
        self.shards = [work.slots[i].shard for i in run]
        dtype = work.slots[run[0]].dtype
        self.grads = flat_or_copy([work.grads[i] for i in run], dtype, scratch, f"{self.prefix} grads")
        numel = self.grads.numel()
        self.second, self.update = self._buffer("second", numel), self._buffer("update", numel)
        self.s, self.u = self._pieces(self.second, "second"), self._pieces(self.update, "update")
        self.matrices = [j for j, s in enumerate(self.shards) if s.factored]
        self.vectors = [j for j, s in enumerate(self.shards) if not s.factored]
        self.spans = [s.factored and s.rows_span_ranks for s in self.shards]
        factored = [self.shards[j] for j in self.matrices]
        self.stat_shapes = (
            [s.row_stat_shape for s in factored],
            [s.col_stat_shape for s in factored],
            [s.block_shape[:-2] for s in factored],
        )
        self.exp_avg = self._flat_state("exp_avg")
        self.new_exp_avg = work.states_of(run, "exp_avg", new=True)
        if self.new_exp_avg is None:
            self.new_exp_avg = torch.empty(numel, dtype=dtype, device=self.grads.device)

    def _pieces(self, flat: torch.Tensor, name: str) -> list[torch.Tensor]:
        """Per slot, its view of a flat buffer ``name`` of the run (kept while it is the same)."""
        shapes = tuple(s.local_shape for s in self.shards)
        held = (flat.data_ptr(), flat.numel(), shapes)
        return self.views.get(("came pieces", name, self.key), held, pieces_of, flat, shapes)

    def _flat_state(self, name: str) -> torch.Tensor:
        flat = self.work.states_of(self.run, name)
        if flat is not None:
            return flat
        states = [self.work.state(i, name) for i in self.run]
        return flat_or_copy(states, self.grads.dtype, self.scratch, f"{self.prefix} {name}")

    def _states(self, js: Sequence[int], name: str, *, new: bool = False) -> list[torch.Tensor]:
        get = self.work.new_state if new else self.work.state
        return [get(self.run[j], name) for j in js]

    def _decayed(self, js: Sequence[int], name: str, beta: float) -> list[torch.Tensor]:
        """``beta`` times state ``name`` of the slots ``js``, written to (and returned as) the new
        states: one op where both lie as one range, else one foreach call per op."""
        new = self._states(js, name, new=True)
        slots = [self.run[j] for j in js]
        old_flat, new_flat = self.work.states_of(slots, name), self.work.states_of(slots, name, new=True)
        if old_flat is not None and new_flat is not None:
            torch.mul(old_flat, beta, out=new_flat)
        else:
            torch._foreach_copy_(new, self._states(js, name))
            torch._foreach_mul_(new, beta)
        return new

    def _stat_views(self, buffer: torch.Tensor, which: int) -> list[torch.Tensor]:
        """Per matrix of the run, its row (``which`` 0), column (1) or per-matrix (2)
        statistics in a buffer laid out as :class:`RunStats` says."""
        shapes = tuple(self.stat_shapes[which])
        held = (buffer.data_ptr(), shapes)
        return self.views.get(("came stats", buffer.data_ptr(), self.key), held, pieces_of, buffer, shapes)

    def _stat_sums(self, row_state: str) -> list[list[torch.Tensor]]:
        """Per slot, the partial sums of ``self.second`` that the row and column EMAs of
        ``row_state`` (and its column twin) need; none for a 1-d tensor."""
        x = self.second
        out: list[list[torch.Tensor]] = [[] for _ in self.run]
        if not self.matrices:
            return out
        sums = [self._zeros(f"{row_state} sums {k}", size + 1) for k, size in enumerate(self.stats.sizes[:2])]
        if self.stats.index is not None:  # flat chunks: one index_add_ each for the whole run
            for total, index in zip(sums, self.stats.index, strict=False):
                total.index_add_(0, index, x)
        rows, cols = self._stat_views(sums[0], 0), self._stat_views(sums[1], 1)
        for j, row, col in zip(self.matrices, rows, cols, strict=True):
            out[j] = [row, col]
            if self.shards[j].flat_range is None:
                torch.sum(self.s[j], -1, out=row)
                torch.sum(self.s[j], -2, out=col)
        if any(self.spans):  # per matrix: its sum (of its row sums) and the sum of its old rows
            row_matrix = self.stats.row_matrix
            per_matrix = self.stats.sizes[2] + 1
            totals = self._zeros(f"{row_state} totals", per_matrix).index_add_(0, row_matrix, sums[0])
            old = self._zeros(f"{row_state} old", per_matrix).index_add_(
                0, row_matrix[:-1], self._matrix_states(row_state)
            )
            for j, total, old_sum in zip(
                self.matrices, self._stat_views(totals, 2), self._stat_views(old, 2), strict=True
            ):
                if self.spans[j]:
                    out[j] += [total, old_sum]
        return out

    def _buffer(self, name: str, numel: int) -> torch.Tensor:
        """A kept buffer of ``numel`` elements of the run's dtype (the views of a kept buffer
        are made once)."""
        return self.scratch.take(f"{self.prefix} {name}", numel, self.grads.dtype, self.grads.device)

    def _zeros(self, name: str, numel: int) -> torch.Tensor:
        return self._buffer(name, numel).zero_()

    def _matrix_states(self, name: str) -> torch.Tensor:
        """States ``name`` of the run's matrices, one after another (a range of their buffer
        where they lie so, else a copy)."""
        slots = [self.run[j] for j in self.matrices]
        flat = self.work.states_of(slots, name)
        if flat is not None:
            return flat
        return flat_or_copy(self._states(self.matrices, name), self.grads.dtype)

    def _factors(self, completed: Sequence[list[torch.Tensor]], states: tuple[str, str], beta: float) -> None:
        """The row and column EMAs of the completed sums (written to the new states ``states``),
        and their ``rsqrt(row / mean_H row) * rsqrt(col)`` spread into the update's matrices
        (and ``1`` into the other elements, when some matrices are flat chunks). The math on
        the statistics runs over the whole run's at once (laid out as :class:`RunStats` says)."""
        js = self.matrices
        if not js:
            return
        buffers = []
        for which, name in ((0, "rows"), (1, "columns")):
            sums = self._completed([completed[j][which] for j in js], which, name, range(len(js)))
            buffer = self._buffer(f"{name} factors", self.stats.sizes[which] + 1)
            buffer[-1:].fill_(1.0)
            buffer[:-1].copy_(self._ema(states[which], beta, sums.div_(self.stats.counts[which])))
            buffers.append(buffer)
        row_buffer, col_buffer = buffers
        row_matrix = self.stats.row_matrix
        norms = self._zeros("norms", self.stats.sizes[2] + 1).index_add_(0, row_matrix, row_buffer)
        norms.div_(self.stats.heights)  # mean_H of the new rows, where the rows are whole here
        spans = [k for k, j in enumerate(js) if self.spans[j]]
        if spans:  # the rows are split: sum_H of the new rows from the sums (see the module doc)
            old = self._completed([completed[js[k]][3] for k in spans], 2, "old rows", spans)
            total = self._completed([completed[js[k]][2] for k in spans], 2, "totals", spans)
            width, height = self.stats.sides
            old.mul_(beta).add_(total.div_(width), alpha=1.0 - beta).div_(height)
            torch.where(self.stats.spans, old, norms[:-1], out=norms[:-1])
        row_buffer.div_(norms.index_select(0, row_matrix)).rsqrt_()
        col_buffer.rsqrt_()
        if self.stats.index is not None:
            torch.index_select(row_buffer, 0, self.stats.index[0], out=self.update)
            self.update.mul_(col_buffer.index_select(0, self.stats.index[1]))
        blocks = [k for k, j in enumerate(js) if self.shards[j].flat_range is None]
        if blocks:
            rows, cols = self._spread_views(row_buffer, 0), self._spread_views(col_buffer, 1)
            update = [self.u[js[k]] for k in blocks]
            torch._foreach_copy_(update, [rows[k] for k in blocks])
            torch._foreach_mul_(update, [cols[k] for k in blocks])

    def _completed(self, sums: list[torch.Tensor], which: int, name: str, ks: Iterable[int]) -> torch.Tensor:
        """Completed sums of the matrices ``ks`` (positions in the run's matrices), one buffer of
        statistics ``which`` laid out as :class:`RunStats` says: their own memory where they lie
        so (sums the step did not communicate), else copied into the kept buffer ``name``."""
        size = self.stats.sizes[which]
        flat = as_flat(sums)
        if flat is not None and flat.numel() == size:
            return flat
        buffer = self._buffer(name, size + 1)
        views = self._stat_views(buffer, which)
        torch._foreach_copy_([views[k] for k in ks], sums)
        return buffer[:-1]

    def _ema(self, name: str, beta: float, values: torch.Tensor) -> torch.Tensor:
        """State ``name`` of the run's matrices (one after another) times ``beta``, plus
        ``1 - beta`` times ``values``: written to the new states, returned as one range."""
        slots = [self.run[j] for j in self.matrices]
        new = self.work.states_of(slots, name, new=True)
        out = new if new is not None else self._buffer(f"new {name}", values.numel())
        torch.mul(self._matrix_states(name), beta, out=out).add_(values, alpha=1.0 - beta)
        if new is None:
            scatter_back(out, self._states(self.matrices, name, new=True))
        return out

    def _spread_views(self, buffer: torch.Tensor, which: int) -> list[torch.Tensor]:
        """Per matrix of the run, its row (``which`` 0) or column (1) factors of ``buffer`` as a
        column or a row, to broadcast over its block."""
        shapes = tuple(self.stat_shapes[which])
        held = (buffer.data_ptr(), shapes)
        return self.views.get(("came spread", which, self.key), held, _spread, buffer, shapes, -1 - which)

    def advance(self, phase: int, completed: Sequence[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """The math up to the sums of ``phase`` (see :data:`PHASES`; past the last, to the end),
        given per slot the completed sums of the phase before; per slot, the partial sums."""
        beta1, beta2, beta3 = self.hyper.betas
        eps1, eps2 = self.hyper.eps
        if phase == 0:
            torch.square(self.grads, out=self.second).add_(eps1)
            if self.vectors:
                torch._foreach_add_(
                    self._decayed(self.vectors, "exp_avg_sq", beta2),
                    [self.s[j] for j in self.vectors],
                    alpha=1.0 - beta2,
                )
            return self._stat_sums("exp_avg_sq_row")
        if phase == 1:
            self._factors(completed, ("exp_avg_sq_row", "exp_avg_sq_col"), beta2)
            if self.vectors:
                update = [self.u[j] for j in self.vectors]
                torch._foreach_copy_(update, self._states(self.vectors, "exp_avg_sq", new=True))
                torch._foreach_rsqrt_(update)
            self.update.mul_(self.grads)
            n = len(self.run)
            squares = self._buffer("squares", n)
            torch.stack(torch._foreach_norm(self.u), out=squares).square_()
            held = (squares.data_ptr(), n)
            return [[s] for s in self.views.get(("came squares", self.key), held, pieces_of, squares, [(1,)] * n)]
        if phase == 2:
            rms = torch.cat([c[0] for c in completed]).sqrt_().div_(self.stats.roots)
            scale = rms.div_(self.hyper.clip_threshold).clamp_(min=1.0)
            torch._foreach_div_(self.u, list(scale.unbind()))
            torch.mul(self.exp_avg, beta1, out=self.new_exp_avg).add_(self.update, alpha=1 - beta1)
            if not self.matrices:
                return [[] for _ in self.run]
            torch.sub(self.update, self.new_exp_avg, out=self.second).square_().add_(eps2)
            return self._stat_sums("exp_avg_res_row")
        if self.vectors and self.stats.index is None:  # their update is exp_avg itself
            self.update.fill_(1.0)
        self._factors(completed, ("exp_avg_res_row", "exp_avg_res_col"), beta3)
        self.update.mul_(self.new_exp_avg)
        self._step_params()
        if self.work.states_of(self.run, "exp_avg", new=True) is None:
            scatter_back(self.new_exp_avg, self._states(range(len(self.run)), "exp_avg", new=True))
        return []

    def _step_params(self) -> None:
        """``p - lr*wd*p - lr*update`` into the new parameters, as whole-range ops."""
        work, run, lr = self.work, self.run, self.hyper.lr
        new = flat_or_copy([work.new_params[i] for i in run], self.grads.dtype, self.scratch, f"{self.prefix} params")
        params = as_flat([work.params[i] for i in run])
        if params is None or params.dtype != new.dtype:
            # Pieces of other tensors (a slice of each parameter): copied into the new
            # parameters in one call and decayed there as one range (the same product).
            torch._foreach_copy_(self._pieces(new, "params"), [work.params[i] for i in run])
            params = new
        if self.hyper.weight_decay != 0:
            torch.add(params, params, alpha=-self.hyper.weight_decay * lr, out=new)
        elif params is not new:
            new.copy_(params)
        new.sub_(self.update.mul_(lr))
        scatter_back(new, [work.new_params[i] for i in run])


def _spread(buffer: torch.Tensor, shapes: Sequence[tuple[int, ...]], dim: int) -> list[torch.Tensor]:
    return [piece.unsqueeze(dim) for piece in pieces_of(buffer, shapes)]


def _update(run: CameRun) -> Update:
    """The run's math as the update the base class drives: per phase it yields the sums of all
    its slots in slot order and is sent them completed, which it hands back to each slot."""
    sums = run.advance(0, [])
    for phase in range(len(PHASES)):
        flat = yield [s for slot_sums in sums for s in slot_sums]
        completed, at = [], 0
        for slot_sums in sums:
            completed.append(flat[at : at + len(slot_sums)])
            at += len(slot_sums)
        sums = run.advance(phase + 1, completed)


class ShardedCAME(ShardedOptimizer):
    """CAME with every state in its tensor's state layout; equals ``came_pytorch.CAME``.

    Arguments as :class:`~runtime.optim.ShardedAdamW`, hyperparameters as ``came_pytorch``
    (``lr`` is required). With ``flat_axis``, each rank keeps the row and column statistics
    of its whole base block and completes their partial sums (built with ``index_add`` over
    its flat range) with one all-reduce of ``h + w`` floats per phase.
    """

    phases = PHASES

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]],
        spec: SpecLike = None,
        *,
        lr: float,
        eps: tuple[float, float] = (1e-30, 1e-16),
        clip_threshold: float = 1.0,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        weight_decay: float = 0.0,
        **options: Unpack[StepOptions],
    ) -> None:
        if not lr > 0 or not clip_threshold > 0 or not weight_decay >= 0 or not all(0 <= b <= 1 for b in betas):
            raise OptimizerError(
                f"invalid CAME hyperparameters: lr={lr}, betas={betas}, clip_threshold={clip_threshold}, "
                f"weight_decay={weight_decay}"
            )
        defaults = {
            "lr": lr,
            "eps": tuple(eps),
            "clip_threshold": clip_threshold,
            "betas": tuple(betas),
            "weight_decay": weight_decay,
        }
        self._specs: dict[int, tuple[StateShard, torch.dtype, tuple[tuple[SumSpec, ...], ...]]] = {}
        self._stats: dict[
            tuple[int, ...], tuple[tuple[StateShard, ...], tuple[torch.dtype, torch.device], RunStats]
        ] = {}
        super().__init__(named_params, spec, defaults, **options)

    def _state_shapes(self, slot: Slot) -> dict[str, tuple[int, ...]]:
        assert slot.shard is not None
        return came_state_shapes(slot.shard)

    def _sum_specs(self, slot: Slot) -> tuple[tuple[SumSpec, ...], ...]:
        # Kept per slot while its shard and dtype are the same: every step asks for them.
        assert slot.shard is not None
        cached = self._specs.get(slot.index)
        if cached is None or cached[0] is not slot.shard or cached[1] != slot.dtype:
            cached = self._specs[slot.index] = (
                slot.shard,
                slot.dtype,
                phase_sum_specs(slot.shard, "came", slot.dtype, slot.name),
            )
        return cached[2]

    def _state_where(self, slot: Slot, name: str) -> StateWhere:
        where = statistic_where(slot, name, ROW_STATES, COL_STATES)
        return where if where is not None else super()._state_where(slot, name)

    memory_kind = "came"

    def _memory_extras(self) -> dict[str, Any]:
        """Kept: its runs' copies of states that lie in no one range of their flat buffer (a
        state in a layout of its own, or a tensor not stepped among those that are), which the
        layouts alone do not tell (docs/memory.md, "Statistics"); ``planner.memory`` sizes the
        rest of its scratch and its runs' statistics."""
        copies = self._scratch.nbytes_of(
            lambda name: name.startswith("came run ") and (name.endswith(" exp_avg") or " new " in name)
        )
        return {**super()._memory_extras(), "kept": copies}

    def _run_stats(self, work: StepWork, run: Sequence[int]) -> RunStats:
        """The run's :class:`RunStats`, kept while its slots' shards, dtype and device are the same."""
        shards, device = tuple(work.slots[i].shard for i in run), work.grads[run[0]].device
        dtype = work.slots[run[0]].dtype
        key = tuple(work.slots[i].index for i in run)
        cached = self._stats.get(key)
        if (
            cached is None
            or cached[1] != (dtype, device)
            or any(a is not b for a, b in zip(cached[0], shards, strict=True))
        ):
            cached = self._stats[key] = (shards, (dtype, device), RunStats.of(shards, dtype, device))
        return cached[2]

    def _updates(self, work: StepWork) -> list[Update]:
        updates: list[Update] = []
        for position, run in enumerate(work.runs()):
            group = work.slots[run[0]].group
            hyper = CameHyper(
                lr=group["lr"],
                eps=group["eps"],
                clip_threshold=group["clip_threshold"],
                betas=group["betas"],
                weight_decay=group["weight_decay"],
            )
            run_stats = self._run_stats(work, run)
            updates.append(_update(CameRun(work, run, position, hyper, run_stats, self._scratch, self._views)))
        return updates
