"""The codec's Triton kernels (imported only on CUDA): HiFT's Snake + causal pad (with the
bias of the conv before it) and its conv bias + residual add (``cosybatch.codec.snake``), the
flow's head-0 rotary in place (``dit_step.block_pre``), the same with the K/V arena writes
(``rotary_qk_kv_``), the gated residual + modulated LayerNorm (``gated_residual_ln``) and its
grouped causal position convs (``dit_step.ConvPositionEmbed``).

The element-wise kernels evaluate their eager twins' float32 operations in the same order
(multiply-adds only where the eager kernel has one), so that the GPU tests can hold them to the
eager ops bit for bit. The conv sums its taps in another order than cuDNN (so its bf16 outputs
can differ by a rounding step) but rounds where the eager ops round."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter (tests) has no libdevice
    @triton.jit
    def _sin(x):
        return tl.sin(x)

    @triton.jit
    def _mish(y):
        e = tl.exp(-2.0 * tl.log(1.0 + tl.exp(y)))
        return y * (1.0 - e) / (1.0 + e)
else:  # the CUDA math library's functions, as PyTorch's own kernels use
    from triton.language.extra import libdevice

    _sin = libdevice.sin

    @triton.jit
    def _mish(y):  # PyTorch's Mish: x * tanh(log1p(exp(x))) in float32
        return y * libdevice.tanh(libdevice.log1p(libdevice.exp(y)))

BLOCK = 1024


@triton.jit
def snake_of(x, a, inv):
    """Snake, x + inv * sin(x * a)^2, in the eager module's order (inv = 1 / (a + 1e-9))."""
    s = _sin(x * a)
    return x + inv * (s * s)


@triton.jit(do_not_specialize=["T", "T_out", "pad"])  # one compiled kernel for every length
def _snake_pad_kernel(x_ptr, alpha_ptr, inv_ptr, bias_ptr, y_ptr, C, T, T_out, pad, BLOCK: tl.constexpr,
                      HAS_BIAS: tl.constexpr):
    row = tl.program_id(0)  # b * C + c
    c = row % C
    a = tl.load(alpha_ptr + c)
    inv = tl.load(inv_ptr + c)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    src = cols - pad
    inside = (src >= 0) & (cols < T_out)
    x = tl.load(x_ptr + row.to(tl.int64) * T + src, mask=inside, other=0.0)
    if HAS_BIAS:  # the bias of the conv that produced x, added as its own eager add would
        x = x + tl.load(bias_ptr + c)
    y = tl.where(inside, snake_of(x, a, inv), 0.0)
    tl.store(y_ptr + row.to(tl.int64) * T_out + cols, y, mask=cols < T_out)


def snake_pad(x: torch.Tensor, alpha: torch.Tensor, inv: torch.Tensor, pad: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C, T] float32 -> [B, C, pad + T]: zeros, then s + inv * sin(alpha * s)^2 with
    s = x (+ bias [C], when given)."""
    x = x.contiguous()
    B, C, T = x.shape
    y = torch.empty(B, C, T + pad, device=x.device, dtype=x.dtype)
    if y.numel():
        grid = (B * C, triton.cdiv(T + pad, BLOCK))
        # no multiply-add contraction: the eager ops round after each multiply
        _snake_pad_kernel[grid](x, alpha, inv, alpha if bias is None else bias, y, C, T, T + pad, pad, BLOCK=BLOCK,
                                HAS_BIAS=bias is not None, num_warps=4, enable_fp_fusion=False)
    return y


@triton.jit(do_not_specialize=["T"])
def _bias_residual_kernel(y_ptr, bias_ptr, x_ptr, out_ptr, C, T, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # b * C + c
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < T
    off = row.to(tl.int64) * T + cols
    y = tl.load(y_ptr + off, mask=m, other=0.0) + tl.load(bias_ptr + row % C)  # rounded, as the eager bias add
    tl.store(out_ptr + off, y + tl.load(x_ptr + off, mask=m, other=0.0), mask=m)


def bias_residual(y: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(y + bias[None, :, None]) + x for y, x [B, C, T] float32: a conv's deferred bias and the
    residual add after it, one pass instead of two."""
    y, x = y.contiguous(), x.contiguous()
    B, C, T = y.shape
    out = torch.empty_like(y)
    if out.numel():
        _bias_residual_kernel[(B * C, triton.cdiv(T, BLOCK))](y, bias, x, out, C, T, BLOCK=BLOCK, num_warps=4)
    return out


