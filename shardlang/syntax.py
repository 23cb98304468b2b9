"""Lark's parse failures as :class:`~shardlang.errors.ParseError` values a person can act on.

Beside "unexpected X; expected Y" (every position counted by :class:`LineIndex`, so lines end
where :data:`~shardlang.errors.LINE_BREAK` says), some mistakes get messages of their own:

- a rule's quoted pattern that its line does not close;
- a block left open: ``tensor a : f32[4] {`` whose ``}`` is missing names the block and where
  its ``{`` is, at the item that starts inside it or at the end of the text; a ``[`` or ``(``
  left open says where it opened and where its closer goes;
- entries of a block separated by ``,`` or ``;``, and a dtype written with a module's name
  (``torch.float32``);
- another framework's notation where a layout goes: DTensor's or Paddle's placements
  (``Shard(0), Replicate()``, ``dist.Partial()``), Paddle's ``dims_mapping`` (``[0, -1]``),
  ColossalAI's sharding sequence (``["S0", "R"]``, read by :mod:`shardlang.notation`), a layout
  without its ``over MESH``, with its ``| P...`` after the mesh or its dims without commas, each
  with the shardlang layout it means ("did you mean 'S0,R over world'?") where it can be told;
- a layout, in any of those notations, where the grammar wants something else: in a block
  without its entry's name, after a name without its ``=``, after a tensor's shape or a rule's
  pattern without a block, or where a tensor's dtype goes: "did you mean" the whole entry or item.

Nothing from lark escapes: any other lark failure is still a placed ``ParseError``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from importlib import resources

import lark
from lark import Token, Tree

from shardlang.dtypes import itemsize
from shardlang.errors import LINE_BREAK, LayoutError, LineIndex, ParseError
from shardlang.notation import COMMAS, PLACEMENTS_EXAMPLE, Meaning, meaning

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
_ENTRY_START = re.compile(r"\b(?:param|grad|state(?:\.\w+)?)\s*=|[{}]")
_MESH_DECL = re.compile(r"(?:^|(?<=\s))mesh\s+([A-Za-z_]\w*)\s*=")
_ROLE = re.compile(r"param|grad|state(?:\.\w+)?")
# What may come before a layout put where a block goes: its entry's name and '=', or a bare '=' or ':'.
_ENTRY_HEAD = re.compile(r"\s*(?:(?P<key>param|grad|state(?:\.\w+)?)\s*)?[=:]?")


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
    # The first diagnosis that recognizes the mistake names it (where: the offset, or None for
    # the end of the text); else lark's own "unexpected ..." below.
    diagnoses = (
        lambda: _foreign_notation(text, offset, stack, start, found, expected),
        lambda: _unclosed_block(stack, found, lines),
        lambda: _misplaced_layout(text, offset, stack, start, expected),
        lambda: _dotted_dtype(text, stack, found),
        lambda: _unclosed_bracket(stack, found, expected, lines),
    )
    for diagnose in diagnoses:
        diagnosis = diagnose()
        if diagnosis is not None:
            at, message = diagnosis
            return ParseError(message, lines.at_offset(end if at is None else at, filename))
    if found in ("','", "character ';'") and {"ENTRY_KEY", "RBRACE"} <= expected:  # { param = ..., grad = ... }
        return ParseError(
            f"the entries of a block are separated by spaces or line breaks, not {found.removeprefix('character ')}: "
            "remove it",
            lines.at_offset(offset, filename),
        )
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


def _dotted_dtype(text: str, stack: Sequence[object], found: str) -> tuple[int, str] | None:
    """A tensor's dtype written with a module's name (``torch.float32``): where, and the
    unknown-dtype message with the language's name for it."""
    last = stack[-1] if stack else None
    if found != "character '.'" or not isinstance(last, Token) or last.type != "DTYPE":
        return None
    begin = last.start_pos or 0
    name = re.match(r"[\w.]*", text[begin:])
    try:
        itemsize(name.group() if name else str(last))
    except LayoutError as e:
        return begin, e.message
    return None


