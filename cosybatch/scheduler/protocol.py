"""The contract between a driver and a streaming pipeline, and the one driver loop.

``cosybatch synth`` (through ``pipeline.FastSynthesizer``), ``cosybatch profile`` (through
``bench.run_closed_loop``) and the tests all drive a pipeline with :func:`drive`: at most
``concurrency`` requests in flight, a new one admitted as soon as one finishes. The driver
owns all timing: a pipeline only says what happened, never when.
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Literal, Protocol, runtime_checkable

import numpy as np

EventKind = Literal["chunk", "done", "error"]

# Read-speech rate of English, in characters (with spaces) per second: what forced lengths assume.
CHARS_PER_SECOND = 14.5


def force_tokens(text: str, token_rate: float = 25.0) -> int:
    """Speech tokens for ``text``: its length at CHARS_PER_SECOND with a +-10 % jitter from a
    stable hash of the text (crc32, unlike ``hash``, is the same in every process).
    ``token_rate`` is the checkpoint's token_frame_rate (25 Hz for CosyVoice3)."""
    jitter = ((zlib.crc32(text.encode("utf-8")) % 2001) / 1000.0 - 1.0) * 0.1
    seconds = len(text) / CHARS_PER_SECOND * (1.0 + jitter)
    return max(1, round(seconds * token_rate))


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
    tokens: int | None = None  # for "done": speech tokens the LM generated for the row (raw ids)
    segments: tuple[str, ...] | None = None  # for "done": the normalized text pieces, in synthesis order
    # for "done": seconds from add_request until the AR engine's first tokens for the row (its
    # wait for the frontend and for an AR slot, and its prefill); None where not measured
    queue_s: float | None = None

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


class PipelineContractError(RuntimeError):
    """The pipeline broke the driver's contract (unknown request, stalled with work pending)."""


@dataclass
class Finished:
    """One request's outcome as the driver saw it; times come from the driver's clock."""

    request: SynthRequest
    admitted: float
    finished: float
    in_flight: int  # requests in flight right after this one was admitted (itself included)
    chunks: list[tuple[float, np.ndarray]] = field(default_factory=list)  # (time, PCM), in order
    error: str | None = None
    tokens: int | None = None  # the done event's speech-token count
    segments: list[str] | None = None  # the done event's text pieces
    queue_s: float | None = None  # the done event's queue time


def drive(pipeline: StreamingPipeline, requests: Iterable[SynthRequest], concurrency: int,
          clock: Callable[[], float] = time.perf_counter,
          on_step: Callable[[], None] = lambda: None) -> Iterator[Finished]:
    """Feed ``requests`` to ``pipeline`` keeping at most ``concurrency`` in flight; yield each
    request's :class:`Finished` as it ends. Events are stamped when ``step`` returns."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pending = deque(requests)
    live: dict[str, Finished] = {}
    seen: set[str] = set()
    while pending or live:
        while pending and len(live) < concurrency:
            req = pending.popleft()
            if req.request_id in seen:
                raise PipelineContractError(f"duplicate request id {req.request_id!r}")
            seen.add(req.request_id)
            live[req.request_id] = Finished(req, clock(), float("nan"), len(live) + 1)
            pipeline.add_request(req)
        if not pipeline.has_work():
            raise PipelineContractError(f"pipeline reports no work while {len(live)} request(s) are in flight: "
                                        + ", ".join(sorted(live)[:5]))
        events = pipeline.step()
        now = clock()
        on_step()
        for ev in events:
            f = live.get(ev.request_id)
            if f is None:
                raise PipelineContractError(f"{ev.kind} event for request {ev.request_id!r}, which is not in flight")
            if ev.kind == "chunk":
                f.chunks.append((now, np.zeros(0, np.float32) if ev.audio is None else ev.audio))
                continue
            del live[ev.request_id]
            f.finished = now
            if ev.kind == "error":
                f.error = ev.error or "error"
            f.tokens = ev.tokens
            f.segments = None if ev.segments is None else list(ev.segments)
            f.queue_s = ev.queue_s
            yield f
