"""Where a flow Euler step's time goes at the sizes the streaming pipeline runs.

For streaming hops of ``--rows`` rows in lock step (prompt 5 s, prefix reused, the mid-row
hop), per row count: GPU milliseconds per Euler step from graph replays (CUDA events), padded
tokens per step, and the fit ``ms = fixed + per_token * tokens`` over the row counts. Then
one kernel profile of the eager step at ``--profile-rows`` rows per ``--profile-variants``: the
kernels by GPU time per Euler step, with launch counts, so the fixed part can be named, and the
kernels per DiT layer (the step with every block against the step with one). ``--variants``
times the step with and without the Triton kernels or the fused layer's parts side by side
(``VARIANTS``) and compares each variant's mels with the first's over four rows' hops; a table
of both last. Random full-size weights.
  python scripts/profile_flow.py --rows 1,2,4,8,16,32 --profile-rows 4 --json out.json
  python scripts/profile_flow.py --rows 6,12,24 --hop 2 --variants unfused,triton --profile-variants unfused,triton
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

from bench_codec import build_flow, make_rows  # noqa: E402
from kernel_census import census  # noqa: E402

from cosybatch.codec.flops import attention_pair_flops, block_token_flops  # noqa: E402
from cosybatch.codec.flow_runner import FUSIONS, FlowJob, FlowRunner  # noqa: E402
from cosybatch.hops import HopSchedule, plan_segment  # noqa: E402


# FlowRunner options per variant: eager ops and cuDNN convs; the Triton rotary with cuDNN's
# convs; every Triton kernel (what the pipeline runs on CUDA).
# "triton-varlen" / "triton-attn": the Triton kernels without the fused residual + LayerNorm, with
# FlashAttention's varlen kernel / the Triton attention (an "attention" entry overrides --attention).
# "unfused": the Triton kernels without the fused layer's parts (design.md D26, what the pipeline
# ran before them); "+chain", "+gelu", "+kv", "+fill": one part each; "triton": all of them (the
# default with triton_kernels).
VARIANTS = {"eager": {"triton_kernels": False}, "cudnn-conv": {"triton_kernels": True, "conv_form": "channels_last"},
            "triton": {"triton_kernels": True},
            "triton-varlen": {"triton_kernels": True, "fused_ln": False, "attention": "varlen", "fusions": ()},
            "triton-attn": {"triton_kernels": True, "fused_ln": False, "attention": "triton", "fusions": ()},
            "unfused": {"triton_kernels": True, "fusions": ()},
            **{f"+{f}": {"triton_kernels": True, "fusions": (f,)} for f in FUSIONS}}


def hop_jobs(rows, tag, hop):
    plans = [(i, pr, tok, plan_segment(HopSchedule(), pr.speech_tokens.shape[0], tok.numel()))
             for i, (pr, tok) in enumerate(rows)]
    out = []
    for h in range(hop + 1):
        out.append([FlowJob((tag, i), tok, pr, c[h]) for i, pr, tok, c in plans if h < len(c) and not c[h].finalize])
    return out


def gpu_ms(fn, device) -> float:
    """Milliseconds ``fn``'s queued work takes (CUDA events; wall clock elsewhere)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1)


def time_hop(runner, rows, tag, hop, reps):
    """Run hops 0..hop-1 to build the prefix, then time hop ``hop``'s steps ``reps`` times."""
    seq = hop_jobs(rows, tag, hop)
    for jobs in seq[:-1]:
        runner.run(jobs)
    ms, host, tokens = [], [], 0
    for r in range(reps):
        before = runner.stats["padded_tokens"]
        t0 = time.perf_counter()
        solve = runner.start(seq[-1])
        host.append((time.perf_counter() - t0) * 1e3)
        solve.step(1)  # first step may capture the bucket's graph: not timed
        ms.append(gpu_ms(lambda: solve.step(runner.n_steps - 1), runner.device) / (runner.n_steps - 1))
        solve.finish()
        tokens = runner.stats["padded_tokens"] - before
        # put the prefix back where the timed hop found it (finish committed the hop)
        if r + 1 < reps:
            for i in range(len(rows)):
                runner.release((tag, i))
            for jobs in seq[:-1]:
                runner.run(jobs)
    for i in range(len(rows)):
        runner.release((tag, i))
    return float(np.median(ms)), tokens, float(np.median(host))


