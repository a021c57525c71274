"""S3TokenizerV3: the speech tokenizer of CosyVoice3 (``speech_tokenizer_v3.onnx``) in PyTorch.

Whisper-style encoder on 128-bin log-mel at 100 Hz:

* ``conv1`` (k3, stride 2, pad 1) + GELU, ``conv2`` (k3, stride 2, pad 1) + GELU: 100 -> 25 Hz;
* ``layers`` pre-LayerNorm blocks: FSMN attention (rotary q/k, no key bias, both q and k scaled
  by head_dim**-0.25, plus a depthwise "memory" conv over v added to the output) and a 4x GELU MLP;
* ``quantizer.project_in`` (dim -> 8) and ternary FSQ: ``round(tanh(h) * 0.999) + 1`` are the
  base-3 digits of the code, digit i weighted 3**i (6561 codes).

Attribute names follow the module scopes of the official ONNX graph (``/conv1/Conv``,
``/blocks.N/attn/query/MatMul``, ``/quantizer/project_in/MatMul`` ...), so state-dict keys and
node names correspond one to one (see ``cosybatch.checkpoint.onnx_weights``).

Padding: rows of a batch are padded at the end and carry their lengths. Inputs of both convs are
zeroed past each row's length, attention ignores padded keys and the FSMN memory conv sees zeros
there, exactly like a row run alone (where the conv's own zero padding sits at the same place):
a row's codes do not depend on what it is batched with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from cosybatch.models.masks import length_mask

FSQ_SCALE = 0.9990000128746033  # float32(0.999): keeps tanh away from +-1 before rounding
ATTN_MASK_VALUE = -1.0e10  # additive bias on padded keys, as in the official graph


@dataclass(frozen=True)
class S3TokenizerConfig:
    n_mels: int = 128
    dim: int = 1280
    heads: int = 20
    layers: int = 12
    fsmn_kernel: int = 31
    fsq_digits: int = 8
    attn_ln_eps: float = 1e-5
    mlp_ln_eps: float = 1e-5
    max_positions: int = 2048  # rotary table rows: 81 s of 25 Hz tokens

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def __post_init__(self):
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError(f"dim {self.dim} must split into {self.heads} heads of even size")
        if self.fsmn_kernel % 2 == 0:
            raise ValueError("the FSMN kernel must be odd")


def rotary_tables(head_dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, head_dim] float32 (theta 1e4; both halves carry the same angles).

    The ONNX stand-in writer stores exactly these tensors, so both paths rotate with identical
    numbers."""
    # on the CPU whatever device context is current: under ``torch.device("meta")`` (the loader
    # builds the module there) arange goes through torch._refs, whose import of torch._dynamo
    # cost the start-up ~2 s
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")[: head_dim // 2] / head_dim))
    phase = torch.outer(torch.arange(positions, dtype=torch.float32, device="cpu"), inv)
    return torch.cat([phase.cos(), phase.cos()], -1), torch.cat([phase.sin(), phase.sin()], -1)


