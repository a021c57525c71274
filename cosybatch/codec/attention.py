"""Attention over packed rows, one interface, several kernels.

The packer (``packing.py``) cuts every row into *sub-sequences* whose queries all see the
same keys: a chunk of a chunk-causal row sees its row's frames ``[0, chunk_end)``, a
full-attention row sees all of its frames. So no kernel needs an intra-sequence mask, only
"these queries against that key range". Sub-sequences are grouped into *launches*: one
launch reads one key tensor, its queries are a contiguous slice of the packed queries, and
its query bound is the longest real query run in it (the chunk length for streaming hops,
not the key width).

Backends:
- ``sdpa``: gathers each launch into a padded batch with a key-padding mask and calls
  ``scaled_dot_product_attention``. Works everywhere (the CPU default, the reference).
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA only, torch >= 2.10).
- ``flash``: ``flash_attn.flash_attn_varlen_func`` when the package is importable.
The two varlen kernels read keys straight from the source tensor (the prefix-cache arena
included): key ranges not used by a launch are covered by dummy sequences with no queries,
so nothing is copied.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Launch:
    """Sub-sequences sharing one key tensor; queries are ``packed[q_start:q_end]`` back to back."""

    source: tuple  # opaque key-tensor id, chosen by the packer
    q_start: int
    q_end: int
    q_lens: tuple[int, ...]
    k_offs: tuple[int, ...]  # ascending, ranges disjoint
    k_lens: tuple[int, ...]

    @property
    def max_q(self) -> int:
        return max(self.q_lens)

    @property
    def max_k(self) -> int:
        return max(self.k_lens)


class SdpaBackend:
    name = "sdpa"

    def prepare(self, launch: Launch, n_keys: int, device) -> dict:
        s, qm, km = len(launch.q_lens), launch.max_q, launch.max_k
        q_idx = torch.zeros(s, qm, dtype=torch.long)
        k_idx = torch.zeros(s, km, dtype=torch.long)
        q_valid = torch.zeros(s, qm, dtype=torch.bool)
        k_valid = torch.zeros(s, km, dtype=torch.bool)
        q0 = 0
        for i, (ql, ko, kl) in enumerate(zip(launch.q_lens, launch.k_offs, launch.k_lens)):
            q_idx[i, :ql] = torch.arange(q0, q0 + ql)
            q_valid[i, :ql] = True
            k_idx[i, :kl] = torch.arange(ko, ko + kl)
            k_valid[i, :kl] = True
            q0 += ql
        return {
            "q_idx": q_idx.to(device),
            "q_sel": q_valid.flatten().nonzero().flatten().to(device),  # host-side: no sync in run
            "k_idx": k_idx.to(device),
            "mask": k_valid[:, None, None, :].to(device),  # padded keys never seen; padded queries discarded
        }

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prep: dict) -> torch.Tensor:
        qp, kp, vp = q[prep["q_idx"]], k[prep["k_idx"]], v[prep["k_idx"]]  # [S, L, H, Dh]
        o = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=prep["mask"])
        # Sub-sequences are back to back, so the valid rows in order are the packed order.
        return o.transpose(1, 2).flatten(0, 1).index_select(0, prep["q_sel"])


def _cu_with_gaps(launch: Launch, n_keys: int) -> tuple[list[int], list[int]]:
    """Cumulative query/key offsets where every key not in a sub-sequence belongs to a
    query-less dummy sequence, so the kernel can index the source tensor in place."""
    cu_q, cu_k = [0], [0]
    cursor = 0
    for ql, ko, kl in zip(launch.q_lens, launch.k_offs, launch.k_lens):
        if ko < cursor:
            raise ValueError("launch key ranges must be ascending and disjoint")
        if ko > cursor:
            cu_q.append(cu_q[-1])
            cu_k.append(ko)
        cu_q.append(cu_q[-1] + ql)
        cu_k.append(ko + kl)
        cursor = ko + kl
    if cursor < n_keys:
        cu_q.append(cu_q[-1])
        cu_k.append(n_keys)
    return cu_q, cu_k


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Varlen kernels need unit stride on the head dim only; q/k/v views of the fused q/k/v
    buffer (row stride 3*inner) are passed as they are."""
    return t if t.stride(-1) == 1 else t.contiguous()


class _VarlenBase:
    def prepare(self, launch: Launch, n_keys: int, device) -> dict:
        cu_q, cu_k = _cu_with_gaps(launch, n_keys)
        return {
            "cu_q": torch.tensor(cu_q, dtype=torch.int32, device=device),
            "cu_k": torch.tensor(cu_k, dtype=torch.int32, device=device),
            "max_q": launch.max_q,
            "max_k": launch.max_k,
        }


class TorchVarlenBackend(_VarlenBase):
    """torch's FlashAttention-2 varlen kernel. Called through the aten op when it accepts the
    arguments (the public ``varlen_attn`` wrapper is a Python custom op whose dispatch cost
    shows at hundreds of launches per Euler step); falls back to the wrapper, and to
    contiguous inputs, if this torch build refuses."""

    name = "varlen"

    def __init__(self):
        from torch.nn.attention.varlen import varlen_attn

        self._public = varlen_attn
        self._direct = True
        self._strided = True

    def _call(self, q, k, v, prep):
        if self._direct:
            try:
                return torch.ops.aten._flash_attention_forward(q, k, v, prep["cu_q"], prep["cu_k"], prep["max_q"], prep["max_k"], 0.0, False, False)[0]
            except (RuntimeError, TypeError) as e:
                log.warning("aten flash varlen call refused (%s); using torch.nn.attention.varlen", e)
                self._direct = False
        return self._public(q, k, v, prep["cu_q"], prep["cu_k"], prep["max_q"], prep["max_k"])

    def run(self, q, k, v, prep):
        if self._strided:
            try:
                return self._call(_rows(q), _rows(k), _rows(v), prep)
            except RuntimeError as e:
                log.warning("varlen kernel refused strided inputs (%s); copying them", e)
                self._strided = False
        return self._call(q.contiguous(), k.contiguous(), v.contiguous(), prep)


class FlashAttnBackend(_VarlenBase):
    name = "flash"

    def __init__(self):
        from flash_attn import flash_attn_varlen_func

        self._fn = flash_attn_varlen_func

    def run(self, q, k, v, prep):
        return self._fn(_rows(q), _rows(k), _rows(v), prep["cu_q"], prep["cu_k"], prep["max_q"], prep["max_k"], causal=False)


def _varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def make_backend(name: str, device) -> object:
    """``auto`` picks flash-attn, then torch varlen on CUDA, and SDPA otherwise (CPU: SDPA)."""
    cuda = torch.device(device).type == "cuda"
    if name == "auto":
        if cuda and _flash_available():
            name = "flash"
        elif cuda and _varlen_available():
            name = "varlen"
        else:
            name = "sdpa"
    if name == "sdpa":
        return SdpaBackend()
    if not cuda:
        raise ValueError(f"attention backend {name!r} needs a CUDA device")
    if name == "varlen":
        return TorchVarlenBackend()
    if name == "flash":
        return FlashAttnBackend()
    raise ValueError(f"unknown attention backend {name!r}; use auto, sdpa, varlen or flash")
