"""Would fp8 GEMMs keep the flow's mels within parity? An emulation that runs on a CPU.

The per-token cost of a flow Euler step is mostly its four GEMMs per DiT layer (q/k/v, O, FF1,
FF2; docs/performance.md, twenty-seventh session), which fp8 tensor cores would run at twice
bf16's rate. Before any kernel is written, this asks what the rounding alone does to the mels:
each of those Linear layers of the full-size DiT (random weights, seed 0, as `bench_codec`)
rounds its operands as a GPU GEMM of that kind would read them and sums in float32; every other
op stays float32. Variants:

  bf16        both operands rounded to bfloat16 (what the pipeline's bf16 GEMMs read)
  fp8-row     float8 e4m3: activations scaled per token, weights per output channel (amax -> 448)
  fp8-tensor  float8 e4m3 with one scale per tensor

Whole responses (`flow_full`: 10 Euler steps with CFG) of ``--rows`` random rows; each variant's
mels against float32: relative RMS and largest absolute difference, and the ratio of each
variant's error to bf16's. bf16 operands are what the pipeline's GEMMs read today; the bf16
flow's whole error (all of its arithmetic in bf16, measured on the GPU) is larger than their
rounding alone, and is what fp8's would add to (docs/performance.md, twenty-seventh session).

    python scripts/fp8_parity.py --rows 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_codec import make_rows  # noqa: E402
from bench_fp8_gemm import quantize, rel_rms  # noqa: E402

from cosybatch.models.config import DiTConfig, FlowConfig  # noqa: E402
from cosybatch.models.flow import CausalMaskedDiffWithDiT  # noqa: E402
from cosybatch.reference.token2wav import flow_full  # noqa: E402


def to_fp8(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """``x`` as float8 e4m3 with scales along ``dim`` (None: one) holds it, back in float32."""
    q, scale = quantize(x, dim)
    return q.float() * scale


ROUNDINGS = {
    "fp32": None,
    "bf16": lambda x, w: (x.bfloat16().float(), w.bfloat16().float()),
    "fp8-row": lambda x, w: (to_fp8(x, -1), to_fp8(w, -1)),
    "fp8-tensor": lambda x, w: (to_fp8(x, None), to_fp8(w, None)),
}


class RoundedLinear(torch.nn.Module):
    """A Linear whose operands are rounded by ``rounding`` before a float32 product."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear
        self.rounding = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rounding is None:
            return self.linear(x)
        xr, wr = self.rounding(x, self.linear.weight)
        return F.linear(xr, wr, self.linear.bias)


def wrap_block_gemms(flow: CausalMaskedDiffWithDiT) -> list[RoundedLinear]:
    """Put a ``RoundedLinear`` around each block's q, k, v, O, FF1 and FF2 (the GEMMs an fp8
    kernel would take; the per-row modulation and the input / output projections stay)."""
    wrapped = []
    for block in flow.decoder.estimator.transformer_blocks:
        a, ff = block.attn, block.ff.ff
        # a Sequential's or ModuleList's children are attributes named by their index
        for parent, name in ((a, "to_q"), (a, "to_k"), (a, "to_v"), (a.to_out, "0"), (ff[0], "0"), (ff, "2")):
            w = RoundedLinear(getattr(parent, name))
            setattr(parent, name, w)
            wrapped.append(w)
    return wrapped


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    return {"rel_rms": rel_rms(got, want), "max_abs": float((got - want).abs().max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--target-tokens", type=int, default=100)
    ap.add_argument("--depth", type=int, default=DiTConfig.depth, help="DiT layers (22 is the model's)")
    ap.add_argument("--variants", default=",".join(ROUNDINGS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if variants[0] != "fp32" or any(v not in ROUNDINGS for v in variants):
        ap.error(f"--variants: fp32 first, then any of {', '.join(ROUNDINGS)}")
    torch.manual_seed(0)
    cfg = FlowConfig(dit=DiTConfig(depth=args.depth))
    flow = CausalMaskedDiffWithDiT(cfg).eval()
    gemms = wrap_block_gemms(flow)
    rows = make_rows(cfg, args.rows, args.prompt_tokens, args.target_tokens, "cpu", seed=1)
    mels, out = {}, {"rows": args.rows, "prompt_tokens": args.prompt_tokens, "target_tokens": args.target_tokens,
                     "depth": args.depth, "variants": {}}
    with torch.inference_mode():
        for v in variants:
            for g in gemms:
                g.rounding = ROUNDINGS[v]
            t0 = time.perf_counter()
            mels[v] = [flow_full(flow, tok, pr) for pr, tok in rows]
            print(f"[{v}] {time.perf_counter() - t0:.1f} s", flush=True)
    for v in variants[1:]:
        per_row = [compare(m, ref) for m, ref in zip(mels[v], mels["fp32"])]
        out["variants"][v] = {"rel_rms": max(r["rel_rms"] for r in per_row),
                              "max_abs": max(r["max_abs"] for r in per_row), "per_row": per_row}
    bf16 = out["variants"].get("bf16")
    print("| GEMM operands | worst rel RMS vs float32 | max abs | rel RMS / bf16's |")
    print("|---|---|---|---|")
    for v, r in out["variants"].items():
        ratio = f"{r['rel_rms'] / bf16['rel_rms']:.1f}x" if bf16 else "-"
        print(f"| {v} | {r['rel_rms']:.2e} | {r['max_abs']:.2e} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
