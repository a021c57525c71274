"""Qwen2 decoder backbone (the CosyVoice3 LLM trunk), state-dict compatible with HF Qwen2Model.

The layer math is split into reusable pieces so that a faster runner (paged KV cache, its own
attention kernel) can drive the same weights:

* ``Qwen2Model.rope(positions, dtype)`` -> ``(cos, sin)``, each ``[B, T, head_dim]``;
* ``Qwen2DecoderLayer.attn_inputs(x, cos, sin)`` -> ``q [B,T,Hq,D], k/v [B,T,Hkv,D]`` (RoPE applied);
* ``Qwen2DecoderLayer.attn_output_and_mlp(x, attn)`` with ``attn [B,T,Hq*D]`` (before ``o_proj``);
* ``Qwen2Model.norm`` for the final RMSNorm.

``Qwen2Model.forward`` composes them with SDPA and the simple contiguous ``KVCache`` below, which
is the reference path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cosybatch.models.config import QwenConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF normalises in float32 and multiplies by the gain only after casting back.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos/sin [B, T, D] (non-interleaved halves, as HF Qwen2)."""
    cos = cos.unsqueeze(2)
    sin = sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Standard HF rotary table. ``inv_freq`` is kept out of the state dict (as in HF) and is
    recomputed in float32 per device, so casting the model to half precision cannot degrade it."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        f = self._inv_freq.get(device)
        if f is None:
            exps = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
            f = 1.0 / (self.theta ** exps)
            self._inv_freq[device] = f
        return f

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq(positions.device)
        freqs = positions.float().unsqueeze(-1) * inv  # [B, T, D/2], float32 like HF
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class KVCache:
    """Reference cache: one contiguous [B, Hkv, S, D] K and V per layer, grown by concatenation."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k/v [B, Hkv, T, D]; return the full cached K/V of that layer."""
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] (already normed) -> q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D], RoPE on q/k."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [B,Hq,T,D], k/v [B,Hkv,S,D]; attn_mask bool (True = attend) or None for plain causal
        (T == S). Returns [B, T, Hq*D]."""
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            # kv head j serves query heads j*rep .. j*rep+rep-1 (HF repeat_kv layout)
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if attn_mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        b, _, t, _ = o.shape
        return o.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)


class Qwen2MLP(nn.Module):
    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: QwenConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = Qwen2Attention(cfg)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attn_inputs(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual stream x [B,T,H] -> (q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D])."""
        return self.self_attn.project_qkv(self.input_layernorm(x), cos, sin)

    def attn_output_and_mlp(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual stream x [B,T,H] and attention result attn [B,T,Hq*D] (pre o_proj) -> next x."""
        x = x + self.self_attn.o_proj(attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        q, k, v = self.attn_inputs(x, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        return self.attn_output_and_mlp(x, self.self_attn.sdpa(q, k, v, attn_mask))


def causal_mask_with_past(past: int, t: int, device: torch.device) -> torch.Tensor:
    """Bool [1, 1, t, past+t]: new query i (absolute past+i) sees keys 0..past+i."""
    q_abs = torch.arange(past, past + t, device=device).unsqueeze(1)
    k_abs = torch.arange(past + t, device=device).unsqueeze(0)
    return (k_abs <= q_abs).view(1, 1, t, past + t)


class Qwen2Model(nn.Module):
    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(positions, dtype)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs_embeds [B,T,H], positions [B,T] long -> post-norm hidden [B,T,H].

        Causal over the cache plus the new tokens. ``attn_mask`` (bool [B|1, 1, T, S], True =
        attend) replaces the causal mask, e.g. for left-padded batches."""
        x = inputs_embeds
        cos, sin = self.rope(positions, x.dtype)
        if attn_mask is None and cache is not None and cache.length > 0:
            attn_mask = causal_mask_with_past(cache.length, x.shape[1], x.device)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, attn_mask)
        return self.norm(x)