def sweep(flow, args, dtype, cuda: bool, variant: str) -> dict:
    """Graphed step times over the row counts for one variant (a key of ``VARIANTS``), the fit,
    and the mels of four rows' first hops (for the comparison between variants)."""
    opts = dict(VARIANTS[variant]) if cuda else {}
    attention = opts.pop("attention", args.attention)
    runner = FlowRunner(flow, dtype=dtype, attention=attention, prefix_budget_bytes=16 << 30,
                        graphs=cuda, graph_capacity=64, **opts)
    out = {"rows": []}
    for n in [int(x) for x in args.rows.split(",") if x]:
        rows = make_rows(flow.cfg, n, 125, 250, args.device, seed=n)
        ms, tok, host = time_hop(runner, rows, ("r", n), args.hop, args.reps)
        out["rows"].append({"rows": n, "ms_per_step": ms, "padded_tokens": tok, "start_host_ms": host})
        print(f"[{variant}] graphed step, {n:3d} rows, hop {args.hop}: {ms:6.3f} ms per Euler step, {tok:6d} padded "
              f"tokens ({1e3 * ms / max(tok, 1):.3f} us/token); host {host:.2f} ms to start the solve", flush=True)
    if len(out["rows"]) >= 2:
        x = np.array([r["padded_tokens"] for r in out["rows"]], float)
        y = np.array([r["ms_per_step"] for r in out["rows"]])
        slope, icpt = np.polyfit(x, y, 1)
        out["fit"] = {"fixed_ms": icpt, "us_per_token": 1e3 * slope}
        print(f"[{variant}] fit: {icpt:.3f} ms fixed + {1e3 * slope:.3f} us per padded token", flush=True)
    out["graphs"] = runner.graphs.stats.as_dict() if runner.graphs else {}
    rows = make_rows(flow.cfg, 4, 125, 250, args.device, seed=7)
    out["mels"] = [m.float() for jobs in hop_jobs(rows, "cmp", args.hop) for m in runner.run(jobs)]
    return out


