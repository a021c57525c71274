"""Ragged layout of one packed flow call (pure index bookkeeping, no model math).

A call solves many *jobs* (one request's hop, or a whole response) at once; each job is two
*rows*, its conditional and unconditional CFG branch (branch 0 = conditional). Frames are
absolute positions within the row (prompt frames first), so rotary angles, noise and the
attention-chunk grid line up with the official full-sequence computation.

Three layouts of the same tokens are used, and this module maps between them:
- **row layout** ``[branch 0 jobs ‖ branch 1 jobs]``, each job's frames ``[q_start, frames)``
  in order: where the Euler state lives and CFG pairs line up (token i and i + job_tokens).
- **conv layout**: each row as ``conv_context`` zero frames, then frames ``[conv_start, frames)``.
  The zeros are the convolutions' left padding and keep rows from leaking into each other;
  the frames before ``q_start`` are the left margin a cached hop recomputes for the convs.
- **attention layout**: tokens grouped by launch (key tensor, then chunk index within the
  hop), so each launch's queries are one contiguous slice (see ``attention.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cosybatch.codec.attention import Launch

SELF, SCRATCH, POOL = "self", "scratch", "pool"


@dataclass(frozen=True)
class RowSpec:
    """Frame ranges of one job (both CFG rows share them)."""

    frames: int  # frames this hop sees (prompt + generated so far)
    q_start: int  # first frame run through the transformer
    conv_start: int  # first frame fed to the position convs (<= q_start)
    chunk: int  # attention chunk in frames; 0 = full attention
    pool: tuple[tuple[int, int], tuple[int, int]] | None = None  # (slab, offset) per branch; None = not cached

    def __post_init__(self):
        if not 0 <= self.conv_start <= self.q_start < self.frames:
            raise ValueError(f"bad row ranges: {self}")
        if self.pool is None and self.q_start != 0:
            raise ValueError("a row without cached keys must start at frame 0")
        if self.chunk == 0 and self.pool is not None:
            raise ValueError("full-attention rows are never cached (their keys change every hop)")
        if self.chunk and self.q_start % self.chunk:
            raise ValueError("a cached prefix must end on the attention-chunk grid")


def subsequences(frames: int, q_start: int, chunk: int) -> list[tuple[int, int, int, int]]:
    """(chunk index within the hop, first query frame, end query frame, visible keys) per piece.

    Chunk-causal: frame i sees frames j < (i // chunk + 1) * chunk, so every query of one
    chunk sees the same key prefix. Full attention is a single piece.
    """
    if chunk <= 0:
        return [(0, q_start, frames, frames)]
    out = []
    first = q_start // chunk
    for c in range(first, (frames - 1) // chunk + 1):
        end = min(frames, (c + 1) * chunk)
        out.append((c - first, max(q_start, c * chunk), end, end))
    return out


@dataclass
class PackedLayout:
    rows: list[RowSpec]
    job_offsets: list[int]  # row-layout start of each job within one branch (+ total)
    launches: list[Launch]
    positions: torch.Tensor  # [tokens] absolute frame of each attention-layout token
    att_to_conv: torch.Tensor  # [tokens] conv index of each attention-layout token
    row_to_att: torch.Tensor  # [tokens] attention index of each row-layout token
    conv_of_row: torch.Tensor  # [tokens] conv index of each row-layout token
    conv_len: int
    conv_valid: torch.Tensor  # [conv_len] 1 at real frames, 0 at padding
    margin_conv: torch.Tensor  # conv index of margin frames, branch-major, then job, then frame
    scratch_frames: int
    scratch_span: tuple[int, int]  # attention-layout range whose K/V go to the scratch buffer
    scratch_slots: torch.Tensor
    pool_writes: list[tuple[int, int, int, torch.Tensor]]  # (slab, att start, att end, slots)

    @property
    def job_tokens(self) -> int:
        return self.job_offsets[-1]

    @property
    def tokens(self) -> int:
        return 2 * self.job_tokens

    def job_slice(self, j: int) -> slice:
        return slice(self.job_offsets[j], self.job_offsets[j + 1])


def _source(row: RowSpec, branch: int) -> tuple:
    if row.pool is not None:
        return (POOL, row.pool[branch][0])
    return (SCRATCH,) if row.chunk else (SELF,)


def _rank(src: tuple) -> tuple:
    return ({SELF: 0, SCRATCH: 1, POOL: 2}[src[0]],) + src[1:]


def pack(rows: list[RowSpec], conv_context: int, device) -> PackedLayout:
    """Lay out ``rows`` (one per job) for one call; ``conv_context`` = frames of conv left padding."""
    job_offsets = [0]
    for r in rows:
        job_offsets.append(job_offsets[-1] + r.frames - r.q_start)
    nj = job_offsets[-1]

    # Conv layout and per-row key bases.
    conv_base, conv_len, margins = {}, 0, []
    valid = []
    scratch_base, scratch_frames = {}, 0
    for b in (0, 1):
        for j, r in enumerate(rows):
            valid.append(torch.zeros(conv_context))
            conv_len += conv_context
            conv_base[b, j] = conv_len
            n = r.frames - r.conv_start
            valid.append(torch.ones(n))
            if r.q_start > r.conv_start:
                margins.append(torch.arange(conv_len, conv_len + r.q_start - r.conv_start))
            conv_len += n
            if r.pool is None and r.chunk:
                scratch_base[b, j] = scratch_frames
                scratch_frames += r.frames

    # Attention layout: every sub-sequence, grouped by (key tensor, chunk index), keys ascending.
    items = []
    for b in (0, 1):
        for j, r in enumerate(rows):
            src = _source(r, b)
            kbase = r.pool[b][1] if r.pool is not None else scratch_base.get((b, j), 0)
            for ci, f0, f1, klen in subsequences(r.frames, r.q_start, r.chunk):
                items.append((_rank(src), ci, kbase, b * len(rows) + j, src, b, j, f0, f1, klen))
    items.sort(key=lambda it: it[:4])

    positions, att_to_conv, row_index = [], [], []
    launches, cur, att = [], None, 0
    scratch_span, scratch_slots = [None, None], []
    pool_spans: dict[int, list] = {}
    for _, ci, kbase, _, src, b, j, f0, f1, klen in items:
        r = rows[j]
        n = f1 - f0
        frames = torch.arange(f0, f1)
        positions.append(frames)
        att_to_conv.append(conv_base[b, j] + frames - r.conv_start)
        row_index.append(b * nj + job_offsets[j] + frames - r.q_start)
        koff = att if src[0] == SELF else kbase
        if src[0] == SCRATCH:
            scratch_span[0] = att if scratch_span[0] is None else scratch_span[0]
            scratch_span[1] = att + n
            scratch_slots.append(kbase + frames)
        elif src[0] == POOL:
            span = pool_spans.setdefault(src[1], [att, att, []])
            span[1] = att + n
            span[2].append(kbase + frames)
        key = (src, ci)
        if cur is None or cur[0] != key:
            cur = [key, att, [], [], []]
            launches.append(cur)
        cur[2].append(n)
        cur[3].append(koff)
        cur[4].append(klen)
        att += n

    lay_launches = [Launch(source=k[0], q_start=s, q_end=s + sum(ql), q_lens=tuple(ql), k_offs=tuple(ko), k_lens=tuple(kl)) for k, s, ql, ko, kl in launches]
    row_index = torch.cat(row_index)
    row_to_att = torch.empty_like(row_index)
    row_to_att[row_index] = torch.arange(row_index.numel())
    conv_of_row = torch.empty_like(row_index)
    conv_of_row[row_index] = torch.cat(att_to_conv)

    def dev(t):
        return t.to(device)

    empty = torch.zeros(0, dtype=torch.long)
    return PackedLayout(
        rows=list(rows),
        job_offsets=job_offsets,
        launches=lay_launches,
        positions=dev(torch.cat(positions)),
        att_to_conv=dev(torch.cat(att_to_conv)),
        row_to_att=dev(row_to_att),
        conv_of_row=dev(conv_of_row),
        conv_len=conv_len,
        conv_valid=dev(torch.cat(valid)),
        margin_conv=dev(torch.cat(margins) if margins else empty),
        scratch_frames=scratch_frames,
        scratch_span=(scratch_span[0] or 0, scratch_span[1] or 0),
        scratch_slots=dev(torch.cat(scratch_slots) if scratch_slots else empty),
        pool_writes=[(slab, a, e, dev(torch.cat(sl))) for slab, (a, e, sl) in sorted(pool_spans.items())],
    )
