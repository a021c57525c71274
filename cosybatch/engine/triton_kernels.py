"""Triton kernels of the packed (GPU) forward. Every kernel is batch invariant by construction:
a row's result is computed by one program with a fixed tile shape and a fixed reduction order,
so it cannot change with the number of rows, their order or their neighbours.

* ``matmul``: y = x @ w.T (+ bias), the reduction fixed per phase (decode / prefill) and per
  weight shape, never per M (the decode phase widens BN for many rows, which moves no bit); no
  split-K, so each output element sums K in the same order every time.
* ``rmsnorm`` / ``add_rmsnorm``: one program per row (HF Qwen2 semantics: the residual sum is
  rounded to the activation dtype, the norm is taken in float32, the gain applied after casting).
* ``rope_cache``: RoPE on q/k of one token, k and v written into their paged-cache slot.
* ``paged_attention``: one program per (query token, kv head); the GQA group of query heads is
  one tile; keys are visited block by block in position order with an online softmax.
* ``silu_mul``: silu(gate) * up (``matmul(silu_pairs=True)`` does it in the gate/up GEMM's
  epilogue, from weights stored as (gate, up) row pairs, with the same bits).
* ``uniforms``: the sampler's counter-based random numbers (``engine.rng``) for every row and
  draw in one launch, with the same int64 operations: integer-exact, so the same bits as the
  185 small tensor ops of the torch form.
* ``sampler_scores``: ``SamplerState.sample`` before its sort (repetition penalty, temperature,
  early-stop masks, the fixed-point probabilities), one program per row, with the float32
  operations its ~30 tensor ops perform: IEEE division (``div_rn``, not Triton's approximate
  ``/``) and the CUDA math library's ``expf`` (libdevice, what PyTorch's ``exp`` runs).
* ``sampler_draw``: ``SamplerState.sample`` after its sort, one program per row, with the same
  integer and float64 steps as its ~50 tensor ops.
* ``rope_paged_attention``: a decode step's ``rope_cache`` and ``paged_attention`` in one launch
  (one token per row: each (token, kv head) program ropes its own query group and key, writes
  the key and value into the cache, then attends). The same operations in the same order, so
  the same bits, one launch fewer per layer (design.md D30).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter (tests) has no libdevice
    @triton.jit
    def _expf(x):
        return tl.exp(x)
else:  # the CUDA math library's expf, which PyTorch's exp kernel runs (tl.exp is ex2.approx)
    from triton.language.extra import libdevice

    _expf = libdevice.exp


def _prec(dtype):
    import torch

    # float32 runs (parity checks) must not silently drop to tf32; other dtypes take the default
    return "ieee" if dtype == torch.float32 else None


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


# ------------------------------------------------------------------------------------------ matmul


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   PREC: tl.constexpr, SILU_PAIRS: tl.constexpr = False):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_PAIRS:
        # w's rows are (gate, up) pairs: y[:, j] = silu(gate_j) * up_j, with silu_mul's arithmetic
        # on the values the GEMM would have stored (rounded to y's dtype), so the same bits
        g, u = tl.split(tl.reshape(acc.to(y_ptr.dtype.element_ty).to(tl.float32), (BM, BN // 2, 2)))
        rj = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        tl.store(y_ptr + rm[:, None] * stride_ym + rj[None, :], (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & (rj < N // 2)[None, :])
    else:
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


# From this many rows (tokens) a decode-phase matmul runs on 64x128 tiles instead of narrow N
# ones: a mixed step or a prefill on the decode phase's tiles (design.md D33) with hundreds of
# prompt tokens. The crossover of the measured whole-forward times (H200, full-size LM, bf16):
# 256 tokens 1.48 ms narrow against 1.76 wide, 640 tokens 2.98 against 2.44, 2560 11.3 against 8.8.
WIDE_DECODE_ROWS = 384


def matmul_tiles(phase: str, n: int, k: int, elem_bytes: int = 2, m: int = 0) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages). A row's bits depend on BK, the MMA shape and the
    order of the K loop, which are functions of the phase, the weight shape and the dtype only,
    never of M: that is what makes a row's bits independent of the batch. The decode phase widens
    BN (and the pipeline's depth) for ``m`` >= ``WIDE_DECODE_ROWS`` rows: each output element is
    still one dot product over K in BK-wide chunks on the same 64-row MMA, only more columns per
    program, so no bit moves (on an H200 the logits of 256-2560-token prefills on 64x128 and on
    128x128 tiles at BK 128 equal the narrow tiles' bit for bit; ``tests/test_engine_gpu.py``
    checks rows of 1 to 700)."""
    wide = elem_bytes >= 4  # float32 tiles take twice the shared memory
    if phase == "prefill":
        return 128, 128, 64, 8, 2 if wide else 3
    if m >= WIDE_DECODE_ROWS and not wide:
        return 64, 128, 128, 4, 3
    # decode: weight-streaming bound; narrow N tiles give more programs for the small projections
    bn = 64 if n >= 4096 else 32
    return 64, bn, 128, 4, 2 if wide else 4


