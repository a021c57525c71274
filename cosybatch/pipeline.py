"""Wires frontend -> LM -> codec for the CLI: one object that turns a manifest row into audio."""

from __future__ import annotations

import platform
from dataclasses import dataclass

import numpy as np
import torch

import cosybatch


@dataclass
class RowResult:
    audio: np.ndarray  # float32 mono at sample_rate
    sample_rate: int
    tokens: int  # speech tokens the LM generated (all segments)
    timings: dict[str, float]  # frontend_s, llm_s, flow_s, hift_s, first_chunk_s, total_s
    chunks: int


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA GPU")
    return torch.device(device)


class ReferenceSynthesizer:
    """The exact, sequential path (profile ``reference``)."""

    def __init__(self, model_dir, device: torch.device, seed: int = 0):
        from cosybatch.checkpoint import load_models
        from cosybatch.frontend import Frontend
        from cosybatch.reference.pipeline import ReferencePipeline
        from cosybatch.text.tokenizer import CosyVoice3Tokenizer

        self.model_dir = model_dir
        self.device = device
        self.models = load_models(model_dir, device=str(device))
        tokenizer = CosyVoice3Tokenizer.from_dir(model_dir / "CosyVoice-BlankEN")
        self.frontend = Frontend(model_dir, self.models.cfg, tokenizer)
        self.sample_rate = self.models.cfg.sample_rate
        self.seed = seed
        self.pipeline = ReferencePipeline(self.models, self.frontend, device, seed=seed)

    def fingerprint(self) -> dict:
        return {"model": str(self.model_dir), "engine": "reference", "seed": self.seed,
                "sampling": vars(self.pipeline.sampling) if hasattr(self.pipeline.sampling, "__dict__") else str(self.pipeline.sampling)}

    def describe(self) -> dict:
        return {
            "model": str(self.model_dir),
            "device": str(self.device),
            "engine": "reference",
            "cosybatch": cosybatch.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        }

    def synthesize(self, row, stream: bool) -> RowResult:
        trace = self.pipeline.run(row.prompt_wav, row.prompt_text, row.target_text, stream)
        return RowResult(
            audio=trace.audio,
            sample_rate=self.sample_rate,
            tokens=sum(len(s.llm_tokens) for s in trace.segments),
            timings=trace.timings,
            chunks=sum(len(s.chunk_wavs) for s in trace.segments),
        )


def build_synthesizer(model: str, device: str = "auto", profile: str | None = None, overrides: list[str] | None = None):
    from cosybatch.checkpoint import resolve_model_dir

    model_dir = resolve_model_dir(model)
    return ReferenceSynthesizer(model_dir, pick_device(device))
