"""Attention over packed rows: one interface, several kernels.

The packer (``packing.py``) describes a launch as sub-sequences: query tokens
``q[q0:q0+ql]`` see keys ``k[k0:k0+kl]`` of one key tensor, where key ranges of different
sub-sequences may overlap (every chunk of a chunk-causal row sees its row's prefix). No kernel
needs an intra-sequence mask. Metadata is prepared once per call (``prepare``). Key starts can
move by a device offset per layer, which is how one captured Euler step serves every (step,
layer) slot of the prefix-cache arena (design.md D16): ``layer_keys(meta, bases)`` turns the
step's offsets (one per layer) into what ``run`` takes for each layer, in a few kernels per
step rather than per layer; ``run(..., keys=None)`` reads keys at their own starts. Tokens
outside the launch's sub-sequences get zeros.

Backends:
- ``sdpa``: gathers each sub-sequence into a padded batch with a key-padding mask and calls
  ``scaled_dot_product_attention``. Works everywhere (the CPU default, the reference).
- ``varlen``: PyTorch's FlashAttention-2 varlen kernel (``aten._flash_attention_forward``,
  CUDA) with a key start and a used key count per sequence, reading keys in place.
- ``flash``: the ``flash_attn`` package's varlen kernel, where it is installed and takes a
  used key count per sequence.
- ``triton``: our Triton kernel (``triton_attention.py``), query tiles sized to the attention
  chunk rather than FlashAttention's 128 rows, keys read in place (CUDA; any float dtype).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from cosybatch.gpu.hostcopy import h2d
from cosybatch.codec.packing import SubSeqs, varlen_offsets

log = logging.getLogger(__name__)


@dataclass
class LaunchMeta:
    """A launch's device metadata; for graphs its tensors are the static inputs."""

    tensors: dict[str, torch.Tensor]
    max_q: int
    max_k: int
    n_seqs: int
    kernel: str = ""  # which backend prepared it, where one backend dispatches to several (``auto``)


class SdpaBackend:
    name = "sdpa"
    bucketable = False  # its padded shapes follow the keys' extent: a fixed bucket would gather far too many

    def prepare(self, seqs: SubSeqs, n_tokens: int, device, n_seqs: int | None = None, max_q: int | None = None,
                max_k: int | None = None) -> LaunchMeta:
        """Real sub-sequences only (empty ones dropped); padded to ``n_seqs`` rows x ``max_q`` queries
        x ``max_k`` keys with masks, so a graph bucket's shapes stay fixed."""
        keep = seqs.q_len > 0
        q0, ql, k0, kl = seqs.q_start[keep], seqs.q_len[keep], seqs.k_start[keep], seqs.k_len[keep]
        s = len(q0) if n_seqs is None else n_seqs
        mq = max(1, int(ql.max()) if len(ql) else 1) if max_q is None else max_q
        mk = max(1, int(kl.max()) if len(kl) else 1) if max_k is None else max_k
        if len(q0) > s or (len(ql) and (ql.max() > mq or kl.max() > mk)):
            raise ValueError("sub-sequences exceed the launch's bucket")
        ar_q, ar_k = np.arange(mq), np.arange(mk)
        q_idx = np.full((s, mq), n_tokens, dtype=np.int64)  # index n_tokens = a scratch row
        q_idx[: len(q0)] = np.where(ar_q[None] < ql[:, None], q0[:, None] + ar_q[None], n_tokens)
        k_rel = np.zeros((s, mk), dtype=np.int64)
        k_rel[: len(k0)] = k0[:, None] + np.minimum(ar_k[None], np.maximum(kl[:, None] - 1, 0))
        k_valid = np.zeros((s, mk), dtype=bool)
        k_valid[: len(kl)] = ar_k[None] < kl[:, None]
        k_valid[:, 0] = True  # padded rows see one (discarded) key, so softmax stays finite
        t = {"q_idx": h2d(torch.from_numpy(q_idx), device=device), "k_rel": h2d(torch.from_numpy(k_rel), device=device),
             "mask": h2d(torch.from_numpy(k_valid), device=device)[:, None, None, :]}
        return LaunchMeta(t, mq, mk, s)

    def layer_keys(self, meta: LaunchMeta, bases: torch.Tensor) -> torch.Tensor:
        """Per layer, the offset added to every key index (row ``layer`` of the result)."""
        return bases

    def run(self, q, k, v, meta: LaunchMeta, keys: torch.Tensor | None = None) -> torch.Tensor:
        t = meta.tensors
        s, mq = t["q_idx"].shape
        idx = (t["k_rel"] if keys is None else t["k_rel"] + keys).flatten()
        kp = k.index_select(0, idx).unflatten(0, (s, -1))  # [S, K, H, Dh]
        vp = v.index_select(0, idx).unflatten(0, (s, -1))
        qx = torch.cat((q, q.new_zeros((1,) + q.shape[1:])))  # row n_tokens: the scratch row
        qp = qx.index_select(0, t["q_idx"].flatten()).unflatten(0, (s, mq))
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                           attn_mask=t["mask"])
        out = torch.zeros_like(qx)
        out.index_copy_(0, t["q_idx"].flatten(), o.transpose(1, 2).flatten(0, 1))  # padding lands on the scratch row
        return out[:-1]


