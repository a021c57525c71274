"""The flow's four GEMMs per DiT layer in bf16 against fp8 with row-wise scales, at its shapes.

For each of q/k/v (1,024 -> 3,072), O (1,024 -> 1,024), FF1 (1,024 -> 2,048) and FF2 (2,048 ->
1,024) at ``--tokens`` rows: the bf16 GEMM the pipeline runs (`F.linear`, cuBLASLt), and
`torch._scaled_mm` on float8 e4m3 operands (weights quantized once per output channel,
activations per row), timed alone and with the activations' quantization before it (what a
layer would pay unless the kernel before the GEMM wrote fp8 itself). On CUDA the median of
`triton.testing.do_bench` (L2 flushed between calls, as `bench_layer_parts` times the layer's
other parts); on a CPU the median wall clock of ``--reps`` calls. µs per call, TFLOP/s, and the
four GEMMs' sum in µs per token of a 22-layer Euler step, the unit of the step's fit (docs/performance.md, twenty-seventh session: ~0.62 µs of its
1.08 are these GEMMs in bf16). The products against float32: relative RMS of each. Runs on a CPU
too (small ``--tokens``: a check that it works, not a timing).

    python scripts/bench_fp8_gemm.py --tokens 2048,6912,23296 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosybatch.codec.flops import block_gemms  # noqa: E402
from cosybatch.models.config import DiTConfig  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
GEMMS = block_gemms(DiTConfig())  # the full-size model's
DEPTH = DiTConfig.depth


def quantize(x: torch.Tensor, dim: int | None = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in float8 e4m3 and its float32 scales (x ~= q * scale), one scale per slice along
    ``dim`` (the last: per row) or for the whole tensor (None): its largest magnitude meets 448."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = amax.float().clamp_min(1e-12) / FP8_MAX
    return (x.float() / scale).to(FP8), scale


def timed(fn, device, reps: int) -> float:
    """Median microseconds of ``fn``: ``triton.testing.do_bench`` on CUDA, else ``reps`` calls'
    wall clock."""
    if device.type == "cuda":
        import triton

        return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    d = (got.float() - want).double()
    return float(d.pow(2).mean().sqrt() / want.double().pow(2).mean().sqrt())


def bench(tokens: int, device, reps: int) -> dict:
    g = torch.Generator(device="cpu").manual_seed(tokens)
    rows = {}
    for name, k, n in GEMMS:
        x32 = torch.randn(tokens, k, generator=g).to(device)
        w32 = (torch.randn(n, k, generator=g) / k ** 0.5).to(device)
        x, w = x32.bfloat16(), w32.bfloat16()
        wq, ws = quantize(w)  # weights once, per output channel
        xq, xs = quantize(x)
        want = x32 @ w32.t()

        def fp8(xq=xq, xs=xs, wq=wq, ws=ws):
            return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)

        def fp8_quant(x=x, wq=wq, ws=ws):
            q, s = quantize(x)
            return torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws.t(), out_dtype=torch.bfloat16)

        flops = 2.0 * tokens * k * n
        r = {}
        for label, fn in (("bf16", lambda x=x, w=w: F.linear(x, w)), ("fp8", fp8), ("fp8+quant", fp8_quant)):
            us = timed(fn, device, reps)
            r[label] = {"us": us, "tflops": flops / (us * 1e-6) / 1e12}
        r["rel_rms"] = {"bf16": rel_rms(F.linear(x, w), want), "fp8": rel_rms(fp8(), want)}
        rows[name] = r
    step = {label: sum(rows[n][label]["us"] for n, _, _ in GEMMS) * DEPTH / tokens
            for label in ("bf16", "fp8", "fp8+quant")}
    return {"tokens": tokens, "gemms": rows, "us_per_token_per_step": step}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="2048,6912,23296")
    ap.add_argument("--reps", type=int, default=20, help="calls timed on a CPU (CUDA: do_bench's own)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    out = [bench(int(t), device, args.reps) for t in args.tokens.split(",") if t]
    print("| tokens | GEMM | bf16 µs (TFLOP/s) | fp8 µs (TFLOP/s) | fp8 + row quantization µs | rel RMS bf16 / fp8 |")
    print("|---|---|---|---|---|---|")
    for r in out:
        for name, g in r["gemms"].items():
            print(f"| {r['tokens']} | {name} | {g['bf16']['us']:.1f} ({g['bf16']['tflops']:.0f}) | "
                  f"{g['fp8']['us']:.1f} ({g['fp8']['tflops']:.0f}) | {g['fp8+quant']['us']:.1f} | "
                  f"{g['rel_rms']['bf16']:.1e} / {g['rel_rms']['fp8']:.1e} |")
        s = r["us_per_token_per_step"]
        print(f"| {r['tokens']} | four GEMMs, µs per token of a {DEPTH}-layer step | {s['bf16']:.3f} | {s['fp8']:.3f} | "
              f"{s['fp8+quant']:.3f} | |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
