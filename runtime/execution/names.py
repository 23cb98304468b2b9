"""How a :class:`~runtime.execution.buckets.StageRun` names its buckets in errors and traffic
records, and which DeviceMesh's groups run them: an optimizer step's (:class:`StepNames`: bucket
``k`` of its tensors) or a reshard's (:class:`ReshardNames`: the plan's step ``k``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from torch.distributed.device_mesh import DeviceMesh

from planner.legs import Bucket
from planner.plans import Plan
from runtime.comm.exchange import RankExchange
from runtime.execution.step_program import BucketProgram, StepProgram


class Names(Protocol):
    """How a :class:`StageRun` names a bucket in errors (:meth:`text`) and in traffic records
    (:meth:`record`: the tensor and step), and the DeviceMesh whose group runs it (:meth:`mesh_of`)."""

    def text(self, bucket: BucketProgram) -> str: ...

    def record(self, bucket: BucketProgram) -> tuple[str | None, int]: ...

    def mesh_of(self, bucket: BucketProgram) -> DeviceMesh | None: ...


class StepNames:
    """A step program's :class:`Names`: its buckets by index and their legs' tensors, each
    group from the DeviceMesh of the bucket's first tensor in ``device_meshes``."""

    __slots__ = ("device_meshes", "program")

    def __init__(self, program: StepProgram, device_meshes: Mapping[str, DeviceMesh | None]) -> None:
        self.program, self.device_meshes = program, device_meshes

    def _tensors(self, bucket: BucketProgram) -> list[str]:
        return [self.program.plan.legs[leg].tensor for leg, *_ in bucket.members]

    def text(self, bucket: BucketProgram) -> str:
        described = _describe(bucket.bucket, self._tensors(bucket))
        return f"bucket {bucket.index + 1} of {len(self.program.plan.buckets)} ({described})"

    def record(self, bucket: BucketProgram) -> tuple[str | None, int]:
        return ",".join(self._tensors(bucket)), bucket.index

    def mesh_of(self, bucket: BucketProgram) -> DeviceMesh | None:
        device_mesh = self.device_meshes.get(self.program.plan.legs[bucket.members[0][0]].tensor)
        if device_mesh is not None and tuple(device_mesh.shape) != bucket.bucket.mesh.shape:
            return None  # a flat group's mesh (planner.legs.flat_group): a group of its own
        return device_mesh


class ReshardNames:
    """How a reshard's run names its buckets (``StageRun``'s ``names``): in errors as the
    plan's steps, prefixed with the call's ``label``; in records with the call's ``name`` and
    the step's index in the plan; every group of the call's ``device_mesh`` when given."""

    __slots__ = ("device_mesh", "label", "name", "plan")

    def __init__(self, plan: Plan, label: str, name: str | None, device_mesh: DeviceMesh | None) -> None:
        self.plan, self.label, self.name, self.device_mesh = plan, label, name, device_mesh

    def text(self, bucket: BucketProgram) -> str:
        k = bucket.bucket.members[0].step
        move, step = bucket.members[0][1], self.plan.steps[k]
        what = f"{step.describe()} -> {step.layout}"
        if isinstance(move, RankExchange):
            what += f", with ranks {list(move.peers)}"
        elif move is not None:  # None: a rank without a part in an exchange
            what += f", on ranks {list(move.members)}"
        return f"{self.label}: step {k + 1} of {len(self.plan.steps)} ({what})"

    def record(self, bucket: BucketProgram) -> tuple[str | None, int]:
        return self.name, bucket.bucket.members[0].step

    def mesh_of(self, bucket: BucketProgram) -> DeviceMesh | None:
        return self.device_mesh


def _describe(bucket: Bucket, names: Sequence[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{bucket.describe()} of {shown}"
