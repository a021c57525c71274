"""CosyVoice3 flow estimator: the DiT of ``cosyvoice/flow/DiT`` (design.md, "The model").

Submodule names mirror flow.pt's ``decoder.estimator.*`` keys so checkpoints load strictly.

The block is split into ``modulation`` / ``attn_inputs`` / ``attention`` / ``attn_outputs``
so that a packed (ragged) runner can reuse the weights and the per-token math while doing
its own attention over many rows. Every per-token helper accepts either padded tensors
``[B, T, D]`` with per-row conditioning ``[B, D]`` or packed tensors ``[N, D]`` with
per-token conditioning ``[N, D]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cosybatch.models.config import DiTConfig

LN_EPS = 1e-6


def _per_token(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Broadcast per-row conditioning [B, D] against padded x [B, T, D]; packed passes through."""
    return p.unsqueeze(-2) if p.dim() < x.dim() else p


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=LN_EPS)


# --------------------------------------------------------------------------- rotary


class RotaryEmbedding(nn.Module):
    """x-transformers ``RotaryEmbedding(dim_head)``; ``inv_freq`` is persistent (it is in flow.pt)."""

    def __init__(self, dim: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """Angles [..., dim] for integer positions, each frequency repeated pairwise (f0,f0,f1,f1,...)."""
        f = positions.to(torch.float32)[..., None] * self.inv_freq.float()
        return f.repeat_interleave(2, dim=-1)

    def forward_from_seq_len(self, seq_len: int) -> torch.Tensor:
        return self.freqs(torch.arange(seq_len, device=self.inv_freq.device))


def _rotate_half_interleaved(x: torch.Tensor) -> torch.Tensor:
    # GPT-J style: channel pairs (a, b) -> (-b, a).
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs.unbind(-1)
    return torch.stack((-b, a), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` channels of x [..., T, inner]; the rest pass through.

    Called on the full inner-width q/k before the head split, as the official code does, so
    only head 0 gets a positional signal (design.md D8).
    """
    rot = freqs.shape[-1]
    dtype = x.dtype
    xr, xp = x[..., :rot].float(), x[..., rot:]
    xr = xr * freqs.cos() + _rotate_half_interleaved(xr) * freqs.sin()
    return torch.cat((xr.to(dtype), xp), dim=-1)


# --------------------------------------------------------------------------- masks


def attention_mask(pad_mask: torch.Tensor, chunk_size: int | None) -> torch.Tensor:
    """Boolean [B, 1, T, T] mask (True = may attend) from a [B, 1, T] or [B, T] padding mask.

    ``chunk_size`` None or <= 0 gives full attention; otherwise frame i sees frames
    j < (i // C + 1) * C, all left chunks included. Rows left with nothing visible become
    all-True, as the official ``add_optional_chunk_mask`` does (their outputs are zeroed later).
    """
    keys = pad_mask.bool().reshape(pad_mask.shape[0], 1, -1)  # [B, 1, T]
    T = keys.shape[-1]
    if chunk_size is not None and chunk_size > 0:
        idx = torch.arange(T, device=keys.device)
        chunk = idx[None, :] < ((idx[:, None] // chunk_size) + 1) * chunk_size  # [T, T]
        m = keys & chunk[None]
    else:
        m = keys
    m = m | (m.sum(dim=-1, keepdim=True) == 0)
    return m.expand(-1, T, -1).unsqueeze(1)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Padded attention: q/k/v [B, T, H, Dh], bool mask [B, 1, T, T] -> [B, T, H*Dh]."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return o.transpose(1, 2).flatten(-2)


# --------------------------------------------------------------------------- embeddings


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def sinusoid(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        step = math.log(10000) / (half - 1)
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -step)
        arg = 1000 * t.unsqueeze(1) * freqs.unsqueeze(0)
        return torch.cat((arg.sin(), arg.cos()), dim=-1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.time_mlp(self.sinusoid(t).to(t.dtype))


class CausalConvPositionEmbedding(nn.Module):
    """Two left-padded grouped convs, each followed by Mish; takes no mask (official)."""

    def __init__(self, dim: int, kernel: int, groups: int):
        super().__init__()
        self.kernel = kernel
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; causal, so right padding never leaks into valid frames."""
        h = x.transpose(1, 2)
        h = self.conv1(F.pad(h, (self.kernel - 1, 0)))
        h = self.conv2(F.pad(h, (self.kernel - 1, 0)))
        return h.transpose(1, 2)


class InputEmbedding(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.mel_dim * 2 + cfg.mu_dim + cfg.spk_dim, cfg.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(cfg.dim, cfg.conv_pos_kernel, cfg.conv_pos_groups)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor) -> torch.Tensor:
        """x/cond/mu [B, T, C] time-major, spks [B, S] -> [B, T, dim]."""
        spk = spks.unsqueeze(1).expand(-1, x.shape[1], -1)
        h = self.proj(torch.cat((x, cond, mu, spk), dim=-1))
        return self.conv_pos_embed(h) + h


# --------------------------------------------------------------------------- blocks


class AdaLayerNormZero(nn.Module):
    """Only the projection of AdaLN-zero holds weights; the norm itself has no affine."""

    def __init__(self, dim: int, n_chunks: int):
        super().__init__()
        self.n_chunks = n_chunks
        self.linear = nn.Linear(dim, dim * n_chunks)

    def forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(F.silu(temb)).chunk(self.n_chunks, dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        # Index 1 of the official ModuleList is a Dropout (no weights, inactive at inference).
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int):
        super().__init__()
        inner = int(dim * mult)
        # Keys ff.0.0 / ff.2: (Linear, GELU) then Dropout then Linear in the official module.
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")), nn.Identity(), nn.Linear(inner, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.attn_norm = AdaLayerNormZero(cfg.dim, 6)
        self.attn = Attention(cfg.dim, cfg.heads, cfg.dim_head)
        self.ff = FeedForward(cfg.dim, cfg.ff_mult)

    def modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp), each shaped like temb."""
        return self.attn_norm(temb)

    def attn_inputs(self, x: torch.Tensor, mod: tuple[torch.Tensor, ...], freqs: torch.Tensor):
        """Modulated pre-norm, q/k/v projections and the head-0-only rotary -> q, k, v [..., H, Dh]."""
        shift, scale = _per_token(mod[0], x), _per_token(mod[1], x)
        h = _layer_norm(x) * (1 + scale) + shift
        a = self.attn
        q = apply_rotary(a.to_q(h), freqs)
        k = apply_rotary(a.to_k(h), freqs)
        v = a.to_v(h)
        split = lambda t: t.unflatten(-1, (self.heads, -1))  # noqa: E731
        return split(q), split(k), split(v)

    def attn_outputs(self, x: torch.Tensor, attn: torch.Tensor, mod: tuple[torch.Tensor, ...], query_keep: torch.Tensor | None) -> torch.Tensor:
        """Output projection, padding-query zeroing, gated residual and the modulated FF.

        ``attn`` is [..., H*Dh] aligned with x; ``query_keep`` [...] bool (None = keep all).
        """
        o = self.attn.to_out[0](attn)
        if query_keep is not None:
            o = o.masked_fill(~query_keep.unsqueeze(-1), 0.0)
        x = x + _per_token(mod[2], x) * o
        h = _layer_norm(x) * (1 + _per_token(mod[4], x)) + _per_token(mod[3], x)
        return x + _per_token(mod[5], x) * self.ff(h)

    def forward(self, x, temb, attn_mask, freqs, query_keep):
        mod = self.modulation(temb)
        q, k, v = self.attn_inputs(x, mod, freqs)
        return self.attn_outputs(x, sdpa_attention(q, k, v, attn_mask), mod, query_keep)


class AdaLayerNormZeroFinal(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim * 2)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        # The final modulation is chunked as (scale, shift), the reverse of the blocks' order.
        scale, shift = self.linear(F.silu(temb)).chunk(2, dim=-1)
        return _layer_norm(x) * (1 + _per_token(scale, x)) + _per_token(shift, x)


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.time_embed = TimestepEmbedding(cfg.dim, cfg.time_freq_dim)
        self.input_embed = InputEmbedding(cfg)
        self.rotary_embed = RotaryEmbedding(cfg.dim_head, cfg.rope_base)
        self.transformer_blocks = nn.ModuleList([DiTBlock(cfg) for _ in range(cfg.depth)])
        self.norm_out = AdaLayerNormZeroFinal(cfg.dim)
        self.proj_out = nn.Linear(cfg.dim, cfg.mel_dim)

    def embed(self, x, mu, t, spks, cond):
        """Time embedding [B, dim] and input embedding [B, T, dim] from channel-major inputs."""
        if t.dim() == 0:
            t = t.repeat(x.shape[0])
        temb = self.time_embed(t)
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)
        return temb, h

    def head(self, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """Final AdaLN + projection: [..., dim] -> [..., mel_dim] (time-major)."""
        return self.proj_out(self.norm_out(h, temb))

    def forward(self, x, mask, mu, t, spks, cond, streaming: bool = False) -> torch.Tensor:
        """x/mu/cond [B, mel, T], mask [B, 1, T], t [B] (or scalar), spks [B, spk] -> [B, mel, T]."""
        temb, h = self.embed(x, mu, t, spks, cond)
        freqs = self.rotary_embed.forward_from_seq_len(h.shape[1])
        attn_mask = attention_mask(mask, self.cfg.static_chunk_size if streaming else None)
        # The official code zeroes attention outputs with the last query row of the mask,
        # which is the key padding mask (every row sees all keys of the last chunk).
        query_keep = attn_mask[:, 0, -1]
        for block in self.transformer_blocks:
            h = block(h, temb, attn_mask, freqs, query_keep)
        return self.head(h, temb).transpose(1, 2)
