"""Random CosyVoice3 checkpoints in the official directory layout, at any size.

``generate_checkpoint(out, size="full")`` writes a Fun-CosyVoice3-0.5B-2512 look-alike (same
yaml structure, file names, state-dict keys and shapes, tokenizer id layout, ONNX I/O
contracts) filled with random weights, for tests and benchmarks that must not depend on the
real download.

Random weights produce noise, not speech.  The LLM has no notion of the text it reads, so its
stop is random too: only eos is a live stop row, tuned to end an utterance after ~100 tokens
on average at ``full`` under the official sampling (~65 at ``small``; geometric-like, capped at
``max_len`` = 20 x text tokens, possibly at step 0 since the official min_len rule does not
mask eos; tiny's greedy decoding may instead loop until ``max_len``).  Benchmarks that
need realistic, text-dependent lengths must force them.  The two ONNX frontends have the
official S3TokenizerV3 / CAM++ structure at every size (``onnx_standins``), ~970 MB of
tokenizer at ``full``.  Writing ``full`` takes ~1-2 min and ~5 GB of memory (one model at a
time).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from cosybatch.models.config import (
    DiTConfig,
    FlowConfig,
    HiFTConfig,
    LLMConfig,
    ModelConfig,
    QwenConfig,
    SamplingConfig,
)

# Greedy under the official RAS sampler: top_k 1 always takes the arg-max (ties -> lowest id)
# and the repetition fallback needs win_size * tau_r = 20 repeats within a 10-token window.
GREEDY_SAMPLING = SamplingConfig(top_p=0.8, top_k=1, win_size=10, tau_r=2.0)
OFFICIAL_SAMPLING = SamplingConfig(top_p=0.8, top_k=25, win_size=10, tau_r=0.1)


@dataclasses.dataclass(frozen=True)
class SizePreset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    pre_lookahead_channels: int
    dit_dim: int
    dit_depth: int
    dit_heads: int
    dit_dim_head: int
    dit_ff_mult: int
    hift_base_channels: int
    f0_cond_channels: int
    sampling: SamplingConfig
    chunk_size: int = 25


SIZES: dict[str, SizePreset] = {
    # the numbers of the cv3-tiny fixture
    "tiny": SizePreset(hidden=12, layers=2, heads=2, kv_heads=1, intermediate=32,
                       pre_lookahead_channels=32, dit_dim=32, dit_depth=2, dit_heads=2,
                       dit_dim_head=16, dit_ff_mult=2, hift_base_channels=32, f0_cond_channels=16,
                       sampling=GREEDY_SAMPLING),
    # big enough to exercise every code path with realistic ratios, fast on a CPU
    "small": SizePreset(hidden=64, layers=4, heads=4, kv_heads=2, intermediate=128,
                        pre_lookahead_channels=128, dit_dim=128, dit_depth=4, dit_heads=4,
                        dit_dim_head=32, dit_ff_mult=2, hift_base_channels=64, f0_cond_channels=64,
                        sampling=OFFICIAL_SAMPLING),
    # Fun-CosyVoice3-0.5B-2512
    "full": SizePreset(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
                       pre_lookahead_channels=1024, dit_dim=1024, dit_depth=22, dit_heads=16,
                       dit_dim_head=64, dit_ff_mult=2, hift_base_channels=512, f0_cond_channels=512,
                       sampling=OFFICIAL_SAMPLING),
}


def model_config_for(size: str = "tiny", chunk_size: int | None = None) -> ModelConfig:
    """The ModelConfig a generated checkpoint of ``size`` describes."""
    key = size.lower()
    if key not in SIZES:
        raise ValueError(f"unknown checkpoint size {size!r}; choose one of {sorted(SIZES)}")
    p = SIZES[key]
    chunk = p.chunk_size if chunk_size is None else int(chunk_size)
    if chunk <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk}")
    flow_defaults = FlowConfig()
    qwen = QwenConfig(hidden_size=p.hidden, num_hidden_layers=p.layers, num_attention_heads=p.heads,
                      num_key_value_heads=p.kv_heads, intermediate_size=p.intermediate)
    llm = LLMConfig(qwen=qwen, llm_input_size=p.hidden, llm_output_size=p.hidden, sampling=p.sampling)
    dit = DiTConfig(dim=p.dit_dim, depth=p.dit_depth, heads=p.dit_heads, dim_head=p.dit_dim_head,
                    ff_mult=p.dit_ff_mult, static_chunk_size=chunk * flow_defaults.token_mel_ratio)
    flow = FlowConfig(pre_lookahead_channels=p.pre_lookahead_channels, dit=dit)
    hift = HiFTConfig(base_channels=p.hift_base_channels, f0_cond_channels=p.f0_cond_channels)
    return ModelConfig(llm=llm, flow=flow, hift=hift, chunk_size=chunk)


def generate_checkpoint(out_dir, size: str = "tiny", seed: int = 0, chunk_size: int | None = None) -> Path:
    """Write a random checkpoint of ``size`` ("tiny", "small", "full") into ``out_dir``.

    Same ``seed`` -> identical tensors, tokenizer files, yaml and ONNX graphs.  Returns the
    directory, which ``cosybatch.checkpoint.load_models`` accepts like the real one.
    """
    from cosybatch.checkpoint.gen_tokenizer import write_blank_en
    from cosybatch.checkpoint.gen_weights import write_weights
    from cosybatch.checkpoint.gen_yaml import render_yaml
    from cosybatch.checkpoint.onnx_standins import write_onnx_standins

    cfg = model_config_for(size, chunk_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cosyvoice3.yaml").write_text(render_yaml(cfg, size.lower(), seed), encoding="utf-8")
    meta = {"framework": "Pytorch", "task": "text-to-speech",
            "cosybatch": {"size": size.lower(), "seed": seed, "chunk_size": cfg.chunk_size}}
    (out / "configuration.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    write_blank_en(out / "CosyVoice-BlankEN", cfg.llm.qwen)
    write_onnx_standins(out, seed, size.lower())
    for _ in write_weights(out, cfg, seed):
        pass
    return out
