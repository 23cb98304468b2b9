"""What a layout written in another framework's notation means in shardlang.

:func:`meaning` reads the dims part of a layout (what comes before ``over``) as shardlang does,
or as DTensor's or Paddle's placements (``Shard(0), Replicate()``, ``dist.Partial()``, a bare
``Replicate``), Paddle's ``dims_mapping`` (``[0, -1]``) or ColossalAI's sharding sequence
(``["S0", "R"]``), and gives the shardlang dims it stands for where they can be told.
:mod:`shardlang.syntax` builds its "did you mean" messages from it. Text only: no lark here.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import attrs

_OPS = {"sum": "sum", "avg": "avg", "mean": "avg", "max": "max", "min": "min"}
_PADDLE_OPS = {"kRedSum": "sum", "kRedAvg": "avg", "kRedMax": "max", "kRedMin": "min"}
_QUALIFIED = r"(?:[A-Za-z_]\w*\.)*"  # torch.distributed.tensor.Shard, dist.Shard
_KINDS = r"(?P<kind>Shard|Replicate|Partial|_StridedShard|_MaskPartial)"
_PLACEMENT = re.compile(_QUALIFIED + _KINDS + r"\s*\(\s*(?P<args>[^()]*?)\s*\)")
# A placement written without its parentheses ('Replicate'): foreign only where the dims hold
# nothing else (a mesh named Shard after 'over' is not one).
_BARE_PLACEMENT = re.compile(_QUALIFIED + _KINDS + r"(?:\s*\(\s*(?P<args>[^()]*?)\s*\))?")
_FOREIGN_WORD = re.compile(_QUALIFIED + r"\b(?:Shard|Replicate|Partial|_StridedShard|_MaskPartial)\s*\(")
_COLOSSAL_ITEM = re.compile(r"""\s*(?P<q>['"]?)(?P<spec>R|S[0-9]+)(?P=q)\s*""")
_DIMS_MAPPING = re.compile(r"\[\s*-?[0-9]+\s*(?:,\s*-?[0-9]+\s*)*,?\s*\]")

COMMAS = "a layout's dims are separated by commas"
"""What :func:`meaning` says of dims written apart with spaces (``S0 R``)."""
PLACEMENTS_EXAMPLE = "e.g. '{layout}S0,R over {mesh}' for (Shard(0), Replicate()) on a 2-d tensor"
"""What a placements message says when the placements have no shardlang form (``{layout}``:
what comes before the layout in the suggestion, such as ``param = ``)."""


@attrs.frozen
class Meaning:
    """What the dims part of a layout means: ``dims``, the shardlang dims (``None`` where they
    cannot be told), and ``notation``, what the text is written in (``None``: shardlang)."""

    dims: str | None
    notation: str | None = None


def meaning(body: str, ndim: int | None, parses: Callable[[str], bool]) -> Meaning | None:
    """What ``body`` means, or ``None`` when it is no layout's dims in any notation known.
    ``ndim``: the tensor's rank where known; ``parses(layout)``: whether a shardlang layout
    text is well formed (``S0,R over MESH``)."""
    body = body.strip()
    if not body:
        return None
    if parses(f"{body} over MESH"):
        return Meaning(body)
    if _FOREIGN_WORD.search(body) or _bare_placements(body) is not None:
        return _placements(body, ndim)
    if _DIMS_MAPPING.fullmatch(body):
        axes = [int(v) for v in re.findall(r"-?[0-9]+", body)]
        dims = ",".join("S" + axes_text([a]) if a >= 0 else "R" for a in axes) or "()"
        return Meaning(
            dims,
            f"{body} looks like Paddle's dims_mapping (the mesh axis of each tensor dim, -1 for none); "
            "shardlang writes S<mesh axis> or R for each dim",
        )
    colossal = _colossal(body)
    if colossal is not None:
        return Meaning(
            colossal,
            f"{body} looks like ColossalAI's sharding sequence; shardlang writes its entries without "
            "brackets or quotes",
        )
    spaced = body.split()
    if len(spaced) > 1 and "," not in body and parses(",".join(spaced) + " over MESH"):
        return Meaning(",".join(spaced), COMMAS)
    return None


def _placements(body: str, ndim: int | None) -> Meaning:
    paddle = re.search(r"\bdist\.", body) is not None
    who = "Paddle's notation" if paddle else "DTensor's notation"
    lead = (
        f"{body} is {who} (a placement per mesh axis); shardlang writes one entry per tensor dim "
        "(S<mesh axes> or R), then '| P<mesh axes>' for pending reductions"
    )
    inner = _unbracketed(body)
    placements = [(m.group("kind"), m.group("args")) for m in _PLACEMENT.finditer(inner)]
    rest = _PLACEMENT.sub("", inner).replace(",", "").strip()
    bare = _bare_placements(body)
    if bare is not None:
        placements, rest = bare, ""
    return Meaning(_from_placements(placements, ndim) if placements and not rest else None, lead)


def _unbracketed(body: str) -> str:
    return body[1:-1] if body[:1] + body[-1:] in ("[]", "()") else body


def _bare_placements(body: str) -> list[tuple[str, str]] | None:
    """``Replicate, Shard(0)``: placements one of which lacks its parentheses, or ``None``."""
    found = [_BARE_PLACEMENT.fullmatch(item.strip()) for item in _unbracketed(body).split(",")]
    if not all(found) or all(m.group("args") is not None for m in found if m):
        return None
    return [(m.group("kind"), m.group("args") or "") for m in found if m]


def _colossal(body: str) -> str | None:
    """ColossalAI's ``["S0", "R"]`` (brackets or quotes: written bare it is shardlang) as shardlang."""
    inner = body[1:-1] if body[:1] == "[" and body[-1:] == "]" else body
    if inner == body and not re.search("['\"]", body):
        return None
    items = inner.split(",")
    matches = [_COLOSSAL_ITEM.fullmatch(item) for item in items]
    if not inner.strip() or not all(matches):
        return None
    return ",".join(m.group("spec") for m in matches if m)


def _from_placements(placements: list[tuple[str, str]], ndim: int | None) -> str | None:
    """The dims and partials of a layout from placements (DTensor's meaning: placement ``i`` is
    mesh axis ``i``; a dim sharded over several axes nests them left to right), or ``None``."""
    shards: list[tuple[int, int]] = []  # (mesh axis, tensor dim)
    partial: list[tuple[int, str]] = []
    for axis, (kind, args) in enumerate(placements):
        if kind == "Replicate" and not args:
            continue
        if kind == "Shard":
            match = re.fullmatch(r"(?:dim\s*=\s*)?(-?[0-9]+)", args)
            if match is None:
                return None
            shards.append((axis, int(match.group(1))))
        elif kind == "Partial":
            match = re.fullmatch(r"(?:reduce_op\s*=\s*)?(?:['\"](\w+)['\"]|" + _QUALIFIED + r"(kRed\w+))?", args)
            op = None if match is None else _OPS.get(match.group(1) or "sum") if not match.group(2) else None
            if match is not None and match.group(2):
                op = _PADDLE_OPS.get(match.group(2))
            if op is None:
                return None
            partial.append((axis, op))
        else:
            return None
    if any(d < 0 for _, d in shards):
        if ndim is None:
            return None
        shards = [(a, d + ndim if d < 0 else d) for a, d in shards]
    rank = ndim if ndim is not None else max((d + 1 for _, d in shards), default=1)
    if any(not 0 <= d < rank for _, d in shards):
        return None
    dims = []
    for dim in range(rank):
        axes = [a for a, d in shards if d == dim]
        dims.append("S" + axes_text(axes) if axes else "R")
    text = ",".join(dims) if dims else "()"
    if partial:
        text += " | " + ",".join(("P" + axes_text([a])) + ("" if op == "sum" else f":{op}") for a, op in partial)
    return text


def axes_text(axes: list[int]) -> str:
    """Mesh axes as a split or partial writes them: ``01``, or ``(10,11)`` past axis 9."""
    return "".join(map(str, axes)) if max(axes) < 10 else f"({','.join(map(str, axes))})"
