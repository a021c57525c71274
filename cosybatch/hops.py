"""Streaming hop schedule (design.md D3), as a pure state machine.

One ``HopSchedule`` lives per manifest row: the hop grows 25 -> 50 -> 100 across the row's
chunks *and* its text segments, as the official code does within a request. (The official
code also leaks the grown hop into the next request; that is a bug we do not copy.)
One ``SegmentPlanner`` lives per segment and decides, from the number of flow tokens
available, when the next chunk fires and which tokens it covers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class HopSchedule:
    hop: int = 25
    max_hop: int = 100
    scale: int = 2

    def grow(self) -> None:
        self.hop = min(self.max_hop, self.hop * self.scale)


@dataclass(frozen=True)
class Hop:
    """One hop of a segment, as planned: run the flow on tokens[:end]; keep mel frames from
    ``offset`` tokens on."""

    end: int
    offset: int
    finalize: bool
    index: int


class SegmentPlanner:
    """Hop decisions for one segment, fed with the count of flow tokens produced so far."""

    def __init__(self, schedule: HopSchedule, prompt_tokens: int, lookahead: int = 3):
        self.schedule = schedule
        self.lookahead = lookahead
        h = schedule.hop
        # The first hop is padded so that prompt + first hop ends on the hop grid, which the
        # official code relies on to align the first chunk with the attention-chunk grid.
        self.pad = math.ceil(prompt_tokens / h) * h - prompt_tokens
        self.offset = 0
        self.index = 0
        self.done = False

    def _this_hop(self) -> int:
        return self.schedule.hop + (self.pad if self.offset == 0 else 0)

    def tokens_needed(self) -> int:
        """Flow tokens that must exist before the next non-final chunk can fire."""
        return self.offset + self._this_hop() + self.lookahead

    def next_chunk(self, available: int, finished: bool) -> Hop | None:
        """The next chunk to run, or None to wait for more tokens.

        ``finished`` says the LLM is done with this segment; then the remainder is emitted
        as one final chunk (full attention, finalize=True) once no full hop is left.
        """
        if self.done:
            return None
        hop = self._this_hop()
        if available - self.offset >= hop + self.lookahead:
            chunk = Hop(end=self.offset + hop + self.lookahead, offset=self.offset, finalize=False, index=self.index)
            self.offset += hop
            self.index += 1
            self.schedule.grow()
            return chunk
        if finished:
            self.done = True
            return Hop(end=available, offset=self.offset, finalize=True, index=self.index)
        return None


def plan_segment(schedule: HopSchedule, prompt_tokens: int, total_tokens: int, lookahead: int = 3) -> list[Hop]:
    """All chunks of a segment whose tokens are already known (offline replay of the schedule)."""
    planner = SegmentPlanner(schedule, prompt_tokens, lookahead)
    chunks = []
    while (c := planner.next_chunk(total_tokens, finished=True)) is not None:
        chunks.append(c)
    return chunks
