"""The block of the global tensor one rank holds, and how to write it."""

from __future__ import annotations

import attrs

from shardlang import Layout
from shardlang.box import Box


@attrs.frozen
class Block:
    """``bounds[d]`` is ``[start, stop)`` of dim ``d``; ``local`` is the padded piece shape."""

    bounds: Box
    shape: tuple[int, ...]
    local: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return self.bounds.empty

    @property
    def padded(self) -> bool:
        """Shorter than the padded piece in some dim (the collectives pad it), but not empty."""
        short = any(n < full for n, full in zip(self.bounds.shape, self.local, strict=True))
        return short and not self.empty

    @property
    def whole(self) -> bool:
        return all((start, stop) == (0, n) for (start, stop), n in zip(self.bounds, self.shape, strict=True))

    def text(self) -> str:
        """``[0:19, :]``: ``:`` for a dim held whole; ``all`` for the whole tensor."""
        if not self.bounds:
            return "scalar"
        if self.whole:
            return "all"
        parts = [
            ":" if (start, stop) == (0, n) else f"{start}:{stop}"
            for (start, stop), n in zip(self.bounds, self.shape, strict=True)
        ]
        return "[" + ", ".join(parts) + "]"

    def mark(self) -> str:
        return "empty" if self.empty else ("padded" if self.padded else "")


def block_at(layout: Layout, shape: tuple[int, ...], coordinate: tuple[int, ...]) -> Block:
    return Block(bounds=layout.piece(shape, coordinate), shape=tuple(shape), local=layout.local_shape(shape))
