"""Padding masks of batched rows of different lengths."""

from __future__ import annotations

import torch


def length_mask(lengths: torch.Tensor, size: int) -> torch.Tensor:
    """[B, size] bool: True at the positions before each row's length."""
    return torch.arange(size, device=lengths.device)[None, :] < lengths[:, None]
