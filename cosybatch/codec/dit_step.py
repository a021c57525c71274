"""The DiT's per-token math as plain functions of tensors, for the packed runner.

Same operations, same order as ``DiTBlock.attn_inputs`` / ``attn_outputs`` and the input
embedding in ``cosybatch.models.dit``; written over explicit weights so that one
``torch.compile`` graph serves every block (compiling bound methods would specialise on each
block and hit the recompile limit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cosybatch.models.dit import LN_EPS, DiT


def _ln(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=LN_EPS)


def rotary_tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the rotary angles [N, rot] (fp32), computed once per call, not per layer."""
    return freqs.cos(), freqs.sin()


def _rotate_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``dit.apply_rotary`` done in place on the first ``rot`` channels only (only head 0 is
    rotated), so the other channels are never copied."""
    rot = cos.shape[-1]
    xr = x[:, :rot].float()
    a, b = xr.unflatten(-1, (-1, 2)).unbind(-1)
    turned = torch.stack((-b, a), dim=-1).flatten(-2)  # GPT-J interleaved rotate_half
    x[:, :rot] = (xr * cos + turned * sin).to(x.dtype)
    return x


def block_pre(h, shift, scale, wq, bq, wk, bk, wv, bv, cos, sin, heads: int):
    """Modulated pre-norm, q/k/v and the head-0 rotary: h [N, D] -> q, k, v [N, H, Dh]."""
    x = _ln(h) * (1 + scale) + shift
    q = _rotate_first(F.linear(x, wq, bq), cos, sin)
    k = _rotate_first(F.linear(x, wk, bk), cos, sin)
    v = F.linear(x, wv, bv)
    return q.unflatten(-1, (heads, -1)), k.unflatten(-1, (heads, -1)), v.unflatten(-1, (heads, -1))


def block_post(h, attn, gate_msa, shift_mlp, scale_mlp, gate_mlp, wo, bo, w1, b1, w2, b2):
    """Output projection, gated residual and the modulated GELU(tanh) feed-forward."""
    h = h + gate_msa * F.linear(attn, wo, bo)
    x = _ln(h) * (1 + scale_mlp) + shift_mlp
    return h + gate_mlp * F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def block_weights(dit: DiT) -> list[tuple[tuple, tuple]]:
    """Per block: (q/k/v weights for ``block_pre``, out/ff weights for ``block_post``)."""
    out = []
    for blk in dit.transformer_blocks:
        a, ff = blk.attn, blk.ff.ff
        pre = (a.to_q.weight, a.to_q.bias, a.to_k.weight, a.to_k.bias, a.to_v.weight, a.to_v.bias)
        post = (a.to_out[0].weight, a.to_out[0].bias, ff[0][0].weight, ff[0][0].bias, ff[2].weight, ff[2].bias)
        out.append((pre, post))
    return out


def conv_position_embed(dit: DiT, h: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``CausalConvPositionEmbedding(h) + h`` over a packed conv layout h [L, D].

    Rows are separated by at least ``kernel - 1`` zero frames (``valid`` = 0), and the first
    conv's output is re-zeroed there, so each row sees exactly the official zero padding.
    """
    pe = dit.input_embed.conv_pos_embed
    k = pe.kernel
    y = h.t().unsqueeze(0)
    y = pe.conv1(F.pad(y, (k - 1, 0))) * valid
    y = pe.conv2(F.pad(y, (k - 1, 0)))
    return y[0].t() + h
