"""The codec's Triton kernels (imported only on CUDA): HiFT's Snake + causal pad
(``cosybatch.codec.snake``) and the flow's head-0 rotary in place (``dit_step.block_pre``).
Each evaluates its eager twin's float32 operations in the same order (multiply-adds only where
the eager kernel has one), so that the GPU tests can hold them to the eager ops bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # the CUDA math library's sinf, as PyTorch's own sin kernel uses
    from triton.language.extra import libdevice

    _sin = libdevice.sin
except ImportError:  # older Triton
    _sin = tl.sin

BLOCK = 1024


@triton.jit(do_not_specialize=["T", "T_out", "pad"])  # one compiled kernel for every length
def _snake_pad_kernel(x_ptr, alpha_ptr, inv_ptr, y_ptr, C, T, T_out, pad, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # b * C + c
    c = row % C
    a = tl.load(alpha_ptr + c)
    inv = tl.load(inv_ptr + c)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    src = cols - pad
    inside = (src >= 0) & (cols < T_out)
    x = tl.load(x_ptr + row.to(tl.int64) * T + src, mask=inside, other=0.0)
    s = _sin(x * a)
    y = tl.where(inside, x + inv * (s * s), 0.0)
    tl.store(y_ptr + row.to(tl.int64) * T_out + cols, y, mask=cols < T_out)


def snake_pad(x: torch.Tensor, alpha: torch.Tensor, inv: torch.Tensor, pad: int) -> torch.Tensor:
    """x [B, C, T] float32 -> [B, C, pad + T]: zeros, then x + inv * sin(alpha * x)^2."""
    x = x.contiguous()
    B, C, T = x.shape
    y = torch.empty(B, C, T + pad, device=x.device, dtype=x.dtype)
    if y.numel():
        grid = (B * C, triton.cdiv(T + pad, BLOCK))
        # no multiply-add contraction: the eager ops round after each multiply
        _snake_pad_kernel[grid](x, alpha, inv, y, C, T, T + pad, pad, BLOCK=BLOCK, num_warps=4,
                                enable_fp_fusion=False)
    return y


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
