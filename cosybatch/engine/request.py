"""What a caller hands the engine (a request with its sampling parameters) and what it gets back.

A ``Sequence`` is the engine's own per-request state: the raw tokens the LM conditions on, the
silent-filtered stream handed on to the flow, its KV blocks and its decode row.
"""

from __future__ import annotations

import enum
import math
import queue
from dataclasses import dataclass, field
from typing import Callable

from cosybatch.models.config import SamplingConfig
from cosybatch.models.silence import SilentFilter

# on_tokens(request_id, new flow-bound tokens, finished)
TokenCallback = Callable[[str, list, bool], None]


class RequestFailed(RuntimeError):
    """One request could not be run (and was dropped); the engine and its other requests go on."""

    def __init__(self, request_id: str, reason: str):
        super().__init__(f"request {request_id}: {reason}")
        self.request_id = request_id


@dataclass(frozen=True)
class SamplingParams:
    """``mode="ras"``: the official repetition-aware sampler (nucleus top_p/top_k, window
    ``win_size``, ``tau_r``; no temperature). ``mode="standard"``: repetition penalty over the
    generated tokens (each distinct token once), temperature, top-k (<= 0: off), top-p (>= 1: off).

    ``seed`` picks the request's own counter-based random stream, so its tokens do not depend on
    what else is batched with it. ``enforce_min_len`` masks every stop id for the first min_len
    steps (the official code masks only sos: design.md D2). ``force_length=N`` ignores stop ids
    and ends after exactly N tokens (benchmarks with random weights)."""

    mode: str = "ras"
    top_k: int = 25
    top_p: float = 0.8
    win_size: int = 10
    tau_r: float = 0.1
    temperature: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    enforce_min_len: bool = False
    force_length: int | None = None
    max_tokens: int | None = None  # a cap on top of the official 20 x text tokens

    def __post_init__(self) -> None:
        if self.mode not in ("ras", "standard"):
            raise ValueError(f"sampling mode must be 'ras' or 'standard', got {self.mode!r}")
        if self.mode == "ras" and self.top_k < 1:
            raise ValueError("RAS needs top_k >= 1")
        if self.temperature <= 0 or self.repetition_penalty <= 0:
            raise ValueError("temperature and repetition_penalty must be > 0")
        if self.force_length is not None and self.force_length < 1:
            raise ValueError("force_length must be >= 1")
        if not 0 <= self.seed < 2**63:
            raise ValueError("seed must be in [0, 2**63)")

    def ras_config(self) -> SamplingConfig:
        """The RAS parameters as the checkpoint config type (what the reference sampler reads)."""
        return SamplingConfig(top_p=self.top_p, top_k=self.top_k, win_size=self.win_size, tau_r=self.tau_r)

    @classmethod
    def ras(cls, cfg: SamplingConfig, seed: int = 0, **kw) -> "SamplingParams":
        return cls(mode="ras", top_k=cfg.top_k, top_p=cfg.top_p, win_size=cfg.win_size,
                   tau_r=cfg.tau_r, seed=seed, **kw)

    @classmethod
    def standard(cls, temperature: float, top_p: float, top_k: int, repetition_penalty: float,
                 seed: int = 0, **kw) -> "SamplingParams":
        return cls(mode="standard", temperature=temperature, top_p=top_p, top_k=top_k,
                   repetition_penalty=repetition_penalty, seed=seed, **kw)


class SeqStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass
class RequestOutput:
    request_id: str
    new_tokens: list[int]  # flow-bound (silent-filtered) tokens produced by this step
    new_raw_tokens: list[int]  # everything the LM produced this step
    finished: bool
    finish_reason: str | None = None  # "stop" | "length"


@dataclass
class Sequence:
    request_id: str
    text_ids: list[int]  # prompt text followed by target text
    prompt_speech: list[int]
    params: SamplingParams
    min_len: int
    max_len: int
    on_tokens: TokenCallback | None = None
    tokens: list[int] = field(default_factory=list)  # raw generated ids (stop id excluded)
    flow_tokens: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    blocks: list[int] = field(default_factory=list)
    row: int = -1
    _filter: SilentFilter = field(default_factory=SilentFilter)

    @property
    def prompt_len(self) -> int:
        """sos + text + task_id + prompt speech tokens."""
        return len(self.text_ids) + len(self.prompt_speech) + 2

    @property
    def max_total_len(self) -> int:
        # +1: the input slot of the last decode step is written even if its output is discarded
        return self.prompt_len + self.max_len + 1

    @property
    def n_gen(self) -> int:
        return len(self.tokens)

    def accept(self, token: int) -> int | None:
        """Append a raw token; return it if it goes on to the flow (silent filter)."""
        self.tokens.append(token)
        if self._filter.push(token):
            self.flow_tokens.append(token)
            return token
        return None


def length_limits(n_text: int, params: SamplingParams, min_ratio: float, max_ratio: float) -> tuple[int, int]:
    """(min_len, max_len) of the official loop; force_length replaces both."""
    if params.force_length is not None:
        return params.force_length, params.force_length
    max_len = int(n_text * max_ratio)
    if params.max_tokens is not None:
        max_len = min(max_len, params.max_tokens)
    return int(n_text * min_ratio), max_len


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


class TokenQueue:
    """A callback that feeds a ``queue.Queue`` with ``(tokens, finished)`` items, for a consumer
    on another thread (the codec starts a hop as soon as hop + lookahead tokens exist)."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()

    def __call__(self, request_id: str, tokens: list, finished: bool) -> None:
        self.queue.put((list(tokens), finished))

    def drain(self) -> tuple[list[int], bool]:
        """Everything delivered so far (non-blocking)."""
        out: list[int] = []
        done = False
        while True:
            try:
                toks, fin = self.queue.get_nowait()
            except queue.Empty:
                return out, done
            out.extend(toks)
            done = done or fin


def as_int_list(x) -> list[int]:
    if hasattr(x, "reshape"):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


__all__ = ["SamplingParams", "Sequence", "SeqStatus", "RequestOutput", "TokenQueue",
           "TokenCallback", "length_limits", "blocks_for", "as_int_list"]