def matmul(x, w, bias=None, out_dtype=None, phase: str = "decode", silu_pairs: bool = False):
    """y = x @ w.T (+ bias); ``silu_pairs``: w's rows are interleaved (gate, up) pairs
    (``gate_up_pairs``) and y = silu(gate) * up, [M, N/2], the bits of ``silu_mul`` applied to
    the GEMM of the [gate | up] weight (one launch instead of two)."""
    import torch

    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n // 2 if silu_pairs else n, dtype=out_dtype or x.dtype, device=x.device)
    bm, bn, bk, warps, stages = matmul_tiles(phase, n, k, x.element_size(), m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _matmul_kernel[grid](x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), w.stride(0),
                         y.stride(0), HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk,
                         PREC=_prec(x.dtype), SILU_PAIRS=silu_pairs, num_warps=warps, num_stages=stages)
    return y


def gate_up_pairs(gate, up):
    """[I, H] gate and up weights -> [2I, H] rows (gate_0, up_0, gate_1, up_1, ...): every GEMM
    tile then holds whole pairs (``matmul(silu_pairs=True)``)."""
    import torch

    return torch.stack([gate, up], 1).reshape(2 * gate.shape[0], gate.shape[1])


# ------------------------------------------------------------------------------------------ norms


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, H, eps, stride_x, stride_r, stride_o,
                    stride_ro, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        s = x + tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        s = s.to(r_out_ptr.dtype.element_ty)
        tl.store(r_out_ptr + row * stride_ro + cols, s, mask=ok)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / H
    y = (x * (1.0 / tl.sqrt(var + eps))).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


def rmsnorm(x, w, eps: float):
    import torch

    out = torch.empty_like(x)
    h = x.shape[1]
    _rmsnorm_kernel[(x.shape[0],)](x, x, w, out, out, h, eps, x.stride(0), x.stride(0), out.stride(0),
                                   out.stride(0), HAS_RES=False, BLOCK=_pow2(h))
    return out


def add_rmsnorm(x, res, w, eps: float):
    """-> (rmsnorm(x + res) * w, x + res)."""
    import torch

    out = torch.empty_like(x)
    new_res = torch.empty_like(res)
    h = x.shape[1]
    _rmsnorm_kernel[(x.shape[0],)](x, res, w, out, new_res, h, eps, x.stride(0), res.stride(0),
                                   out.stride(0), new_res.stride(0), HAS_RES=True, BLOCK=_pow2(h))
    return out, new_res


# ------------------------------------------------------------------------------------------ rope + cache