# --- a bracket or a block left open --------------------------------------------------------------
_CLOSERS = {"LSQB": ("[", "]", "RSQB"), "LPAR": ("(", ")", "RPAR")}
# What never stands inside a shape's, a mesh's or an axis list's brackets.
_AFTER_BRACKETS = ("'tensor'", "'rule'", "'mesh'", "'over'", "'{'", "'}'", "'|'", "'param'", "'grad'", "'state'", "")


def _unclosed_bracket(
    stack: Sequence[object], found: str, expected: set[str], lines: LineIndex
) -> tuple[int, str] | None:
    """Where its closer goes and the message, when the parser met what follows a bracket's
    contents (``{``, ``over``, the next item) while a ``[`` or ``(`` was still open."""
    if found not in _AFTER_BRACKETS and not found.startswith("'state."):
        return None
    tokens = [v for v in stack if isinstance(v, Token)]
    depth: dict[str, int] = {"LSQB": 0, "LPAR": 0}
    for token in reversed(tokens):
        for opener, (_, _, closer) in _CLOSERS.items():
            if token.type == closer:
                depth[opener] += 1
            elif token.type == opener and depth[opener]:
                depth[opener] -= 1
            elif token.type == opener:
                left, right, _ = _CLOSERS[opener]
                if closer not in expected:
                    return None
                opened = lines.at_offset(token.start_pos or 0)
                return tokens[-1].end_pos or 0, (
                    f"the '{left}' at line {opened.line}, column {opened.column} is not closed: write '{right}' "
                    f"here, before {found or 'the end of the text'}"
                )
    return None


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


# --- another framework's notation, a layout in the wrong place ----------------------------------
def _foreign_notation(
    text: str, offset: int, stack: Sequence[object], start: str, found: str, expected: set[str]
) -> tuple[int, str] | None:
    """The offset to point at and the message, when the layout being read when the parser
    stopped is written in another framework's notation (or lacks its ``over MESH``, or has its
    pending reductions after it)."""
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
    if offset <= stop and over is not None and found == "'|'":
        on, _, partials = region[over.end() :].partition("|")
        moved = f"{body} | {partials.strip()} over {on.strip()}"
        if _parses(moved):
            return offset, f"the pending reductions ('| P<mesh axes>') come before 'over': did you mean '{moved}'?"
    read = meaning(body, _declared_ndim(text, stack), _parses) if offset <= stop else None
    if read is not None and read.notation is not None:  # a missing comma: at the dim after it
        return offset if read.notation == COMMAS else at, _did_you_mean(read, [read.notation], "", mesh, "")
    if "OVER" in expected and over is None and body and _ends_layout(found):
        dims, _, last = body.rpartition(" ")
        if dims and _parses(f"{dims.strip()} over {last}"):  # 'R,S1 mesh[2,2]': its mesh without 'over'
            body, mesh = dims.strip(), last
        elif not _parses(f"{body} over {mesh}"):
            return None
        return at + len(body), (
            f"a layout ends with 'over' and its mesh: did you mean '{body} over {mesh}'? "
            f"(found {found or 'the end of the text'})"
        )
    return None


