"""Ragged layout of one packed flow call: pure index bookkeeping (numpy), no model math.

A call solves many *jobs* (one segment's hop, or a whole response) at once; each job is two
*rows*, its conditional and unconditional CFG branch. Frames are absolute positions within the
row (prompt frames first), so rotary angles, noise and the attention-chunk grid line up with
the official full-sequence computation (design.md D9).

Two layouts of the same tokens:
- **token layout** ``[branch 0: every job's frames [q_start, frames) ‖ branch 1: the same]``:
  where the Euler state lives, the transformer runs and CFG pairs line up (token i and
  i + stride). Padding for a graph bucket goes at the end of each branch.
- **conv layout**: each row as ``conv_gap`` zero frames, then frames ``[conv_start, frames)``.
  The zeros are the convolutions' left padding and keep rows from leaking into each other;
  frames before ``q_start`` are the left margin a cached hop needs for its convs.

Attention is described as *sub-sequences*: a run of query tokens that all see the same keys.
A chunk of a chunk-causal row sees its row's frames ``[0, chunk_end)``; a full-attention row
sees all its frames. Keys come from one of two places, so there are two launches:
- **pool** (rows whose K/V are cached across hops): keys are read in place from the prefix
  cache's arena, at the row's region;
- **self** (uncached rows): keys are this call's own k/v, at the row's token positions.
Sub-sequences of one launch may read overlapping key ranges (the kernel takes a start and a
used length per sub-sequence), so each launch is one kernel call whatever the chunking.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RowSpec:
    """Frame ranges of one job (both CFG rows share them)."""

    frames: int  # frames this hop sees (prompt + generated so far)
    q_start: int  # first frame run through the transformer
    conv_start: int  # first frame fed to the position convs (<= q_start)
    chunk: int  # attention chunk in frames; 0 = full attention
    pool: tuple[int, int] | None = None  # arena frame offset of the row's K/V region per branch; None = uncached

    def __post_init__(self):
        if not 0 <= self.conv_start <= self.q_start < self.frames:
            raise ValueError(f"bad row ranges: {self}")
        if self.pool is None and self.q_start != 0:
            raise ValueError("a row without cached keys must start at frame 0")
        if self.chunk == 0 and self.pool is not None:
            raise ValueError("full-attention rows are never cached (their keys change every hop)")
        if self.chunk and self.q_start % self.chunk:
            raise ValueError("a cached prefix must end on the attention-chunk grid")


def subsequences(frames: int, q_start: int, chunk: int) -> list[tuple[int, int, int]]:
    """(first query frame, end query frame, visible keys) per piece of one row.

    Chunk-causal: frame i sees frames j < (i // chunk + 1) * chunk, so every query of one
    chunk sees the same key prefix. Full attention is a single piece.
    """
    if chunk <= 0:
        return [(q_start, frames, frames)]
    out = []
    for c in range(q_start // chunk, (frames - 1) // chunk + 1):
        end = min(frames, (c + 1) * chunk)
        out.append((max(q_start, c * chunk), end, end))
    return out


@dataclass(frozen=True)
class SubSeqs:
    """One launch's sub-sequences in token order: queries ``q[q_start : q_start + q_len]`` see
    keys ``k[k_start : k_start + k_len]`` of that launch's key tensor."""

    q_start: np.ndarray
    q_len: np.ndarray
    k_start: np.ndarray
    k_len: np.ndarray

    def __len__(self) -> int:
        return len(self.q_start)

    @property
    def max_q(self) -> int:
        return int(self.q_len.max()) if len(self) else 0

    @property
    def max_k(self) -> int:
        return int(self.k_len.max()) if len(self) else 0

    @property
    def pairs(self) -> int:
        """Query-key pairs the launch computes (for FLOP counts)."""
        return int((self.q_len * self.k_len).sum())


def _subseqs(items: list[tuple[int, int, int, int]]) -> SubSeqs:
    a = np.array(sorted(items), dtype=np.int64).reshape(-1, 4)
    return SubSeqs(a[:, 0], a[:, 1], a[:, 2], a[:, 3])


@dataclass(frozen=True)
class FlowLayout:
    rows: tuple[RowSpec, ...]
    job_offsets: np.ndarray  # [jobs + 1] token offset of each job within one branch
    stride: int  # tokens per branch, padding included (branch 1 starts here)
    conv_len: int  # conv frames, the masked sink frames at the end included
    conv_valid: np.ndarray  # [conv_len] bool: real frames (False at the rows' zero gaps and the sink)
    conv_first: np.ndarray  # [2, jobs] conv index of each row's first frame (its conv_start)
    conv_of_token: np.ndarray  # [2 * stride] conv index of each token; padding points at the sink
    margin_conv: np.ndarray  # [2, margin] conv index of each margin frame, per branch
    positions: np.ndarray  # [2 * stride] absolute frame of each token (0 for padding)
    pool_slots: np.ndarray  # [2 * stride] arena frame of a pool token's K/V, -1 for other tokens
    pool: SubSeqs  # keys: arena frames
    self: SubSeqs  # keys: token indices of this call

    @property
    def job_tokens(self) -> int:
        return int(self.job_offsets[-1])

    @property
    def tokens(self) -> int:
        return 2 * self.stride

    @property
    def margin(self) -> int:
        return self.margin_conv.shape[1]

    def job_slice(self, j: int) -> slice:
        return slice(int(self.job_offsets[j]), int(self.job_offsets[j + 1]))


def conv_frames(rows: list[RowSpec], conv_gap: int) -> int:
    """Conv-layout frames ``rows`` need (both branches, gaps included, no sink)."""
    return 2 * sum(conv_gap + r.frames - r.conv_start for r in rows)


def pack(rows: list[RowSpec], conv_gap: int, stride: int | None = None, conv_len: int | None = None,
         margin: int | None = None) -> FlowLayout:
    """Lay out ``rows`` (one per job) for one call; ``conv_gap`` = frames of conv left padding.

    ``stride``, ``conv_len`` and ``margin`` pad the layout to a graph bucket's sizes: padded
    tokens and margin entries point at a masked sink frame past the real conv frames, so
    nothing they compute reaches a real row.
    """
    q_lens = np.array([r.frames - r.q_start for r in rows], dtype=np.int64)
    job_offsets = np.concatenate(([0], np.cumsum(q_lens)))
    nj = int(job_offsets[-1])
    real_conv = conv_frames(rows, conv_gap)
    stride = nj if stride is None else stride
    conv_len = real_conv + 1 if conv_len is None else conv_len
    if stride < nj or conv_len <= real_conv:
        raise ValueError(f"bucket too small: {stride} < {nj} tokens or {conv_len} <= {real_conv} conv frames")
    sink = real_conv
    conv_of_token = np.full(2 * stride, sink, dtype=np.int64)
    positions = np.zeros(2 * stride, dtype=np.int64)
    pool_slots = np.full(2 * stride, -1, dtype=np.int64)
    valid = np.zeros(conv_len, dtype=bool)
    conv_first = np.zeros((2, len(rows)), dtype=np.int64)
    margins: list[list[np.ndarray]] = [[], []]
    pool_items, self_items = [], []
    conv = 0
    for b in (0, 1):
        for j, r in enumerate(rows):
            conv += conv_gap
            conv_first[b, j] = conv
            valid[conv : conv + r.frames - r.conv_start] = True
            first = conv + r.q_start - r.conv_start  # conv index of the row's first token
            margins[b].append(np.arange(conv, first))
            t0 = b * stride + int(job_offsets[j])  # token index of the row's first token
            span = slice(t0, t0 + int(q_lens[j]))
            conv_of_token[span] = np.arange(first, first + q_lens[j])
            positions[span] = np.arange(r.q_start, r.frames)
            if r.pool is not None:
                pool_slots[span] = r.pool[b] + positions[span]
            for f0, f1, keys in subsequences(r.frames, r.q_start, r.chunk):
                q0 = t0 + f0 - r.q_start
                if r.pool is not None:
                    pool_items.append((q0, f1 - f0, r.pool[b], keys))
                else:  # uncached rows start at frame 0, so the row's keys begin at its first token
                    self_items.append((q0, f1 - f0, t0, keys))
            conv += r.frames - r.conv_start
    margin_conv = np.stack([np.concatenate(m) if m else np.zeros(0, np.int64) for m in margins])
    if margin is not None:
        if margin < margin_conv.shape[1]:
            raise ValueError(f"bucket too small: {margin_conv.shape[1]} margin frames > {margin}")
        margin_conv = np.pad(margin_conv, ((0, 0), (0, margin - margin_conv.shape[1])), constant_values=sink)
    return FlowLayout(rows=tuple(rows), job_offsets=job_offsets, stride=stride, conv_len=conv_len,
                      conv_valid=valid, conv_first=conv_first, conv_of_token=conv_of_token, margin_conv=margin_conv.astype(np.int64),
                      positions=positions, pool_slots=pool_slots, pool=_subseqs(pool_items),
                      self=_subseqs(self_items))


def varlen_offsets(seqs: SubSeqs, n_tokens: int, n_seqs: int, key_base: int = 0) -> tuple[np.ndarray, ...]:
    """(cu_q [n_seqs + 1], k_start [n_seqs + 1], k_used [n_seqs]) int32 for a varlen kernel that
    takes a key start and a used key count per sequence.

    Token runs that belong to no sub-sequence of this launch (the other launch's tokens, padding)
    become sequences with no keys, whose output the kernel writes as zeros; the list is then
    padded to ``n_seqs`` with empty sequences so a graph's arrays keep their size. Key starts
    are relative to ``key_base``.
    """
    cu_q, k_start, k_used = [0], [], []
    pos = 0
    for q0, ql, k0, kl in zip(seqs.q_start, seqs.q_len, seqs.k_start, seqs.k_len):
        if q0 < pos:
            raise ValueError("sub-sequences overlap")
        if q0 > pos:  # a gap: the other launch's tokens
            cu_q.append(int(q0))
            k_start.append(key_base)
            k_used.append(0)
        cu_q.append(int(q0 + ql))
        k_start.append(key_base + int(k0))
        k_used.append(int(kl))
        pos = int(q0 + ql)
    if pos < n_tokens:
        cu_q.append(n_tokens)
        k_start.append(key_base)
        k_used.append(0)
    if pos > n_tokens or len(k_used) > n_seqs:
        raise ValueError(f"{len(k_used)} sequences over {n_tokens} tokens do not fit {n_seqs} slots")
    pad = n_seqs - len(k_used)
    cu_q += [n_tokens] * pad
    k_start += [key_base] * (pad + 1)
    k_used += [0] * pad
    i32 = np.int32
    return np.array(cu_q, i32), np.array(k_start, i32), np.array(k_used, i32)
