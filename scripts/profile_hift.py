"""Where a batched HiFT call's time goes at the sizes the streaming pipeline runs.

Streaming rounds of ``--requests`` requests (chunks of 50, 100, 200 mel frames, every request
advancing one chunk per call; TF32 on, decode graphs as the pipeline uses them): per call,
the host milliseconds until its work is queued and the GPU milliseconds (CUDA events), then a
kernel profile of one call by kernel, with launch counts. A call whose host time exceeds
its GPU time leaves the GPU waiting for the host. Each variant (``VARIANTS``) runs the same
calls; their audio is compared with the first variant's (bit for bit, or the largest
difference). Full-size random weights.
  python scripts/profile_hift.py --requests 6 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hift import make_mels, make_model, set_tf32, stream_rounds  # noqa: E402
from profile_flow import kernel_table  # noqa: E402

from cosybatch.codec.hift_runner import HiftRunner  # noqa: E402

# HiftRunner options per variant: eager Snake ops and cuDNN's float64 F0 convs; the fused
# Triton Snake + pad kernel; both fused and the F0 predictor as float64 GEMMs (the default); the
# decode's convs on channels-last tensors, by cuDNN or as Triton launches (optimizations.hift_convs).
VARIANTS = {"unfused": {"fused_snake": False, "f0_gemm": False}, "fused": {"fused_snake": True, "f0_gemm": False},
            "f0-gemm": {"fused_snake": True, "f0_gemm": True},
            "cudnn-cl": {"f0_gemm": True, "convs": "cudnn_channels_last"},
            "triton-convs": {"f0_gemm": True, "convs": "triton"}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--variants", default="unfused,fused,f0-gemm", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    set_tf32(True)
    model = make_model(False, dev)
    mels = make_mels(args.requests, args.seconds, dev)
    results, outputs = {}, {}
    for variant in args.variants.split(","):
        runner = HiftRunner(model, graphs=dict(capacity=64, capture_after=1), max_batch=64, **VARIANTS[variant])
        outputs[variant], results[variant] = measure(runner, mels, args.top, variant)
    (a, x), *others = list(outputs.items())
    for b, y in others:  # every call's audio against the first variant's
        diff = max((u - v).abs().max().item() if u.numel() else 0.0 for u, v in zip(x, y))
        print(f"outputs {b} vs {a}: {'bit-equal' if diff == 0 else f'max |diff| {diff:.2e}'}", flush=True)
        results[f"{b}_vs_{a}_max_abs"] = diff
    print("| variant | host ms per call (p50) | GPU ms per call (p50) | kernel ms (one call) | launches |")
    print("|---|---|---|---|---|")
    for v, r in results.items():
        if isinstance(r, dict):
            print(f"| {v} | {r['host_ms_p50']:.2f} | {r['gpu_ms_p50']:.2f} | {r['kernel_ms']:.2f} | {r['launches']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def measure(runner: HiftRunner, mels, top: int, variant: str):
    """(the timed calls' audio, per-call figures and the kernel table) for one runner."""
    for w in range(2):  # capture on first use, replay on the second
        for jobs in stream_rounds(mels, f"warm{w}"):
            runner.run(jobs)
    torch.cuda.synchronize()
    calls, audio = [], []
    for jobs in stream_rounds(mels, "timed"):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e0.record()
        audio += runner.run(jobs)
        e1.record()
        host = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        calls.append({"jobs": len(jobs), "frames": sum(j.mel.shape[2] for j in jobs), "host_ms": host,
                      "gpu_ms": e0.elapsed_time(e1)})
    for c in calls:
        print(f"[{variant}] call: {c['jobs']} jobs, {c['frames']:5d} new frames: host {c['host_ms']:6.2f} ms, "
              f"GPU (events, includes waits for the host) {c['gpu_ms']:6.2f} ms", flush=True)
    host = float(np.median([c["host_ms"] for c in calls]))
    gpu = float(np.median([c["gpu_ms"] for c in calls]))
    print(f"[{variant}] median per call: host {host:.2f} ms, GPU {gpu:.2f} ms; graphs {runner.graphs.stats.as_dict()}",
          flush=True)

    from torch.profiler import ProfilerActivity, profile

    rounds = stream_rounds(mels, "prof")
    runner.run(rounds[0])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        runner.run(rounds[1])
        torch.cuda.synchronize()
    kernels = kernel_table(prof, f"[{variant}] one call of {len(rounds[1])} jobs", top)
    return audio, {"calls": calls, "host_ms_p50": host, "gpu_ms_p50": gpu, **kernels}

if __name__ == "__main__":
    main()