def compare(base: list, other: list) -> dict:
    """Worst relative RMS and max |difference| of ``other``'s mels against ``base``'s."""
    rel = max(((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item() for a, b in zip(other, base))
    return {"worst_rel_rms": rel, "max_abs": max((a - b).abs().max().item() for a, b in zip(other, base))}


def kernel_profile(runner, rows, hop, top, what="", fresh=None):
    """Kernels of one eager Euler step, then kernels per DiT layer: the same step's launches
    with every block against one block only (the difference over depth - 1 blocks). ``fresh``:
    rows whose whole responses join the profiled call (uncached, full attention: the self launch
    beside the pool's, as a call of the pipeline often has)."""
    from torch.profiler import ProfilerActivity, profile

    seq = hop_jobs(rows, "prof", hop)
    for jobs in seq[:-1]:
        runner.run(jobs)
    before = dict(runner.stats)
    solve = runner.start(seq[-1] + [FlowJob(("fresh", i), tok, pr) for i, (pr, tok) in enumerate(fresh or ())])
    solve.step(1)
    # one Euler step's padded tokens and attention pairs (per layer): what the classes below divide by
    step_tokens = runner.stats["padded_tokens"] - before["padded_tokens"]
    step_pairs = runner.stats["attn_pairs"] - before["attn_pairs"]
    cuda = runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    act = [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
    sync()
    with profile(activities=act) as prof:
        solve.step(1)
        sync()
    out = kernel_table(prof, f"one eager Euler step, {len(rows)} rows {what}", top, cuda)
    blocks = runner.tables.blocks
    runner.tables.blocks = blocks[:1]
    try:
        with profile(activities=act) as one:
            solve.step(1)
            sync()
    finally:
        runner.tables.blocks = blocks
    # The same step's launches as the ops issue them (kernel_census): what the profiler counts
    # beyond these per layer is launched inside ops (a library's own kernels).
    counted = census(runner, solve) if solve.steps_left else None
    solve.step(solve.steps_left)
    solve.finish()
    for i in range(len(rows)):
        runner.release(("prof", i))
    depth = len(blocks)
    full, single = _launches(prof, cuda), _launches(one, cuda)
    # Over the kernels of both steps: a per-step op can launch another kernel variant with one
    # block than with all (an elementwise op over the [layers, ...] key and slot tables that
    # broadcasts only when there are several), and a kernel seen only in the one-block step must
    # be subtracted too, or each such adds 1 / (depth - 1) to the count (10.05 for 10).
    zero = (0, 0)
    per = {k: (full.get(k, zero)[0] - single.get(k, zero)[0], full.get(k, zero)[1] - single.get(k, zero)[1])
           for k in full.keys() | single.keys()}
    per = {k: (n / (depth - 1), t / (depth - 1)) for k, (n, t) in per.items() if n}
    out["kernels_per_layer"] = sum(n for n, _ in per.values())
    out["layer_ms"] = sum(t for _, t in per.values()) / 1e3
    out["step_launches"] = sum(n for n, _ in full.values())
    out["per_layer"] = [{"kernel": k, "count": n, "us": t} for k, (n, t) in sorted(per.items(), key=lambda kv: -kv[1][1])]
    print(f"# kernels per layer {what}: {out['kernels_per_layer']:.2f} ({out['layer_ms']:.3f} ms of kernels per layer; "
          f"{out['step_launches']} launches per step)", flush=True)
    for r in out["per_layer"]:
        print(f"    x{r['count']:4.2f} {r['us']:8.1f} us  {r['kernel'][:100]}", flush=True)
    out["by_class"] = by_class(out["per_layer"], step_tokens, step_pairs, depth, runner.flow.cfg.dit)
    for c, r in out["by_class"].items():
        rate = f", {r['tflops']:.0f} TFLOP/s" if r.get("tflops") else ""
        print(f"#   {c:11s} {r['us_per_token']:.3f} us per padded token per Euler step ({r['kernels']:.2f} kernels a "
              f"layer{rate})", flush=True)
    if counted is not None:
        out["census_per_layer"] = counted.per_layer()
        out["census_step_launches"] = counted.total
        print(counted.format(what), flush=True)
    return out


def kernel_class(name: str) -> str:
    """A DiT layer's kernel by what it does: ``attention``, ``gemm`` (cuBLAS / CUTLASS, epilogues
    included), or ``elementwise`` (norms, gates, rotary, K/V writes, fills)."""
    n = name.lower()
    if "attn" in n or "attention" in n or "flash" in n:
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "addmm", "aten::mm", "bmm")):
        return "gemm"
    return "elementwise"


def by_class(per_layer: list, tokens: int, pairs: int, depth: int, d) -> dict:
    """Per-layer kernel time split by ``kernel_class`` as microseconds per padded token of a whole
    Euler step (the unit of the graphed step's fit), with the rate the GEMMs and attention reach:
    where a step's per-token cost goes, kernel class by kernel class."""
    out = {}
    for r in per_layer:
        c = out.setdefault(kernel_class(r["kernel"]), {"us_layer": 0.0, "kernels": 0.0})
        c["us_layer"] += r["us"]
        c["kernels"] += r["count"]
    flops = {"gemm": tokens * block_token_flops(d), "attention": pairs * attention_pair_flops(d)}
    for name, c in out.items():
        c["us_per_token"] = c["us_layer"] * depth / max(tokens, 1)
        if name in flops and c["us_layer"] > 0:
            c["tflops"] = flops[name] / (c["us_layer"] * 1e-6) / 1e12
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us_layer"]))


def _launches(prof, cuda: bool) -> dict:
    """{kernel: (launches, us)} of a profile (ops on the CPU)."""
    out = {}
    for ev in prof.key_averages():
        t = (getattr(ev, "self_device_time_total", 0) or getattr(ev, "self_cuda_time_total", 0)) if cuda \
            else ev.self_cpu_time_total
        if t > 0 and ev.count > 0:
            out[ev.key] = (ev.count, t)
    return out


def kernel_table(prof, what: str, top: int, cuda: bool = True) -> dict:
    """Print a profile's kernels (ops on the CPU) by own time, with launch counts; return them."""
    rows = []
    for ev in prof.key_averages():
        t = (getattr(ev, "self_device_time_total", 0) or getattr(ev, "self_cuda_time_total", 0)) if cuda \
            else ev.self_cpu_time_total
        if t > 0 and ev.count > 0:
            rows.append((t, ev.count, ev.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    launches = sum(r[1] for r in rows)
    print(f"# kernel profile, {what}: {total / 1e3:.2f} ms of kernels, {launches} launches", flush=True)
    for t, n, k in rows[:top]:
        print(f"  {t / 1e3:7.3f} ms {100 * t / total:5.1f} % x{n:4d}  {k[:110]}", flush=True)
    return {"kernel_ms": total / 1e3, "launches": launches,
            "top": [{"ms": t / 1e3, "count": n, "kernel": k} for t, n, k in rows[:top]]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--hop", type=int, default=2, help="which hop of the rows to time (0 = the first)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile-rows", type=int, default=4)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--size", default="full", choices=["tiny", "small", "full"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default="eager,cudnn-conv,triton",
                    help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--profile-variants", default=None,
                    help="comma list of variants to kernel-profile (default: the last of --variants)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = True
    flow = build_flow(args.size, args.device)
    cuda = args.device.startswith("cuda")
    cfg = flow.cfg
    out = {}
    dtype = torch.bfloat16 if cuda else torch.float32
    variants = [v for v in args.variants.split(",") if v]
    for variant in variants:
        out[variant] = sweep(flow, args, dtype, cuda, variant)
    base = out[variants[0]].pop("mels")
    for variant in variants[1:]:
        out[variant]["vs_" + variants[0]] = c = compare(base, out[variant].pop("mels"))
        print(f"[{variant}] mels vs {variants[0]}: worst rel RMS {c['worst_rel_rms']:.2e}, "
              f"max |diff| {c['max_abs']:.2e}", flush=True)
    if len(variants) > 1:
        print("| rows | padded tokens | " + " | ".join(f"ms per step, {v}" for v in variants) + " |")
        print("|---|---|" + "---|" * len(variants))
        for i, r in enumerate(out[variants[0]]["rows"]):
            print(f"| {r['rows']} | {r['padded_tokens']} | " + " | ".join(f"{out[v]['rows'][i]['ms_per_step']:.3f}"
                                                                      for v in variants) + " |")
        print("| fit | | " + " | ".join(f"{out[v]['fit']['fixed_ms']:.2f} ms + {out[v]['fit']['us_per_token']:.2f} us/token"
                                         if "fit" in out[v] else "-" for v in variants) + " |", flush=True)
    out["profile"], out["profile_mixed"] = {}, {}
    for variant in (args.profile_variants or variants[-1]).split(","):
        opts = dict(VARIANTS[variant]) if cuda else {}
        eager = FlowRunner(flow, dtype=dtype, attention=opts.pop("attention", args.attention),
                           prefix_budget_bytes=16 << 30, **opts)
        rows = make_rows(cfg, args.profile_rows, 125, 250, args.device, seed=99)
        out["profile"][variant] = kernel_profile(eager, rows, args.hop, args.top, f"[{variant}]")
        # the same cached rows with two short whole responses beside them (pool + self launches)
        fresh = make_rows(cfg, 2, 125, 25, args.device, seed=98)
        out["profile_mixed"][variant] = kernel_profile(eager, rows, args.hop, args.top, f"[{variant}, + fresh rows]",
                                                       fresh)
    prof, mixed = out["profile"], out["profile_mixed"]
    if len(prof) > 1:
        print("| | " + " | ".join(prof) + " |")
        print("|---|" + "---|" * len(prof))
        print("| kernels per layer | " + " | ".join(f"{p['kernels_per_layer']:.2f}" for p in prof.values()) + " |")
        print("| launches per layer by its ops (kernel_census) | "
              + " | ".join(f"{len(p.get('census_per_layer', ()))}" for p in prof.values()) + " |")
        print("| kernels per layer, + uncached rows (pool + self launches) | "
              + " | ".join(f"{p['kernels_per_layer']:.2f}" for p in mixed.values()) + " |")
        print("| launches per layer by its ops, + uncached rows | "
              + " | ".join(f"{len(p.get('census_per_layer', ()))}" for p in mixed.values()) + " |")
        print("| ms of kernels per layer (eager) | " + " | ".join(f"{p['layer_ms']:.3f}" for p in prof.values()) + " |")
        print("| launches per step | " + " | ".join(f"{p['step_launches']}" for p in prof.values()) + " |")
        print("| ms of kernels per step (eager) | " + " | ".join(f"{p['kernel_ms']:.3f}" for p in prof.values()) + " |")
        for v in variants:
            if "fit" in out[v]:
                print(f"| graphed step fit [{v}] | {out[v]['fit']['fixed_ms']:.3f} ms + {out[v]['fit']['us_per_token']:.3f} us/token |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
