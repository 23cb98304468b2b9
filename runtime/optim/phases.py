"""The optimizer math of one step, phase by phase, with the statistic sums between its phases.

An optimizer gives its math as updates (:data:`Update`): generators over the rank's shards
(:class:`StepWork`) that yield, per phase, the partial sums their statistics need (CAME's row
and column sums, Adafactor's norms) and are sent them completed. :class:`PhaseDriver` runs them
in lockstep, all tensors' sums of a phase in one batch of all-reduces
(``runtime.optim.sums``), and keeps a rank whose math failed in step with its peers.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch

from runtime.errors import DistributedError
from runtime.execution.ranges import UPDATE, profiled
from runtime.optim.errors import OptimizerStepError
from runtime.optim.flat import FlatStates
from runtime.optim.slots import Slot
from runtime.optim.sums import SumReducer, SumSpec
from shardlang.errors import ShardlangError

# The math of the step's tensors: yields the partial sums of each phase, is sent them
# completed; it writes its results into the destinations it was given.
Update = Generator[list[torch.Tensor], list[torch.Tensor], None]


def done() -> Update:
    """The update of math that needs no sums (it has already written its results)."""
    return
    yield  # a generator that yields nothing


class StepWork:
    """What the math of one step gets, per stepped slot ``i`` (in the optimizer's order): the
    gradient and parameter in the state layout (``grads[i]``, ``params[i]``: possibly views),
    the states as they are (:meth:`state`), and where to write the new parameter
    (``new_params[i]``) and states (:meth:`new_state`). :meth:`states_of` gives the states of
    consecutive slots as one range of their flat buffer, for whole-buffer math."""

    def __init__(
        self,
        slots: Sequence[Slot],
        grads: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        new_params: Sequence[torch.Tensor],
        flat: FlatStates,
        new_buffers: Mapping[Any, torch.Tensor],
        own: Mapping[tuple[int, str], torch.Tensor],
    ) -> None:
        self.slots, self.grads, self.params, self.new_params = tuple(slots), tuple(grads), tuple(params), new_params
        self._flat, self._new_buffers, self._own = flat, new_buffers, own
        # In place (new_params are params, new_buffers the states' own): nothing is allocated.
        self.in_place = new_params is params
        self.own_new = (
            dict(own)
            if self.in_place
            else {key: torch.empty_like(value, dtype=slots[key[0]].dtype) for key, value in own.items()}
        )

    @classmethod
    def in_place_of(
        cls,
        slots: Sequence[Slot],
        grads: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        flat: FlatStates,
        own: Mapping[tuple[int, str], torch.Tensor],
    ) -> StepWork:
        """The work of an update in place: ``params`` and the states are read and written."""
        return cls(slots, grads, params, params, flat, flat.buffers, own)

    def state(self, i: int, name: str) -> torch.Tensor:
        own = self._own.get((i, name))
        return own if own is not None else self._flat.view(self.slots[i].index, name)

    def new_state(self, i: int, name: str) -> torch.Tensor:
        own = self.own_new.get((i, name))
        return own if own is not None else self._flat.view(self.slots[i].index, name, self._new_buffers)

    def runs(self) -> list[list[int]]:
        """Indices of ``slots`` in runs of consecutive slots sharing param group, step count,
        dtype and device: what one whole-buffer update covers."""
        runs: list[list[int]] = []
        last: tuple | None = None
        for i, slot in enumerate(self.slots):
            key = (id(slot.group), slot.step, slot.dtype, self.grads[i].device)
            if key != last:
                runs.append([])
                last = key
            runs[-1].append(i)
        return runs

    def states_of(self, run: Sequence[int], name: str, *, new: bool = False) -> torch.Tensor | None:
        """State ``name`` (new: its destination) of the slots ``run`` as one flat range, when
        they lie one after another in its buffer; else ``None``."""
        if any((i, name) in self._own for i in run):
            return None
        return self._flat.run([self.slots[i].index for i in run], name, self._new_buffers if new else None)


class UpdateFailed(Exception):
    """This rank's math failed (``error``), after joining the step's sums (:meth:`PhaseDriver.run`)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class PhaseDriver:
    """Runs an optimizer's math (``updates``: its updates for a step's work) through its
    ``phases``, completing each phase's sums (``sum_specs``: per slot, per phase, the sums it
    yields) with one batch of all-reduces. ``communicates``: the updates run collectives of
    their own besides these sums (Muon), so a rank whose math failed cannot join the rest."""

    def __init__(
        self,
        phases: Sequence[str],
        updates: Callable[[StepWork], list[Update]],
        sum_specs: Callable[[Slot], tuple[tuple[SumSpec, ...], ...]],
        reducer: SumReducer,
        *,
        communicates: bool,
    ) -> None:
        self.phases, self._updates, self._sum_specs = tuple(phases), updates, sum_specs
        self._reducer, self._communicates = reducer, communicates

    def phase_specs(self, slots: Sequence[Slot]) -> list[list[SumSpec]]:
        """Per phase, the sums a step of ``slots`` completes, in the order they are yielded."""
        specs = [self._sum_specs(slot) for slot in slots]
        return [[spec for s in specs for spec in s[k]] for k in range(len(self.phases))]

    def joinable(self, error: Exception) -> Exception:
        """``error``, raised by this rank's math, if the rest of the step can be joined despite
        it (``StepTransaction.join_after``); raises it otherwise: our own errors (raised where
        they are meant to be, often on every rank alike) and any error of an update that
        communicates."""
        if isinstance(error, ShardlangError) or self._communicates:
            raise error
        return error

    def run(self, work: StepWork, step_number: int) -> tuple[int, int]:
        """Drive the math in lockstep, one batch of reductions per phase; the bytes and
        all-reduces the reductions took. An update (one per slot, or one per run of slots)
        yields, per phase, the partial sums of its slots in slot order and is sent back as many,
        completed. A rank whose math fails joins the remaining sums with zeros, then raises
        :class:`UpdateFailed`."""
        specs = [self._sum_specs(slot) for slot in work.slots]
        pending: list[Update] = []
        sent: list[list[torch.Tensor]] = []
        failure: Exception | None = None
        try:
            for update in self._updates(work):
                try:
                    sent.append(next(update))
                    pending.append(update)
                except StopIteration:  # no phases: the math is local
                    pass
        except Exception as e:  # this rank's math failed: its sums are still joined, below
            failure = self.joinable(e)
        total_bytes = total_collectives = 0
        if not pending and failure is None:
            return 0, 0
        for k, phase in enumerate(self.phases):
            phase_specs = [spec for slot_specs in specs for spec in slot_specs[k]]
            if failure is None:
                values = [v for slot_values in sent for v in slot_values]
                if len(values) != len(phase_specs):
                    raise AssertionError(f"{len(values)} sums yielded for {phase}, {len(phase_specs)} specified")
            else:  # zeros, so that the peers' sums complete (the step commits nowhere)
                device = work.grads[0].device
                values = [torch.zeros(spec.numel, dtype=spec.dtype, device=device) for spec in phase_specs]
            try:
                with profiled(UPDATE, f"sums {k + 1} of {len(self.phases)} ({phase})"):
                    completed, collectives = self._reducer.reduce(phase_specs, values, phase)
            except DistributedError as e:
                raise OptimizerStepError(
                    f"step {step_number} failed reducing {phase}: {e.message}; "
                    "parameters and optimizer states are unchanged"
                ) from e
            total_bytes += sum(c.bytes for c in collectives)
            total_collectives += len(collectives)
            offset = 0
            for i, update in enumerate(pending if failure is None else ()):
                n = len(sent[i])
                try:
                    sent[i] = update.send(completed[offset : offset + n])
                except StopIteration:
                    sent[i] = []
                except Exception as e:  # as above: the later phases are joined with zeros
                    failure = self.joinable(e)
                    break
                offset += n
        if failure is not None:
            raise UpdateFailed(failure)
        return total_bytes, total_collectives
