"""Codec settings: what the packed flow and the batched HiFT receive, resolved from a profile.

Nothing in ``cosybatch.codec`` reads a profile; ``cosybatch.profiles.resolve`` builds this. No field
has a default: each setting's default and meaning are declared once, in ``cosybatch.profiles.schema``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class CodecConfig:
    max_num_seqs: int  # rows (hops or whole responses) per packed flow / HiFT call
    flow_dtype: "torch.dtype | None"  # None: the flow module's own dtype
    attention: str  # auto | sdpa | varlen | flash (see codec/attention.py)
    prefix_budget_bytes: int  # 0: streaming hops recompute their prefix (no K/V reuse)
    chunk_causal_final: bool  # opt-in, not exact (design.md D4)
    flow_compile: bool
    flow_graphs: bool  # replay one captured Euler step per layout bucket (CUDA)
    flow_graph_capacity: int
    flow_graph_precapture: int | None  # start-up capture up to this many tokens per branch; None: lazy
    flow_graph_precapture_from: int  # ... from this many
    hift_graphs: bool
    hift_graph_capacity: int
    hift_graph_counters: int
    hift_graph_capture_after: int
    hift_graph_precapture: tuple[tuple[int, ...], ...]
    hift_frame_bucket: int | None  # HiftRunner(frame_bucket=...); None: its default
    # The codec's Triton kernels (CUDA): HiFT's resblock Snake + pad + conv biases + residual,
    # the flow's rotary and position convs (profile key optimizations.triton_kernels)
    triton_kernels: bool
    # how HiFT's decode convs run: cudnn | cudnn_channels_last | triton (codec/hift_convs.py;
    # profile key optimizations.hift_convs)
    hift_convs: str

    def hift_graph_options(self) -> dict | None:
        """``HiftRunner(graphs=...)``: None for eager decode."""
        if not self.hift_graphs:
            return None
        return {"capacity": self.hift_graph_capacity, "max_counters": self.hift_graph_counters,
                "capture_after": self.hift_graph_capture_after}
