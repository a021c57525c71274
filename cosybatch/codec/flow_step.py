"""One Euler step of the packed flow solve, written so that one CUDA graph serves every step.

Everything a step reads lives in a :class:`StepBuffers` (the graph's static inputs), and the
step index is a device scalar the step itself advances: the modulation vectors, the time step
and the prefix-cache slot of each layer are looked up from it, so replaying one captured step
ten times is the whole 10-step solve (design.md D16). The math is the official one: the DiT
(``cosybatch.models.dit``) through the fused helpers of ``dit_step``, classifier-free guidance
``v = (1 + r) v_cond - r v_uncond`` and ``x += dt * v`` with the official time schedule.

Padding (graph buckets) is inert by construction: padded tokens read zero keys (their output
is zeros), gather conv input from a masked sink frame, and write K/V into the arena's dump
frame; nothing they compute is ever read for a real token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from cosybatch.codec.attention import LaunchMeta
from cosybatch.codec.dit_step import ConvPositionEmbed, block_post, block_pre, block_qkv
from cosybatch.models.dit import LN_EPS


@dataclass
class FlowTables:
    """Per-runner constants, indexed by the step scalar: identical for every row (all rows share t)."""

    mods: torch.Tensor  # [steps, depth, 6, dim]: shift, 1+scale, gate, shift_mlp, 1+scale_mlp, gate_mlp
    final: torch.Tensor  # [steps, 2, dim]: 1+scale, shift of the final AdaLN
    dt: torch.Tensor  # [steps] float32, the official accumulated schedule
    cfg_rate: float
    blocks: list  # per block: ((wqkv, bqkv), (wo, bo, w1, b1, w2, b2))
    proj_in: tuple  # (weight, bias) of the input embedding's projection
    proj_out: tuple
    conv: ConvPositionEmbed
    heads: int
    pre: Callable = block_pre  # dit_step.block_pre, or a compiled twin
    post: Callable = block_post
    # The fused layer (design.md D26), each part on its own so that each can be measured:
    # ``chain``: every block's feed-forward residual also computes the next block's modulated
    # LayerNorm (the last block's: the final AdaLN), through ``post(..., next_ln=...)``, and
    # blocks start from that output through ``qkv`` (dit_step.block_qkv): one LayerNorm per step.
    chain: bool = False
    qkv: Callable = block_qkv
    # ``kv_writes``: the rotary also writes each token's K/V row into the arena (``kv=`` of
    # ``pre``/``qkv``), where the eager form is two index_copy_ per layer.
    kv_writes: bool = False
    # ``fill``: the attention writes one output (pool and self launches together) and its own
    # zeros, where the eager form zero-fills each launch's output and selects with torch.where.
    fill: bool = False
    # ``merge`` (read when a call's buffers are made, ``StepBuffers.merged``): a call with both
    # launches runs them as one kernel launch.
    merge: bool = False


@dataclass
class StepBuffers:
    """The inputs and state of one solve (for a graph: its static tensors, bucket-sized)."""

    x: torch.Tensor  # [stride, mel] float32 Euler state, one copy per job token
    step: torch.Tensor  # [1] long: the next step's index
    static: torch.Tensor  # [conv_len, 2 * mel + spk] dtype: cond | mu | spk per conv frame
    valid: torch.Tensor  # [conv_len] bool
    conv_of_token: torch.Tensor  # [2 * stride] long
    cos: torch.Tensor  # [2 * stride, rot] float32 rotary tables of each token's position
    sin: torch.Tensor
    pool_slots: torch.Tensor  # [2 * stride] long, frame within an arena slot (the dump for non-pool tokens)
    pool_mask: torch.Tensor  # [2 * stride, 1, 1] bool: token attends through the pool launch
    pool: LaunchMeta | None
    self_: LaunchMeta | None
    margin_conv: torch.Tensor | None = None  # [2 * margin] long
    margin: torch.Tensor | None = None  # [steps, margin, mel] dtype: earlier trajectory at the margin frames
    # ``pool`` is both launches as one (``prepare_pair``: the pool's keys from the arena, the
    # self launch's from this call's k/v); ``self_`` is then None
    merged: bool = False
    record_idx: torch.Tensor | None = None  # [records] long: tokens whose trajectory the next hop needs
    traj: torch.Tensor | None = None  # [steps, records, mel] float32, written step by step
    extra: dict = field(default_factory=dict)

    @property
    def stride(self) -> int:
        return self.x.shape[0]


def euler_step(b: StepBuffers, t: FlowTables, backend, arena=None) -> None:
    """Advance ``b`` by one Euler step in place (no host sync: capturable)."""
    s = b.step
    stride = b.stride
    dtype = b.static.dtype
    xx = b.x.to(dtype)
    xin = torch.zeros(b.static.shape[0], b.x.shape[1], device=xx.device, dtype=dtype)
    xin.index_copy_(0, b.conv_of_token, torch.cat((xx, xx)))
    if b.margin is not None:
        m = b.margin.index_select(0, s)[0]
        xin.index_copy_(0, b.margin_conv, torch.cat((m, m)))
    h = F.linear(torch.cat((xin, b.static), dim=1), *t.proj_in)
    h = torch.where(b.valid[:, None], h, 0.0)
    h = t.conv(h, b.valid.to(dtype)).index_select(0, b.conv_of_token)
    mods = t.mods.index_select(0, s)[0]
    keys = slots = None
    if arena is not None and b.pool is not None:
        # This step's arena slot of every layer, as key starts and K/V write positions: a few
        # kernels per step, where per-layer offsets cost five tiny graph nodes per layer.
        depth = len(t.blocks)
        bases = s * (depth * arena.slot) + torch.arange(depth, device=s.device) * arena.slot
        keys = backend.layer_keys(b.pool, bases)
        slots = b.pool_slots[None, :] + bases[:, None]
    fm = t.final.index_select(0, s)[0]  # 1 + scale, shift of the final AdaLN
    kv_writes = t.kv_writes and keys is not None
    fill = t.fill and getattr(backend, "fills", False)
    depth = len(t.blocks)
    x = F.layer_norm(h, (h.shape[-1],), mods[0][1], mods[0][0], eps=LN_EPS) if t.chain else None
    for layer, (wpre, wpost) in enumerate(t.blocks):
        m = mods[layer]
        kw = {"kv": (arena.k, arena.v, slots[layer])} if kv_writes else {}
        if t.chain:
            q, k, v = t.qkv(x, *wpre, b.cos, b.sin, t.heads, **kw)
        else:
            q, k, v = t.pre(h, m[0], m[1], *wpre, b.cos, b.sin, t.heads, **kw)
        o = _attend(q, k, v, b, backend, arena, None if keys is None else (keys[layer], slots[layer]),
                    written=kv_writes, fill=fill)
        if t.chain:
            last = layer + 1 == depth
            nxt = (fm[0], fm[1]) if last else (mods[layer + 1][1], mods[layer + 1][0])
            h, x = t.post(h, o.flatten(-2), m[2], m[3], m[4], m[5], *wpost, next_ln=nxt, keep_h=not last)
        else:
            h = t.post(h, o.flatten(-2), m[2], m[3], m[4], m[5], *wpost)
    if not t.chain:
        x = F.layer_norm(h, (h.shape[-1],), fm[0], fm[1], eps=LN_EPS)
    vel = F.linear(x, *t.proj_out).float()
    if b.record_idx is not None:
        b.traj.index_copy_(0, s, b.x.index_select(0, b.record_idx)[None])
    v_cond, v_uncond = vel[:stride], vel[stride:]
    b.x.add_(t.dt.index_select(0, s) * ((1.0 + t.cfg_rate) * v_cond - t.cfg_rate * v_uncond))
    b.step.add_(1)


def _attend(q, k, v, b: StepBuffers, backend, arena, pool_keys, written: bool = False, fill: bool = False):
    """The layer's attention output [N, H, Dh]. ``written``: K/V already in the arena (the
    rotary wrote them); ``fill``: one output for both launches, zeros written by the last."""
    if b.pool is not None:
        # Every token writes its K/V (non-pool tokens into the dump frame), then the pool
        # launch reads each cached row's keys in place from this (step, layer) slot.
        keys, idx = pool_keys
        if not written:
            _wide(arena.k).index_copy_(0, idx, _wide(k))
            _wide(arena.v).index_copy_(0, idx, _wide(v))
    if b.merged:  # one launch: cached rows' keys from the arena, the others' from this call's k/v
        return backend.run(q, arena.k, arena.v, b.pool, keys, fill=(b.pool,) if fill else None, k2=k, v2=v)
    if fill:
        out = q.new_empty(q.shape)
        launches = tuple(m for m in (b.pool, b.self_) if m is not None)
        if b.pool is not None:
            backend.run(q, arena.k, arena.v, b.pool, keys, out=out, fill=None if b.self_ is not None else launches)
        if b.self_ is not None:  # pool and self tokens are disjoint: each launch writes its own
            backend.run(q, k, v, b.self_, out=out, fill=launches)
        return out
    o_pool = backend.run(q, arena.k, arena.v, b.pool, keys) if b.pool is not None else None
    o_self = backend.run(q, k, v, b.self_) if b.self_ is not None else None
    if o_pool is None:
        return o_self
    if o_self is None:
        return o_pool
    return torch.where(b.pool_mask, o_pool, o_self)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` [N, H, Dh] viewed as 8-byte elements where its layout allows: the same bytes, so a
    copy through the views is exact, but a quarter of the elements for bf16 (a 3,456-token
    step's K/V writes took 0.50 ms of kernels as 2-byte elements, 0.23 ms as 8-byte ones, on
    the H200: docs/performance.md)."""
    ratio = 8 // t.element_size()
    if ratio > 1 and t.stride(-1) == 1 and t.shape[-1] % ratio == 0 and t.storage_offset() % ratio == 0 \
            and all(st % ratio == 0 for st in t.stride()[:-1]):
        return t.view(torch.int64)
    return t