@triton.jit
def _rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, row_stride, inner, cs_stride, rot, ROT: tl.constexpr):
    n = tl.program_id(0)
    c = tl.arange(0, ROT)
    m = c < rot
    cs = tl.load(cos_ptr + n * cs_stride + c, mask=m, other=0.0)
    sn = tl.load(sin_ptr + n * cs_stride + c, mask=m, other=0.0)
    base = qkv_ptr + n.to(tl.int64) * row_stride
    for j in tl.static_range(2):  # q, then k; a row's pair partners are loaded before it is stored
        p = base + j * inner
        x = tl.load(p + c, mask=m, other=0.0).to(tl.float32)
        y = tl.load(p + (c ^ 1), mask=m, other=0.0).to(tl.float32)  # the pair partner
        out = tl.fma(y, sn, x * cs)  # eager: addcmul(x * cos, swapped, sin), one multiply-add
        tl.store(p + c, out.to(qkv_ptr.dtype.element_ty), mask=m)


def rotary_qk_(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """In place on qkv [N, 3, inner]: q's and k's first ``rot`` channels (head 0) rotated, GPT-J
    pairs: out = x * cos + swap(x) * sin_signed, in float32, stored in qkv's dtype."""
    n, _, inner = qkv.shape
    rot = cos.shape[-1]
    if qkv.stride(2) != 1 or qkv.stride(1) != inner or cos.stride(-1) != 1 or sin_signed.stride() != cos.stride():
        raise ValueError("rotary_qk_: unexpected layout")
    if n:
        _rotary_kernel[(n,)](qkv, cos, sin_signed, qkv.stride(0), inner, cos.stride(0), rot,
                             ROT=triton.next_power_of_2(rot), num_warps=1, enable_fp_fusion=False)


@triton.jit(do_not_specialize=["n"])  # one compiled kernel for every token count (n only bounds a mask)
def _rotary_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, rows_ptr, n, row_stride, inner, dst_stride, cs_stride,
                      rot, ROT: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    tok = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = tok < n
    base = qkv_ptr + tok.to(tl.int64)[:, None] * row_stride
    ty = qkv_ptr.dtype.element_ty
    # q's head 0, as _rotary_kernel (the partner loaded before the row is stored)
    c = tl.arange(0, ROT)[None, :]
    r = live[:, None] & (c < rot)
    cs = tl.load(cos_ptr + tok[:, None] * cs_stride + c, mask=r, other=0.0)
    sn = tl.load(sin_ptr + tok[:, None] * cs_stride + c, mask=r, other=0.0)
    x = tl.load(base + c, mask=r, other=0.0).to(tl.float32)
    y = tl.load(base + (c ^ 1), mask=r, other=0.0).to(tl.float32)
    tl.store(base + c, tl.fma(y, sn, x * cs).to(ty), mask=r)
    # k: its whole row is read once (it is copied to the arena); the pair partners of its head-0
    # channels come from that register copy (split into pairs, swapped, joined back), so no
    # channel is re-read from memory after it may have been stored.
    cb = tl.arange(0, BLOCK)[None, :]
    m = live[:, None] & (cb < inner)
    rb = live[:, None] & (cb < rot)
    k = tl.load(base + inner + cb, mask=m, other=0.0)
    kx = k.to(tl.float32)
    a, b = tl.split(tl.reshape(kx, (ROWS, BLOCK // 2, 2)))
    ky = tl.reshape(tl.join(b, a), (ROWS, BLOCK))
    csb = tl.load(cos_ptr + tok[:, None] * cs_stride + cb, mask=rb, other=0.0)
    snb = tl.load(sin_ptr + tok[:, None] * cs_stride + cb, mask=rb, other=0.0)
    k = tl.where(rb, tl.fma(ky, snb, kx * csb).to(ty), k)
    tl.store(base + inner + cb, k, mask=rb)  # the self launch reads k from qkv
    dst = tl.load(rows_ptr + tok, mask=live, other=0).to(tl.int64)[:, None] * dst_stride
    tl.store(k_ptr + dst + cb, k, mask=m)
    tl.store(v_ptr + dst + cb, tl.load(base + 2 * inner + cb, mask=m, other=0.0), mask=m)


def rotary_qk_kv_(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_dst: torch.Tensor,
                  v_dst: torch.Tensor, rows: torch.Tensor, rows_per_program: int | None = None) -> None:
    """``rotary_qk_`` (in place on qkv [N, 3, inner]), and each token's rotated k and its v
    written to row ``rows[n]`` of the K/V arenas ``k_dst``, ``v_dst`` [M, H, Dh]: one kernel
    where the eager form is the rotary and two ``index_copy_`` (the same values stored).
    ``rows_per_program``: tokens per program (by default 1 on a GPU, as the fused LayerNorm; 16
    in the CPU interpreter, whose cost is per program)."""
    n, _, inner = qkv.shape
    rot = cos.shape[-1]
    if qkv.stride(2) != 1 or qkv.stride(1) != inner or cos.stride(-1) != 1 or sin_signed.stride() != cos.stride() \
            or not (k_dst.is_contiguous() and v_dst.is_contiguous()) or k_dst[0].numel() != inner \
            or k_dst.shape != v_dst.shape or k_dst.dtype != qkv.dtype or v_dst.dtype != qkv.dtype or rot % 2:
        raise ValueError("rotary_qk_kv_: unexpected layout")
    per = rows_per_program or (16 if os.environ.get("TRITON_INTERPRET") == "1" else 1)
    if n:
        _rotary_kv_kernel[(triton.cdiv(n, per),)](qkv, cos, sin_signed, k_dst, v_dst, rows, n, qkv.stride(0), inner,
                                                  inner, cos.stride(0), rot, ROT=triton.next_power_of_2(rot),
                                                  BLOCK=max(2, triton.next_power_of_2(inner)), ROWS=per, num_warps=4,
                                                  enable_fp_fusion=False)


@triton.jit(do_not_specialize=["L"])
def _conv_mish_kernel(x_ptr, w_ptr, b_ptr, valid_ptr, res_ptr, y_ptr, L, D, K: tl.constexpr, CG: tl.constexpr,
                      BLOCK_T: tl.constexpr, MASKED: tl.constexpr, RESIDUAL: tl.constexpr, IEEE: tl.constexpr):
    g = tl.program_id(1)  # channel group: one [BLOCK_T, CG] x [CG, CG] product per tap
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, CG)
    col = g * CG + c
    acc = tl.zeros((BLOCK_T, CG), dtype=tl.float32)
    for k in range(K):
        src = t - (K - 1) + k  # causal: frames before 0 are the conv's zero padding
        inside = (src >= 0) & (src < L)
        x = tl.load(x_ptr + src.to(tl.int64)[:, None] * D + col[None, :], mask=inside[:, None], other=0.0)
        w = tl.load(w_ptr + ((g * K + k) * CG + c)[:, None] * CG + c[None, :])  # [in, out] of this tap
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    out_ty = y_ptr.dtype.element_ty
    # Rounded where the eager ops round: the conv's output, the bias add, Mish, the mask / residual.
    y = acc.to(out_ty).to(tl.float32) + tl.load(b_ptr + col).to(tl.float32)[None, :]
    y = y.to(out_ty).to(tl.float32)
    y = _mish(y).to(out_ty)
    rows = t < L
    if MASKED:
        keep = tl.load(valid_ptr + t, mask=rows, other=0.0) != 0
        y = tl.where(keep[:, None], y, 0.0).to(out_ty)
    if RESIDUAL:
        r = tl.load(res_ptr + t.to(tl.int64)[:, None] * D + col[None, :], mask=rows[:, None], other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ty)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * D + col[None, :], y, mask=rows[:, None])


def conv_weight(w: torch.Tensor, groups: int) -> torch.Tensor:
    """A grouped Conv1d weight [D, D / groups, K] as the kernel reads it: [groups, K, in, out]."""
    d, cg, k = w.shape
    return w.reshape(groups, d // groups, cg, k).permute(0, 3, 2, 1).contiguous()


def causal_conv_mish(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, valid: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, block_t: int = 64) -> torch.Tensor:
    """Mish(causal grouped conv1d(x)) over time-major x [L, D], then zeroed where ``valid`` [L]
    is 0, or plus ``residual`` [L, D]; ``w`` from ``conv_weight``. One kernel, where the eager
    form is a pad, cuDNN's per-group kernels, the bias add, Mish and the mask or add."""
    groups, k, cg, _ = w.shape
    n, d = x.shape
    if not x.is_contiguous() or d != groups * cg or (residual is not None and not residual.is_contiguous()):
        raise ValueError("causal_conv_mish: unexpected layout")
    y = torch.empty_like(x)
    if n:
        grid = (triton.cdiv(n, block_t), groups)
        _conv_mish_kernel[grid](x, w, bias, x if valid is None else valid, x if residual is None else residual, y,
                                n, d, K=k, CG=cg, BLOCK_T=block_t, MASKED=valid is not None,
                                RESIDUAL=residual is not None, IEEE=x.dtype == torch.float32, num_warps=4)
    return y


@triton.jit
def _gated_residual_ln_kernel(h_ptr, y_ptr, gate_ptr, w_ptr, b_ptr, h_out_ptr, x_out_ptr, D, eps,
                              BLOCK: tl.constexpr, STORE_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < D
    h = tl.load(h_ptr + row * D + c, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * D + c, mask=m, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + c, mask=m, other=0.0).to(tl.float32)
    # addcmul in float32, rounded to the activations' dtype: LayerNorm reads the rounded residual
    hn = (h + g * y).to(h_out_ptr.dtype.element_ty)
    if STORE_H:
        tl.store(h_out_ptr + row * D + c, hn, mask=m)
    x = hn.to(tl.float32)
    mean = tl.sum(x, 0) / D
    d = tl.where(m, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, 0) / D + eps)
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + c, mask=m, other=0.0).to(tl.float32)
    tl.store(x_out_ptr + row * D + c, (d * rstd * w + b).to(x_out_ptr.dtype.element_ty), mask=m)


def gated_residual_ln(h: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, scale1: torch.Tensor,
                      shift: torch.Tensor, eps: float, keep_h: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(h + gate * y, LayerNorm(h + gate * y) * scale1 + shift) for h, y [N, D] and gate, scale1,
    shift [D]: the DiT's gated residual and the next modulated LayerNorm in one pass, where the
    eager form is addcmul then layer_norm (the residual written, then read back). ``keep_h=False``:
    the residual is not stored (None returned for it), where only the LayerNorm's output is read
    (the last block's, before the final projection)."""
    if not (h.is_contiguous() and y.is_contiguous()) or h.shape != y.shape:
        raise ValueError("gated_residual_ln: unexpected layout")
    n, d = h.shape
    h_out, x_out = torch.empty_like(h) if keep_h else None, torch.empty_like(h)
    if n:
        _gated_residual_ln_kernel[(n,)](h, y, gate, scale1, shift, h_out if keep_h else x_out, x_out, d, eps,
                                        BLOCK=triton.next_power_of_2(d), STORE_H=keep_h, num_warps=4)
    return h_out, x_out
