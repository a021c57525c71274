"""The slow, exact pipeline: one row at a time, official semantics end to end.

Every fast path (AR engine, packed codec) is tested against this.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from cosybatch.hops import HopSchedule, SegmentPlanner
from cosybatch.reference.llm import generate_tokens
from cosybatch.reference.token2wav import HiftStream, flow_chunk, flow_full
from cosybatch.models.silence import silent_filter


@dataclass
class SegmentTrace:
    """What one text segment produced (kept for parity tests and timing)."""

    llm_tokens: list[int]
    flow_tokens: list[int]
    chunk_wavs: list[np.ndarray] = field(default_factory=list)
    chunk_mels: list[torch.Tensor] = field(default_factory=list)


@dataclass
class RowTrace:
    segments: list[SegmentTrace]
    audio: np.ndarray
    timings: dict[str, float]
    segment_texts: list[str] = field(default_factory=list)  # the normalized piece behind each segment


class _Clock:
    """Accumulates wall time per stage; synchronizes CUDA so stage times are real."""

    def __init__(self, device: torch.device):
        self.device = device
        self.t = {"frontend_s": 0.0, "llm_s": 0.0, "flow_s": 0.0, "hift_s": 0.0}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, stage: str, fn, *args, **kw):
        self.sync()
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        self.sync()
        self.t[stage] += time.perf_counter() - t0
        return out


class ReferencePipeline:
    def __init__(self, models, frontend, device: torch.device, sampling=None, enforce_min_len: bool = False,
                 full_attention_final: bool = True, seed: int = 0):
        self.models = models
        self.frontend = frontend
        self.device = device
        self.sampling = sampling or models.cfg.llm.sampling
        self.enforce_min_len = enforce_min_len
        self.full_attention_final = full_attention_final
        self.seed = seed

    def run(self, prompt_wav, prompt_transcript: str, target_text: str, stream: bool) -> RowTrace:
        t_start = time.perf_counter()
        clock = _Clock(self.device)
        m = self.models
        feats = clock.run("frontend_s", self.frontend.prompt, prompt_wav)
        text = clock.run("frontend_s", self.frontend.prepare, prompt_transcript, target_text)
        dev = self.device
        prompt = feats.to(dev)
        prompt_text_ids = text.prompt_text_ids.to(dev)
        P = prompt.speech_tokens.shape[0]
        lookahead = m.cfg.flow.pre_lookahead_len
        schedule = HopSchedule()
        generator = torch.Generator(device="cpu").manual_seed(self.seed)
        first_chunk_at = None
        segments, pieces = [], []

        for seg_ids in text.segments:
            trace = SegmentTrace(llm_tokens=[], flow_tokens=[])
            hift = HiftStream(m.hift)
            planner = SegmentPlanner(schedule, P, lookahead) if stream else None

            def emit(chunk):
                nonlocal first_chunk_at
                toks = torch.tensor(trace.flow_tokens, dtype=torch.long, device=dev)
                mel = clock.run("flow_s", flow_chunk, m.flow, toks, prompt, chunk, self.full_attention_final)
                wav = clock.run("hift_s", hift.push, mel, chunk.finalize)
                trace.chunk_mels.append(mel.cpu())
                trace.chunk_wavs.append(wav[0].float().cpu().numpy())
                if first_chunk_at is None and wav.shape[1] > 0:
                    first_chunk_at = time.perf_counter() - t_start

            def on_token(tok: int):
                trace.llm_tokens.append(tok)
                if planner is None:
                    return
                trace.flow_tokens = silent_filter(trace.llm_tokens)
                # Chunks fire while the LM is still decoding, as in the official threaded loop.
                clock.t["llm_s"] -= _pause(clock, lambda: _drain(planner, trace, emit, finished=False))

            clock.run("llm_s", generate_tokens, m.llm, seg_ids.to(dev), prompt_text_ids, prompt.speech_tokens,
                      self.sampling, generator=generator, enforce_min_len=self.enforce_min_len, on_token=on_token)
            trace.flow_tokens = silent_filter(trace.llm_tokens)
            if stream:
                _drain(planner, trace, emit, finished=True)
            else:
                toks = torch.tensor(trace.flow_tokens, dtype=torch.long, device=dev)
                mel = clock.run("flow_s", flow_full, m.flow, toks, prompt)
                wav, _ = clock.run("hift_s", m.hift.inference, mel, True)
                trace.chunk_mels.append(mel.cpu())
                trace.chunk_wavs.append(wav[0].float().cpu().numpy())
                if first_chunk_at is None:
                    first_chunk_at = time.perf_counter() - t_start
            segments.append(trace)
            pieces.extend(trace.chunk_wavs)

        audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        timings = dict(clock.t)
        timings["first_chunk_s"] = first_chunk_at if first_chunk_at is not None else float("nan")
        timings["total_s"] = time.perf_counter() - t_start
        return RowTrace(segments=segments, audio=audio.astype(np.float32), timings=timings,
                        segment_texts=list(text.segment_texts))


def _drain(planner, trace, emit, finished: bool) -> None:
    while (chunk := planner.next_chunk(len(trace.flow_tokens), finished)) is not None:
        emit(chunk)


def _pause(clock: _Clock, fn) -> float:
    """Run ``fn`` inside an LLM-timed region and return its duration, so stages are not double counted."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
