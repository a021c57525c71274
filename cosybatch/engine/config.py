"""Engine settings: admission, KV-cache size, precision, kernels and CUDA graphs.

Everything the scheduler and runner need arrives in one frozen object (built from a profile by
``cosybatch.profiles.resolve.engine_config``); nothing in the engine reads globals.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

from cosybatch.models.config import resolve_dtype

@dataclass(frozen=True)
class EngineConfig:
    # The settings a profile chooses (``cosybatch.profiles.schema.ARProfile`` declares each
    # one's default and meaning; ``cosybatch.profiles.resolve.engine_config`` builds this).
    max_num_seqs: int
    max_model_len: int
    kv_block_size: int
    kv_cache_gb: float | None
    max_prefill_tokens: int
    dtype: str
    executor: str
    linear: str
    cuda_graphs: bool
    graph_batch_sizes: tuple[int, ...]
    graph_capture: str
    prefill_min_rows: int
    prefill_wait_ms: float
    rope_in_attention: bool
    mixed_prefill: bool
    mixed_graph_precapture: tuple[tuple[int, int], ...] = ()  # [decoding rows, prompt tokens] pairs
    # Engine-only knobs (benchmarks and tests set them; no profile does):
    # paged KV blocks (None: from kv_cache_gb, else enough for max_num_seqs rows of max_model_len)
    num_kv_blocks: int | None = None
    # prefills of at most this many packed tokens replay a graph per token bucket (0: eager)
    prefill_graph_tokens: int = 4096
    # triton executor: the sampler's steps before its sort, its random numbers and its draw after
    # the sort as three Triton kernels (engine.triton_kernels.sampler_scores, uniforms,
    # sampler_draw), the same bits as the sampler's tensor ops: 9 launches to sample and record a
    # token instead of 290 (design.md D30)
    sampler_kernels: bool = True
    # official CosyVoice3LM.inference ratios (not in the yaml)
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_model_len < 2 or self.kv_block_size < 1:
            raise ValueError(f"bad engine sizes: {self}")
        if self.executor not in ("auto", "torch", "triton"):
            raise ValueError(f"executor must be auto|torch|triton, got {self.executor!r}")
        if self.linear not in ("triton", "torch"):
            raise ValueError(f"linear must be triton|torch, got {self.linear!r}")
        if self.prefill_min_rows < 1 or self.prefill_wait_ms < 0:
            raise ValueError(f"prefill_min_rows must be >= 1 and prefill_wait_ms >= 0: {self}")
        if self.graph_capture not in ("startup", "lazy", "warm"):
            raise ValueError(f"graph_capture must be startup|lazy|warm, got {self.graph_capture!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(m) - known
        if unknown:
            raise ValueError(f"unknown engine settings: {sorted(unknown)}")
        kw = dict(m)
        if "graph_batch_sizes" in kw:
            kw["graph_batch_sizes"] = tuple(int(b) for b in kw["graph_batch_sizes"])
        if "mixed_graph_precapture" in kw:
            kw["mixed_graph_precapture"] = tuple((int(d), int(t)) for d, t in kw["mixed_graph_precapture"])
        return cls(**kw)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        return resolve_dtype(self.dtype, device)

    def buckets(self) -> tuple[int, ...]:
        """Decode batch sizes replayed from graphs: the configured ones up to max_num_seqs, plus
        one that covers max_num_seqs itself."""
        bs = sorted(b for b in set(self.graph_batch_sizes) if b < self.max_num_seqs)
        return tuple(bs) + (self.max_num_seqs,)
