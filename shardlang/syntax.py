"""Lark's parse failures as :class:`~shardlang.errors.ParseError` values a person can act on.

Beside "unexpected X; expected Y" (every position counted by :class:`LineIndex`, so lines end
where :data:`~shardlang.errors.LINE_BREAK` says), some mistakes get messages of their own:

- a rule's quoted pattern that its line does not close;
- a block left open: ``tensor a : f32[4] {`` whose ``}`` is missing names the block and where
  its ``{`` is, at the item that starts inside it or at the end of the text;
- another framework's notation where a layout goes: DTensor's or Paddle's placements
  (``Shard(0), Replicate()``, ``dist.Partial()``), Paddle's ``dims_mapping`` (``[0, -1]``),
  ColossalAI's sharding sequence (``["S0", "R"]``), or a layout without its ``over MESH``, each
  with the shardlang layout it means ("did you mean 'S0,R over world'?") where it can be told.

Nothing from lark escapes: any other lark failure is still a placed ``ParseError``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from importlib import resources

import lark
from lark import Token, Tree

from shardlang.errors import LINE_BREAK, LineIndex, ParseError

FRIENDLY = {
    "NAME": "a name",
    "SHARD_DIGITS": "a split such as S0",
    "PARTIAL_DIGITS": "a partial such as P0",
    "TENSOR_NAME": "a tensor name",
    "ENTRY_KEY": "param, grad, state or state.<name>",
    "DTYPE": "a dtype such as f32",
    "INT": "an integer",
    "NUMBER": "a number",
    "DURATION": "a duration such as 5us",
    "STRING": 'a quoted pattern such as "h.*.weight"',
    "$END": "the end of the text",
}
_ITEM_KEYWORDS = ("tensor", "rule", "mesh")  # what starts an item of a spec file
_OPS = {"sum": "sum", "avg": "avg", "mean": "avg", "max": "max", "min": "min"}
_PADDLE_OPS = {"kRedSum": "sum", "kRedAvg": "avg", "kRedMax": "max", "kRedMin": "min"}
_QUALIFIED = r"(?:[A-Za-z_]\w*\.)*"  # torch.distributed.tensor.Shard, dist.Shard
_PLACEMENT = re.compile(
    _QUALIFIED + r"(?P<kind>Shard|Replicate|Partial|_StridedShard|_MaskPartial)\s*\(\s*(?P<args>[^()]*?)\s*\)"
)
_FOREIGN_WORD = re.compile(_QUALIFIED + r"\b(?:Shard|Replicate|Partial|_StridedShard|_MaskPartial)\s*\(")
_COLOSSAL_ITEM = re.compile(r"""\s*(?P<q>['"]?)(?P<spec>R|S[0-9]+)(?P=q)\s*""")
_DIMS_MAPPING = re.compile(r"\[\s*-?[0-9]+\s*(?:,\s*-?[0-9]+\s*)*,?\s*\]")
_ENTRY_START = re.compile(r"\b(?:param|grad|state(?:\.\w+)?)\s*=|[{}]")
_MESH_DECL = re.compile(r"(?:^|(?<=\s))mesh\s+([A-Za-z_]\w*)\s*=")


@functools.cache
def grammar() -> lark.Lark:
    text = resources.files("shardlang").joinpath("grammar.lark").read_text()
    return lark.Lark(text, start=["layout", "mesh_text", "spec"], parser="lalr", propagate_positions=True)


def describe_expected(names: set[str] | frozenset[str]) -> str:
    described = set()
    for name in names:
        if name in FRIENDLY:
            described.add(FRIENDLY[name])
            continue
        try:
            pattern = grammar().get_terminal(name).pattern
        except KeyError:
            described.add(name)
            continue
        described.add(f"'{pattern.value}'" if pattern.type == "str" else name)
    items = sorted(described) or [FRIENDLY["$END"]]
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " or " + items[-1]


def parse_tree(text: str, start: str, filename: str | None, lines: LineIndex) -> Tree:
    """The tree of ``text`` from the grammar's ``start``; every failure a placed ``ParseError``."""
    if not isinstance(text, str):
        raise ParseError(f"a {start.removesuffix('_text')} is text, not {type(text).__name__}")
    try:
        return grammar().parse(text, start=start)
    except lark.exceptions.UnexpectedInput as e:
        raise _explain(e, text, start, filename, lines) from None
    except lark.exceptions.LarkError as e:  # any other lark failure: still ours, still placed
        raise ParseError(f"cannot parse: {e}", lines.at_offset(0, filename)) from None


def _explain(
    e: lark.exceptions.UnexpectedInput, text: str, start: str, filename: str | None, lines: LineIndex
) -> ParseError:
    parser = getattr(e, "interactive_parser", None)
    stack: list[object] = list(parser.parser_state.value_stack) if parser is not None else []
    end = len(text.rstrip())
    if isinstance(e, lark.exceptions.UnexpectedCharacters):
        offset, found, expected = e.pos_in_stream, f"character {text[e.pos_in_stream]!r}", set(e.allowed or ())
    elif isinstance(e, lark.exceptions.UnexpectedToken) and e.token.type != "$END":
        offset, found, expected = e.token.start_pos or 0, f"'{e.token}'", set(e.expected)
    else:  # the end of the text (UnexpectedToken of $END, or UnexpectedEOF)
        offset, found, expected = end, "", set(getattr(e, "expected", ()) or ())
    foreign = _foreign_notation(text, offset, stack, start, found, expected)
    if foreign is not None:
        at, message = foreign
        return ParseError(message, lines.at_offset(at, filename))
    unclosed = _unclosed_block(stack, found, lines)
    if unclosed is not None:
        at, message = unclosed
        return ParseError(message, lines.at_offset(end if at is None else at, filename))
    if found == "character '\"'" and "STRING" in expected:  # a quote the line does not close
        return ParseError(
            "this '\"' opens a pattern that its line does not close: write the closing '\"' before the line ends",
            lines.at_offset(offset, filename),
        )
    if not found:
        return ParseError(
            f"the text ends too early; expected {describe_expected(expected)}", lines.at_offset(end, filename)
        )
    return ParseError(f"unexpected {found}; expected {describe_expected(expected)}", lines.at_offset(offset, filename))


# --- a block left open --------------------------------------------------------------------------
def _unclosed_block(stack: Sequence[object], found: str, lines: LineIndex) -> tuple[int | None, str] | None:
    """Where to place the error and its message when the parser met a new item (or the end of the
    text) inside a ``{`` block: ``None`` for the end, else the offset of the item's keyword."""
    tokens = [v for v in stack if isinstance(v, Token)]
    brace = next((i for i in range(len(tokens) - 1, -1, -1) if tokens[i].type == "LBRACE"), None)
    if brace is None:
        return None
    head = next((t for t in reversed(tokens[:brace]) if t.type in ("TENSOR", "RULE")), None)
    if head is None:
        return None
    name_index = tokens.index(head) + 1
    name = str(tokens[name_index]) if name_index < brace else "?"
    block = f"tensor '{name}'" if head.type == "TENSOR" else f"rule {name}"
    opened = lines.at_offset(tokens[brace].start_pos or 0)
    where = f"its '{{' at line {opened.line}, column {opened.column}"
    if not found:
        return None, f"the text ends inside the block of {block} ({where}): close it with '}}'"
    last = tokens[-1] if brace < len(tokens) - 1 else None
    if last is not None and last.type == "ENTRY_KEY" and str(last) in _ITEM_KEYWORDS:
        return last.start_pos or 0, (
            f"the block of {block} ({where}) is not closed before this '{last}': add '}}' after its last entry"
        )
    return None


# --- another framework's notation -------------------------------------------------------------
def _foreign_notation(
    text: str, offset: int, stack: Sequence[object], start: str, found: str, expected: set[str]
) -> tuple[int, str] | None:
    """The offset to point at and the message, when the layout being read when the parser
    stopped is written in another framework's notation (or lacks its ``over MESH``)."""
    if start == "layout":
        begin = 0
    else:
        tokens = [v for v in stack if isinstance(v, Token)]
        if not _after_entry_equal(stack):
            return None
        equal = next(t for t in reversed(tokens) if t.type == "EQUAL")
        key = tokens[tokens.index(equal) - 1]
        if key.type != "ENTRY_KEY":
            return None
        begin = equal.end_pos or 0
    if offset < begin:
        return None
    stop = _layout_end(text, begin, start)
    region = text[begin:stop]
    at = begin + len(region) - len(region.lstrip())
    over = re.search(r"\bover\b", region)
    body = (region[: over.start()] if over else region).strip()
    mesh = (region[over.end() :].strip() if over else None) or _only_mesh(text[:begin]) or "MESH"
    hint = _foreign_hint(body, _declared_ndim(text, stack), mesh) if offset <= stop else None
    if hint is not None:
        return at, hint
    if "OVER" in expected and over is None and body and _ends_layout(found):
        return at + len(region.strip()), (
            f"a layout ends with 'over' and its mesh: did you mean '{body} over {mesh}'? "
            f"(found {found or 'the end of the text'})"
        )
    return None


def _foreign_hint(body: str, ndim: int | None, mesh: str) -> str | None:
    """What ``body``, a layout's dims written in another framework's notation, means in shardlang."""
    if _FOREIGN_WORD.search(body):
        return _placements_hint(body, ndim, mesh)
    if _DIMS_MAPPING.fullmatch(body):
        axes = [int(v) for v in re.findall(r"-?[0-9]+", body)]
        dims = ",".join("S" + _axes([a]) if a >= 0 else "R" for a in axes) or "()"
        return (
            f"{body} looks like Paddle's dims_mapping (the mesh axis of each tensor dim, -1 for none); "
            f"shardlang writes S<mesh axis> or R for each dim: did you mean '{dims} over {mesh}'?"
        )
    colossal = _colossal(body)
    if colossal is not None:
        return (
            f"{body} looks like ColossalAI's sharding sequence; shardlang writes its entries without "
            f"brackets or quotes: did you mean '{colossal} over {mesh}'?"
        )
    return None


def _after_entry_equal(stack: Sequence[object]) -> bool:
    """Whether the parser is inside a layout that an entry's ``=`` began (no reduced layout since)."""
    for value in reversed(stack):
        if isinstance(value, Tree) and value.data in ("layout", "entry"):
            return False
        if isinstance(value, Token) and value.type in ("EQUAL", "LBRACE", "RBRACE"):
            return value.type == "EQUAL"
    return False


def _ends_layout(found: str) -> bool:
    """Whether what the parser found after a layout's dims is what follows a whole entry."""
    return (
        not found
        or found in ("'}'", "'tensor'", "'rule'", "'mesh'", "'param'", "'grad'", "'state'")
        or (found.startswith("'state."))
    )


def _layout_end(text: str, begin: int, start: str) -> int:
    if start == "layout":
        return len(text)
    stops = [m.start() for m in (LINE_BREAK.search(text, begin), _ENTRY_START.search(text, begin)) if m]
    return min(stops, default=len(text))


def _only_mesh(before: str) -> str | None:
    names = set(_MESH_DECL.findall(before))
    return names.pop() if len(names) == 1 else None


def _declared_ndim(text: str, stack: Sequence[object]) -> int | None:
    """The rank of the tensor whose block the parser is in (``None`` in a rule or a layout)."""
    tokens = [v for v in stack if isinstance(v, Token)]
    heads = [t for t in tokens if t.type in ("TENSOR", "RULE")]
    if not heads or heads[-1].type != "TENSOR":
        return None
    after = tokens[tokens.index(heads[-1]) :]
    lo = next((t for t in after if t.type == "LSQB"), None)
    hi = next((t for t in after if t.type == "RSQB"), None)
    if lo is None or hi is None:
        return None
    inside = text[lo.end_pos or 0 : hi.start_pos or 0].strip()
    return len(inside.split(",")) if inside else 0


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


def _placements_hint(body: str, ndim: int | None, mesh: str) -> str:
    paddle = re.search(r"\bdist\.", body) is not None
    who = "Paddle's notation" if paddle else "DTensor's notation"
    lead = (
        f"{body} is {who} (a placement per mesh axis); shardlang writes one entry per tensor dim "
        "(S<mesh axes> or R), then '| P<mesh axes>' for pending reductions"
    )
    inner = body[1:-1] if body[:1] + body[-1:] in ("[]", "()") else body
    placements = [(m.group("kind"), m.group("args")) for m in _PLACEMENT.finditer(inner)]
    rest = _PLACEMENT.sub("", inner).replace(",", "").strip()
    layout = _from_placements(placements, ndim) if placements and not rest else None
    if layout is None:
        return f"{lead}: e.g. 'S0,R over {mesh}' for (Shard(0), Replicate()) on a 2-d tensor"
    return f"{lead}: did you mean '{layout} over {mesh}'?"


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
        dims.append("S" + _axes(axes) if axes else "R")
    text = ",".join(dims) if dims else "()"
    if partial:
        text += " | " + ",".join(("P" + _axes([a])) + ("" if op == "sum" else f":{op}") for a, op in partial)
    return text


def _axes(axes: list[int]) -> str:
    return "".join(map(str, axes)) if max(axes) < 10 else f"({','.join(map(str, axes))})"
