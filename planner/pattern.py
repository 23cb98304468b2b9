"""The transfers of a point-to-point step as a pattern: what the layouts say, not a list.

A point-to-point step (``planner.p2p``) sends, for every target rank holding a nonempty piece
and every source block overlapping it, the overlap: from the rank itself when it holds that
block (a local copy), else from one of the block's holders. Where the planner's choice of
senders is a round robin (every block's messages have one size, or the block has one holder,
and the links do not tell holders apart: ``planner.pieces.cyclic_senders_hold``), the whole list
follows from the two layouts and the tensor's shape by mesh-axis arithmetic: per dim, the
intervals each layout's axes cut and their strides in the mesh (``planner.pieces``); per source
block, its holders (its base position plus the offsets of the axes that split no dim, in mesh
order) taking its messages in turn, in target mesh order. An :class:`ExchangePattern` is that
description: a few hundred bytes whatever the rank count, where the list at 131,072 ranks holds
tens of thousands of transfers (docs/reference/planner.md, "Point-to-point plans and other meshes").

- :meth:`ExchangePattern.transfers_of` gives one rank's transfers (what it receives, copies and
  sends), in the list's order, from the blocks and receivers that concern it alone;
- :meth:`ExchangePattern.expanded` gives the explicit list (``Plan.expanded``,
  ``shardlang plan --expand``), the same transfers in the same order as the planner's list;
- its JSON (``{"pattern": {...}}`` in a step) and its ``repr`` read back to an equal pattern.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from planner.transfers import Transfer
from shardlang.box import Box
from shardlang.layout import Layout, format_layout
from shardlang.mesh import Mesh
from shardlang.parser import parse_layout

_ARROW, _FOR = " -> ", " for "


@attrs.frozen
class ExchangePattern:
    """The transfers taking ``source`` to ``target`` (neither partial) for a tensor of ``shape``,
    senders in turn (module docstring). Iterating it yields :meth:`expanded`."""

    source: Layout
    target: Layout
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(x) for x in s))

    def __len__(self) -> int:
        """How many transfers (local copies included), counted from the cuts."""
        from planner.pieces import exchange_rows

        return exchange_rows(self.source, self.target, self.shape)

    def __iter__(self) -> Iterator[Transfer]:
        return iter(self.expanded())

    @property
    def message_count(self) -> int:
        """The transfers between two ranks (local copies excluded)."""
        table = table_of(self)
        return int((table.sender != table.receiver).sum())

    def most_copied_elements(self) -> int:
        """The most elements a rank copies locally (``planner.copies.exchange_copy_elements``)."""
        from planner.pieces import copied_elements

        _, elements = copied_elements(self.source, self.target, self.shape, table_of(self))
        return int(elements.max()) if len(elements) else 0

    def expanded(self) -> tuple[Transfer, ...]:
        """Every transfer, in the planner's order: receivers in target mesh order, then source blocks ascending."""
        table = table_of(self)
        boxes = zip(
            *(zip(lo.tolist(), hi.tolist(), strict=True) for lo, hi in zip(table.lo, table.hi, strict=True)),
            strict=True,
        )
        return tuple(
            Transfer(sender, receiver, Box.trusted(box))
            for sender, receiver, box in zip(table.sender.tolist(), table.receiver.tolist(), boxes, strict=True)
        )

    def transfers_of(self, rank: int) -> tuple[Transfer, ...]:
        """The transfers ``rank`` sends, receives or copies, in :meth:`expanded`'s order, without
        making the others: its target piece's blocks, and the receivers of its source block."""
        import numpy as np

        from planner.pieces import pieces_of

        source, target = pieces_of(self.source, self.shape), pieces_of(self.target, self.shape)
        found: list[tuple[int, int, Transfer]] = []  # (receiver position, block, transfer)
        asked = np.array([rank], dtype=np.int64)
        own_position = source.position_of(asked)
        own_block = int(source.block_of(own_position)[0])
        position = int(target.position_of(asked)[0])
        if position >= 0:
            los, his = target.intervals(np.array([position], dtype=np.int64))
            wanted = [(int(lo[0]), int(hi[0])) for lo, hi in zip(los, his, strict=True)]
            if all(lo < hi for lo, hi in wanted):
                ranges = []
                for cut, (lo, hi) in zip(source.cuts, wanted, strict=True):
                    first, count = cut.overlapping(np.array([lo]), np.array([hi]))
                    ranges.append(range(int(first[0]), int(first[0] + count[0])))
                for index in itertools.product(*ranges):
                    block = sum(i * r for i, r in zip(index, source.radix, strict=True))
                    part = Box.trusted(
                        (max(lo, int(c.lo[i])), min(hi, int(c.hi[i])))
                        for (lo, hi), c, i in zip(wanted, source.cuts, index, strict=True)
                    )
                    sender = rank if block == own_block else self._sender(index, block, position)
                    found.append((position, block, Transfer(sender, rank, part)))
        if own_block >= 0:
            index = tuple((own_block // r) % len(c) for r, c in zip(source.radix, source.cuts, strict=True))
            positions, parts, local = self._receivers(index, own_block)
            base = int(source.base([np.array([i]) for i in index])[0])
            turn = int(np.searchsorted(source.free, int(own_position[0]) - base))
            remote = np.flatnonzero(~local)
            chosen = remote[turn :: source.holders_per_block]
            receivers = target.rank_of(positions[chosen]).tolist()
            for p, receiver, k in zip(positions[chosen].tolist(), receivers, chosen.tolist(), strict=True):
                box = Box.trusted((int(lo[k]), int(hi[k])) for lo, hi in parts)
                found.append((p, own_block, Transfer(rank, receiver, box)))
        found.sort(key=lambda entry: (entry[0], entry[1]))
        return tuple(t for _, _, t in found)

    def _receivers(self, index: tuple[int, ...], block: int) -> tuple[Any, list[tuple[Any, Any]], Any]:
        """The target positions whose piece overlaps source block ``index`` (ascending), the
        overlaps per dim (lo, hi arrays), and which of them hold the block (a local copy)."""
        import numpy as np

        from planner.pieces import pieces_of

        source, target = pieces_of(self.source, self.shape), pieces_of(self.target, self.shape)
        grids = []
        for s, t, i in zip(source.cuts, target.cuts, index, strict=True):
            first, count = t.overlapping(s.lo[i : i + 1], s.hi[i : i + 1])
            grids.append(np.arange(int(first[0]), int(first[0] + count[0])))
        per_dim = [g.reshape(-1) for g in np.meshgrid(*grids, indexing="ij")] if grids else []
        base = target.base(per_dim)
        positions = (base[:, None] + target.free[None, :]).reshape(-1)
        order = np.argsort(positions, kind="stable")
        positions = positions[order]
        per_dim = [np.repeat(i, len(target.free))[order] for i in per_dim]
        parts = [
            (np.maximum(t.lo[j], s.lo[i]), np.minimum(t.hi[j], s.hi[i]))
            for s, t, i, j in zip(source.cuts, target.cuts, index, per_dim, strict=True)
        ]
        local = source.block_of(source.position_of(target.rank_of(positions))) == block
        return positions, parts, local

    def _sender(self, index: tuple[int, ...], block: int, position: int) -> int:
        """Who sends source block ``index`` to the receiver at target ``position`` (not a holder):
        the holder whose turn it is among the block's messages, in target mesh order."""
        import numpy as np

        from planner.pieces import pieces_of

        source = pieces_of(self.source, self.shape)
        base = int(source.base([np.array([i]) for i in index])[0])
        turn = 0
        if source.holders_per_block > 1:
            positions, _, local = self._receivers(index, block)
            turn = int(np.searchsorted(positions[~local], position)) % source.holders_per_block
        return int(source.rank_of(np.array([base + int(source.free[turn])]))[0])

    # --- text and JSON ------------------------------------------------------------------
    def text(self) -> str:
        """``S0 over mesh[4] -> R over mesh[2] ranks 4..5 for [8, 8]``: both layouts with their meshes."""
        return (
            f"{format_layout(self.source, mesh_inline=True)}{_ARROW}"
            f"{format_layout(self.target, mesh_inline=True)}{_FOR}{list(self.shape)}"
        )

    @classmethod
    def parse(cls, text: str) -> ExchangePattern:
        """Read back :meth:`text`."""
        pair, _, shape = text.rpartition(_FOR)
        source, _, target = pair.partition(_ARROW)
        numbers = shape.strip().removeprefix("[").removesuffix("]")
        return cls(parse_layout(source), parse_layout(target), tuple(int(n) for n in numbers.split(",") if n.strip()))

    def __repr__(self) -> str:
        return f"ExchangePattern.parse({self.text()!r})"

    def to_json(self) -> dict[str, Any]:
        return {"source": str(self.source), "target": str(self.target), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], meshes: Mapping[str, Mesh]) -> ExchangePattern:
        return cls(parse_layout(data["source"], meshes), parse_layout(data["target"], meshes), tuple(data["shape"]))


@functools.lru_cache(maxsize=16)
def table_of(pattern: ExchangePattern) -> Any:
    """The pattern's table (``planner.pieces.exchange_table``), kept for the last few patterns."""
    from planner.pieces import exchange_table

    return exchange_table(pattern.source, pattern.target, pattern.shape)
