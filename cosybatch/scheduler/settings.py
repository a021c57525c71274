"""The typed settings of one run of the fast pipeline, built from a profile by ``cosybatch.profiles.resolve``:
the engine's, the codec's and the process's configs plus what the scheduler itself decides."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cosybatch.codec.config import CodecConfig
from cosybatch.engine.config import EngineConfig
from cosybatch.engine.request import SamplingParams
from cosybatch.gpu.runtime import ProcessSettings
from cosybatch.text.normalize import TextNormalizer


@dataclass(frozen=True)
class SliceSettings:
    """How the GPU timeline sizes codec work (design.md D15; ``timeline.policy.Limits``)."""

    budget_ms: float  # codec GPU time between two AR steps
    budget_max_ms: float | None  # the most it grows to while few rows decode; None: fixed
    solve_tokens: int | None  # a flow solve worth starting; None: from the learned costs
    first_wait_s: float  # a row's first hop waits at most this long for a bigger solve
    max_wait_s: float  # any hop, at most this long
    deadline_lead_s: float | None = None  # streaming deadline batching (design.md D22); None: off
    deadline_tokens: int = 8192  # the solve size deadline batching waits for
    first_apart: bool = False  # streaming: first hops solved at once, apart (design.md D39)


@dataclass(frozen=True)
class FrontendSettings:
    """The ``cosybatch.frontend.frontend.Frontend`` arguments a profile chooses."""

    backend: str  # "auto", "torch" or "onnxruntime"
    dtype: torch.dtype
    split_tf32: bool
    batch: int  # prompts per GPU frontend launch while the AR engine has that many rows queued
    gather_s: float  # with fewer queued, how long gathered prompts wait for more before they launch
    row_bucket: int  # a GPU frontend launch's rows padded to a multiple of this
    batch_bucket_s: float  # and, too large for a graph, its length to a multiple of this many seconds
    graph_rows: int  # a launch of at most this many prompts replays a CUDA graph of its shape
    warmup: bool  # every length bucket's shapes planned and captured at start-up
    prime: bool  # or, without that, one small launch at start-up (a process's one-time set-up)
    audio_processes: bool  # prompt audio read in helper processes, one per frontend worker


@dataclass(frozen=True)
class TextSettings:
    """How the frontend reads target texts (profile section ``text``)."""

    normalizer: TextNormalizer = "wetext"


@dataclass(frozen=True)
class RunSettings:
    """Everything the fast pipeline needs, with every default filled in."""

    engine: EngineConfig
    codec: CodecConfig
    process: ProcessSettings
    streaming: bool
    hops: tuple[int, int, int]  # (first, max, scale) in tokens
    sampling: SamplingParams  # per-row seeds and forced lengths are derived from it
    frontend_workers: int
    frontend: FrontendSettings
    slices: SliceSettings
    profile: str = ""
    # "serial": the AR step and the codec on one stream; "beside": the AR step on a
    # high-priority stream of its own (design.md D22; CUDA with a graphed decode only)
    ar_stream: str = "serial"
    # "beside": the GPU frontend's launches on a stream of their own (design.md D34)
    frontend_stream: str = "serial"
    # "beside": HiFT's calls on a stream of their own, after their mels' solves (design.md D36)
    hift_stream: str = "serial"
    text: TextSettings = TextSettings()
