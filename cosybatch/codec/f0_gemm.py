"""HiFT's F0 predictor (float64, as the official code runs it) as GEMMs instead of convolutions.

On the H200, cuDNN runs the predictor's five float64 convolutions with a generic kernel
(``implicit_convolve_dgemm``): 0.88 ms of a 12.5 ms streaming HiFT call (docs/performance.md).
Unfolding each conv's few taps (kernel 4, then 3) into one float64 GEMM lets cuBLAS use the
float64 tensor cores. Same math in float64; only the summation order differs (~1e-16 relative).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cosybatch.models.causal_conv import CausalConv1d
from cosybatch.models.f0 import CausalConvF0Predictor


class F0Gemm:
    """``predictor(mel, finalize=True)`` for mel [B, in, T] -> f0 [B, T] float64, time-major inside."""

    def __init__(self, predictor: CausalConvF0Predictor):
        self.layers = []  # (weight [k * in, out], bias [out], kernel, (pad left, pad right)), or None: ELU
        for m in predictor.condnet:
            if isinstance(m, CausalConv1d):
                if m.dilation[0] != 1:
                    raise ValueError("F0Gemm: dilated convolutions are not supported")
                out, cin, k = m.weight.shape
                pad = (m.causal_padding, 0) if m.causal_type == "left" else (0, m.causal_padding)
                w = m.weight.detach().to(torch.float64).permute(2, 1, 0).reshape(k * cin, out)  # row j * in + c
                self.layers.append((w, m.bias.detach().to(torch.float64), k, pad))
            elif isinstance(m, torch.nn.ELU):
                self.layers.append(None)
            else:
                raise ValueError(f"F0Gemm: unexpected layer {type(m).__name__}")
        self.classifier = (predictor.classifier.weight.detach().to(torch.float64),
                           predictor.classifier.bias.detach().to(torch.float64))

    def __call__(self, mel: torch.Tensor) -> torch.Tensor:
        x = mel.to(torch.float64).transpose(1, 2)  # [B, T, C]
        b, t, _ = x.shape
        for layer in self.layers:
            if layer is None:
                x = F.elu(x)
                continue
            w, bias, k, (left, right) = layer
            xp = F.pad(x, (0, 0, left, right))  # time is dim 1
            cols = torch.cat([xp[:, j : j + t] for j in range(k)], dim=2)  # [B, T, k * C]: tap-major
            x = torch.addmm(bias, cols.reshape(b * t, -1), w).view(b, t, -1)
        return torch.abs(F.linear(x, *self.classifier).squeeze(-1))
