"""Admission and row bookkeeping: FIFO waiting queue, at most max_num_seqs running, KV blocks
reserved whole at admission, running sequences kept compact in rows 0..n-1.

Each engine step is either a prefill of newly admitted sequences (preferred, so new requests
start as soon as a row and their blocks are free) or one decode step of every running row; with
``mixed`` (design.md D33) a prefill while rows decode is one step of both ("mixed").

Prefill batching (``prefill_min_rows`` > 1, design.md D29): while rows decode and more
sequences wait than rows are free, a free row waits, up to ``prefill_wait_s`` from the moment
one could first be admitted, until ``prefill_min_rows`` are free to prefill together. A prefill
of one prompt costs the AR stream about one decode step of every running row, and under a
backlog rows free up one at a time, so unbatched the prefills come one sequence each. Without
a backlog (no more requests than rows) nothing is held: the rows would not fill anyway.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from cosybatch.engine.kv_cache import BlockAllocator
from cosybatch.engine.request import Sequence, SeqStatus, blocks_for


@dataclass
class StepPlan:
    kind: str  # "prefill" | "decode" | "mixed"
    seqs: list[Sequence]  # prefill, mixed: the admitted sequences; decode: the running ones
    decode: list[Sequence] = field(default_factory=list)  # mixed: the rows decoding beside them (rows 0..)


class Scheduler:
    def __init__(self, max_num_seqs: int, allocator: BlockAllocator, block_size: int,
                 max_prefill_tokens: int, prefill_min_rows: int = 1, prefill_wait_s: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter):
        self.max_num_seqs = max_num_seqs
        self.allocator = allocator
        self.block_size = block_size
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_min_rows = prefill_min_rows
        self.prefill_wait_s = prefill_wait_s
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i].row == i
        self.mixed = False  # a prefill while rows decode rides along their decode step (set by the engine)
        self._held_since: float | None = None  # when a possible prefill was first held back

    def blocks_needed(self, seq: Sequence) -> int:
        return blocks_for(seq.max_total_len, self.block_size)

    def fits_ever(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq) <= self.allocator.capacity

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """Would ``schedule`` admit the head of the queue now (prefill batching included)?"""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        if self.blocks_needed(self.waiting[0]) > self.allocator.num_free:
            return False
        return self._prefill_now()

    def _prefill_now(self) -> bool:
        """Prefill batching (module docstring): prefill now if no row decodes, or no more
        sequences wait than rows are free (no backlog: holding a row would only delay them), or
        enough rows are free, or the first that could have gone has waited long enough."""
        free = self.max_num_seqs - len(self.running)
        if (self.prefill_min_rows <= 1 or not self.running or len(self.waiting) <= free
                or free >= self.prefill_min_rows):
            return True
        now = self.clock()
        if self._held_since is None:
            self._held_since = now
        return now - self._held_since >= self.prefill_wait_s

    def schedule(self) -> StepPlan | None:
        admitted: list[Sequence] = []
        tokens = 0
        if self.waiting and not self.can_admit():
            return StepPlan("decode", list(self.running)) if self.running else None
        self._held_since = None
        decoding = list(self.running)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if admitted and tokens + seq.prompt_len > self.max_prefill_tokens:
                break
            blocks = self.allocator.allocate(self.blocks_needed(seq))
            if blocks is None:
                break  # head-of-line waits for blocks: keeps admission order = arrival order
            self.waiting.popleft()
            seq.blocks = blocks
            seq.row = len(self.running)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            tokens += seq.prompt_len
        if admitted:
            if self.mixed and decoding:
                return StepPlan("mixed", admitted, decoding)
            return StepPlan("prefill", admitted)
        if self.running:
            return StepPlan("decode", list(self.running))
        return None

    def unadmit(self, seqs: list[Sequence]) -> None:
        """Undo the admission of ``seqs`` (the newest running rows, in admission order): they go
        back to the head of the queue in the same order, their blocks are freed."""
        for seq in reversed(seqs):
            assert self.running and self.running[-1] is seq, "only the newest admissions can be undone"
            self.running.pop()
            self.allocator.free(seq.blocks)
            seq.blocks = []
            seq.row = -1
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> tuple[int, int] | None:
        """Release seq's blocks and row. Returns (src, dst) if the last row moved into its hole."""
        row = seq.row
        last = self.running.pop()
        self.allocator.free(seq.blocks)
        seq.blocks = []
        seq.row = -1
        seq.status = SeqStatus.FINISHED
        if last is seq:
            return None
        self.running[row] = last
        src = last.row
        last.row = row
        return src, row
