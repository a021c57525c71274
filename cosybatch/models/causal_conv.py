"""Causal 1-D convolutions used by the CosyVoice3 vocoder (HiFT).

They are plain ``nn.Conv1d`` subclasses so that state-dict keys stay ``<name>.weight`` /
``<name>.bias`` (weight norm is folded by the loader). The padding is applied by hand
instead of by ``nn.Conv1d(padding=...)`` because causal padding is one-sided, and because
streaming replaces the zero padding with real context frames.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


class CausalConv1d(nn.Conv1d):
    """Stride-1 convolution whose receptive field lies entirely on one side.

    ``causal_type='left'`` looks only at the past (zeros padded on the left).
    ``causal_type='right'`` looks only at the future: zeros padded on the right, or the
    caller supplies the real next frames as ``context`` (streaming look-ahead).
    The output always has as many frames as ``x``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        dilation: int = 1,
        causal_type: Literal["left", "right"] = "left",
        bias: bool = True,
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=1, padding=0,
                         dilation=dilation, bias=bias)
        if causal_type not in ("left", "right"):
            raise ValueError(f"causal_type must be 'left' or 'right', got {causal_type!r}")
        self.causal_type = causal_type
        self.causal_padding = (kernel_size - 1) * dilation

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        pad = self.causal_padding
        if context is None:
            padding = (pad, 0) if self.causal_type == "left" else (0, pad)
            x = F.pad(x, padding)
        else:
            if context.shape[-1] != pad:
                raise ValueError(f"context has {context.shape[-1]} frames, expected {pad}")
            parts = [context, x] if self.causal_type == "left" else [x, context]
            x = torch.cat(parts, dim=2)
        return super().forward(x)

    def forward_padded(self, x: torch.Tensor) -> torch.Tensor:
        """The convolution of an input that already carries its causal padding."""
        return super().forward(x)


class CausalConv1dUpsample(nn.Conv1d):
    """Nearest-neighbour upsampling by ``stride`` followed by a left-causal convolution.

    This replaces a transposed convolution in the causal HiFT; the weight is therefore a
    regular Conv1d weight of shape (out, in, k).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=1, padding=0)
        self.scale = int(stride)
        self.causal_padding = kernel_size - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.interpolate (not repeat_interleave) so the index rounding is torch's own,
        # exactly as in the official nn.Upsample.
        x = F.interpolate(x, scale_factor=float(self.scale), mode="nearest")
        x = F.pad(x, (self.causal_padding, 0))
        return super().forward(x)


class CausalConv1dDownSample(nn.Conv1d):
    """Strided convolution (kernel ``2*stride``) with ``stride-1`` zeros on the left."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        if stride < 2 or kernel_size % stride != 0:
            raise ValueError(f"bad downsample: kernel {kernel_size}, stride {stride}")
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0)
        self.causal_padding = stride - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.causal_padding, 0)))
