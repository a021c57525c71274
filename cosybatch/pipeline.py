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


class FastSynthesizer:
    """``synth`` on the fast path: many rows in flight through ``serving.FastPipeline``."""

    def __init__(self, model_dir, device: torch.device, profile):
        from cosybatch.checkpoint import load_models
        from cosybatch.frontend import Frontend
        from cosybatch.serving import FastPipeline

        self.model_dir = model_dir
        self.device = device
        self.profile = profile
        models = load_models(model_dir, device=str(device))
        self.pipeline = FastPipeline(models, Frontend(model_dir, models.cfg, cache_size=4096), profile, device)
        self.sample_rate = models.cfg.sample_rate
        # Flow tokens -> samples is exact (2 mel frames per token, 480 samples per frame).
        self.samples_per_token = models.cfg.hift.samples_per_frame * models.cfg.flow.token_mel_ratio
        # Admit a bounded window of rows so the frontend never runs far ahead of the engine.
        self.window = max(profile.ar.max_num_seqs, profile.codec.max_num_seqs) * 2

    def fingerprint(self) -> dict:
        return {"model": str(self.model_dir), "engine": "fast", "profile": self.profile.to_dict()}

    def stage_busy(self) -> dict[str, float]:
        """Seconds each stage has been busy; rows share batches, so stages are timed per run."""
        return self.pipeline.stage_busy()

    def describe(self) -> dict:
        return {"model": str(self.model_dir), "device": str(self.device), "engine": "fast",
                "profile": self.profile.name, "cosybatch": cosybatch.__version__, "torch": torch.__version__,
                "python": platform.python_version()}

    def synthesize(self, row, stream: bool) -> RowResult:
        for _, outcome in self.synthesize_batch([row], stream):
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        raise RuntimeError("the pipeline returned nothing")

    def synthesize_batch(self, rows, stream: bool):
        import time

        from cosybatch.requests import SynthRequest

        todo = list(rows)
        by_id, chunks, started, first = {}, {}, {}, {}
        nxt = 0
        while nxt < len(todo) or self.pipeline.has_work():
            while nxt < len(todo) and len(by_id) < self.window:
                row = todo[nxt]
                rid = f"{nxt}:{row.utt_id}"
                by_id[rid], chunks[rid], started[rid] = row, [], time.perf_counter()
                self.pipeline.add_request(SynthRequest(rid, row, stream))
                nxt += 1
            for ev in self.pipeline.step():
                row = by_id.get(ev.request_id)
                if row is None:
                    continue
                if ev.kind == "chunk":
                    chunks[ev.request_id].append(ev.audio)
                    if len(ev.audio) and ev.request_id not in first:
                        first[ev.request_id] = time.perf_counter() - started[ev.request_id]
                    continue
                del by_id[ev.request_id]
                pieces = chunks.pop(ev.request_id)
                total = time.perf_counter() - started.pop(ev.request_id)
                if ev.kind == "error":
                    yield row, RuntimeError(ev.error)
                    continue
                audio = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
                timings = {"first_chunk_s": first.pop(ev.request_id, float("nan")), "total_s": total}
                yield row, RowResult(audio, self.sample_rate, len(audio) // self.samples_per_token, timings, len(pieces))


def _load(model: str, profile: str | None, overrides, stream: bool | None):
    from cosybatch.checkpoint import resolve_model_dir
    from cosybatch.profiles import load_profile

    prof = load_profile(profile, list(overrides or ()), stream=stream)
    return resolve_model_dir(model), prof


def build_synthesizer(model: str, device: str = "auto", profile: str | None = None,
                      overrides: list[str] | None = None, stream: bool | None = None):
    """The CLI's ``synth`` factory: the profile's engine (default profile: ``default``)."""
    model_dir, prof = _load(model, profile, overrides, stream)
    dev = pick_device(device)
    if prof.engine == "reference":
        if prof.sampling.mode == "standard":
            raise ValueError("the reference engine implements the checkpoint's RAS sampler only")
        return ReferenceSynthesizer(model_dir, dev, seed=prof.sampling.seed)
    return FastSynthesizer(model_dir, dev, prof)


def build_streaming_pipeline(model: str, device: str, profile):
    """The ``profile`` command's factory: a ``requests.StreamingPipeline`` for the profile."""
    from cosybatch.checkpoint import load_models, resolve_model_dir
    from cosybatch.frontend import Frontend
    from cosybatch.serving import FastPipeline

    if profile.engine == "reference":
        raise ValueError("profile measures the fast engine; the reference engine has no streaming pipeline")
    model_dir = resolve_model_dir(model)
    dev = pick_device(device)
    models = load_models(model_dir, device=str(dev))
    return FastPipeline(models, Frontend(model_dir, models.cfg, cache_size=4096), profile, dev)
