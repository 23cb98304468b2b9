"""Declared replication, verified: where a layout leaves a mesh axis out (neither split nor
partial over it), the ranks along that axis must hold the same values. A forgotten seed, a
model not broadcast, gradients declared ``R`` that no DDP reduced: each trains silently wrong
otherwise (docs/design/failures.md, "Replicas").

Each tensor's piece is summarized by a fingerprint: the sum, modulo 2**64, of every element's
bits times a weight that depends on its position. Equal pieces give equal fingerprints on every
device; two pieces that differ in one element, or hold the same elements in another order,
give different ones except by a 1 in 2**64 chance. The fingerprints of all the tensors that
share a group of replicas, folded into one, go in one all-gather of three integers per group
(only where a group differs, a second all-gather of every tensor's fingerprint names them), and
one all-reduce of the mismatch count over every rank involved makes all of them raise together:

    verify_replicas([("w", w, layout), ...], rank, what="parameters", cause=PARAMETERS_CAUSE)

Its cost: one pass over the pieces (in chunks of :data:`CHUNK` elements, so the scratch is
bounded), one all-gather of 24 bytes per group of replicas and one all-reduce of 8 bytes.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Sequence

import torch

from runtime.comm.collectives import collective, default_device
from runtime.comm.groups import axis_ranks, group_for, ranks_group
from runtime.errors import DistributedError, ReplicaMismatchError
from shardlang.layout import Layout
from shardlang.mesh import Mesh

# Elements fingerprinted at once: bounds the int64 scratch to 16 MiB.
CHUNK = 1 << 20
# The weights cycle through this prime's residues (1 ... PRIME), so that a swap of two
# elements less than PRIME apart always changes the sum.
PRIME = 1_000_003
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

PARAMETERS_CAUSE = (
    "the ranks started from different values: seed every rank alike before building the model, "
    "or broadcast the parameters from one rank first"
)
GRADIENTS_CAUSE = (
    "gradients declared replicated were not reduced across these ranks: wrap the model in DDP "
    "(or reduce them yourself), or declare the gradient as a pending mean, e.g. 'R,R | P(dp):avg'"
)


def fingerprint(piece: torch.Tensor) -> int:
    """The piece's fingerprint (module docstring): an integer of 64 bits, the same for equal
    values whatever the device, strides or summation order.

    >>> a = torch.tensor([1.0, 2.0, 3.0])
    >>> fingerprint(a) == fingerprint(a.clone()) != fingerprint(a.flip(0))
    True
    """
    return int(_fingerprint(piece).item())


def _fingerprint(piece: torch.Tensor) -> torch.Tensor:
    """:func:`fingerprint` as a 0-d int64 tensor on the piece's device (no host round trip)."""
    flat = piece.detach().reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    bits = flat.view(_BITS[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), CHUNK):
        chunk = bits[start : start + CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=flat.device) % PRIME + 1
        # Integer products and sums wrap modulo 2**64 alike on every device and in any order.
        total += (chunk * weights).sum()
    return total


