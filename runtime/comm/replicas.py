"""Declared replication, verified: where a layout leaves a mesh axis out (neither split nor
partial over it), the ranks along that axis must hold the same values. A forgotten seed, a
model not broadcast, gradients declared ``R`` that no DDP reduced: each trains silently wrong
otherwise (docs/design/failures.md, "Replicas").

Each tensor's piece is summarized by a fingerprint (:func:`fingerprint`): the sum, modulo
2**64, of its bytes' 32-bit words times odd weights that depend on their positions. Equal
pieces give equal fingerprints on every device; two that differ in one element always give
different ones, two that hold the same elements in another order (or differ in several)
except by a chance of about 2**-63, 2**-32 at worst. The fingerprints of all the tensors that
share a group of replicas, folded into one, go in one all-gather of three integers per group
(only where a group differs, a second all-gather of every tensor's fingerprint names them), and
one all-reduce of the mismatch count over every rank involved makes all of them raise together:

    verify_replicas([("w", w, layout), ...], rank, what="parameters", cause=PARAMETERS_CAUSE)

Its cost: one pass over the pieces (in chunks, so the scratch is bounded), one all-gather of 24
bytes per group of replicas and one all-reduce of 8 bytes. The fingerprints can also be taken
first (:func:`fingerprints`) and compared later (:func:`compare`), or carried, one digest per
group (:func:`group_digest`), by a collective that runs anyway: the optimizers' gradient check
rides on the commit flag that way (runtime/optim/replica_checks.py).
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

# 32-bit words per block of position weights (:func:`fingerprint`), and fingerprinted at once
# on the CPU, where the scratch then stays in cache (2**16: the fastest on a 2-core x86 CPU).
BLOCK = 1 << 16
# 32-bit words fingerprinted at once on an accelerator (a 16 MiB scratch; fewer kernel launches).
CHUNK = 1 << 21

PARAMETERS_CAUSE = (
    "the ranks started from different values: seed every rank alike before building the model, "
    "or broadcast the parameters from one rank first"
)
GRADIENTS_CAUSE = (
    "gradients declared replicated were not reduced across these ranks: wrap the model in DDP "
    "(or reduce them yourself), or declare the gradient as a pending mean, e.g. 'R,R | P(dp):avg'"
)


def fingerprint(piece: torch.Tensor) -> int:
    """The piece's fingerprint: an integer of 64 bits, the same for equal bytes whatever the
    device, strides or summation order.

    The piece's bytes, read as 32-bit words ``x`` (a last partial word padded with zeros), sign
    extended, give ``sum(x[i] * W[i]) mod 2**64`` plus a hash of the byte count. Every ``W[i]``
    is odd and pseudo-random, a fixed hash of the position: the weight of ``i`` within its block
    of :data:`BLOCK` words (:func:`_weights`) times its block's (:func:`_block_weights`), so
    alike on every rank and device, however the pass is chunked. Integer products and sums wrap
    modulo ``2**64`` alike on every device and in any order. What it detects:

    - a piece that differs in one element, whatever the dtype (a single-ulp change, a sign
      flip, NaN against a number, ``-0.0`` against ``0.0``): always, as the word changes by
      ``d``, ``0 < |d| < 2**32``, and ``d * W[i]`` with ``W[i]`` odd is never ``0 mod 2**64``;
    - anything else (pieces of other lengths in bytes, as a piece and the same with zeros
      appended ; elements swapped or permuted; several changed): the digests collide with a
      probability of about ``2**-32`` where the words differ only in their top bit (values of
      opposite sign swapped), ``2**(k-64)`` where the lowest differing bit of some word is bit
      ``k``: about ``2**-63`` for most differences. It is a checksum against mistakes, not
      against an adversary who knows the weights.

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
    data = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    if data.storage_offset() % 4:  # a 4-byte view needs an aligned start
        data = data.clone()
    nbytes = data.numel()
    words = data[: nbytes - nbytes % 4].view(torch.int32)
    if nbytes % 4:
        tail = torch.zeros(4, dtype=torch.uint8, device=data.device)
        tail[: nbytes % 4] = data[nbytes - nbytes % 4 :]
        words = torch.cat([words, tail.view(torch.int32)])
    on_cpu = data.device.type == "cpu"
    sums = _block_sums(words, BLOCK if on_cpu else CHUNK, fused=on_cpu)
    total = _dot(sums, _block_weights(sums.numel(), sums.device), fused=on_cpu)
    return total + _signed(_mix(_LENGTH_KEY + nbytes))


