"""Host and GPU milliseconds of an eager call at a shape seen for the first time, then again.

In ``synth`` the batched HiFT calls and the GPU frontend's launches cost the host about as long
as the GPU (``timeline.slice_queue_ms``, docs/performance.md). A suspected cause: cuDNN builds
an execution plan for every new convolution shape, and full-mode batches rarely repeat a shape.
This times, for each (rows, seconds) shape, the first eager call (cold) and a second call of
the same shape (warm): host milliseconds until the call returns (its work queued) and GPU
milliseconds between events around it. Cold host time far above warm confirms it.
``--host-ops N``: each frontend launch also under the torch profiler (host side: aten ops and
CUDA runtime calls), its N costliest by self host time, cold beside warm: what the first sight
of a shape pays for (cuDNN's plans inside the conv ops, ``cudaMalloc`` as the caching allocator
grows, cuFFT's plans inside ``stft``); the profiler adds its own cost to both calls alike.

  python scripts/profile_cold_shapes.py --model-dir /tmp/ckpt-full --shapes 19x5.1,20x5.3,8x6.0 --json out.json
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

from bench_hift import make_model, set_tf32  # noqa: E402

from cosybatch.checkpoint.synthetic_audio import speech_like  # noqa: E402
from cosybatch.codec.hift_runner import HiftJob, HiftRunner  # noqa: E402
from cosybatch.models.config import ModelConfig  # noqa: E402
from cosybatch.frontend.frontend import Frontend  # noqa: E402

MEL_FRAMES_PER_S = 50


def _timed(fn, dev) -> tuple[float, float]:
    """(host ms until ``fn`` returns, GPU ms between events around it; on a CPU both are wall)."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return ms, ms
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    e0.record()
    fn()
    e1.record()
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return host, e0.elapsed_time(e1)


def _profiled(fn, dev) -> tuple[tuple[float, float], dict[str, tuple[float, int]]]:
    """``_timed`` under the torch profiler's host side: (times, {op or runtime call: (self host
    ms, calls)})."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        times = _timed(fn, dev)
    ops = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}
    return times, ops


def _print_ops(ops: dict, n: int, title: str) -> None:
    """The ``n`` ops the cold call spent most self host time in, beside the warm call's."""
    cold, warm = ops["cold"], ops["warm"]
    print(f"  host ops of {title}: self ms (calls), cold | warm; total {sum(v[0] for v in cold.values()):.1f} | "
          f"{sum(v[0] for v in warm.values()):.1f}")
    for key, (ms, calls) in sorted(cold.items(), key=lambda kv: -kv[1][0])[:n]:
        w_ms, w_calls = warm.get(key, (0.0, 0))
        print(f"    {key[:48]:<48} {ms:8.2f} ({calls:4d}) | {w_ms:8.2f} ({w_calls:4d})")


def hift_calls(rows: int, seconds: float, tag: str, dev) -> list[HiftJob]:
    """A full-mode batch: ``rows`` whole rows, lengths spread +-10 % around ``seconds``."""
    g = torch.Generator().manual_seed(rows * 1000 + int(seconds * 10))
    jobs = []
    for i in range(rows):
        frames = int(seconds * MEL_FRAMES_PER_S * (0.9 + 0.2 * i / max(1, rows - 1)))
        jobs.append(HiftJob((tag, i), (torch.randn(1, 80, frames, generator=g) - 5.0).to(dev), True))
    return jobs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True, help="a checkpoint with the full-size frontend stand-ins")
    ap.add_argument("--shapes", default="19x5.1,20x5.3,8x6.0,32x4.5", help="comma list of ROWSxSECONDS")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny HiFT (a smoke test of the script)")
    ap.add_argument("--host-ops", type=int, default=0, metavar="N",
                    help="list each frontend launch's N costliest host ops, cold and warm (torch profiler)")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    shapes = [(int(r), float(s)) for r, s in (x.split("x") for x in a.shapes.split(","))]
    set_tf32(True)  # HiFT as the shipped profiles run it
    # eager, with the pipeline's 32-frame width buckets and its fused kernels
    hift = HiftRunner(make_model(a.tiny, dev), graphs=False, max_batch=64, frame_bucket=32, fused_snake=dev.type == "cuda")
    front = Frontend(a.model_dir, ModelConfig(), backend="torch", device=dev, dtype=torch.float32, split_tf32=True,
                     cache_size=0, warmup=False)
    with torch.inference_mode():  # lazy CUDA set-up outside the measured calls
        hift.run(hift_calls(2, 1.0, "init", dev))
        one = front.load_waveform(torch.from_numpy(speech_like(1.0, 24000, 0).astype(np.float32)), 24000, "init")
        front.features([one, one])
    rows = []
    for n, sec in shapes:
        # the same lengths with other samples: a launch takes prompts an earlier one computes
        prompts = {tag: [front.load_waveform(torch.from_numpy(speech_like(sec * (0.9 + 0.2 * i / max(1, n - 1)), 24000,
                                                                          seed * 1000 + i).astype(np.float32)),
                                             24000, f"{tag}{n}-{i}") for i in range(n)]
                   for seed, tag in enumerate(("cold", "warm"), 1)}
        jobs = {tag: hift_calls(n, sec, tag, dev) for tag in ("cold", "warm")}
        pending = []  # launched frontend work, read after the timing (reading it waits for the GPU)
        for what, call in (("hift", lambda tag: hift.run(jobs[tag])),
                           ("frontend", lambda tag: pending.append(front.launch_features(prompts[tag])))):
            ops = {}
            with torch.inference_mode():
                if what == "frontend" and a.host_ops:
                    cold, ops["cold"] = _profiled(lambda: call("cold"), dev)
                    warm, ops["warm"] = _profiled(lambda: call("warm"), dev)
                else:
                    cold = _timed(lambda: call("cold"), dev)
                    warm = _timed(lambda: call("warm"), dev)
                for p in pending:
                    p.result()
            if ops:
                _print_ops(ops, a.host_ops, f"{what} {n} rows x {sec:g} s")
            r = {"part": what, "rows": n, "seconds": sec, "cold_host_ms": cold[0], "cold_gpu_ms": cold[1],
                 "warm_host_ms": warm[0], "warm_gpu_ms": warm[1]}
            rows.append(r)
            print(f"{what:<8} {n:3d} rows x {sec:4.1f} s: cold host {cold[0]:7.1f} ms GPU {cold[1]:7.1f} ms | "
                  f"warm host {warm[0]:7.1f} ms GPU {warm[1]:7.1f} ms", flush=True)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    print(f"\n# eager calls at a new shape and again, {name}")
    print("| part | rows x s | cold host ms | cold GPU ms | warm host ms | warm GPU ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['part']} | {r['rows']} x {r['seconds']:g} | {r['cold_host_ms']:.1f} | {r['cold_gpu_ms']:.1f} | "
              f"{r['warm_host_ms']:.1f} | {r['warm_gpu_ms']:.1f} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