def verify_replicas(
    pieces: Sequence[tuple[str, torch.Tensor | None, Layout]],
    rank: int,
    *,
    what: str,
    cause: str,
    timeout: datetime.timedelta,
) -> None:
    """Check that the ranks along every replicated axis of each layout hold equal pieces.

    ``pieces``: ``(tensor name, this rank's piece, its layout)``; every rank of the layouts'
    meshes calls with the same tensors in the same order (a rank outside a tensor's mesh leaves
    it out). A piece of ``None`` is one this rank cannot show (a gradient a bucket already
    freed): it is compared among the ranks that hold it. ``what`` names the pieces in the error
    ("parameters", "gradients"), ``cause`` says what usually makes them differ and how to fix
    it. Raises :class:`ReplicaMismatchError` on every rank involved when any group differs
    (naming the tensors, axes and ranks where it can see them), :class:`DistributedError` when
    a peer does not arrive within ``timeout``.

    Per group of replicas one all-gather of three integers (how many tensors, a digest of their
    names, a fingerprint of all their fingerprints), so that ranks that disagree on the tensors
    (other specs) get this error, not a collective of mismatched sizes; only where the group
    differs, a second all-gather of every tensor's fingerprint names them."""
    groups: dict[tuple[Mesh, tuple[int, ...]], list[tuple[str, torch.Tensor]]] = {}
    involved: set[int] = set()
    for name, piece, layout in pieces:
        axes = layout.replicated_axes()
        if rank not in layout.mesh.ranks or not any(layout.mesh.shape[a] > 1 for a in axes):
            continue
        value = _UNSEEN if piece is None else _fingerprint(piece)
        groups.setdefault((layout.mesh, axes), []).append((name, value))
        involved.update(layout.mesh.ranks)
    found: list[str] = []
    counted = 0  # the differing tensors of the groups this rank comes first in: each once
    device = default_device()
    try:
        for (mesh, axes), entries in groups.items():
            members = axis_ranks(mesh, axes, rank)
            group = group_for(mesh, axes, members, timeout=timeout)
            mine = torch.stack([value for _, value in entries]).to(device)
            listed = torch.tensor([len(entries), _names_digest(entries)], dtype=torch.int64, device=device)
            header = torch.cat([listed, _combined(mine).view(1)])
            headers = collective("all_gather", header, len(members), None, group, timeout).view(-1, 3)
            if bool((headers == headers[:1]).all()):
                continue
            if bool((headers[:, :2] != headers[:1, :2]).any()):
                differ = [_other_tensors(mesh, axes, members, headers)]
            else:
                gathered = collective("all_gather", mine, len(members), None, group, timeout).view(len(members), -1)
                differ = _differences(entries, gathered, members, mesh, axes)
            found += differ
            counted += len(differ) if members[0] == rank else 0
        if not involved:
            return
        count = torch.tensor([counted], dtype=torch.int64, device=device)
        everyone = tuple(sorted(involved))
        total = collective("all_reduce", count, len(everyone), "sum", ranks_group(everyone, timeout=timeout), timeout)
    except DistributedError as e:
        raise DistributedError(f"verifying that the replicated {what} agree: {e.message}") from e
    if found:
        shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
        raise ReplicaMismatchError(f"{what} declared replicated differ across ranks: {shown}. Usual cause: {cause}")
    if int(total.item()):
        raise ReplicaMismatchError(
            f"{what} declared replicated differ across other ranks ({_tensors(int(total.item()))}; their "
            f"errors name them). Usual cause: {cause}"
        )


# The fingerprint of a piece a rank cannot show (compared among the ranks that can).
_UNSEEN = torch.tensor(-(2**63), dtype=torch.int64)
_UNSEEN_VALUE = -(2**63)
_MASK = (1 << 63) - 1


def _names_digest(entries: list[tuple[str, torch.Tensor]]) -> int:
    """A 63-bit digest of the tensors' names, in order."""
    text = "\0".join(name for name, _ in entries).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & _MASK


def _combined(values: torch.Tensor) -> torch.Tensor:
    """One fingerprint of a group's fingerprints, in order (odd weights: one that differs
    changes the sum modulo 2**64)."""
    weights = torch.arange(values.numel(), dtype=torch.int64, device=values.device) * 2 + 1
    return (values * weights).sum()


def _other_tensors(mesh: Mesh, axes: tuple[int, ...], members: tuple[int, ...], headers: torch.Tensor) -> str:
    """The line for ranks of a group of replicas that list other tensors (their specs differ)."""
    labels = ",".join(mesh.axis_label(a) for a in axes)
    holders: dict[tuple[int, int], list[int]] = {}
    for member, (n, names) in zip(members, headers[:, :2].tolist(), strict=True):
        holders.setdefault((n, names), []).append(member)
    sides = " vs ".join(f"ranks {ranks} ({_tensors(n)})" for (n, _), ranks in holders.items())
    return f"the ranks along {labels} declare different tensors replicated ({sides}): their specs differ"


def _tensors(n: int) -> str:
    return f"{n} tensor" if n == 1 else f"{n} tensors"


def _differences(
    entries: list[tuple[str, torch.Tensor]],
    gathered: torch.Tensor,
    members: tuple[int, ...],
    mesh: Mesh,
    axes: tuple[int, ...],
) -> list[str]:
    """One line per tensor whose fingerprints differ in ``gathered`` (a row per member): the
    tensor, the axes, and the ranks grouped by the value they hold."""
    out = []
    labels = ",".join(mesh.axis_label(a) for a in axes)
    for column, (name, _) in enumerate(entries):
        values = gathered[:, column].tolist()
        holders: dict[int, list[int]] = {}
        for member, value in zip(members, values, strict=True):
            if value != _UNSEEN_VALUE:
                holders.setdefault(value, []).append(member)
        if len(holders) < 2:
            continue
        sides = " vs ".join(f"ranks {ranks}" for ranks in holders.values())
        out.append(f"'{name}' along {labels} ({sides} hold different values)")
    return out
