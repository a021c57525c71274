"""Exact prefix reuse for streaming flow hops (design.md D9).

Why it is exact: with the chunk-causal mask (grid from frame 0), the left-only position
convolutions and the fixed per-position CFM noise, a frame in a chunk that was *complete* in
an earlier hop depends only on frames of that hop, whose inputs (mu with its real look-ahead
tokens, prompt cond, noise, speaker) do not change later. So its K/V at every (Euler step,
layer, CFG branch) equal what the official recompute produces at any later hop. A hop then
runs the transformer on the frames from the last complete chunk on; the two causal convs need
``conv_context``-frame left margins at every step, rebuilt from the Euler trajectory kept here.

Storage: one *arena* per K and V, ``[steps, depth, frames + 1, inner]``. Viewed flat as
``[steps * depth * (frames + 1), heads, dh]``,
the slot of (step, layer) starts at ``(step * depth + layer) * (frames + 1)``, so the attention
kernel reads a row's keys in place from any slot with one offset. Each cached segment owns one
contiguous region of frames per CFG branch (the same frames in every slot); regions grow in
place or move (rarely), and are freed when the segment ends. The last frame of every slot is
a dump that uncached tokens write into. The arena starts small and doubles when a region
does not fit, up to a byte budget (and the GPU's free memory); each growth bumps ``version``,
because a captured graph holds the old address. A segment that does not fit is simply
recomputed (the caller's fallback).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Hashable

import torch

log = logging.getLogger(__name__)

# Kept free when the arena grows into the GPU's free memory: activations, graphs, HiFT.
_RESERVE_BYTES = 16 << 30
_FIRST_FRAMES = 4096


@dataclass
class PrefixEntry:
    """What a cached segment keeps between hops."""

    regions: list[int]  # arena frame offset per CFG branch
    capacity: int  # frames reserved in each region
    tokens: torch.Tensor  # CPU flow tokens [end] the last hop used
    frames: int = 0  # frames of the last hop
    complete: int = 0  # frames in complete chunks = next hop's first transformer frame
    traj: torch.Tensor | None = None  # [steps, n, mel] x at each step's input, frames [traj_start, complete)
    traj_start: int = 0
    finalized: bool = False


class _FreeList:
    """First-fit allocator of frame ranges in ``[0, size)``."""

    def __init__(self, size: int):
        self.free = [(0, size)] if size > 0 else []  # sorted (start, length)

    def alloc(self, n: int) -> int | None:
        for i, (s, length) in enumerate(self.free):
            if length >= n:
                self.free[i : i + 1] = [(s + n, length - n)] if length > n else []
                return s
        return None

    def release(self, start: int, n: int) -> None:
        merged: list[tuple[int, int]] = []
        for s, length in sorted(self.free + [(start, n)]):
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((s, length))
        self.free = merged

    def extend(self, start: int, old: int, new: int) -> bool:
        """Grow ``[start, start + old)`` in place if the frames after it are free."""
        for i, (s, length) in enumerate(self.free):
            if s == start + old and length >= new - old:
                rest = length - (new - old)
                self.free[i : i + 1] = [(s + new - old, rest)] if rest else []
                return True
        return False

    def used(self, size: int) -> int:
        return size - sum(n for _, n in self.free)


class PrefixCache:
    """The K/V arena and the per-segment entries, keyed by segment id."""

    def __init__(self, steps: int, depth: int, heads: int, inner: int, dtype, device, budget_bytes: int,
                 block: int = 64):
        self.steps, self.depth, self.heads, self.inner = steps, depth, heads, inner
        self.dtype, self.device = dtype, torch.device(device)
        elem = torch.empty(0, dtype=dtype).element_size()
        self.bytes_per_frame = steps * depth * 2 * inner * elem  # K and V of one frame, one branch
        self.budget_frames = max(0, int(budget_bytes) // self.bytes_per_frame)
        self.block = block
        self.k: torch.Tensor | None = None  # flat [steps * depth * slot, heads, dh]
        self.v: torch.Tensor | None = None
        self.frames = 0  # usable frames per slot (the dump frame excluded)
        self.version = 0  # bumped whenever the arena moves
        self.first_frames = _FIRST_FRAMES
        self._free = _FreeList(0)
        self.rows: dict[Hashable, PrefixEntry] = {}

    # ------------------------------------------------------------------ the arena

    @property
    def enabled(self) -> bool:
        return self.budget_frames > 0

    @property
    def slot(self) -> int:
        """Frames between consecutive (step, layer) slots of the flat arena."""
        return self.frames + 1

    @property
    def dump(self) -> int:
        """The frame (within a slot) that tokens without a region write their K/V into."""
        return self.frames

    @property
    def allocated_bytes(self) -> int:
        return self.slot * self.bytes_per_frame if self.k is not None else 0

    def used_frames(self) -> int:
        return self._free.used(self.frames)

    def ensure_arena(self) -> bool:
        """Allocate the arena if there is none yet; False if there is no budget or no memory."""
        if self.k is None and self.enabled:
            self._grow(min(self.budget_frames, self.first_frames))
        return self.k is not None

    def _grow(self, want: int) -> bool:
        """Move the arena into one of ``want`` frames per slot (bounded by the budget and, on CUDA,
        by free memory); False if it cannot grow."""
        want = min(want, self.budget_frames) // self.block * self.block
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            want = min(want, self.frames + max(0, free - _RESERVE_BYTES) // self.bytes_per_frame // self.block * self.block)
        if want <= self.frames:
            return False
        shape = (self.steps * self.depth * (want + 1), self.heads, self.inner // self.heads)
        try:
            k = torch.empty(shape, dtype=self.dtype, device=self.device)
            v = torch.empty(shape, dtype=self.dtype, device=self.device)
        except (torch.OutOfMemoryError, RuntimeError):
            # The budget is a cap, not a promise of free memory: recompute instead of failing.
            log.warning("flow prefix cache: no memory to grow the arena to %d frames; hops that do not fit "
                        "recompute their prefix", want)
            self.budget_frames = self.frames
            return False
        if self.k is not None:
            old_k, old_v = self._slots()
            new_k, new_v = (t.view(self.steps, self.depth, want + 1, self.inner) for t in (k, v))
            new_k[:, :, : self.frames] = old_k[:, :, : self.frames]
            new_v[:, :, : self.frames] = old_v[:, :, : self.frames]
        self._free.release(self.frames, want - self.frames)
        self.k, self.v, self.frames = k, v, want
        self.version += 1
        log.info("flow prefix cache: %d frames per slot (%.1f GiB)", want, self.allocated_bytes / (1 << 30))
        return True

    def _alloc(self, n: int, grow: bool = True) -> int | None:
        while (off := self._free.alloc(n)) is None:
            if not grow or not self._grow(max(2 * self.frames, self.frames + n)):
                return None
        return off

    def _slots(self) -> torch.Tensor:
        return self.k.view(self.steps, self.depth, self.slot, self.inner), self.v.view(self.steps, self.depth, self.slot, self.inner)

    # ------------------------------------------------------------------ entries

    def get(self, key) -> PrefixEntry | None:
        return self.rows.get(key)

    def _round(self, n: int) -> int:
        return -(-n // self.block) * self.block

    def reserve(self, key, frames: int, tokens: torch.Tensor, grow: bool = True) -> PrefixEntry | None:
        """Make ``key``'s regions hold ``frames`` frames (allocate, extend or move); None if the
        arena cannot hold them (the entry is then dropped and the caller recomputes). ``grow``
        False: nor without moving the arena (a solve part-way through holds its address)."""
        if self.k is None and not grow:
            return None
        if not self.ensure_arena():
            return None
        st = self.rows.get(key)
        if st is not None and frames <= st.capacity:
            return st
        # Headroom for the next hops' growth, so regions rarely move (a move copies only the
        # complete-chunk frames, which is cheap next to a hop's compute).
        want = self._round(frames + frames // 4 + self.block)
        if st is None:
            regions = []
            for _ in range(2):
                r = self._alloc(want, grow)
                if r is None:
                    for off in regions:
                        self._free.release(off, want)
                    return None
                regions.append(r)
            st = PrefixEntry(regions=regions, capacity=want, tokens=tokens)
            self.rows[key] = st
            return st
        new_regions = []
        for b, off in enumerate(st.regions):
            if self._free.extend(off, st.capacity, want):
                new_regions.append(off)
                continue
            r = self._alloc(want, grow)
            if r is None:  # undo this call's growth, then drop the entry
                for old, new in zip(st.regions, new_regions):
                    if new == old:  # grown in place: give back the extension
                        self._free.release(old + st.capacity, want - st.capacity)
                    else:  # moved: give back the new region
                        self._free.release(new, want)
                for old in st.regions:
                    self._free.release(old, st.capacity)
                del self.rows[key]
                return None
            new_regions.append(r)
        ks, vs = self._slots()
        n = st.complete
        for old, new in zip(st.regions, new_regions):
            if old == new:
                continue
            if n:
                ks[:, :, new : new + n] = ks[:, :, old : old + n]
                vs[:, :, new : new + n] = vs[:, :, old : old + n]
            self._free.release(old, st.capacity)
        st.regions, st.capacity = new_regions, want
        return st

    def drop(self, key) -> None:
        st = self.rows.pop(key, None)
        if st is not None:
            for off in st.regions:
                self._free.release(off, st.capacity)

    def clear(self) -> None:
        for key in list(self.rows):
            self.drop(key)
