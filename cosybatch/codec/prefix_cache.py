"""Exact prefix reuse for streaming flow hops.

Why it is exact: with the chunk-causal mask (grid from frame 0), the left-only position
convolutions and the fixed per-position CFM noise, a frame in a chunk that was *complete* in
an earlier hop depends only on frames of that hop, whose inputs (mu with its real look-ahead
tokens, prompt cond, noise, speaker) do not change later. So its K/V at every (Euler step,
layer, CFG branch) equal what the official recompute produces at any later hop. A hop then
runs the transformer on the frames from the last complete chunk on; the two causal convs need
``conv_context``-frame left margins at every step, rebuilt from the Euler trajectory kept here.

Storage: K/V live in a few large *slabs* ``[steps, depth, slab_frames, inner]`` so the
varlen kernels read a row's keys in place. Each cached row owns one contiguous region per
CFG branch; regions grow by moving (rarely) and are freed when the request ends. A byte
budget bounds the slabs; a row that does not fit is simply recomputed (the caller's fallback).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowState:
    """What a cached row keeps between hops (one request segment)."""

    regions: list[tuple[int, int]]  # (slab, offset) per CFG branch
    capacity: int  # frames reserved in each region
    tokens: torch.Tensor  # CPU flow tokens [end] the last hop used
    frames: int = 0  # frames of the last hop
    complete: int = 0  # frames in complete chunks = next hop's first transformer frame
    traj: torch.Tensor | None = None  # [steps, n, mel] x at each step's input, frames [traj_start, complete)
    traj_start: int = 0
    finalized: bool = False


class _Slab:
    def __init__(self, shape, dtype, device):
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.free = [(0, shape[2])]  # sorted (start, length) intervals

    def alloc(self, n: int) -> int | None:
        for i, (s, length) in enumerate(self.free):
            if length >= n:
                self.free[i : i + 1] = [(s + n, length - n)] if length > n else []
                return s
        return None

    def release(self, start: int, n: int) -> None:
        self.free.append((start, n))
        self.free.sort()
        merged = []
        for s, length in self.free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((s, length))
        self.free = merged

    def extend(self, start: int, old: int, new: int) -> bool:
        """Grow the region ``[start, start+old)`` in place if the frames after it are free."""
        for i, (s, length) in enumerate(self.free):
            if s == start + old and length >= new - old:
                rest = length - (new - old)
                self.free[i : i + 1] = [(s + new - old, rest)] if rest else []
                return True
        return False


class PrefixCache:
    """K/V arena + per-row state, keyed by (request_id, segment)."""

    def __init__(self, steps: int, depth: int, inner: int, dtype, device, budget_bytes: int, slab_frames: int = 16384, block: int = 64):
        self.shape_head = (steps, depth)
        self.inner = inner
        self.dtype, self.device = dtype, torch.device(device)
        elem = torch.empty(0, dtype=dtype).element_size()
        self.bytes_per_frame = steps * depth * 2 * inner * elem  # K and V, one branch
        self.budget_frames = max(0, int(budget_bytes) // self.bytes_per_frame)
        self.slab_frames = slab_frames
        self.block = block
        self.slabs: dict[int, _Slab] = {}  # id -> slab; an emptied slab is freed
        self._next_slab = 0
        self.rows: dict[tuple, RowState] = {}

    # ------------------------------------------------------------------ memory

    @property
    def allocated_bytes(self) -> int:
        return sum(s.k.shape[2] for s in self.slabs.values()) * self.bytes_per_frame

    def used_frames(self) -> int:
        return sum(s.k.shape[2] - sum(n for _, n in s.free) for s in self.slabs.values())

    def _round(self, n: int) -> int:
        return -(-n // self.block) * self.block

    def _alloc(self, n: int) -> tuple[int, int] | None:
        for i, slab in self.slabs.items():
            start = slab.alloc(n)
            if start is not None:
                return i, start
        have = sum(s.k.shape[2] for s in self.slabs.values())
        size = min(max(self.slab_frames, n), self.budget_frames - have)
        if size < n:
            return None
        try:
            slab = _Slab(self.shape_head + (size, self.inner), self.dtype, self.device)
        except torch.OutOfMemoryError:
            # The budget is a cap, not a promise of free memory: recompute instead of failing.
            return None
        i = self._next_slab
        self._next_slab += 1
        self.slabs[i] = slab
        return i, self.slabs[i].alloc(n)

    def _release(self, slab: int, start: int, n: int) -> None:
        s = self.slabs[slab]
        s.release(start, n)
        if s.free == [(0, s.k.shape[2])]:
            del self.slabs[slab]  # give the memory back once nothing lives there

    def slab_kv(self, slab: int, step: int, layer: int, heads: int):
        s = self.slabs[slab]
        return s.k[step, layer].view(-1, heads, self.inner // heads), s.v[step, layer].view(-1, heads, self.inner // heads)

    # ------------------------------------------------------------------ rows

    def get(self, key) -> RowState | None:
        return self.rows.get(key)

    def reserve(self, key, frames: int, tokens: torch.Tensor) -> RowState | None:
        """Make ``key``'s regions hold ``frames`` frames (allocate, extend or move); None if
        the budget cannot hold them (the row is then dropped and recomputed by the caller)."""
        st = self.rows.get(key)
        if st is not None and frames <= st.capacity:
            return st
        # Headroom for the next hops' growth, so regions rarely move (a move copies only the
        # complete-chunk frames, which is cheap next to a hop's compute).
        want = self._round(frames + frames // 4 + self.block)
        if st is None:
            regions = []
            for _ in range(2):
                r = self._alloc(want)
                if r is None:
                    for slab, off in regions:
                        self._release(slab, off, want)
                    return None
                regions.append(r)
            st = RowState(regions=regions, capacity=want, tokens=tokens)
            self.rows[key] = st
            return st
        # Grow each branch in place if possible, else move it; on failure drop the row.
        sizes = [st.capacity] * len(st.regions)
        new_regions = list(st.regions)
        for b, (slab, off) in enumerate(st.regions):
            if self.slabs[slab].extend(off, st.capacity, want):
                sizes[b] = want
                continue
            r = self._alloc(want)
            if r is None:
                for bb in range(b):
                    if new_regions[bb] != st.regions[bb]:
                        self._release(new_regions[bb][0], new_regions[bb][1], want)
                        sizes[bb] = st.capacity
                for bb, (s2, o2) in enumerate(st.regions):
                    self._release(s2, o2, sizes[bb])
                del self.rows[key]
                return None
            new_regions[b] = r
        for b, ((slab, off), (ns, no)) in enumerate(zip(st.regions, new_regions)):
            if (slab, off) == (ns, no):
                continue
            n = st.complete
            if n:
                self.slabs[ns].k[:, :, no : no + n] = self.slabs[slab].k[:, :, off : off + n]
                self.slabs[ns].v[:, :, no : no + n] = self.slabs[slab].v[:, :, off : off + n]
            self._release(slab, off, st.capacity)
        st.regions = new_regions
        st.capacity = want
        return st

    def _free_row(self, st: RowState) -> None:
        for slab, off in st.regions:
            self._release(slab, off, st.capacity)

    def drop(self, key) -> None:
        st = self.rows.pop(key, None)
        if st is not None:
            self._free_row(st)

    def release(self, request_id) -> None:
        for key in [k for k in self.rows if k[0] == request_id]:
            self.drop(key)

    def clear(self) -> None:
        for key in list(self.rows):
            self.drop(key)
