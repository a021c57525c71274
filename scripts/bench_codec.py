"""Flow (DiT) throughput of the packed codec runner, random weights.

Measures, for the flow part of the codec stage, per variant (``--variants``: eager, graphs =
one captured Euler step per layout bucket, compiled = torch.compile'd block math, eager):
- full passes (whole responses, full attention) versus packed size: frames/s, achieved
  TFLOP/s and host milliseconds per 10-step solve (time until the work is queued);
- streaming with exact prefix reuse (hops 25/50/100 + prompt pad, all rows in lock step, one
  call per hop) against the same rows without reuse (the official recompute) and against one
  full pass: flow work (FLOPs and GPU time) per output second, final hop excluded.

FLOPs are counted from the config (2 per multiply-add): per processed token the linear/conv
work of one DiT pass, plus 4 * inner * depth per attended (query, key) pair, times the Euler
steps; CFG rows count as tokens. Example:
  python scripts/bench_codec.py --size full --device cuda --dtype bf16 --variants eager,graphs --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosybatch.codec.flops import dit_token_flops, solve_flops  # noqa: E402
from cosybatch.codec.flow_runner import FlowJob, FlowRunner  # noqa: E402
from cosybatch.hops import HopSchedule, plan_segment  # noqa: E402
from cosybatch.models.config import FlowConfig  # noqa: E402
from cosybatch.models.flow import CausalMaskedDiffWithDiT  # noqa: E402
from cosybatch.prompt import PromptFeatures  # noqa: E402

FRAMES_PER_SECOND = 50


def build_flow(size: str, device) -> CausalMaskedDiffWithDiT:
    if size == "full":
        cfg = FlowConfig()
    else:
        from cosybatch.checkpoint.generate import model_config_for

        cfg = model_config_for(size).flow
    torch.manual_seed(0)
    return CausalMaskedDiffWithDiT(cfg).eval().to(device)


def work(cfg: FlowConfig, stats_before: dict, stats_after: dict) -> tuple[float, int, int]:
    """(FLOPs, processed tokens, output frames) between two snapshots of ``runner.stats``."""
    tok = stats_after["tokens"] - stats_before["tokens"]
    pairs = stats_after["attn_pairs"] - stats_before["attn_pairs"]
    out = stats_after["output_frames"] - stats_before["output_frames"]
    return solve_flops(cfg, tok, pairs), tok, out


def make_rows(cfg, n_rows, prompt_tokens, target_tokens, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n_rows):
        p = prompt_tokens
        # as the pipeline holds them: speech tokens on the host (planning reads them there; a
        # device copy would sync per job), embedding and mel on the device
        prompt = PromptFeatures(
            torch.randint(0, cfg.vocab_size, (p,), generator=g),
            torch.randn(1, cfg.spk_embed_dim, generator=g).to(device),
            torch.randn(1, 2 * p, cfg.output_size, generator=g).to(device),
        )
        rows.append((prompt, torch.randint(0, cfg.vocab_size, (target_tokens,), generator=g)))
    return rows


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_call(runner, jobs, device):
    """(GPU-inclusive seconds, host seconds until the work was queued, stats before, after)."""
    before = dict(runner.stats)
    sync(device)
    t0 = time.perf_counter()
    runner.run(jobs)
    host = time.perf_counter() - t0
    sync(device)
    return time.perf_counter() - t0, host, before, dict(runner.stats)


def bench_full(runner, cfg, rows, device, reps, tag):
    jobs = [FlowJob(("full", tag, i), tok, pr) for i, (pr, tok) in enumerate(rows)]
    runner.run(jobs)  # warm-up (allocator, autotuning, compilation, graph capture)
    secs, host, flops, toks, outs = 0.0, 0.0, 0.0, 0, 0
    for _ in range(reps):
        dt, h, b, a = timed_call(runner, jobs, device)
        f, t, o = work(cfg, b, a)
        secs, host, flops, toks, outs = secs + dt, host + h, flops + f, toks + t, outs + o
    return {"seconds": secs / reps, "host_ms_per_solve": host / reps * 1e3, "flops": flops / reps,
            "tokens": toks // reps, "output_frames": outs // reps}


def bench_stream(runner, cfg, rows, device, tag):
    """All rows stream in lock step; returns totals for non-final hops and for final hops."""
    plans = [(i, pr, tok, plan_segment(HopSchedule(), pr.speech_tokens.shape[0], tok.numel())) for i, (pr, tok) in enumerate(rows)]
    res = {k: {"seconds": 0.0, "host_s": 0.0, "flops": 0.0, "tokens": 0, "output_frames": 0, "calls": 0}
           for k in ("hops", "final")}
    for hop in range(max(len(c) for *_, c in plans)):
        jobs = [FlowJob((tag, i), tok, pr, c[hop]) for i, pr, tok, c in plans if hop < len(c)]
        for final in (False, True):
            part = [j for j in jobs if j.chunk.finalize == final]
            if not part:
                continue
            dt, h, b, a = timed_call(runner, part, device)
            f, t, o = work(cfg, b, a)
            r = res["final" if final else "hops"]
            r["seconds"] += dt
            r["host_s"] += h
            r["flops"] += f
            r["tokens"] += t
            r["output_frames"] += o
            r["calls"] += 1
    for i, *_ in plans:
        runner.release((tag, i))
    return res


def profile_full(flow, cfg, dtype, args, budget):
    """Top GPU kernels of one eager full pass: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    runner = FlowRunner(flow, dtype=dtype, attention=args.attention, prefix_budget_bytes=budget)
    rows = make_rows(cfg, args.profile, args.full_prompt, args.full_target, args.device, seed=1)
    jobs = [FlowJob(("prof", i), tok, pr) for i, (pr, tok) in enumerate(rows)]
    runner.run(jobs)
    sync(args.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        runner.run(jobs)
        sync(args.device)
    key = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60), flush=True)


