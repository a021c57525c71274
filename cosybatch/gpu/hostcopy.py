"""Host -> device copies that never wait for the GPU.

A copy from ordinary (pageable) host memory is synchronous: ``torch.tensor(values,
device="cuda")`` and ``cuda_tensor.copy_(cpu_tensor)`` wait until every kernel queued before
them has run, ``non_blocking=True`` included (it only applies to pinned memory). The
single-thread scheduler (design.md D15) relies on the host running ahead of the GPU, so every
small upload goes through :func:`h2d`: the values are staged in pinned memory (PyTorch's
caching host allocator, which keeps a block until the copy that reads it has completed) and
copied asynchronously. On the CPU it is a plain tensor.
"""

from __future__ import annotations

import torch


def h2d(values, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """``values`` (a list, array or CPU tensor) as a tensor on ``device``, without a sync."""
    t = values if isinstance(values, torch.Tensor) else torch.as_tensor(values, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device is None or torch.device(device).type != "cuda":
        return t if device is None else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for a CPU ``src``, staged through pinned memory on CUDA (no sync)."""
    if dst.is_cuda and not src.is_cuda and not src.is_pinned():
        src = src.pin_memory()
    return dst.copy_(src, non_blocking=dst.is_cuda)
