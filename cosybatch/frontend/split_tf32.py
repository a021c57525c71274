"""Float32 matmuls at tensor-core speed: each product as three TF32 products ("3xTF32").

A TF32 tensor core reads 10 of a float32's 23 mantissa bits. Split each operand into a high
part that TF32 holds exactly (the float32 with its low 13 mantissa bits cleared) and the rest:
``a = a_hi + a_lo`` exactly, ``|a_lo| <= 2**-10 |a|``. Then

    a @ b = a_hi @ b_hi + a_hi @ b_lo + a_lo @ b_hi + a_lo @ b_lo,

and TF32 GEMMs with float32 accumulation keep the first three terms. What is lost: the
dropped term (at most 2**-20 of |a||b|, typically ~2**-22) and TF32's reading of the two small
parts (~2**-21 of them): a few bits short of float32's 2**-24 per operation, against 2**-11
for a single TF32 GEMM, which flips speech-tokenizer codes (measured: 99.35 % of positions
kept, docs/performance.md). Strict float32 GEMMs run on the CUDA cores at ~1/7 of the TF32
tensor cores' rate.

Only the GEMMs inside :class:`SplitTF32Linear` run on TF32 (``runtime.float32_math`` turns
the switch on around them and restores it), so every other float32 op of the caller keeps its
precision. On a CPU there is no TF32: the three products are plain float32 and equal
``F.linear`` to rounding.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from cosybatch.gpu.runtime import float32_math, triton_available

_HIGH_BITS = -(1 << 13)  # int32 0xFFFFE000: sign, exponent and the top 10 mantissa bits


def tf32_high(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) with the 13 low mantissa bits cleared: exactly representable in TF32."""
    return (x.contiguous().view(torch.int32) & _HIGH_BITS).view(torch.float32)


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (high, low) with high + low == x exactly (float32)."""
    hi = tf32_high(x)
    return hi, x - hi


@functools.cache
def _fused_split2():
    """The Triton twin of ``split2`` where Triton imports, else None."""
    if not triton_available():
        return None
    from cosybatch.frontend.triton_kernels import tf32_split2

    return tf32_split2


def split2(x: torch.Tensor) -> torch.Tensor:
    """[M, K] float32 -> [M, 2K] = [low | high] (one Triton pass on CUDA, ``split`` elsewhere)."""
    fused = _fused_split2() if x.is_cuda else None
    if fused is not None:
        return fused(x)
    hi, lo = split(x)
    return torch.cat([lo, hi], dim=1)


class SplitTF32Linear(nn.Module):
    """``nn.Linear`` over float32 computed as three TF32 products (see the module docstring), in
    two GEMMs: ``[x_lo | x_hi] @ [w_hi | w_lo]^T`` (the two small terms, one GEMM over twice the
    inner size, the bias in its epilogue), then ``x_hi @ w_hi^T`` added, the exact-in-TF32 product
    last. With the operand's split in one kernel that is three launches a linear instead of five
    (design.md D40)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        hi, lo = split(w)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # [out, 2 in]: pairs with [x_lo | x_hi]; its first half is w_hi, which the last product reads
        self.register_buffer("w_pair", torch.cat([hi, lo], dim=1).contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, k = x.shape, self.in_features
        pair = split2(x.reshape(-1, k).float())
        with float32_math(conv_tf32=False, matmul_tf32=True):
            y = F.linear(pair, self.w_pair, self.bias)  # x_lo w_hi + x_hi w_lo (+ bias)
            y.addmm_(pair[:, k:], self.w_pair[:, :k].t())  # + x_hi w_hi
        return y.view(*shape[:-1], self.out_features)


def split_linears(module: nn.Module) -> nn.Module:
    """Replace every float32 ``nn.Linear`` inside ``module`` (in place) by its 3xTF32 twin."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32:
            setattr(module, name, SplitTF32Linear(child).to(child.weight.device))
        else:
            split_linears(child)
    return module


__all__ = ["SplitTF32Linear", "split", "split2", "split_linears", "tf32_high"]
