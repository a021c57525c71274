"""Band-limited sinc resampling, numerically equal to ``torchaudio.transforms.Resample``.

The official frontend resamples prompts with torchaudio's defaults (Hann-windowed sinc,
``lowpass_filter_width=6``, ``rolloff=0.99``); the speech tokenizer and speaker model were
fed exactly that signal, so the kernel is built the same way: in float64, cast to float32,
one polyphase conv1d with stride = reduced input rate.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

LOWPASS_FILTER_WIDTH = 6
ROLLOFF = 0.99


@lru_cache(maxsize=16)
def _sinc_kernel(orig: int, new: int, lowpass_filter_width: int, rolloff: float) -> tuple[torch.Tensor, int]:
    """Kernel [new, 1, 2*width+orig] for already gcd-reduced rates, and the pad width."""
    base_freq = min(orig, new) * rolloff
    width = math.ceil(lowpass_filter_width * orig / base_freq)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    # One row per output phase: phase j samples at input time j/new. torchaudio divides an
    # integer arange, so j/new is rounded to float32 before joining the float64 grid.
    phase = (torch.arange(0, -new, -1).to(torch.float32) / new).to(torch.float64)
    t = phase[:, None, None] + idx
    t = (t * base_freq).clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    scale = base_freq / orig
    kernel = torch.where(t == 0, torch.ones((), dtype=t.dtype), t.sin() / t)
    kernel = kernel * (window * scale)
    return kernel.to(torch.float32), width


def resample(
    wav: torch.Tensor,
    orig_sr: int,
    new_sr: int,
    lowpass_filter_width: int = LOWPASS_FILTER_WIDTH,
    rolloff: float = ROLLOFF,
) -> torch.Tensor:
    """Resample the last axis of ``wav`` ([..., n]) from ``orig_sr`` to ``new_sr`` Hz."""
    orig_sr, new_sr = int(orig_sr), int(new_sr)
    if orig_sr <= 0 or new_sr <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_sr} -> {new_sr}")
    if orig_sr == new_sr:
        return wav
    if not wav.is_floating_point():
        raise TypeError(f"resample expects a floating-point waveform, got {wav.dtype}")
    g = math.gcd(orig_sr, new_sr)
    orig, new = orig_sr // g, new_sr // g
    kernel, width = _sinc_kernel(orig, new, int(lowpass_filter_width), float(rolloff))
    kernel = kernel.to(device=wav.device, dtype=wav.dtype)

    shape = wav.shape
    x = wav.reshape(-1, shape[-1])
    n = x.shape[-1]
    x = F.pad(x, (width, width + orig))
    y = F.conv1d(x[:, None], kernel, stride=orig)  # [B, new, frames]
    y = y.transpose(1, 2).reshape(x.shape[0], -1)
    # torchaudio rounds the length through a default-dtype (float32) tensor before ceil;
    # for long inputs that can drop the last sample, so do the same.
    target = int(torch.ceil(torch.tensor(new * n / orig, dtype=torch.float32)).item())
    return y[..., :target].reshape(*shape[:-1], -1)
