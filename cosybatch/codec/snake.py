"""HiFT's Snake activation fused with the zero padding of the causal conv it feeds.

Every Snake of the vocoder's resblocks is followed by a left-causal conv, which pads its input
with ``(kernel - 1) * dilation`` zeros. Eager, that is seven kernels per Snake (the reciprocal
of alpha, x * alpha, sin, the square, the scale, the add, then the pad's fill and copy), each a
full pass over activations of up to 64 channels x 6,000 samples per audio second: the largest
share of a HiFT call's GPU time on the H200 (docs/performance.md). ``SnakePad`` writes
``F.pad(snake(x), (pad, 0))`` in one pass instead.

The fused kernel evaluates the same float32 operations in the same order as the eager
expression ``x + (1 / (alpha + 1e-9)) * sin(x * alpha) ** 2`` (the reciprocal precomputed by
PyTorch itself, no multiply-add contraction, the CUDA math library's ``sinf``), so it is meant
to equal the eager path bit for bit; the GPU tests check that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cosybatch.models.hift import Snake


class SnakePad:
    """``snake_pad(x, snake, pad)`` for ``CausalHiFTGenerator.decode_spec``.

    ``backend``: ``"triton"`` (one kernel; CUDA float32) or ``"torch"`` (the eager ops, for
    CPUs and tests). The per-channel ``1 / (alpha + 1e-9)`` is computed once here, by the same
    PyTorch expression as the eager Snake, so later changes to the alphas are not seen.
    """

    def __init__(self, hift: torch.nn.Module, backend: str = "triton"):
        if backend not in ("triton", "torch"):
            raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
        self._kernel = None
        if backend == "triton":
            from cosybatch.codec.triton_kernels import snake_pad

            self._kernel = snake_pad
        self._inv = {m: (1.0 / (m.alpha.detach() + 1e-9)) for m in hift.modules() if isinstance(m, Snake)}

    def __call__(self, x: torch.Tensor, snake: Snake, pad: int) -> torch.Tensor:
        alpha, inv = snake.alpha.detach(), self._inv[snake]
        if self._kernel is not None and x.is_cuda and x.dtype == torch.float32:
            return self._kernel(x, alpha, inv, pad)
        a, i = alpha[None, :, None], inv[None, :, None]
        return F.pad(x + i * torch.sin(x * a).pow(2), (pad, 0))
