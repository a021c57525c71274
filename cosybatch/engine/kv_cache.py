"""Paged KV cache: fixed-size blocks preallocated once, handed out whole per sequence.

A sequence reserves, at admission, every block it can ever need (prompt + max_len + 1 tokens),
so decoding never allocates and never preempts; a request that does not fit waits in the queue.
Block 0 is a scratch block that padding rows of a decode bucket read and write.
"""

from __future__ import annotations

import torch

NULL_BLOCK = 0


def block_bytes(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * kv_heads * head_dim * elem


class BlockAllocator:
    """Free list over blocks 1..num_blocks-1 (block 0 is the scratch block)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is scratch)")
        self.num_blocks = num_blocks
        # pop() from the end hands out low ids first, which keeps runs reproducible
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """K and V of every layer: ``k[layer]`` is ``[num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def flat_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_blocks * block_size, kv_heads, head_dim] views of one layer."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    @staticmethod
    def slots_for(blocks: list[int], start: int, end: int, block_size: int) -> list[int]:
        """Flat slot ids of token positions start..end-1 of a sequence owning ``blocks``."""
        return [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]


def plan_num_blocks(cfg, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Blocks from an explicit count, a memory budget, or max_num_seqs full-length sequences."""
    if cfg.num_kv_blocks is not None:
        return int(cfg.num_kv_blocks)
    per_block = block_bytes(num_layers, cfg.kv_block_size, kv_heads, head_dim, dtype)
    if cfg.kv_cache_gb is not None:
        return max(2, int(cfg.kv_cache_gb * 2**30) // per_block)
    per_seq = -(-cfg.max_model_len // cfg.kv_block_size)
    return 1 + cfg.max_num_seqs * per_seq