class _VarlenBase:
    bucketable = True  # sequence counts and query bounds are all a graph bucket fixes

    def prepare(self, seqs: SubSeqs, n_tokens: int, device, n_seqs: int | None = None, max_q: int | None = None,
                max_k: int | None = None) -> LaunchMeta:
        n = n_seqs if n_seqs is not None else 2 * len(seqs) + 1  # every gap can need a dummy
        cu_q, k_start, k_used = varlen_offsets(seqs, n_tokens, n)
        t = {"cu_q": h2d(torch.from_numpy(cu_q), device=device), "k_start": h2d(torch.from_numpy(k_start), device=device),
             "k_used": h2d(torch.from_numpy(k_used), device=device)}
        mq = max(1, seqs.max_q) if max_q is None else max_q
        mk = max(1, seqs.max_k) if max_k is None else max_k
        return LaunchMeta(t, mq, mk, n)

    def layer_keys(self, meta: LaunchMeta, bases: torch.Tensor) -> torch.Tensor:
        """[layers, seqs] int32 key starts: the launch's own plus each layer's offset."""
        return meta.tensors["k_start"][None, :] + bases.to(torch.int32)[:, None]

    def _starts(self, meta: LaunchMeta, keys: torch.Tensor | None) -> torch.Tensor:
        return meta.tensors["k_start"] if keys is None else keys


class TorchVarlenBackend(_VarlenBase):
    """torch's FlashAttention-2 varlen kernel through the aten op (its public wrapper lacks the
    per-sequence used key count in torch 2.11)."""

    name = "varlen"

    def run(self, q, k, v, meta: LaunchMeta, keys: torch.Tensor | None = None) -> torch.Tensor:
        t = meta.tensors
        starts = self._starts(meta, keys)
        return torch.ops.aten._flash_attention_forward(q, k, v, t["cu_q"], starts, meta.max_q, meta.max_k, 0.0,
                                                       False, False, seqused_k=t["k_used"])[0]


class FlashAttnBackend(_VarlenBase):
    name = "flash"

    def __init__(self):
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError as e:
            raise ValueError("codec.attention=flash needs the flash-attn package (pip install flash-attn); "
                             f"it is not importable here: {e}") from None
        if "seqused_k" not in inspect.signature(flash_attn_varlen_func).parameters:
            raise ValueError("codec.attention=flash: this flash-attn version has no seqused_k argument "
                             "(overlapping key ranges); use codec.attention=varlen")
        self._fn = flash_attn_varlen_func

    def run(self, q, k, v, meta: LaunchMeta, keys: torch.Tensor | None = None) -> torch.Tensor:
        t = meta.tensors
        starts = self._starts(meta, keys)
        return self._fn(q, k, v, t["cu_q"], starts, meta.max_q, meta.max_k, seqused_k=t["k_used"], causal=False)


