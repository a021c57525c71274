"""HiFT throughput for many requests: audio seconds vocoded per wall second.

Full-size ``HiFTConfig()`` with the module's own random init, fp32; TF32 off and on;
eager vs CUDA graphs; one request per call (the anchor's streaming HiFT) vs batched across
requests. Two workloads: full-response (one finalize job per request) and streaming
(chunks of 50, 100, 200, ... mel frames, every request advancing one chunk per call).
Also checks, at full size, graph vs eager, batched vs per-request, and the bounded
streaming state vs the official re-run of the whole history.

    python scripts/bench_hift.py --out results.json            # on the GPU
    python scripts/bench_hift.py --device cpu --tiny --requests 3 --seconds 2   # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosybatch.codec.hift_convs import DECODERS  # noqa: E402
from cosybatch.codec.hift_runner import HiftJob, HiftRunner  # noqa: E402
from cosybatch.models.config import HiFTConfig  # noqa: E402
from cosybatch.models.hift import CausalHiFTGenerator  # noqa: E402
from cosybatch.reference.token2wav import HiftStream  # noqa: E402

FRAMES_PER_S = 50


def set_tf32(on: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def make_model(tiny: bool, dev) -> CausalHiFTGenerator:
    cfg = HiFTConfig(base_channels=32, f0_cond_channels=16) if tiny else HiFTConfig()
    torch.manual_seed(0)
    model = CausalHiFTGenerator(cfg)
    with torch.no_grad():  # random init gives f0 ~ 0; centre it on a voice so phase runs
        model.f0_predictor.classifier.bias.fill_(150.0)
    return model.to(dev).eval()


def make_mels(n: int, seconds: float, dev, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):  # lengths spread +-40 % so batches need padding, as in real traffic
        frames = int(seconds * FRAMES_PER_S * (0.6 + 0.8 * i / max(1, n - 1)))
        out.append((torch.randn(1, 80, frames, generator=g) - 5.0).to(dev))
    return out


def stream_hops(total: int) -> list[int]:
    hops, hop = [], 50
    while sum(hops) + hop < total:
        hops.append(hop)
        hop = min(200, hop * 2)
    hops.append(total - sum(hops))
    return hops


def full_jobs(mels, tag):
    return [[HiftJob((tag, i), m, True) for i, m in enumerate(mels)]]


def stream_rounds(mels, tag):
    plans = [stream_hops(m.shape[2]) for m in mels]
    rounds = []
    for k in range(max(len(p) for p in plans)):
        jobs = []
        for i, (m, hops) in enumerate(zip(mels, plans)):
            if k < len(hops):
                a = sum(hops[:k])
                jobs.append(HiftJob((tag, i), m[:, :, a:a + hops[k]], k == len(hops) - 1))
        rounds.append(jobs)
    return rounds


def run_workload(runner: HiftRunner, rounds, per_request: bool) -> list[torch.Tensor]:
    outs = []
    for jobs in rounds:
        if per_request:
            for j in jobs:
                outs.extend(runner.run([j]))
        else:
            outs.extend(runner.run(jobs))
    return outs


def measure(model, mels, workload: str, per_request: bool, graphs: bool, args, dev) -> dict:
    opts = dict(capacity=args.graph_capacity, capture_after=2) if graphs else False
    runner = HiftRunner(model, graphs=opts, max_batch=args.max_batch, max_batch_frames=args.max_batch_frames,
                        fused_snake=dev.type == "cuda" and not args.no_triton,
                        convs=args.hift_convs if dev.type == "cuda" else "cudnn")
    make = full_jobs if workload == "full" else stream_rounds
    for w in range(2 if graphs else 1):  # warm-up: cuDNN plans; graphs captured on 2nd use
        run_workload(runner, make(mels, f"warm{w}"), per_request)
    if runner.graphs is not None:
        before = runner.graphs.stats.as_dict()
    sync(dev)
    t0 = time.perf_counter()
    outs = run_workload(runner, make(mels, "timed"), per_request)
    sync(dev)
    wall = time.perf_counter() - t0
    audio = sum(o.shape[1] for o in outs) / model.cfg.sampling_rate
    row = dict(workload=workload, batched=not per_request, graphs=graphs,
               audio_s=round(audio, 2), wall_s=round(wall, 4), audio_s_per_s=round(audio / wall, 1))
    if runner.graphs is not None:
        st = runner.graphs.stats.as_dict()
        calls = st["calls"] - before["calls"]
        row.update(graph_hit_rate=round((st["hits"] - before["hits"]) / max(1, calls), 3),
                   graphs_live=st["graphs"], captures=st["captures"], failures=st["failures"],
                   evictions=st["evictions"], pool_reserved_mb=round(st["pool_reserved_bytes"] / 2**20, 1),
                   static_mb=round(st["static_bytes"] / 2**20, 1))
    row["_outs"] = outs
    return row


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b) if x.numel())


def parity(model, dev) -> dict:
    """Full-size, TF32 off: bounded stream vs the official whole-history re-run."""
    set_tf32(False)
    mel = make_mels(1, 12.0, dev, seed=7)[0]
    hops = stream_hops(mel.shape[2])
    ref, runner, pos, worst = HiftStream(model), HiftRunner(model), 0, 0.0
    for i, n in enumerate(hops):
        fin = i == len(hops) - 1
        a = ref.push(mel[:, :, pos:pos + n], fin)
        b = runner.run([HiftJob("p", mel[:, :, pos:pos + n], fin)])[0]
        pos += n
        worst = max(worst, (a - b).abs().max().item() if a.numel() else 0.0)
    return dict(stream_vs_official_max_abs=worst, hops=hops)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-batch-frames", type=int, default=32768)
    ap.add_argument("--graph-capacity", type=int, default=32)
    ap.add_argument("--budget-s", type=float, default=150.0, help="skip what would start later")
    ap.add_argument("--cudnn-benchmark", action="store_true", help="let cuDNN autotune per shape")
    ap.add_argument("--batched-only", action="store_true", help="skip the one-request-per-call rows")
    ap.add_argument("--no-parity", action="store_true")
    ap.add_argument("--no-triton", action="store_true", help="eager Snake ops (the pipeline uses the fused kernel on CUDA)")
    ap.add_argument("--hift-convs", default="cudnn", choices=list(DECODERS),
                    help="how the decode's convs run (optimizations.hift_convs)")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    t_start = time.perf_counter()
    model = make_model(args.tiny, dev)
    mels = make_mels(args.requests, args.seconds, dev)
    result = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                  torch=torch.__version__, requests=args.requests, seconds=args.seconds,
                  config="tiny" if args.tiny else "HiFTConfig() full size",
                  cudnn_benchmark=args.cudnn_benchmark, rows=[])
    if not args.no_parity:
        result["parity"] = parity(model, dev)
        print(json.dumps(result["parity"]), flush=True)
    cuda = dev.type == "cuda"
    tf32s = [False, True] if cuda else [False]
    graph_modes = [False, True] if cuda else [False]
    # Most telling first, in case the time budget cuts the list short.
    plan = [(w, False, tf, g) for w in ("full", "stream") for tf in tf32s for g in graph_modes]
    if not args.batched_only:
        plan += [(w, True, tf, g) for tf in tf32s for w in ("full", "stream") for g in graph_modes]
    refs = {}
    for workload, per_request, tf32, graphs in plan:
        if time.perf_counter() - t_start > args.budget_s:
            result["truncated"] = True
            break
        set_tf32(tf32)
        row = measure(model, mels, workload, per_request, graphs, args, dev)
        outs = row.pop("_outs")
        key = (workload, tf32)
        if key not in refs:
            refs[key] = outs  # batched eager at this precision
        else:
            row["max_abs_vs_batched_eager"] = max_diff(outs, refs[key])
        row["tf32"] = tf32
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if dev.type == "cuda":
        result["max_memory_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    print_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def print_table(result: dict) -> None:
    print(f"\n{result['device']}, torch {result['torch']}, {result['config']}, "
          f"{result['requests']} requests x ~{result['seconds']} s, "
          f"cudnn.benchmark={result['cudnn_benchmark']}")
    print("| workload | TF32 | batched | graphs | audio-s/s | hit rate | pool MB | max abs vs batched eager |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['workload']} | {r['tf32']} | {r['batched']} | {r['graphs']} | {r['audio_s_per_s']} | "
              f"{r.get('graph_hit_rate', '-')} | {r.get('pool_reserved_mb', '-')} | "
              f"{r.get('max_abs_vs_batched_eager', '-')} |")


if __name__ == "__main__":
    main()
