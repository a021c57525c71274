"""The packed flow's arithmetic: what benchmarks and the timeline divide by time to get TFLOP/s."""

from __future__ import annotations

from cosybatch.models.config import DiTConfig, FlowConfig


def block_gemms(d: DiTConfig) -> tuple[tuple[str, int, int], ...]:
    """A DiT block's GEMMs per token as (name, in features, out features): q/k/v as one, the
    attention's output projection, the feed-forward's two."""
    inner, ff = d.heads * d.dim_head, d.dim * d.ff_mult
    return (("qkv", d.dim, 3 * inner), ("o", inner, d.dim), ("ff1", d.dim, ff), ("ff2", ff, d.dim))


def block_token_flops(d: DiTConfig) -> float:
    """One DiT block's GEMM FLOPs per transformer token."""
    return 2.0 * sum(k * n for _, k, n in block_gemms(d))


def attention_pair_flops(d: DiTConfig) -> float:
    """One layer's attention FLOPs per query-key pair (QK^T and PV over every head)."""
    return 4.0 * d.heads * d.dim_head


def dit_token_flops(d: DiTConfig) -> float:
    """One DiT pass's linear and conv FLOPs per transformer token (its AdaLN runs once per row
    and step, not per token, so it is left out)."""
    conv = 2 * d.dim * (d.dim // d.conv_pos_groups) * d.conv_pos_kernel
    macs = (2 * d.mel_dim + d.mu_dim + d.spk_dim) * d.dim + conv + d.dim * d.out_channels
    return d.depth * block_token_flops(d) + 2.0 * macs


def solve_flops(cfg: FlowConfig, tokens: int, attn_pairs: int = 0) -> float:
    """FLOPs of a whole solve (every Euler step) over ``tokens`` transformer tokens per step (CFG
    twins included) whose attention computes ``attn_pairs`` query-key pairs per layer and step."""
    d = cfg.dit
    return cfg.n_timesteps * (tokens * dit_token_flops(d) + attention_pair_flops(d) * d.depth * attn_pairs)