def _block_sums(words: torch.Tensor, span: int, *, fused: bool) -> torch.Tensor:
    """``sum(x * weights)`` of every block of :data:`BLOCK` words (the last may be shorter), an
    int64 vector. ``span`` words (a multiple of the block) at a time go through one int64
    scratch (bounded; on the CPU one block, small enough to stay in cache): copied (sign
    extending), then multiplied by the weights and summed, in one fused pass where ``fused``."""
    weights = _weights(words.device)
    scratch = torch.empty(min(span, words.numel()), dtype=torch.int64, device=words.device)
    sums = [torch.zeros(0, dtype=torch.int64, device=words.device)]
    for start in range(0, words.numel(), span):
        part = scratch[: min(span, words.numel() - start)].copy_(words[start : start + span])
        full = part.numel() // BLOCK * BLOCK
        if full:
            blocks = part[:full].view(-1, BLOCK)
            if fused:
                sums.append(torch.stack([torch.dot(row, weights) for row in blocks]))
            else:
                sums.append(blocks.mul_(weights).sum(dim=1))
        if full < part.numel():
            sums.append(_dot(part[full:], weights[: part.numel() - full], fused=fused).view(1))
    return torch.cat(sums)


def _dot(a: torch.Tensor, b: torch.Tensor, *, fused: bool) -> torch.Tensor:
    """``sum(a * b)`` of int64 vectors, wrapping; ``a`` is overwritten unless ``fused`` (int64
    ``dot``, one pass, has a kernel on the CPU only)."""
    return torch.dot(a, b) if fused else a.mul_(b).sum()


_MASK64 = (1 << 64) - 1
# Block k's weight hashes _BLOCK_KEYS + k, the byte count _LENGTH_KEY + nbytes: values no
# position reaches (were a block's _mix(k), position i of block k and position k of block i
# would weigh the same).
_BLOCK_KEYS = 1 << 62
_LENGTH_KEY = 1 << 63
_weights_cache: dict[torch.device, torch.Tensor] = {}


def _mix(value: int) -> int:
    """splitmix64's finalizer: a fixed, well-mixed 64-bit hash of ``value``."""
    z = (value * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 holding it."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _weights(device: torch.device) -> torch.Tensor:
    """The odd weights of the positions ``0 .. BLOCK-1`` in a block (:func:`_mix` of the
    position, made odd), computed once per device, then cached: the same on every rank."""
    weights = _weights_cache.get(device)
    if weights is None:
        # int64 arithmetic in torch wraps like the masked Python in _mix; >> on int64 is
        # arithmetic, so each shift is masked to stay logical.
        z = torch.arange(BLOCK, dtype=torch.int64) * _signed(0x9E3779B97F4A7C15) + 0x632BE59BD9B4E019
        z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _signed(0xBF58476D1CE4E5B9)
        z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _signed(0x94D049BB133111EB)
        z = z ^ ((z >> 31) & ((1 << 33) - 1))
        weights = _weights_cache[device] = (z | 1).to(device)
    return weights


def _block_weights(n: int, device: torch.device) -> torch.Tensor:
    """The odd weights of blocks ``0 .. n-1``."""
    return torch.tensor([_signed(_mix(_BLOCK_KEYS + k) | 1) for k in range(n)], dtype=torch.int64, device=device)


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
    compare(fingerprints(pieces, rank), rank, what=what, cause=cause, timeout=timeout)


# This rank's fingerprints per group of replicas, keyed by the layouts' mesh and replicated
# axes: (tensor name, 0-d int64 fingerprint) in the order given.
Held = dict[tuple[Mesh, tuple[int, ...]], list[tuple[str, torch.Tensor]]]


def fingerprints(pieces: Sequence[tuple[str, torch.Tensor | None, Layout]], rank: int) -> Held:
    """The fingerprints :func:`verify_replicas` compares, taken now (no collective, no host
    sync), so that they can be compared later, after the pieces changed or were freed: by
    :func:`compare`, or folded into another collective (:func:`group_digest`)."""
    held: Held = {}
    for name, piece, layout in pieces:
        axes = layout.replicated_axes()
        if rank not in layout.mesh.ranks or not any(layout.mesh.shape[a] > 1 for a in axes):
            continue
        value = _UNSEEN if piece is None else _fingerprint(piece)
        held.setdefault((layout.mesh, axes), []).append((name, value))
    return held


def group_digest(entries: list[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """One 0-d int64 of a group's header (how many tensors, their names, their fingerprints):
    equal on two ranks that would send equal headers in :func:`compare`; a fingerprint that
    differs in one tensor always changes it (odd weights, :func:`_combined`). The commit flag
    carries it instead of the header (runtime/optim/replica_checks.py)."""
    mine = torch.stack([value for _, value in entries]).to(device)
    return _combined(mine) + _signed(_mix(_names_digest(entries) ^ len(entries)))


def compare(held: Held, rank: int, *, what: str, cause: str, timeout: datetime.timedelta) -> None:
    """:func:`verify_replicas`' collectives on fingerprints already taken (:func:`fingerprints`):
    every rank of the groups' meshes calls it, and raises alike."""
    involved = {r for mesh, _ in held for r in mesh.ranks}
    found: list[str] = []
    counted = 0  # the differing tensors of the groups this rank comes first in: each once
    device = default_device()
    try:
        for (mesh, axes), entries in held.items():
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
