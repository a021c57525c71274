"""HiFT's Snake activations fused with the convs around them, for the resblocks.

Every Snake of the vocoder's resblocks is followed by a left-causal conv, which pads its input
with ``(kernel - 1) * dilation`` zeros. Eager, that is seven kernels per Snake (the reciprocal
of alpha, x * alpha, sin, the square, the scale, the add, then the pad's fill and copy), each a
full pass over activations of up to 64 channels x 6,000 samples per audio second, plus the
conv's own bias add (PyTorch adds a cuDNN conv's bias in a separate broadcast kernel) and the
residual add: the largest share of a HiFT call's GPU time on the H200 (docs/performance.md).

``SnakePad.pair`` runs one resblock step ``x + conv2(snake2(conv1(snake1(x))))`` as two convs
without their biases and three Triton kernels: snake1 + pad; conv1's bias + snake2 + pad;
conv2's bias + the residual add. Each kernel evaluates the same float32 operations in the same
order as the eager ops (the bias add, then ``x + (1 / (alpha + 1e-9)) * sin(x * alpha) ** 2``
with the reciprocal precomputed by PyTorch itself, no multiply-add contraction, the CUDA math
library's ``sinf``), so it is meant to equal the eager path bit for bit; the GPU tests check that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cosybatch.models.causal_conv import CausalConv1d
from cosybatch.models.hift import Snake


def snake_scales(hift: torch.nn.Module) -> dict:
    """Each Snake of ``hift`` -> (alpha, 1 / (alpha + 1e-9)): the scale computed once, by the
    eager module's own PyTorch expression, for the fused kernels (later changes to the alphas
    are not seen)."""
    return {m: (m.alpha.detach(), 1.0 / (m.alpha.detach() + 1e-9)) for m in hift.modules() if isinstance(m, Snake)}


class SnakePad:
    """The fused resblock hook of ``CausalHiFTGenerator.decode_spec`` (``ResBlock.forward``).

    ``backend``: ``"triton"`` (CUDA float32) or ``"torch"`` (the model's own ops, for CPUs and
    tests). The per-channel scales come from ``snake_scales``.
    """

    def __init__(self, hift: torch.nn.Module, backend: str = "triton"):
        if backend not in ("triton", "torch"):
            raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
        self._k = None
        if backend == "triton":
            from cosybatch.codec import triton_kernels

            self._k = triton_kernels
        self._scales = snake_scales(hift)

    def _fused(self, x: torch.Tensor) -> bool:
        return self._k is not None and x.is_cuda and x.dtype == torch.float32

    def __call__(self, x: torch.Tensor, snake: Snake, pad: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.pad(snake(x + bias), (pad, 0))`` (bias [C] optional)."""
        alpha, inv = self._scales[snake]
        if self._fused(x):
            return self._k.snake_pad(x, alpha, inv, pad, None if bias is None else bias.detach())
        if bias is not None:
            x = x + bias.detach()[None, :, None]
        a, i = alpha[None, :, None], inv[None, :, None]
        return F.pad(x + i * torch.sin(x * a).pow(2), (pad, 0))

    def pair(self, x: torch.Tensor, c1: CausalConv1d, a1: Snake, c2: CausalConv1d, a2: Snake) -> torch.Tensor:
        """``c2(a2(c1(a1(x)))) + x``."""
        if not self._fused(x):
            y = c1.forward_padded(self(x, a1, c1.causal_padding))
            return c2.forward_padded(self(y, a2, c2.causal_padding)) + x
        y = F.conv1d(self(x, a1, c1.causal_padding), c1.weight, None, 1, 0, c1.dilation)
        y = F.conv1d(self(y, a2, c2.causal_padding, c1.bias), c2.weight, None, 1, 0, c2.dilation)
        return self._k.bias_residual(y, c2.bias.detach(), x)
