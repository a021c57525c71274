"""The DiT's per-token math as plain functions of tensors, for the packed runner.

Same operations as ``DiTBlock.attn_inputs`` / ``attn_outputs`` and the input embedding in
``cosybatch.models.dit``, rearranged for speed without changing the math: q/k/v come from one
fused GEMM, the head-0 rotary is applied to q and k together on their first ``rot`` channels
only, and the modulation's ``1 + scale`` is precomputed (it depends on t only). Written over
explicit weights so that one ``torch.compile`` graph serves every block (compiling bound
methods would specialise on each block and hit the recompile limit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cosybatch.models.dit import LN_EPS, DiT


def _modulated_ln(x: torch.Tensor, scale1: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """LN(x) * (1 + scale) + shift. The modulation is the same for every token of a step (all
    rows share t), so it is exactly LayerNorm's affine: one kernel instead of three passes."""
    return F.layer_norm(x, (x.shape[-1],), scale1, shift, eps=LN_EPS)


def rotary_tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [N, rot] fp32 for ``freqs`` [N, rot], computed once per call.

    The GPT-J rotate_half maps each pair (a, b) to (-b, a); with the pair swapped to (b, a),
    the sign moves into the sine table: out = x * cos + swap(x) * (-sin, +sin).
    """
    sign = (torch.arange(freqs.shape[-1], device=freqs.device) % 2) * 2 - 1  # -1, +1, -1, ...
    return freqs.cos(), freqs.sin() * sign


def rotary_qk_(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """In place on qkv [N, 3, inner]: the rotary of q's and k's first ``rot`` channels (only
    head 0 carries it), in float32. Five kernels; ``triton_kernels.rotary_qk_`` is one."""
    qk = qkv[:, :2, : cos.shape[-1]]
    xr = qk.float()
    swapped = xr.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    qk.copy_(torch.addcmul(xr * cos[:, None], swapped, sin_signed[:, None]))


def rotary_qk_kv_(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_dst: torch.Tensor,
                  v_dst: torch.Tensor, rows: torch.Tensor) -> None:
    """``rotary_qk_``, then each token's (rotated) k and its v copied to rows ``rows`` [N] of the
    K/V arenas ``k_dst``, ``v_dst`` [M, H, Dh]: the eager twin of ``triton_kernels.rotary_qk_kv_``."""
    rotary_qk_(qkv, cos, sin_signed)
    _, k, v = qkv.unflatten(-1, (k_dst.shape[1], -1)).unbind(1)
    k_dst.index_copy_(0, rows, k)
    v_dst.index_copy_(0, rows, v)


def block_pre(h, shift, scale1, wqkv, bqkv, cos, sin_signed, heads: int, rotary_=rotary_qk_,
              rotary_kv_=rotary_qk_kv_, kv=None):
    """Modulated pre-norm, fused q/k/v and the head-0 rotary: h [N, D] -> q, k, v [N, H, Dh]
    (strided views of one [N, 3, H, Dh] buffer; ``scale1`` is the precomputed 1 + scale)."""
    return block_qkv(_modulated_ln(h, scale1, shift), wqkv, bqkv, cos, sin_signed, heads, rotary_, rotary_kv_, kv)


def block_qkv(x, wqkv, bqkv, cos, sin_signed, heads: int, rotary_=rotary_qk_, rotary_kv_=rotary_qk_kv_, kv=None):
    """``block_pre`` after its LayerNorm: x [N, D] (already modulated-normalized, e.g. by the
    previous block's ``residual_ln``) -> q, k, v. ``kv`` = (k arena, v arena, rows): the rotary is
    then ``rotary_kv_``, which also writes each token's k and v to its arena row."""
    qkv = F.linear(x, wqkv, bqkv).unflatten(-1, (3, -1))  # [N, 3, inner]
    if kv is None:
        rotary_(qkv, cos, sin_signed)
    else:
        rotary_kv_(qkv, cos, sin_signed, *kv)
    q, k, v = qkv.unflatten(-1, (heads, -1)).unbind(1)
    return q, k, v


def block_pre_functional(h, shift, scale1, wqkv, bqkv, cos, sin_signed, heads: int):
    """``block_pre`` without in-place writes or views of a shared buffer, for torch.compile.

    Under torch.compile on the H200 the fused in-place form ran at half its eager speed; this
    form follows the one that compiled to 347 TFLOP/s (full pass, 64k packed tokens)."""
    x = _modulated_ln(h, scale1, shift)
    inner = wqkv.shape[0] // 3
    rot = cos.shape[-1]

    def rotate(t):
        xr = t[:, :rot].float()
        swapped = xr.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        return torch.cat((torch.addcmul(xr * cos, swapped, sin_signed).to(t.dtype), t[:, rot:]), dim=-1)

    q = rotate(F.linear(x, wqkv[:inner], bqkv[:inner]))
    k = rotate(F.linear(x, wqkv[inner : 2 * inner], bqkv[inner : 2 * inner]))
    v = F.linear(x, wqkv[2 * inner :], bqkv[2 * inner :])
    return q.unflatten(-1, (heads, -1)), k.unflatten(-1, (heads, -1)), v.unflatten(-1, (heads, -1))


def ff1_gelu(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor) -> torch.Tensor:
    """GELU(tanh)(x @ w1.T + b1): the feed-forward's first GEMM and its activation (two kernels)."""
    return F.gelu(F.linear(x, w1, b1), approximate="tanh")


def ff1_gelu_epilogue(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor) -> torch.Tensor:
    """``ff1_gelu`` on CUDA as one cuBLASLt GEMM with its bias + GELU epilogue: the tanh
    approximation, as ``F.gelu(approximate="tanh")`` (PyTorch's CUDA fallbacks without the
    epilogue apply that GELU too). The epilogue applies GELU to the float32 accumulator and
    rounds once, where the eager pair rounds the GEMM's output first: outputs may differ by a
    bf16 step. Elsewhere the eager pair: the CPU's ``_addmm_activation`` applies the exact (erf)
    GELU, not the model's (measured: 8.9e-5 mean from tanh's, 1.1e-7 from erf's, float32)."""
    if not x.is_cuda:
        return ff1_gelu(x, w1, b1)
    return torch._addmm_activation(b1, x, w1.t(), use_gelu=True)


def block_post(h, attn, gate_msa, shift_mlp, scale1_mlp, gate_mlp, wo, bo, w1, b1, w2, b2, residual_ln=None,
               ff1=ff1_gelu, next_ln=None, keep_h=True):
    """Output projection, gated residual and the modulated GELU(tanh) feed-forward.

    ``residual_ln`` (``triton_kernels.gated_residual_ln``): the gated residual and the modulated
    LayerNorm after it in one pass (2.4x faster than the two eager kernels at 6,400 tokens on
    the H200; the residual bit-equal, the LayerNorm's output within a bf16 step).
    ``next_ln`` = (1 + scale, shift) of the modulated LayerNorm that reads this block's output
    (the next block's pre-norm, or the final AdaLN after the last block): the feed-forward's gated
    residual then goes through ``residual_ln`` too, and (h, that LayerNorm's output) is returned
    (``block_qkv`` takes the latter), so a block's own pre-norm is no kernel of its own.
    ``keep_h=False`` (the last block): the fused kernel need not store h (None is returned)."""
    y = F.linear(attn, wo, bo)
    if residual_ln is None:
        h = torch.addcmul(h, gate_msa, y)
        x = _modulated_ln(h, scale1_mlp, shift_mlp)
    else:
        h, x = residual_ln(h, gate_msa, y, scale1_mlp, shift_mlp, LN_EPS)
    y = F.linear(ff1(x, w1, b1), w2, b2)
    if next_ln is None:
        return torch.addcmul(h, gate_mlp, y)
    if residual_ln is None:
        h = torch.addcmul(h, gate_mlp, y)
        return h, _modulated_ln(h, *next_ln)
    return residual_ln(h, gate_mlp, y, *next_ln, LN_EPS, keep_h=keep_h)


def block_weights(dit: DiT) -> list[tuple[tuple, tuple]]:
    """Per block: (fused q/k/v weight and bias for ``block_pre``, out/ff weights for ``block_post``)."""
    out = []
    for blk in dit.transformer_blocks:
        a, ff = blk.attn, blk.ff.ff
        wqkv = torch.cat((a.to_q.weight, a.to_k.weight, a.to_v.weight)).detach()
        bqkv = torch.cat((a.to_q.bias, a.to_k.bias, a.to_v.bias)).detach()
        post = (a.to_out[0].weight, a.to_out[0].bias, ff[0][0].weight, ff[0][0].bias, ff[2].weight, ff[2].bias)
        out.append(((wqkv, bqkv), post))
    return out


def block_modulation(blk, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(shift, 1+scale, gate, shift_mlp, 1+scale_mlp, gate_mlp) [D] for one block at one t."""
    shift, scale, gate, shift_m, scale_m, gate_m = (m.reshape(-1) for m in blk.modulation(temb))
    return shift, 1 + scale, gate, shift_m, 1 + scale_m, gate_m


class ConvPositionEmbed:
    """``CausalConvPositionEmbedding(h) + h`` over a packed conv layout h [L, D].

    Rows are separated by at least ``kernel - 1`` zero frames (``valid`` = 0) and the first
    conv's output is re-zeroed there, so each row sees exactly the official zero padding.
    ``form``:

    - ``"triton"`` (CUDA): each conv, its bias, Mish and the mask or the residual add as one
      Triton kernel (``triton_kernels.causal_conv_mish``). cuDNN runs these 16-group convs as
      one kernel per group, each too small to fill the GPU: 1.13 ms of the 6.9 ms of kernels
      of a 3,456-token step on the H200, against 0.17 ms for the Triton pair; inside a graph
      the step gained 0.18 ms (docs/performance.md).
    - ``"channels_last"`` (CUDA without Triton): the time-major activations already are a
      channels-last [1, D, 1, L] image, the layout cuDNN's grouped-conv kernels prefer, so no
      transposes are needed; the causal alignment comes from symmetric implicit padding with
      the right overhang dropped. (A form that unfolds the 31-frame windows into one batched
      GEMM per conv was slower than this inside graphs: the unfolded windows' memory traffic.)
    - ``"conv1d"``: the module's own [1, D, L] form (faster on CPUs).
    """

    FORMS = ("triton", "channels_last", "conv1d")

    @staticmethod
    def triton_fits(dit: DiT) -> bool:
        """Whether the Triton form can run this DiT: its tensor-core tiles need a power of two
        of at least 16 channels per group (the full model has 64; small test checkpoints less)."""
        cg = dit.cfg.dim // dit.cfg.conv_pos_groups
        return cg >= 16 and cg & (cg - 1) == 0

    def __init__(self, dit: DiT, form: str):
        if form not in self.FORMS:
            raise ValueError(f"conv form must be one of {self.FORMS}, got {form!r}")
        if form == "triton" and not self.triton_fits(dit):
            raise ValueError("the Triton conv form needs a power of two >= 16 channels per group")
        pe = dit.input_embed.conv_pos_embed
        self.k = pe.kernel
        self.form = form
        self.convs = []
        if form == "triton":
            from cosybatch.codec import triton_kernels

            self._kernel = triton_kernels.causal_conv_mish
        for seq in (pe.conv1, pe.conv2):
            c = seq[0]
            w = c.weight.detach()
            if form == "triton":
                w = triton_kernels.conv_weight(w, c.groups)
            elif form == "channels_last":
                w = w.unsqueeze(2).contiguous(memory_format=torch.channels_last)
            self.convs.append((w, c.bias.detach(), c.groups))

    def __call__(self, h: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        if self.form == "triton":
            (w1, b1, _), (w2, b2, _) = self.convs
            h = h.contiguous()
            return self._kernel(self._kernel(h, w1, b1, valid=valid), w2, b2, residual=h)
        if self.form == "channels_last":
            y = h.t()[None, :, None, :]  # [1, D, 1, L] view, channels-last strides
            for i, (w, b, groups) in enumerate(self.convs):
                y = F.mish(F.conv2d(y, w, b, padding=(0, self.k - 1), groups=groups)[..., :n])
                if i == 0:
                    y = y * valid
            return y[0, :, 0, :].t() + h
        y = h.t().unsqueeze(0)
        for i, (w, b, groups) in enumerate(self.convs):
            y = F.mish(F.conv1d(F.pad(y, (self.k - 1, 0)), w, b, groups=groups))
            if i == 0:
                y = y * valid
        return y[0].t() + h
