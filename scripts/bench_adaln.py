#!/usr/bin/env python3
"""The DiT's gated residual + modulated LayerNorm: eager (addcmul, layer_norm) against the fused
Triton kernel (``triton_kernels.gated_residual_ln``), bf16, dim 1024, on CUDA.

    PYTHONPATH=$PWD python scripts/bench_adaln.py

Token counts: a 64-row streaming hop (6,400), a 3,456-token graph bucket's both branches
(6,912) and a 64k-token full pass. Median of ``triton.testing.do_bench``; the difference to
eager is reported as max abs and the share of elements that differ (bf16 roundings). Table last.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from cosybatch.codec.triton_kernels import gated_residual_ln  # noqa: E402
from cosybatch.models.dit import LN_EPS  # noqa: E402


def eager(h, gate, y, scale1, shift):
    h = torch.addcmul(h, gate, y)
    return h, F.layer_norm(h, (h.shape[-1],), scale1, shift, eps=LN_EPS)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n in (6400, 6912, 65536):
        h, y = (torch.randn(2, n, 1024, device="cuda", generator=g) * 4).to(torch.bfloat16).unbind(0)
        h, y = h.contiguous(), y.contiguous()
        gate, scale1, shift = (torch.randn(3, 1024, device="cuda", generator=g)).to(torch.bfloat16).unbind(0)
        he, xe = eager(h, gate, y, scale1, shift)
        hf, xf = gated_residual_ln(h, gate, y, scale1, shift, LN_EPS)
        diff = lambda a, b: ((a.float() - b.float()).abs().max().item(), (a != b).float().mean().item())  # noqa: E731
        t_e = triton.testing.do_bench(lambda: eager(h, gate, y, scale1, shift), warmup=10, rep=50, return_mode="median")
        t_f = triton.testing.do_bench(lambda: gated_residual_ln(h, gate, y, scale1, shift, LN_EPS), warmup=10, rep=50,
                                      return_mode="median")
        rows.append((n, t_e * 1e3, t_f * 1e3, *diff(he, hf), *diff(xe, xf)))
    print(f"\n{'tokens':>7} {'eager us':>9} {'fused us':>9} {'speed-up':>8} {'h max':>8} {'h diff%':>8} {'ln max':>8} {'ln diff%':>8}")
    for n, te, tf, hm, hd, xm, xd in rows:
        print(f"{n:7d} {te:9.1f} {tf:9.1f} {te / tf:8.2f} {hm:8.1e} {hd * 100:8.3f} {xm:8.1e} {xd * 100:8.3f}")


if __name__ == "__main__":
    main()
