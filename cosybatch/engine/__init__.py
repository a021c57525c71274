"""AR engine: continuous batching over a paged KV cache, batch-invariant sampling on the device,
CUDA-graph decode. Only this package knows about batching, caches and graphs."""

from cosybatch.engine.config import EngineConfig
from cosybatch.engine.llm_engine import EngineStats, LLMEngine
from cosybatch.engine.request import RequestOutput, SamplingParams, Sequence, TokenQueue

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams", "Sequence",
           "TokenQueue"]
