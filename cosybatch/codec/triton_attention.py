"""Chunk-causal attention over packed sub-sequences as one Triton kernel (``codec.attention=triton``).

Why a kernel of our own: a streaming hop's sub-sequences are attention chunks of 50 queries,
and FlashAttention's 128-query tiles are then 39 % full (85 TFLOP/s of useful work measured on
the H200 for a 64-row hop, docs/performance.md). Here a launch is cut into *query tiles* of
``BLOCK_M`` consecutive tokens, on the host, once per call (``prepare``):

- not merged: one tile run per sub-sequence (a 50-query chunk fills 78 % of a 64-row tile);
- merged: consecutive sub-sequences that read keys from the same start (the chunks of one
  chunk-causal row) share tiles, each query row masked to its own key count. A row's two new
  chunks are then one 128-row tile that loads the row's keys once.

A tile is (first token, rows, key start, fewest and most keys of its rows); each query row's key
count comes from a per-token table. One program per (head, tile) runs FlashAttention's online
softmax in float32: the key blocks every row of the tile sees go unmasked, only the rest are
masked per row. Keys and values are read in place at the tile's key start, which ``layer_keys``
moves by each layer's arena offset (the same contract as the varlen backends).

For CUDA graphs the tile table is padded to a count the graph bucket fixes (tiles with no rows
exit at once, and come last so that they never delay real work); real tiles are ordered by
decreasing key count so that the longest programs start first. Tokens outside the launch's
sub-sequences are zeros: the output starts zeroed (one memset, a few microseconds), or, with
``fill``, extra programs of the same launch write the zeros (no memset kernel).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
import triton
import triton.language as tl

from cosybatch.gpu.hostcopy import h2d
from cosybatch.codec.packing import SubSeqs

LOG2E = 1.4426950408889634


@triton.jit
def _attn_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, start, cols, klim, kmax, sk, sv, qk_scale,
                MASKED: tl.constexpr, IEEE: tl.constexpr):
    """One key block of the online softmax (logits in base 2: ``qk_scale`` includes log2 e)."""
    if MASKED:
        inside = (start + cols) < kmax
        k = tl.load(k_ptrs + start * sk, mask=inside[None, :], other=0.0)
        v = tl.load(v_ptrs + start * sv, mask=inside[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs + start * sk)
        v = tl.load(v_ptrs + start * sv)
    if IEEE:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * qk_scale
    if MASKED:  # each query row sees its own sub-sequence's keys only
        s = tl.where((start + cols)[None, :] < klim[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["n_tiles", "n_tok"])
def _chunk_attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tiles_ptr, keys_ptr, klen_ptr, fill_a_ptr, fill_b_ptr,
                       k2_ptr, v2_ptr, src_ptr, sq, sqh, sk, skh, sv, svh, sk2, skh2, sv2, svh2, so, soh, qk_scale,
                       n_tiles, n_tok, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       IEEE: tl.constexpr, INTERPRETED: tl.constexpr, FILL: tl.constexpr, TWO: tl.constexpr):
    h = tl.program_id(0)
    t = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rd = tl.arange(0, D)
    if FILL > 0:
        if t >= n_tiles:  # a zero-fill program: BLOCK_M tokens no launch gives a key are zeros
            tok = ((t - n_tiles) * BLOCK_M + rm).to(tl.int64)
            empty = (tok < n_tok) & (tl.load(fill_a_ptr + tok, mask=tok < n_tok, other=1) == 0)
            if FILL > 1:
                empty = empty & (tl.load(fill_b_ptr + tok, mask=tok < n_tok, other=1) == 0)
            zero = tl.zeros([BLOCK_M, D], dtype=o_ptr.dtype.element_ty)
            tl.store(o_ptr + tok[:, None] * so + h * soh + rd[None, :], zero, mask=empty[:, None])
            return
    rows = tl.load(tiles_ptr + t * 4 + 1)
    if rows == 0:  # padding of a graph bucket
        return
    q0 = tl.load(tiles_ptr + t * 4)
    kmin = tl.load(tiles_ptr + t * 4 + 2)
    kmax = tl.load(tiles_ptr + t * 4 + 3)
    k0 = tl.load(keys_ptr + t).to(tl.int64)  # int64: arena slots reach past 2^31 elements
    if TWO:  # tiles of two launches in one: this tile's keys from the second K/V where src says so
        second = tl.load(src_ptr + t) != 0
        k_ptr = tl.where(second, k2_ptr, k_ptr)
        v_ptr = tl.where(second, v2_ptr, v_ptr)
        sk = tl.where(second, sk2, sk)
        skh = tl.where(second, skh2, skh)
        sv = tl.where(second, sv2, sv)
        svh = tl.where(second, svh2, svh)
    cols = tl.arange(0, BLOCK_N)
    live = rm < rows
    tok = (q0 + rm).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * sq + h * sqh + rd[None, :], mask=live[:, None], other=0.0)
    # Rows past the tile's end take the most keys, so that no row is all -inf (no NaN).
    klim = tl.where(live, tl.load(klen_ptr + q0 + rm, mask=live, other=0), kmax)
    key = k0 + cols
    k_ptrs = k_ptr + key[None, :] * sk + h * skh + rd[:, None]  # [D, BLOCK_N]: K transposed
    v_ptrs = v_ptr + key[:, None] * sv + h * svh + rd[None, :]  # [BLOCK_N, D]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    shared = (kmin // BLOCK_N) * BLOCK_N  # blocks every row sees in full: no mask
    if INTERPRETED:  # the CPU interpreter (NumPy 2) cannot take a loaded scalar as a range() bound
        start = 0
        while start < kmax:
            if start < shared:
                acc, m_i, l_i = _attn_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, start, cols, klim, kmax, sk, sv,
                                            qk_scale, MASKED=False, IEEE=IEEE)
            else:
                acc, m_i, l_i = _attn_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, start, cols, klim, kmax, sk, sv,
                                            qk_scale, MASKED=True, IEEE=IEEE)
            start += BLOCK_N
    else:  # for loops, which the compiler software-pipelines (num_stages)
        for start in range(0, shared, BLOCK_N):
            acc, m_i, l_i = _attn_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, start, cols, klim, kmax, sk, sv, qk_scale,
                                        MASKED=False, IEEE=IEEE)
        for start in range(shared, kmax, BLOCK_N):
            acc, m_i, l_i = _attn_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, start, cols, klim, kmax, sk, sv, qk_scale,
                                        MASKED=True, IEEE=IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a sub-sequence without keys gives zeros
    tl.store(o_ptr + tok[:, None] * so + h * soh + rd[None, :], out.to(o_ptr.dtype.element_ty), mask=live[:, None])


def tile_table(seqs: SubSeqs, block_m: int, merge: bool) -> tuple[np.ndarray, np.ndarray]:
    """(tiles [T, 4] = (first token, rows, fewest keys, most keys), key start per tile [T]) for
    the real sub-sequences of ``seqs``.

    ``merge``: runs of adjacent sub-sequences with one key start share tiles."""
    keep = seqs.q_len > 0
    q0s, qls, k0s, kls = (a[keep].astype(np.int64) for a in (seqs.q_start, seqs.q_len, seqs.k_start, seqs.k_len))
    order = np.argsort(q0s, kind="stable")
    q0s, qls, k0s, kls = q0s[order], qls[order], k0s[order], kls[order]
    runs: list[list[int]] = []
    for i in range(len(q0s)):
        if merge and runs and k0s[i] == k0s[runs[-1][-1]] and q0s[i] == q0s[runs[-1][-1]] + qls[runs[-1][-1]]:
            runs[-1].append(i)
        else:
            runs.append([i])
    tiles, starts = [], []
    for run in runs:
        first, end = int(q0s[run[0]]), int(q0s[run[-1]] + qls[run[-1]])
        klen_tok = np.concatenate([np.full(int(qls[i]), kls[i]) for i in run])
        for a in range(first, end, block_m):
            part = klen_tok[a - first : min(end, a + block_m) - first]
            tiles.append((a, len(part), int(part.min()), int(part.max())))
            starts.append(int(k0s[run[0]]))
    t = np.array(tiles, dtype=np.int64).reshape(-1, 4)
    s = np.array(starts, dtype=np.int64)
    # Longest first: the last programs to start are the short ones (a shorter tail).
    by_work = np.argsort(-t[:, 3], kind="stable")
    return t[by_work], s[by_work]


def max_tiles(n_seqs: int, max_q: int, n_tokens: int, block_m: int) -> int:
    """Most tiles a launch of at most ``n_seqs`` sub-sequences of at most ``max_q`` queries over
    ``n_tokens`` tokens can need: each run of sub-sequences gives at most len / block_m + 1
    tiles, and no sub-sequence more than cdiv(max_q, block_m)."""
    return max(1, min(n_seqs * triton.cdiv(max_q, block_m), triton.cdiv(n_tokens, block_m) + n_seqs))


def key_counts(seqs: SubSeqs, n_tokens: int) -> np.ndarray:
    """[n_tokens] int32: keys each query token sees (0 outside the sub-sequences)."""
    out = np.zeros(n_tokens, dtype=np.int32)
    for q0, ql, kl in zip(seqs.q_start, seqs.q_len, seqs.k_len):
        out[q0 : q0 + ql] = kl
    return out


def _padded(t: np.ndarray, columns: tuple, n_tiles: int | None) -> tuple[np.ndarray, list[np.ndarray]]:
    """The tile table [T, 4] and its per-tile columns as int32, padded with empty tiles (zeros) to
    ``n_tiles`` (at least one tile; the real count when None)."""
    n = len(t) if n_tiles is None else n_tiles
    if len(t) > n:
        raise ValueError(f"{len(t)} query tiles do not fit the launch's {n}")
    tiles = np.zeros((max(n, 1), 4), dtype=np.int32)
    tiles[: len(t)] = t
    out = []
    for c in columns:
        col = np.zeros(max(n, 1), dtype=np.int32)
        col[: len(c)] = c
        out.append(col)
    return tiles, out


def prepare_tile_pair(first: SubSeqs, second: SubSeqs, n_tokens: int, device, block_m: int, merge: bool,
                      n_tiles: int | None = None):
    """``prepare_tiles`` for two launches over disjoint tokens run as one (``chunk_attention``'s
    ``k2``/``v2``/``src``): their tiles together, longest first, ``src`` [T] int32 1 for the
    second's (keys from the second K/V), ``shift`` [T] int32 1 for the first's (the tiles a layer
    offset moves, ``TritonBackend.layer_keys``), one ``k_len`` for both."""
    (t1, s1), (t2, s2) = tile_table(first, block_m, merge), tile_table(second, block_m, merge)
    t, st = np.concatenate((t1, t2)), np.concatenate((s1, s2))
    src = np.concatenate((np.zeros(len(t1), np.int32), np.ones(len(t2), np.int32)))
    by_work = np.argsort(-t[:, 3], kind="stable")
    tiles, (starts, srcs) = _padded(t[by_work], (st[by_work], src[by_work]), n_tiles)
    klen = key_counts(first, n_tokens) + key_counts(second, n_tokens)
    dev = lambda a: h2d(torch.from_numpy(a), device=device)  # noqa: E731
    return {"tiles": dev(tiles), "k_start": dev(starts), "k_len": dev(klen), "src": dev(srcs),
            "shift": dev(np.ascontiguousarray(1 - srcs))}


def prepare_tiles(seqs: SubSeqs, n_tokens: int, device, block_m: int, merge: bool, n_tiles: int | None = None):
    """Device tensors of one launch: ``tiles`` [T, 4] int32, ``k_start`` [T] int32, ``k_len``
    [n_tokens] int32; T = ``n_tiles`` (padded with empty tiles) or the real count."""
    t, s = tile_table(seqs, block_m, merge)
    tiles, (starts,) = _padded(t, (s,), n_tiles)
    return {"tiles": h2d(torch.from_numpy(tiles), device=device), "k_start": h2d(torch.from_numpy(starts), device=device),
            "k_len": h2d(torch.from_numpy(key_counts(seqs, n_tokens)), device=device)}


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: torch.Tensor, k_start: torch.Tensor,
                    k_len: torch.Tensor, block_m: int, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                    scale: float | None = None, out: torch.Tensor | None = None,
                    fill: tuple[torch.Tensor, ...] | None = None, k2: torch.Tensor | None = None,
                    v2: torch.Tensor | None = None, src: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D], k/v [M, H, D] (any token and head strides, unit channel stride) -> [N, H, D]
    in q's dtype: the attention of every tile's rows over its keys, zeros elsewhere.

    ``out`` [N, H, D] (unit channel stride): written in place, only at the tiles' rows (so two
    launches over disjoint tokens can share it) and at the zeros of ``fill``. ``fill``: one or two
    per-token key-count tables ([N] ints, e.g. this launch's and another's ``k_len``); the tokens
    with no key in any of them are written as zeros by ``cdiv(N, block_m)`` extra programs of the
    same launch, which replaces the zero fill of a fresh output (a kernel of its own). Without
    ``out`` and ``fill`` the output is zero-filled first. ``src`` [T] (with ``k2``, ``v2``): the
    tiles where it is non-zero read their keys from ``k2``/``v2`` (two launches in one,
    ``prepare_tile_pair``)."""
    n, heads, d = q.shape
    if (src is None) != (k2 is None) or (k2 is None) != (v2 is None):
        raise ValueError("chunk_attention: src, k2 and v2 go together")
    k2, v2 = (k, v) if k2 is None else (k2, v2)
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or k2.stride(2) != 1 or v2.stride(2) != 1 \
            or d & (d - 1) or d < 16:
        raise ValueError("chunk_attention: unit channel stride and a power-of-two head size >= 16 needed")
    if fill is not None and not 1 <= len(fill) <= 2:
        raise ValueError("chunk_attention: fill takes one or two key-count tables")
    if out is None:
        out = (torch.empty if fill else torch.zeros)(n, heads, d, device=q.device, dtype=q.dtype)
    elif out.shape != q.shape or out.stride(2) != 1 or out.dtype != q.dtype:
        raise ValueError("chunk_attention: out must be shaped and typed as q, with unit channel stride")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    fills = tuple(fill or ())
    if n:
        n_tiles = tiles.shape[0]
        grid = (heads, n_tiles + (triton.cdiv(n, block_m) if fills else 0))
        fa = fills[0] if fills else k_len
        fb = fills[-1] if fills else k_len
        _chunk_attn_kernel[grid](q, k, v, out, tiles, k_start, k_len, fa, fb, k2, v2, k_start if src is None else src,
                                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                 k2.stride(0), k2.stride(1), v2.stride(0), v2.stride(1), out.stride(0), out.stride(1),
                                 scale * LOG2E, n_tiles, n, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
                                 IEEE=q.dtype == torch.float32, INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1",
                                 FILL=len(fills), TWO=src is not None, num_warps=num_warps, num_stages=num_stages)
    return out
