"""Float32 matmuls at tensor-core speed: each product as three TF32 products ("3xTF32").

A TF32 tensor core reads 10 of a float32's 23 mantissa bits. Split each operand into a high
part that TF32 holds exactly (the float32 with its low 13 mantissa bits cleared) and the rest:
``a = a_hi + a_lo`` exactly, ``|a_lo| <= 2**-10 |a|``. Then

    a @ b = a_hi @ b_hi + a_hi @ b_lo + a_lo @ b_hi + a_lo @ b_lo,

and three TF32 GEMMs with float32 accumulation keep the first three terms. What is lost: the
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

import torch
import torch.nn as nn

from cosybatch.gpu.runtime import float32_math

_HIGH_BITS = -(1 << 13)  # int32 0xFFFFE000: sign, exponent and the top 10 mantissa bits


def tf32_high(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) with the 13 low mantissa bits cleared: exactly representable in TF32."""
    return (x.contiguous().view(torch.int32) & _HIGH_BITS).view(torch.float32)


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (high, low) with high + low == x exactly (float32)."""
    hi = tf32_high(x)
    return hi, x - hi


class SplitTF32Linear(nn.Module):
    """``nn.Linear`` over float32 computed as three TF32 GEMMs (see the module docstring)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        hi, lo = split(w)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # transposed once: addmm_ reads [in, out]
        self.register_buffer("w_hi_t", hi.t().contiguous())
        self.register_buffer("w_lo_t", lo.t().contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_hi, x_lo = split(x.reshape(-1, shape[-1]).float())
        with float32_math(conv_tf32=False, matmul_tf32=True):
            # smallest terms first, the exact-in-TF32 product last
            if self.bias is None:
                y = x_lo @ self.w_hi_t
            else:
                y = torch.addmm(self.bias, x_lo, self.w_hi_t)
            y.addmm_(x_hi, self.w_lo_t)
            y.addmm_(x_hi, self.w_hi_t)
        return y.view(*shape[:-1], self.out_features)


def split_linears(module: nn.Module) -> nn.Module:
    """Replace every float32 ``nn.Linear`` inside ``module`` (in place) by its 3xTF32 twin."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32:
            setattr(module, name, SplitTF32Linear(child).to(child.weight.device))
        else:
            split_linears(child)
    return module


__all__ = ["SplitTF32Linear", "split", "split_linears", "tf32_high"]