def conv_out_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Valid frames after one k3/stride-2/pad-1 conv: ceil(L / 2)."""
    return (lengths - 1) // 2 + 1


def token_lengths(feat_lengths: torch.Tensor) -> torch.Tensor:
    """25 Hz codes per row for ``feat_lengths`` 100 Hz frames: ceil(ceil(L/2)/2) = ceil(L/4)."""
    return conv_out_lengths(conv_out_lengths(feat_lengths))


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, hd] * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) =
    roll(x) * [-1.., 1..] and that sign folded into ``sin_signed`` (exact: a sign flip). The
    tables come repeated over heads, [1, T, H, hd], so both products broadcast over the batch
    only and run as vectorised kernels."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


class FSMNAttention(nn.Module):
    def __init__(self, cfg: S3TokenizerConfig):
        super().__init__()
        d = cfg.dim
        self.heads = cfg.heads
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        # zero padding (k-1)/2 on both sides, as the official graph pads before this conv
        self.fsmn_block = nn.Conv1d(d, d, cfg.fsmn_kernel, padding=(cfg.fsmn_kernel - 1) // 2, groups=d, bias=False)

    def forward(self, x, keep: torch.Tensor | None, bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor):
        """x [B,T,D]; keep [B,T,1] (1 valid, 0 pad) and bias [B,1,1,T] (-1e10 on padded keys),
        both None when nothing is padded; cos/sin [1,T,1,hd] rotary tables times
        head_dim**-0.25 (the official graph scales both q and k by it), sin signed."""
        b, t, d = x.shape
        q = _rotary(self.query(x).view(b, t, self.heads, -1), cos, sin).view(b, t, d)
        k = _rotary(self.key(x).view(b, t, self.heads, -1), cos, sin).view(b, t, d)
        v = self.value(x)
        # FSMN memory: depthwise conv over the (masked) values, plus the values themselves
        vm = v if keep is None else v * keep
        mem = self.fsmn_block(vm.transpose(1, 2)).transpose(1, 2) + vm
        if keep is not None:
            mem = mem * keep
        qh, kh, vh = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        mask = None if bias is None else bias.to(q.dtype)
        att = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=1.0)
        return self.out(att.transpose(1, 2).reshape(b, t, d)) + mem


class ResidualBlock(nn.Module):
    def __init__(self, cfg: S3TokenizerConfig):
        super().__init__()
        self.attn_ln = nn.LayerNorm(cfg.dim, eps=cfg.attn_ln_eps)
        self.attn = FSMNAttention(cfg)
        self.mlp_ln = nn.LayerNorm(cfg.dim, eps=cfg.mlp_ln_eps)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x, keep, bias, cos, sin):
        x = x + self.attn(self.attn_ln(x), keep, bias, cos, sin)
        return x + self.mlp(self.mlp_ln(x))


class FSQHead(nn.Module):
    def __init__(self, cfg: S3TokenizerConfig):
        super().__init__()
        self.project_in = nn.Linear(cfg.dim, cfg.fsq_digits)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # The rounding decides the code: callers running the encoder in bfloat16 keep this
        # projection in float32 (``S3TokenizerV3.to_mixed``), and h is promoted to its dtype.
        z = self.project_in(h.to(self.project_in.weight.dtype)).float()
        digits = (torch.tanh(z) * FSQ_SCALE).round() + 1.0
        # not a buffer: model.to(bfloat16) would round 3**7 = 2187
        powers = 3.0 ** torch.arange(digits.shape[-1], device=h.device, dtype=torch.float32)
        return (digits * powers).sum(-1).to(torch.long)


class S3TokenizerV3(nn.Module):
    def __init__(self, cfg: S3TokenizerConfig = S3TokenizerConfig()):
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.n_mels, cfg.dim, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(cfg.dim, cfg.dim, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(ResidualBlock(cfg) for _ in range(cfg.layers))
        self.quantizer = FSQHead(cfg)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)make the rotary tables on the CPU (they are not in the state dict), already
        times head_dim**-0.25 (the official graph scales both q and k by it) and with
        rotate_half's sign folded into sin (see ``_rotary``)."""
        cos, sin = rotary_tables(self.cfg.head_dim, self.cfg.max_positions)
        scale = self.cfg.head_dim ** -0.25
        half = self.cfg.head_dim // 2
        sign = torch.cat([-torch.ones(half, device="cpu"), torch.ones(half, device="cpu")])
        self.register_buffer("rope_cos", cos * scale, persistent=False)
        self.register_buffer("rope_sin", sin * (sign * scale), persistent=False)

    def to_mixed(self, device, dtype: torch.dtype) -> "S3TokenizerV3":
        """Move to ``device``; the encoder in ``dtype``, the FSQ projection in float32."""
        self.to(device=device, dtype=dtype)
        self.quantizer.float()
        return self

    def encode(self, feats: torch.Tensor, lengths: torch.Tensor, padded: bool | None = None):
        """feats [B, n_mels, T] (any float dtype), lengths [B] -> (hidden [B, T4, D], T4 lengths).
        ``padded``: whether any row is shorter than T (None: find out, which syncs a GPU)."""
        if feats.dim() != 3 or feats.shape[1] != self.cfg.n_mels:
            raise ValueError(f"expected feats [B, {self.cfg.n_mels}, T], got {tuple(feats.shape)}")
        lengths = lengths.to(device=feats.device, dtype=torch.long)
        if padded is None:
            padded = bool((lengths < feats.shape[2]).any())
        dtype = self.conv1.weight.dtype
        x = feats.to(dtype)
        if padded:
            x = x * length_mask(lengths, x.shape[2])[:, None].to(dtype)
        x = F.gelu(self.conv1(x))
        lengths = conv_out_lengths(lengths)
        if padded:
            x = x * length_mask(lengths, x.shape[2])[:, None].to(dtype)
        x = F.gelu(self.conv2(x))
        lengths = conv_out_lengths(lengths)
        t = x.shape[2]
        if t > self.cfg.max_positions:
            raise ValueError(f"{t} tokens exceed the rotary table ({self.cfg.max_positions})")
        keep = bias = None
        if padded:
            valid = length_mask(lengths, t)
            keep = valid[:, :, None].to(dtype)
            bias = ((~valid).to(dtype) * ATTN_MASK_VALUE)[:, None, None, :]
        h = self.cfg.heads
        cos = self.rope_cos[:t].to(dtype)[None, :, None, :].expand(1, t, h, -1).contiguous()
        sin = self.rope_sin[:t].to(dtype)[None, :, None, :].expand(1, t, h, -1).contiguous()
        x = x.transpose(1, 2)
        for block in self.blocks:
            x = block(x, keep, bias, cos, sin)
        return x, lengths

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor, padded: bool | None = None):
        """-> (codes long [B, ceil(T/4)] in [0, 3**8), code lengths [B]); codes past a row's
        length are padding."""
        hidden, lengths = self.encode(feats, lengths, padded)
        return self.quantizer(hidden), lengths


__all__ = ["S3TokenizerConfig", "S3TokenizerV3", "rotary_tables", "token_lengths", "conv_out_lengths"]
