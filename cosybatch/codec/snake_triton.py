"""The Triton kernel of ``cosybatch.codec.snake`` (imported only on CUDA)."""

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
