"""The packed flow's arithmetic: what benchmarks and the timeline divide by time to get TFLOP/s."""

from __future__ import annotations

from cosybatch.models.config import DiTConfig, FlowConfig


def dit_token_flops(d: DiTConfig) -> float:
    """One DiT pass's linear and conv FLOPs per transformer token (its AdaLN runs once per row
    and step, not per token, so it is left out)."""
    inner, ff = d.heads * d.dim_head, d.dim * d.ff_mult
    block = 3 * d.dim * inner + inner * d.dim + 2 * d.dim * ff
    conv = 2 * d.dim * (d.dim // d.conv_pos_groups) * d.conv_pos_kernel
    macs = d.depth * block + (2 * d.mel_dim + d.mu_dim + d.spk_dim) * d.dim + conv + d.dim * d.out_channels
    return 2.0 * macs


def solve_flops(cfg: FlowConfig, tokens: int, attn_pairs: int = 0) -> float:
    """FLOPs of a whole solve (every Euler step) over ``tokens`` transformer tokens per step (CFG
    twins included) whose attention computes ``attn_pairs`` query-key pairs per layer and step."""
    d = cfg.dit
    return cfg.n_timesteps * (tokens * dit_token_flops(d) + 4.0 * d.heads * d.dim_head * d.depth * attn_pairs)
