"""The step plan's buckets (``planner.step``) for display: one collective per bucket, in the
order every rank runs them, as a text table, a summary line and rows for the summary picture
(docs/reference/step-plans.md)."""

from __future__ import annotations

import itertools

import attrs

from cli.summary import fold_names
from cli.tables import format_bytes, format_seconds, format_table, total_row
from cli.terminal import Style
from planner.bucket_cap import SLACK, BucketCap, far_from, step_bucket_cap
from planner.legs import DURING_BACKWARD, IN_STEP, Bucket
from planner.spec_plan import SpecPlan
from planner.step import StepPlan

# The tensors column lists names (folded per declaration) up to about this many characters.
NAMES_WIDTH = 48


@attrs.frozen
class BucketRow:
    """What a reader needs of one bucket: its stage (``before``/``after`` the update), its
    collective, the tensors in buffer order and the steps they contribute."""

    number: int
    stage: str
    collective: str
    mesh: str
    tensors: tuple[str, ...]
    steps: int
    names: str
    bytes: int
    buffer_bytes: int
    seconds: float

    @property
    def count(self) -> str:
        """``4``, or ``4 (5 steps)`` when a tensor has more than one step in the bucket."""
        n = len(self.tensors)
        return str(n) if self.steps == n else f"{n} ({self.steps} steps)"


def bucket_rows(spec_plan: SpecPlan) -> list[BucketRow]:
    step = spec_plan.step
    declared = {tp.tensor.name: tp.tensor.position for tp in spec_plan.tensors}
    rows = []
    for number, bucket in enumerate(step.buckets, 1):
        tensors = bucket_tensors(step, bucket)
        rows.append(
            BucketRow(
                number=number,
                stage=bucket.stage.split()[0] + ("" if bucket.launch == IN_STEP else f", {bucket.launch}"),
                collective=bucket.describe(),
                mesh=bucket.mesh.name or bucket.mesh.describe(),
                tensors=tensors,
                steps=len(bucket.members),
                names=names_text(tensors, declared),
                bytes=bucket.bytes,
                buffer_bytes=bucket.buffer_bytes,
                seconds=bucket.seconds,
            )
        )
    return rows


def bucket_tensors(step: StepPlan, bucket: Bucket) -> tuple[str, ...]:
    """The bucket's tensors, each once, in the order their chunks lie in the buffer."""
    return tuple(dict.fromkeys(step.legs[m.leg].tensor for m in bucket.members))


def names_text(tensors: tuple[str, ...], declared: dict[str, object], width: int = NAMES_WIDTH) -> str:
    """``wpe, h.{0..11}.attn.c_attn.weight, +13 more``: neighbours of one declaration folded,
    runs listed while they fit ``width`` (always the first)."""
    runs = [list(run) for _, run in itertools.groupby(tensors, key=lambda name: declared.get(name, name))]
    shown: list[str] = []
    listed = 0
    for run in runs:
        label = fold_names(run)
        if shown and len(", ".join([*shown, label])) > width:
            break
        shown.append(label)
        listed += len(run)
    rest = len(tensors) - listed
    return ", ".join(shown) + (f", +{rest} more" if rest else "")


def summary_line(step: StepPlan) -> str:
    """``10 collectives (102 unbucketed, ...): 5.06 ms modeled (5.98 ms unbucketed)``."""
    n = step.collectives
    return (
        f"{n} collective{'s' * (n != 1)} ({step.unbucketed_collectives} unbucketed, one per communicating "
        f"step of every tensor): {format_seconds(step.total_seconds)} modeled "
        f"({format_seconds(step.unbucketed_seconds)} unbucketed)"
    )


def buffer_line(step: StepPlan) -> str:
    """The memory the buckets add and the cap they were cut under."""
    text = (
        f"largest bucket buffer {format_bytes(step.max_buffer_bytes)} per rank; "
        f"cap {format_bytes(step.bucket_bytes)} (--bucket-bytes)"
    )
    if step.max_buffer_bytes > step.bucket_bytes:
        text += "; a step over the cap is a bucket of its own"
    return text


def heading(step: StepPlan, flat_axis: str | int | None = None) -> str:
    """``buckets`` and, with flat sharding, whose plan it is (the flat hop is a rank's block)."""
    whose = "" if flat_axis is None else f", flat over axis {flat_axis} (the plan of rank {step.rank})"
    return f"buckets{whose}: one collective each, in the order every rank runs them (stage: before or after the update)"


def format_buckets(spec_plan: SpecPlan, style: Style, flat_axis: str | int | None = None) -> str:
    """The bucket table of the step, a total row, then the summary and buffer lines."""
    step = spec_plan.step
    title = style(heading(step, flat_axis), "bold")
    if not step.buckets:
        return f"{title}\n  none: no step of any tensor communicates"
    rows = [
        [
            str(r.number),
            r.stage,
            style(r.collective, "cyan"),
            r.mesh,
            r.count,
            r.names,
            format_bytes(r.bytes),
            format_bytes(r.buffer_bytes),
            format_seconds(r.seconds),
        ]
        for r in bucket_rows(spec_plan)
    ]
    headers = ["#", "stage", "collective", "mesh", "count", "tensors (buffer order)", "bytes/rank", "buffer", "time"]
    totals = {
        "stage": "total",
        "bytes/rank": format_bytes(step.total_bytes),
        "time": format_seconds(step.total_seconds),
    }
    rows.append(total_row(headers, {h: style(t, "bold") for h, t in totals.items()}))
    table = format_table(headers, rows, "><<<><>>>", "  ")
    return "\n".join([title, table, f"  {summary_line(step)}", f"  {buffer_line(step)}"])


def bucket_cap_warnings(spec_plan: SpecPlan) -> list[str]:
    """A line where the step's bucket cap is far from the cost model's (``planner.bucket_cap``):
    too small (the step slower) or too large (bucket memory for a step at most 5% faster). None
    with overlap: the model does not know how much of the buckets backward hides."""
    step = spec_plan.step
    if any(b.launch == DURING_BACKWARD for b in step.buckets):
        return []
    model = step_bucket_cap(step, {tp.tensor.name: tp.cost for tp in spec_plan.tensors})
    in_use = (step.total_seconds, step.max_buffer_bytes)
    return cap_warning(
        step.bucket_bytes, in_use, model, "--bucket-bytes auto takes it (bucket_bytes in the optimizers)"
    )


def cap_warning(cap: int, in_use: tuple[float, int], model: BucketCap, advice: str) -> list[str]:
    """The warning line (none where the cap is not far from the model's): ``in_use`` is the
    step's (seconds, largest bucket buffer) under ``cap``."""
    far = far_from(in_use, model)
    if far is None:
        return []
    theirs = (
        f"the cost model's cap, {format_bytes(model.bytes)} ({format_seconds(model.seconds)}, buckets of up to "
        f"{format_bytes(model.buffer_bytes)} per rank)"
    )
    seconds, buffer = in_use
    if far == "slower":
        return [
            f"warning: the {format_bytes(cap)} bucket cap makes this step {seconds / model.seconds:.1f}x slower "
            f"({format_seconds(seconds)}) than {theirs}: {advice}"
        ]
    return [
        f"warning: the {format_bytes(cap)} bucket cap holds buckets of up to {format_bytes(buffer)} per rank, "
        f"{buffer / model.buffer_bytes:.1f}x those of {theirs}, for a step at most {SLACK:.0%} faster: {advice}"
    ]