@triton.jit
def _rope_heads(src, dst, heads, h_ok, stride_dh, cos_ptr, sin_ptr, pos, stride_cs, D: tl.constexpr,
                HALF: tl.constexpr, HALF_P: tl.constexpr):
    """Rotate-half RoPE at position ``pos`` of one token's heads ``heads`` (D values each from
    ``src``) into ``dst`` (head h at dst + h * stride_dh): float32 arithmetic, rounded to dst's dtype."""
    j = tl.arange(0, HALF_P)
    j_ok = j < HALF
    c = tl.load(cos_ptr + pos * stride_cs + j, mask=j_ok, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_cs + j, mask=j_ok, other=0.0)[None, :]
    m = h_ok[:, None] & j_ok[None, :]
    a = tl.load(src + heads[:, None] * D + j[None, :], mask=m, other=0.0).to(tl.float32)
    b = tl.load(src + heads[:, None] * D + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
    out = dst + heads[:, None] * stride_dh + j[None, :]
    tl.store(out, (a * c - b * s).to(dst.dtype.element_ty), mask=m)
    tl.store(out + HALF, (b * c + a * s).to(dst.dtype.element_ty), mask=m)


@triton.jit
def _rope_cache_kernel(qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr,
                       stride_qkv, stride_q, stride_cs, stride_slot,
                       HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HQ_P: tl.constexpr,
                       HKV_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, D_P: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    row = qkv_ptr + t * stride_qkv
    hq = tl.arange(0, HQ_P)
    _rope_heads(row, q_ptr + t * stride_q, hq, hq < HQ, D, cos_ptr, sin_ptr, pos, stride_cs, D, HALF, HALF_P)
    hk = tl.arange(0, HKV_P)
    _rope_heads(row + HQ * D, kc_ptr + slot * stride_slot, hk, hk < HKV, D, cos_ptr, sin_ptr, pos, stride_cs,
                D, HALF, HALF_P)
    d = tl.arange(0, D_P)
    mv = (hk < HKV)[:, None] & (d < D)[None, :]
    v = tl.load(row + (HQ + HKV) * D + hk[:, None] * D + d[None, :], mask=mv, other=0.0)
    tl.store(vc_ptr + slot * stride_slot + hk[:, None] * D + d[None, :], v.to(vc_ptr.dtype.element_ty), mask=mv)


def rope_cache(qkv, pos, slots, cos, sin, k_slots, v_slots, hq: int, hkv: int, d: int):
    """qkv [T, (hq+2hkv)*d]; pos/slots [T]; cos/sin [max_pos, d/2] float32; k_slots/v_slots
    [num_slots, hkv, d]. Returns roped q [T, hq, d]; writes roped k and v into their slots."""
    import torch

    t = qkv.shape[0]
    q = torch.empty(t, hq, d, dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(t,)](qkv, pos, slots, cos, sin, q, k_slots, v_slots, qkv.stride(0), q.stride(0),
                             cos.stride(0), k_slots.stride(0), HQ=hq, HKV=hkv, D=d, HQ_P=_pow2(hq, 2),
                             HKV_P=_pow2(hkv, 2), HALF=d // 2, HALF_P=_pow2(d // 2, 2), D_P=_pow2(d, 2))
    return q


# ------------------------------------------------------------------------------------------ attention


@triton.jit
def _attend(q_ptr, kc_ptr, vc_ptr, bt_ptr, out_ptr, t, row, pos, kvh, scale, stride_qt, stride_qh, stride_kb,
            stride_ks, stride_kh, stride_bt, stride_ot, GROUP: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr,
            D_P: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr):
    """Token t's query group of kv head ``kvh`` (read from q) against keys 0..pos of its row, block
    by block in position order with an online softmax, written to out."""
    g = tl.arange(0, G_P)
    d = tl.arange(0, D_P)
    g_ok = g < GROUP
    d_ok = d < D
    qh = kvh * GROUP + g
    q = tl.load(q_ptr + t * stride_qt + qh[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([G_P], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P], tl.float32)
    acc = tl.zeros([G_P, D_P], tl.float32)
    n = tl.arange(0, BS)
    for b in range(0, pos // BS + 1):
        blk = tl.load(bt_ptr + row * stride_bt + b).to(tl.int64)
        off = blk * stride_kb + n[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        k = tl.load(kc_ptr + off, mask=d_ok[None, :], other=0.0)
        v = tl.load(vc_ptr + off, mask=d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        s = tl.where((b * BS + n)[None, :] <= pos, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + t * stride_ot + qh[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _paged_attn_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, row_ptr, pos_ptr, out_ptr, scale,
                       stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot,
                       GROUP: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
                       BS: tl.constexpr, PREC: tl.constexpr):
    t = tl.program_id(0)
    _attend(q_ptr, kc_ptr, vc_ptr, bt_ptr, out_ptr, t, tl.load(row_ptr + t), tl.load(pos_ptr + t), tl.program_id(1),
            scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, GROUP, G_P, D, D_P,
            BS, PREC)


@triton.jit
def _rope_paged_attn_kernel(qkv_ptr, slot_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, bt_ptr, row_ptr, pos_ptr,
                            out_ptr, scale, stride_qkv, stride_cs, stride_qt, stride_qh, stride_kb, stride_ks,
                            stride_kh, stride_bt, stride_ot, HQ: tl.constexpr, GROUP: tl.constexpr,
                            G_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, HALF: tl.constexpr,
                            HALF_P: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # rope_cache's arithmetic for this program's query group and key, stored where the separate
    # kernels store them: the key and value into this token's cache slot, the query into q
    src = qkv_ptr + t * stride_qkv
    g = tl.arange(0, G_P)
    _rope_heads(src, q_ptr + t * stride_qt, kvh * GROUP + g, g < GROUP, stride_qh, cos_ptr, sin_ptr, pos, stride_cs,
                D, HALF, HALF_P)
    # the key into the slot, addressed through the block layout the attention reads
    blk = (slot // BS) * stride_kb + (slot % BS) * stride_ks
    kv = kvh + tl.zeros([1], tl.int32)
    _rope_heads(src + HQ * D, kc_ptr + blk, kv, kv == kvh, stride_kh, cos_ptr, sin_ptr, pos, stride_cs, D, HALF,
                HALF_P)
    dst = blk + kvh * stride_kh
    d = tl.arange(0, D_P)
    d_ok = d < D
    v = tl.load(src + (HQ + (HQ // GROUP)) * D + kvh * D + d, mask=d_ok, other=0.0)
    tl.store(vc_ptr + dst + d, v.to(vc_ptr.dtype.element_ty), mask=d_ok)
    # every thread of the program sees the stores above before reading them back
    tl.debug_barrier()
    # paged_attention's work, unchanged
    _attend(q_ptr, kc_ptr, vc_ptr, bt_ptr, out_ptr, t, tl.load(row_ptr + t), pos, kvh, scale, stride_qt, stride_qh,
            stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, GROUP, G_P, D, D_P, BS, PREC)


def rope_paged_attention(qkv, pos, slots, cos, sin, k_cache, v_cache, block_tables, tok_rows, scale: float,
                         hq: int, hkv: int, d: int):
    """``rope_cache`` then ``paged_attention`` for tokens that are each their row's only query
    (a decode step): the same results, bit for bit, from one launch. qkv [T, (hq+2hkv)*d];
    k/v_cache [num_blocks, bs, hkv, d] (written at ``slots``) -> [T, hq*d]."""
    import torch

    t = qkv.shape[0]
    bs = k_cache.shape[1]
    group = hq // hkv
    q = torch.empty(t, hq, d, dtype=qkv.dtype, device=qkv.device)  # scratch: the program reads back its group
    out = torch.empty(t, hq * d, dtype=qkv.dtype, device=qkv.device)
    _rope_paged_attn_kernel[(t, hkv)](qkv, slots, cos, sin, q, k_cache, v_cache, block_tables, tok_rows, pos, out,
                                      scale, qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1),
                                      k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                      block_tables.stride(0), out.stride(0), HQ=hq, GROUP=group,
                                      G_P=_pow2(group, 16), D=d, D_P=_pow2(d, 16), HALF=d // 2,
                                      HALF_P=_pow2(d // 2, 2), BS=bs, PREC=_prec(qkv.dtype), num_warps=4)
    return out


def paged_attention(q, k_cache, v_cache, block_tables, tok_rows, pos, scale: float):
    """q [T, hq, d]; k/v_cache [num_blocks, bs, hkv, d]; block_tables [R, max_blocks] int32;
    tok_rows/pos [T]: each query token attends to keys 0..pos of its row. -> [T, hq*d]."""
    import torch

    t, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    out = torch.empty(t, hq * d, dtype=q.dtype, device=q.device)
    _paged_attn_kernel[(t, hkv)](q, k_cache, v_cache, block_tables, tok_rows, pos, out, scale,
                                 q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                                 k_cache.stride(2), block_tables.stride(0), out.stride(0),
                                 GROUP=group, G_P=_pow2(group, 16), D=d, D_P=_pow2(d, 16), BS=bs,
                                 PREC=_prec(q.dtype), num_warps=4)
    return out


# ------------------------------------------------------------------------------------------ mlp


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, stride_gu, stride_o, BLOCK: tl.constexpr, PAIRS: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    if PAIRS:
        g = tl.load(gu_ptr + row * stride_gu + 2 * cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + 2 * cols + 1, mask=ok, other=0.0).to(tl.float32)
    else:
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + I + cols, mask=ok, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gu, pairs: bool = False):
    """gu [T, 2I] (gate | up; ``pairs``: (gate, up) column pairs) -> silu(gate) * up [T, I]."""
    import torch

    t, two_i = gu.shape
    i = two_i // 2
    out = torch.empty(t, i, dtype=gu.dtype, device=gu.device)
    block = min(1024, _pow2(i))
    _silu_mul_kernel[(t, triton.cdiv(i, block))](gu, out, i, gu.stride(0), out.stride(0), BLOCK=block, PAIRS=pairs)
    return out


# ------------------------------------------------------------------------------------------ rng


@triton.jit
def _mix(x, C1: tl.constexpr, C2: tl.constexpr, M32: tl.constexpr):
    # engine.rng._mix, the same int64 operations (values < 2**32, products < 2**62)
    x = x ^ (x >> 16)
    x = (x * C1) & M32
    x = x ^ (x >> 16)
    x = (x * C2) & M32
    x = x ^ (x >> 16)
    x = (x * C1) & M32
    return x ^ (x >> 15)


@triton.jit
def _hash32(lo, hi, step, draw: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, M32: tl.constexpr,
            GOLD: tl.constexpr, SALT: tl.constexpr):
    # engine.rng.hash32, its draw's word (engine.rng.draw_salt) folded at compile time
    h = _mix((step & M32) ^ ((draw * GOLD + SALT) & M32), C1, C2, M32)
    h = _mix(h ^ hi, C1, C2, M32)
    return _mix(((h + GOLD) & M32) ^ lo, C1, C2, M32)


# n only bounds a mask: unspecialised, a row count of another divisibility class is no new
# variant (one per BLOCK, all of which a run's launch list holds; else one compiled in the run)
@triton.jit(do_not_specialize=["n"])
def _uniforms_kernel(lo_ptr, hi_ptr, step_ptr, out_ptr, n, DRAWS: tl.constexpr, BLOCK: tl.constexpr,
                     C1: tl.constexpr, C2: tl.constexpr, M32: tl.constexpr, GOLD: tl.constexpr, SALT: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    lo = tl.load(lo_ptr + i, mask=ok, other=0)
    hi = tl.load(hi_ptr + i, mask=ok, other=0)
    step = tl.load(step_ptr + i, mask=ok, other=0)
    for d in tl.static_range(DRAWS):
        a = _hash32(lo, hi, step, 2 * d, C1, C2, M32, GOLD, SALT) >> 5  # 27 bits
        b = _hash32(lo, hi, step, 2 * d + 1, C1, C2, M32, GOLD, SALT) >> 6  # 26 bits
        v = ((a << 26) + b).to(tl.float64) * 1.1102230246251565e-16  # 2**-53
        tl.store(out_ptr + i * DRAWS + d, v, mask=ok)


def uniforms(seed_lo, seed_hi, step, draws: int):
    """``engine.rng.uniforms`` in one launch: [n] int64 each -> [n, draws] float64."""
    import torch

    from cosybatch.engine import rng

    n = step.shape[0]
    out = torch.empty(n, draws, dtype=torch.float64, device=step.device)
    block = min(1024, _pow2(n, 16))
    _uniforms_kernel[(triton.cdiv(n, block),)](seed_lo.contiguous(), seed_hi.contiguous(), step.contiguous(),
                                               out, n, DRAWS=draws, BLOCK=block, C1=rng._C1, C2=rng._C2,
                                               M32=rng._M32, GOLD=rng._GOLD, SALT=rng._SALT)
    return out


# ------------------------------------------------------------------------------------------ scores


@triton.jit
def _scores_kernel(logit_ptr, p_ptr, seen_ptr, ngen_ptr, scores_ptr, q_ptr, VP, STOP_START, V, SOS,
                   stride_l, stride_p, stride_s, stride_o, IS_RAS: tl.constexpr, PENALTY: tl.constexpr,
                   TEMPERATURE: tl.constexpr, MIN_LEN: tl.constexpr, MASK_ALL_EARLY: tl.constexpr,
                   FORCE: tl.constexpr, FIXED_ONE: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    col = tl.arange(0, BLOCK)
    ok = col < VP
    prm = p_ptr + r * stride_p
    x = tl.load(logit_ptr + r * stride_l + col, mask=ok, other=float("-inf"))
    # standard-mode transforms (no-ops for RAS rows: penalty 1, temperature 1)
    pen = tl.load(prm + PENALTY).to(tl.float32)
    penalized = tl.where(x > 0, tl.math.div_rn(x, pen), x * pen)
    seen = tl.load(seen_ptr + r * stride_s + col, mask=ok, other=0) != 0
    standard = tl.load(prm + IS_RAS) <= 0
    scores = tl.where(seen, tl.where(standard, penalized, x), x)
    scores = tl.math.div_rn(scores, tl.load(prm + TEMPERATURE).to(tl.float32))
    early = tl.load(ngen_ptr + r) < tl.load(prm + MIN_LEN).to(tl.int64)
    mask_all = (early & (tl.load(prm + MASK_ALL_EARLY) > 0)) | (tl.load(prm + FORCE) > 0)
    sos_only = early & (mask_all == 0)
    kill = (mask_all & (col >= STOP_START) & (col < V)) | (sos_only & (col == SOS))
    scores = tl.where(kill, float("-inf"), scores)
    # fixed-point probabilities (unnormalised; the max id gets exactly FIXED_ONE)
    e = _expf(scores - tl.max(scores, axis=0))
    q = tl.floor(e * FIXED_ONE).to(tl.int64)
    tl.store(scores_ptr + r * stride_o + col, scores, mask=ok)
    tl.store(q_ptr + r * stride_o + col, q, mask=ok)


def sampler_scores(logits, params, seen, n_gen, columns: dict, stop_start: int, vocab: int, sos: int,
                   fixed_one: float):
    """``SamplerState.sample`` before its sort, one program per row: logits [n, Vp] float32
    (padding columns -inf), params [n, len(columns)] float64, seen [n, Vp] bool, n_gen [n] ->
    (scores [n, Vp] float32, q [n, Vp] int64 = floor(exp(score - max) * fixed_one))."""
    import torch

    n, vp = logits.shape
    scores = torch.empty(n, vp, dtype=torch.float32, device=logits.device)
    q = torch.empty(n, vp, dtype=torch.int64, device=logits.device)
    _scores_kernel[(n,)](logits, params, seen, n_gen, scores, q, vp, stop_start, vocab, sos,
                         logits.stride(0), params.stride(0), seen.stride(0), scores.stride(0),
                         IS_RAS=columns["is_ras"], PENALTY=columns["penalty"], TEMPERATURE=columns["temperature"],
                         MIN_LEN=columns["min_len"], MASK_ALL_EARLY=columns["mask_all_early"],
                         FORCE=columns["force"], FIXED_ONE=fixed_one, BLOCK=_pow2(vp), num_warps=16)
    return scores, q


# ------------------------------------------------------------------------------------------ draw


@triton.jit
def _draw_kernel(order_ptr, q_ptr, p_ptr, u_ptr, hist_ptr, ngen_ptr, out_ptr, V, VP, H,
                 stride_o, stride_q, stride_p, stride_h, IS_RAS: tl.constexpr, TOP_K: tl.constexpr,
                 TOP_P: tl.constexpr, REP: tl.constexpr, WIN: tl.constexpr, BLOCK: tl.constexpr,
                 HBLOCK: tl.constexpr):
    r = tl.program_id(0)
    col = tl.arange(0, BLOCK)
    ok = col < VP
    prm = p_ptr + r * stride_p
    # the nucleus walk over the stable descending order (int64 sums: exact in any order)
    order = tl.load(order_ptr + r * stride_o + col, mask=ok, other=0)
    qs = tl.load(q_ptr + r * stride_q + order, mask=ok, other=0)
    incl = tl.cumsum(qs, axis=0)
    excl = incl - qs
    total = tl.sum(qs, axis=0)
    k = tl.load(prm + TOP_K).to(tl.int64)
    top_p = tl.load(prm + TOP_P)
    kept = (((col < k) & (excl.to(tl.float64) < top_p * total.to(tl.float64))) | (col == 0)) & ok
    n_kept = tl.sum(kept.to(tl.int64), axis=0)
    kept_total = tl.sum(tl.where(col == n_kept - 1, incl, 0), axis=0)
    t1 = tl.floor(tl.load(u_ptr + 2 * r) * kept_total.to(tl.float64)).to(tl.int64)
    r1 = tl.minimum(tl.sum(((incl <= t1) & kept).to(tl.int64), axis=0), n_kept - 1)
    tok1 = tl.sum(tl.where(col == r1, order, 0), axis=0)
    # RAS: repeated within the window -> redraw from the full distribution without it
    ng = tl.load(ngen_ptr + r)
    win = tl.load(prm + WIN).to(tl.int64)
    hc = tl.arange(0, HBLOCK)
    hist = tl.load(hist_ptr + r * stride_h + hc, mask=hc < H, other=0)
    in_win = (hc >= ng - win) & (hc < ng) & (hc < H)
    rep = tl.sum(((hist == tok1) & in_win).to(tl.int64), axis=0)
    hit = (tl.load(prm + IS_RAS) > 0) & (rep.to(tl.float64) >= tl.load(prm + REP))
    q2 = tl.where(col == tok1, 0, tl.load(q_ptr + r * stride_q + col, mask=ok, other=0))
    incl2 = tl.cumsum(q2, axis=0)
    total2 = tl.sum(q2, axis=0)
    t2 = tl.floor(tl.load(u_ptr + 2 * r + 1) * total2.to(tl.float64)).to(tl.int64)
    tok2 = tl.sum(((incl2 <= t2) & ok).to(tl.int64), axis=0)
    # nothing else has any mass left: the runner-up, as the official multinomial would pick
    tok2 = tl.where(total2 > 0, tok2, tl.sum(tl.where(col == 1, order, 0), axis=0))
    tok2 = tl.minimum(tok2, V - 1)
    tl.store(out_ptr + r, tl.where(hit, tok2, tok1))


def sampler_draw(order, q, params, u, history, n_gen, vocab: int, columns: dict):
    """``SamplerState.sample`` after its sort, one program per row: order/q [n, Vp] int64, params
    [n, len(columns)] float64 (columns: name -> index), u [n, 2] float64, history [n, H] int64,
    n_gen [n] -> ids [n] int64."""
    import torch

    n, vp = q.shape
    out = torch.empty(n, dtype=torch.long, device=q.device)
    h = history.shape[1]
    _draw_kernel[(n,)](order, q, params, u.contiguous(), history, n_gen, out, vocab, vp, h,
                       order.stride(0), q.stride(0), params.stride(0), history.stride(0),
                       IS_RAS=columns["is_ras"], TOP_K=columns["top_k"], TOP_P=columns["top_p"],
                       REP=columns["rep_threshold"], WIN=columns["win_size"], BLOCK=_pow2(vp), HBLOCK=_pow2(h), num_warps=16)
    return out