def bench_conv(flow, dtype, args, reps=20):
    """The two causal position convs over packed layouts of several sizes, in each form of
    ``ConvPositionEmbed`` this device runs (the Triton kernel only on CUDA)."""
    import copy

    from cosybatch.codec.dit_step import ConvPositionEmbed

    dit = copy.deepcopy(flow.decoder.estimator).to(dtype)
    forms = [f for f in ConvPositionEmbed.FORMS if args.device.startswith("cuda") or f == "conv1d"]
    convs = {f: ConvPositionEmbed(dit, f) for f in forms}
    out = []
    for frames in [int(x) for x in args.conv_frames.split(",") if x]:
        h = torch.randn(frames, dit.cfg.dim, device=args.device, dtype=dtype)
        valid = torch.ones(frames, device=args.device, dtype=dtype)
        gflop = 2 * 2 * frames * dit.cfg.dim * (dit.cfg.dim // dit.cfg.conv_pos_groups) * dit.cfg.conv_pos_kernel / 1e9
        for name, conv in convs.items():
            conv(h, valid)
            sync(args.device)
            t0 = time.perf_counter()
            for _ in range(reps):
                conv(h, valid)
            sync(args.device)
            ms = (time.perf_counter() - t0) / reps * 1e3
            out.append({"frames": frames, "form": name, "ms": ms})
            print(f"conv   {name:22s} {frames:6d} frames: {ms:7.3f} ms ({gflop / ms:6.1f} TFLOP/s)", flush=True)
        ref = convs["conv1d"](h, valid).float()
        for name, conv in convs.items():
            if name != "conv1d":
                d = (conv(h, valid).float() - ref).abs().max().item()
                print(f"conv   max |{name} - conv1d| = {d:.3e}", flush=True)
    return out


def per_output_second(r):
    sec = r["output_frames"] / FRAMES_PER_SECOND
    return r["flops"] / sec, r["seconds"] / sec


def _guard(what, fn, *a):
    """Run one benchmark section; a failure is reported and the others still run."""
    try:
        return fn(*a)
    except Exception:  # noqa: BLE001 - a benchmark should report every section it can
        print(f"!! section {what} failed:\n{traceback.format_exc()}", flush=True)
        return None


def graph_stats(runner) -> dict:
    return runner.graphs.stats.as_dict() if runner.graphs is not None else {}


def section_full(runner, cfg, args, n, label, results):
    rows = make_rows(cfg, n, args.full_prompt, args.full_target, args.device, seed=n)
    r = bench_full(runner, cfg, rows, args.device, args.reps, n)
    r.update(mode=label, jobs=n, backend=runner.backend.name, graphs=graph_stats(runner))
    r["tflops"] = r["flops"] / r["seconds"] / 1e12
    r["tokens_per_s"] = r["tokens"] / r["seconds"]
    r["audio_s_per_s"] = r["output_frames"] / FRAMES_PER_SECOND / r["seconds"]
    results["full"].append(r)
    g = r["graphs"]
    print(f"full   {label:8s} jobs={n:4d} tokens={r['tokens']:6d} {r['seconds'] * 1e3:8.1f} ms "
          f"{r['tokens_per_s'] / 1e3:8.1f} k tok/s {r['tflops']:6.1f} TFLOP/s {r['audio_s_per_s']:7.1f} audio-s/s "
          f"host {r['host_ms_per_solve']:6.2f} ms/solve"
          + (f" graph hit {g['hit_rate']:.2f} pool {g['pool_bytes'] / 2**20:.0f} MB" if g else ""), flush=True)


def section_stream(runner, flow, cfg, dtype, budget, args, label, compiled, results):
    """Streaming hops with prefix reuse (and, for the eager variant, the recompute baseline)."""
    rows = make_rows(cfg, args.stream_rows, args.prompt_tokens, args.target_tokens, args.device, seed=7)
    full = bench_full(runner, cfg, rows, args.device, 1, "stream-base")
    bench_stream(runner, cfg, rows, args.device, "warm")  # warm-up: shapes, allocator, compile
    variants = [("reuse", runner)]
    if not args.no_baseline and label == "eager":
        variants.append(("recompute", FlowRunner(flow, dtype=dtype, attention=args.attention, prefix_budget_bytes=0)))
    f_full, s_full = per_output_second(full)
    for name, rr in variants:
        res = bench_stream(rr, cfg, rows, args.device, "timed")
        hops = res["hops"]
        f_hop, s_hop = per_output_second(hops)
        entry = {"mode": label, "variant": name, "rows": args.stream_rows, "full_pass": full, **res,
                 "flop_ratio_vs_full": f_hop / f_full, "time_ratio_vs_full": s_hop / s_full,
                 "hop_tflops": hops["flops"] / hops["seconds"] / 1e12,
                 "host_ms_per_solve": hops["host_s"] / max(1, hops["calls"]) * 1e3,
                 "kv_cache_gb": rr.cache.allocated_bytes / 2**30, "graphs": graph_stats(rr)}
        results["stream"].append(entry)
        print(f"stream {label:8s} {name:9s} rows={args.stream_rows} hops: {hops['calls']} calls {hops['seconds'] * 1e3:8.1f} ms "
              f"{entry['hop_tflops']:6.1f} TFLOP/s host {entry['host_ms_per_solve']:.2f} ms/solve; per output s vs full "
              f"pass: work x{entry['flop_ratio_vs_full']:.3f}, time x{entry['time_ratio_vs_full']:.3f}; final hops "
              f"{res['final']['seconds'] * 1e3:.1f} ms; K/V arena {entry['kv_cache_gb']:.1f} GiB", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="full", choices=["tiny", "small", "full"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--variants", default="eager,graphs", help="comma list of eager, graphs, compiled")
    ap.add_argument("--full-jobs", default="16,32,64", help="packed full-pass sizes, in jobs of --full-prompt + --full-target tokens")
    ap.add_argument("--full-prompt", type=int, default=125)
    ap.add_argument("--full-target", type=int, default=125)
    ap.add_argument("--stream-rows", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=125, help="streaming prompt (125 tokens = 5 s)")
    ap.add_argument("--target-tokens", type=int, default=250, help="streaming reply (250 tokens = 10 s)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prefix-budget-gb", type=float, default=64.0)
    ap.add_argument("--no-baseline", action="store_true", help="skip the streaming run without reuse")
    ap.add_argument("--no-triton", action="store_true", help="the rotary as PyTorch ops (the pipeline uses the Triton kernel on CUDA)")
    ap.add_argument("--profile", type=int, default=0, help="profile one eager full pass of this many jobs (top kernels)")
    ap.add_argument("--conv", action="store_true", help="time the position convs: NCL conv1d vs the channels-last form")
    ap.add_argument("--conv-frames", default="800,1600,3200,6400,12800,34000")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    flow = build_flow(args.size, args.device)
    cfg = flow.cfg
    args.no_triton = args.no_triton or not args.device.startswith("cuda")
    budget = int(args.prefix_budget_gb * (1 << 30))
    variants = [v for v in args.variants.split(",") if v]
    results = {"args": vars(args), "token_gflop": dit_token_flops(cfg.dit) / 1e9, "full": [], "stream": []}
    if args.device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name()
    print(f"# flow bench: size={args.size} dtype={args.dtype} device={args.device} token GFLOP/pass={dit_token_flops(cfg.dit) / 1e9:.4f}", flush=True)

    if args.conv:
        results["conv"] = _guard("conv", bench_conv, flow, dtype, args)
    if args.profile:
        _guard("profile", profile_full, flow, cfg, dtype, args, budget)
    for label in variants:
        t0 = time.perf_counter()
        compiled = label == "compiled"
        runner = FlowRunner(flow, dtype=dtype, attention=args.attention, prefix_budget_bytes=budget, compile=compiled,
                            graphs=label == "graphs", graph_capacity=64, triton_kernels=not args.no_triton)
        for n in [int(x) for x in args.full_jobs.split(",") if x]:
            _guard(f"full {label} {n}", section_full, runner, cfg, args, n, label, results)
        _guard(f"stream {label}", section_stream, runner, flow, cfg, dtype, budget, args, label, compiled, results)
        print(f"# {label} section took {time.perf_counter() - t0:.1f} s", flush=True)
        if args.json:  # after every section, so a run cut short still leaves its figures
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        del runner
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.device.startswith("cuda"):
        results["max_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        print(f"# peak GPU memory {results['max_memory_gb']:.1f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    main()
