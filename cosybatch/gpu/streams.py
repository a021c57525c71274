"""Which CUDA stream a block's kernels go on."""

from __future__ import annotations

import contextlib


def on_stream(stream):
    """``torch.cuda.stream(stream)`` for a stream; for None nothing: the block's kernels go on
    the current stream (on a CPU, there are none)."""
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)
