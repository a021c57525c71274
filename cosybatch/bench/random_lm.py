"""A seeded random ``CosyVoice3LM`` of any shape, built directly on the target device (tests and
benchmarks at full size need no checkpoint file)."""

from __future__ import annotations

import torch

from cosybatch.models.config import LLMConfig
from cosybatch.models.speech_lm import CosyVoice3LM


@torch.no_grad()
def random_lm(cfg: LLMConfig, seed: int = 0, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32, head_gain: float = 3.0) -> CosyVoice3LM:
    """HF-style init (N(0, 0.02) weights and biases, unit norm gains) filled from one generator
    in sorted-name order. ``head_gain`` scales llm_decoder to N(0, gain/sqrt(hidden)) so that the
    speech-token distribution is peaked like a trained model's rather than flat."""
    device = torch.device(device)
    with torch.device(device):
        lm = CosyVoice3LM(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    params = dict(lm.named_parameters())
    for name in sorted(params):
        p = params[name]
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name == "llm_decoder.weight":
            p.normal_(0.0, head_gain / p.shape[1] ** 0.5, generator=g)
        else:
            p.normal_(0.0, 0.02, generator=g)
    return lm.to(dtype).eval()
