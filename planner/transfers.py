"""One message of a point-to-point step, its own module so that a step's list of them
(``planner.plans``) and the pattern that describes them (``planner.pattern``) share it."""

from __future__ import annotations

from typing import Any

import attrs

from shardlang.box import Box


@attrs.frozen
class Transfer:
    """One message of a point-to-point step: global rank ``src_rank`` sends global rank
    ``dst_rank`` the block ``box`` of the global tensor (``[start, stop)`` per dim)."""

    src_rank: int
    dst_rank: int
    box: Box = attrs.field(converter=Box)

    def to_json(self) -> dict[str, Any]:
        return {"src": self.src_rank, "dst": self.dst_rank, "box": [list(b) for b in self.box]}
