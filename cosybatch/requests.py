"""The contract between the benchmark driver and a streaming pipeline.

``cosybatch profile`` drives any object with this shape in a closed loop; the fast engine's
pipeline (``cosybatch.pipeline.build_streaming_pipeline``) implements it, and tests use a fake.
The driver owns all timing: a pipeline only says what happened, never when.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

EventKind = Literal["chunk", "done", "error"]


@dataclass(frozen=True)
class SynthRequest:
    request_id: str
    row: Any  # a ManifestRow, or anything with utt_id, prompt_text, prompt_wav, target_text
    stream: bool = True
    # Generate exactly this many speech tokens (stop ids ignored): benchmarks with random
    # weights would otherwise stop at arbitrary lengths.
    force_tokens: int | None = None


@dataclass(frozen=True)
class Event:
    request_id: str
    kind: EventKind
    audio: np.ndarray | None = None  # float32 mono PCM for "chunk"; may be empty
    error: str | None = None  # for "error"

    def __post_init__(self) -> None:
        if self.kind not in ("chunk", "done", "error"):
            raise ValueError(f"event kind must be chunk, done or error, got {self.kind!r}")


@runtime_checkable
class StreamingPipeline(Protocol):
    """One process, many requests in flight; the driver calls ``step`` until nothing is left.

    Per request the pipeline emits zero or more ``chunk`` events, then exactly one ``done`` or
    one ``error`` event, after which it holds nothing for that request.
    """

    sample_rate: int  # Hz of every chunk's PCM
    token_frame_rate: int  # speech tokens per second of audio (for --force-length)

    def add_request(self, req: SynthRequest) -> None: ...

    def step(self) -> list[Event]: ...

    def has_work(self) -> bool: ...

    def stage_busy(self) -> dict[str, float]:
        """Seconds each stage (frontend, ar, flow, hift) has been busy since construction."""
        ...
