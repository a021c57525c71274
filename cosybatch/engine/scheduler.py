"""Admission and row bookkeeping: FIFO waiting queue, at most max_num_seqs running, KV blocks
reserved whole at admission, running sequences kept compact in rows 0..n-1.

Each engine step is either a prefill of newly admitted sequences (preferred, so new requests
start as soon as a row and their blocks are free) or one decode step of every running row.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cosybatch.engine.kv_cache import BlockAllocator
from cosybatch.engine.request import Sequence, SeqStatus, blocks_for


@dataclass
class StepPlan:
    kind: str  # "prefill" | "decode"
    seqs: list[Sequence]


class Scheduler:
    def __init__(self, max_num_seqs: int, allocator: BlockAllocator, block_size: int,
                 max_prefill_tokens: int):
        self.max_num_seqs = max_num_seqs
        self.allocator = allocator
        self.block_size = block_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i].row == i

    def blocks_needed(self, seq: Sequence) -> int:
        return blocks_for(seq.max_total_len, self.block_size)

    def fits_ever(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq) <= self.allocator.capacity

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """Would ``schedule`` admit the head of the queue now?"""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        return self.blocks_needed(self.waiting[0]) <= self.allocator.num_free

    def schedule(self) -> StepPlan | None:
        admitted: list[Sequence] = []
        tokens = 0
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