class TritonBackend:
    """Query tiles of ``block_m`` rows per (tile, head) program; ``merge``: the chunks of one row
    share tiles (see ``triton_attention``). The defaults are the fastest fixed choice measured on
    the H200 at the flow's shapes (docs/performance.md, eleventh session)."""

    name = "triton"
    bucketable = True  # the tile count is bounded by the bucket's sequence count, query bound and tokens
    # Padded sub-sequences and query bounds only add empty tiles, which exit at once, so graph
    # buckets may take them from the stride and jobs alone (``flow_buckets``, design.md D27).
    coarse_buckets = True

    def __init__(self, block_m: int = 128, block_n: int = 64, num_warps: int = 8, num_stages: int = 3,
                 merge: bool = True):
        try:
            from cosybatch.codec import triton_attention
        except ImportError as e:
            raise ValueError(f"codec.attention=triton needs the triton package; it is not importable here: {e}") from None
        self._k = triton_attention
        self.block_m, self.block_n, self.num_warps, self.num_stages, self.merge = \
            block_m, block_n, num_warps, num_stages, merge

    def prepare(self, seqs: SubSeqs, n_tokens: int, device, n_seqs: int | None = None, max_q: int | None = None,
                max_k: int | None = None) -> LaunchMeta:
        mq = max(1, seqs.max_q) if max_q is None else max_q
        mk = max(1, seqs.max_k) if max_k is None else max_k
        real = int((seqs.q_len > 0).sum())
        if n_seqs is not None and (real > n_seqs or seqs.max_q > mq):
            raise ValueError("sub-sequences exceed the launch's bucket")
        n_tiles = None if n_seqs is None else self._k.max_tiles(n_seqs, mq, n_tokens, self.block_m)
        t = self._k.prepare_tiles(seqs, n_tokens, device, self.block_m, self.merge, n_tiles)
        return LaunchMeta(t, mq, mk, real if n_seqs is None else n_seqs, kernel=self.name)

    def prepare_pair(self, first: SubSeqs, second: SubSeqs, n_tokens: int, device, first_sizes: tuple = (None,) * 3,
                     second_sizes: tuple = (None,) * 3) -> LaunchMeta:
        """Two launches over disjoint tokens as one (``run(..., k2=, v2=)``): ``first``'s keys are
        read from ``run``'s k/v at key starts a layer offset moves (the pool launch, from the
        arena), ``second``'s from ``k2``/``v2`` at their own starts (the self launch, this call's
        keys). ``*_sizes``: each launch's (n_seqs, max_q, max_k) bucket bounds, as ``prepare``."""
        parts = []
        for seqs, (n_seqs, max_q, _) in ((first, first_sizes), (second, second_sizes)):
            mq = max(1, seqs.max_q) if max_q is None else max_q
            if n_seqs is not None and (int((seqs.q_len > 0).sum()) > n_seqs or seqs.max_q > mq):
                raise ValueError("sub-sequences exceed the launch's bucket")
            parts.append(None if n_seqs is None else self._k.max_tiles(n_seqs, mq, n_tokens, self.block_m))
        n_tiles = None if None in parts else sum(parts)
        t = self._k.prepare_tile_pair(first, second, n_tokens, device, self.block_m, self.merge, n_tiles)
        return LaunchMeta(t, max(first.max_q, second.max_q), max(first.max_k, second.max_k), len(first) + len(second),
                          kernel=self.name + "-pair")

    def layer_keys(self, meta: LaunchMeta, bases: torch.Tensor) -> torch.Tensor:
        """[layers, tiles] int32 key starts: each tile's own plus each layer's offset (a pair's
        second launch: its own only)."""
        t = meta.tensors
        if "shift" in t:
            return t["k_start"][None, :] + bases.to(torch.int32)[:, None] * t["shift"][None, :]
        return t["k_start"][None, :] + bases.to(torch.int32)[:, None]

    # ``run`` can write into a shared output and zero-fill in the same launch (``run(..., out, fill)``)
    fills = True

    def run(self, q, k, v, meta: LaunchMeta, keys: torch.Tensor | None = None, out: torch.Tensor | None = None,
            fill: tuple[LaunchMeta, ...] | None = None, k2: torch.Tensor | None = None,
            v2: torch.Tensor | None = None) -> torch.Tensor:
        """``out``: written at this launch's tokens only; ``fill``: launches (this one among them)
        whose tokens without any key become zeros in this launch (``chunk_attention``'s fill);
        ``k2``, ``v2``: the second launch's keys of a ``prepare_pair`` launch."""
        t = meta.tensors
        tables = None if fill is None else tuple(m.tensors["k_len"] for m in fill)
        if ("src" in t) != (k2 is not None):
            raise ValueError("a prepare_pair launch runs with k2 and v2, and only it")
        return self._k.chunk_attention(q, k, v, t["tiles"], t["k_start"] if keys is None else keys, t["k_len"],
                                       self.block_m, self.block_n, self.num_warps, self.num_stages, out=out,
                                       fill=tables, k2=k2, v2=v2, src=t.get("src"))


def varlen_available(device) -> bool:
    return torch.device(device).type == "cuda" and hasattr(torch.ops.aten, "_flash_attention_forward")


_HALF = (torch.float16, torch.bfloat16)  # what FlashAttention's kernels take


def triton_available(device) -> bool:
    if torch.device(device).type != "cuda":
        return False
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def check_dtype(name: str, dtype: torch.dtype) -> None:
    """FlashAttention's kernels (``varlen``, ``flash``) take fp16/bf16 only."""
    if name in ("varlen", "flash") and dtype not in _HALF:
        raise ValueError(f"codec.attention={name} runs in fp16/bf16 only (FlashAttention), not {dtype}; "
                         "a float32 flow needs codec.attention=sdpa or auto")


def make_backend(name: str, device, dtype: torch.dtype = torch.bfloat16):
    """``auto``: on CUDA in fp16/bf16 the Triton kernel where triton is importable, else
    FlashAttention's varlen kernel; SDPA elsewhere. Measured on the H200 at the flow's shapes
    (scripts/bench_attention.py, docs/performance.md, eleventh session), the Triton kernel beat
    varlen on streaming hops (1.9x at 64 rows of 400 + 2 x 50 frames) and on packed whole rows
    (1.26x at 128 x 500, 1.4x ragged 250-750)."""
    if name == "auto":
        if dtype in _HALF and triton_available(device):
            name = "triton"
        else:
            name = "varlen" if dtype in _HALF and varlen_available(device) else "sdpa"
    check_dtype(name, dtype)
    if name == "sdpa":
        return SdpaBackend()
    if name == "varlen":
        if not varlen_available(device):
            raise ValueError("codec.attention=varlen needs CUDA (FlashAttention-2 varlen kernel); use sdpa on CPU")
        return TorchVarlenBackend()
    if name == "flash":
        return FlashAttnBackend()
    if name == "triton":
        if not triton_available(device) and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("codec.attention=triton needs CUDA and the triton package; use sdpa on CPU")
        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, sdpa, varlen, flash or triton")