def _misplaced_layout(
    text: str, offset: int, stack: Sequence[object], start: str, expected: set[str]
) -> tuple[int, str] | None:
    """The offset to point at and the message, when a layout (in any notation) stands where the
    grammar wants something else: in a block without its entry's name (``{ S0 over w }``), after
    an entry's name without its '=' (``param: S0 over w``), after a tensor's shape or a rule's
    pattern without a block, or where a tensor's dtype goes."""
    tokens = [v for v in stack if isinstance(v, Token)] if start == "spec" else []
    last = tokens[-1] if tokens else None
    if last is None:
        return None
    heads = [t for t in tokens if t.type in ("TENSOR", "RULE")]
    in_block = bool(heads) and _in_block(tokens)
    key_read = last.type == "ENTRY_KEY" and "EQUAL" in expected  # a name read, its '=' missing
    if in_block and key_read and _ROLE.fullmatch(str(last)):  # param S0 over w, param: S0 over w
        return _suggest(text, offset, stack, ["an entry is its name, '=' and its layout"], f"{last} = ", "", at=offset)
    if in_block and (key_read or "ENTRY_KEY" in expected):
        # { S0 over w }, { [Shard(0)] over w }: a layout where an entry's name goes
        begin = (last.start_pos or 0) if key_read else offset
        brace = next(t for t in reversed(tokens) if t.type == "LBRACE")
        key = _free_role(text[brace.end_pos or 0 : begin])
        why = "a layout in a block is the value of an entry ('param = ', 'grad = ' or 'state = ' before it)"
        return _suggest(text, begin, stack, [why], f"{key} = ", "", at=begin)
    if not heads:
        return None
    head = heads[-1]
    if "LBRACE" in expected and last.type in ("RSQB", "STRING"):  # tensor a : f32[4] S0 over w
        block = ("tensor", "shape") if head.type == "TENSOR" else ("rule", "pattern")
        what = "a {}'s layouts go in a block after its {}".format(*block)
        header = text[head.start_pos or 0 : last.end_pos or 0]
        return _suggest(text, offset, stack, [what], f"{header} {{ param = ", " }", at=offset)
    if "LSQB" in expected and last.type == "DTYPE" and head.type == "TENSOR":  # tensor a : S0 over w
        header = text[head.start_pos or 0 : tokens[-2].end_pos or 0]
        what = f"after '{header}' come the tensor's dtype and shape, then its layouts in a block"
        begin = last.start_pos or 0
        return _suggest(text, begin, stack, [what], f"{header} DTYPE[SHAPE] {{ param = ", " }", at=begin)
    return None


def _in_block(tokens: list[Token]) -> bool:
    """Whether the parser is inside a tensor's or rule's ``{`` block (where entries go)."""
    braces = [t.type for t in tokens if t.type in ("LBRACE", "RBRACE")]
    return bool(braces) and braces[-1] == "LBRACE"


def _suggest(
    text: str, begin: int, stack: Sequence[object], why: list[str], before: str, after: str, at: int
) -> tuple[int, str] | None:
    """The message for the layout at ``begin`` (an entry's name or '=' before it skipped, and
    taken) written as ``before`` + the layout + ``after``, or ``None`` when it is no layout."""
    start = _ENTRY_HEAD.match(text, begin)
    if start is not None and start.group("key"):
        before = before.replace("param = ", f"{start.group('key')} = ")
    begin = start.end() if start is not None else begin
    region = text[begin : _layout_end(text, begin, "spec")]
    over = re.search(r"\bover\b", region)
    body = region[: over.start()] if over else region
    mesh = (region[over.end() :].strip() if over else "") or _only_mesh(text[:begin]) or "MESH"
    read = meaning(body, _declared_ndim(text, stack), _parses)
    if read is None or (read.dims is not None and not _parses(f"{read.dims} over {mesh}")):
        return None
    return at, _did_you_mean(read, [read.notation, *why] if read.notation else why, before, mesh, after)


def _did_you_mean(read: Meaning, why: list[str | None], before: str, mesh: str, after: str) -> str:
    lead = "; ".join(w for w in why if w)
    if read.dims is None:
        return f"{lead}: " + PLACEMENTS_EXAMPLE.format(layout=before, mesh=mesh + after)
    return f"{lead}: did you mean '{before}{read.dims} over {mesh}{after}'?"


def _free_role(entries: str) -> str:
    """The first of param, grad and state that ``entries`` (a block's text so far) lacks."""
    given = set(re.findall(r"\b(param|grad|state)\s*=", entries))
    return next((role for role in ("param", "grad", "state") if role not in given), "param")


def _parses(layout: str) -> bool:
    """Whether ``layout`` is a well-formed shardlang layout (its meshes not looked up)."""
    try:
        grammar().parse(layout, start="layout")
    except lark.exceptions.LarkError:
        return False
    return True


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
