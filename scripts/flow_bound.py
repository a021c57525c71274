#!/usr/bin/env python3
"""How fast the flow would have to run for a throughput target, from one measured run.

    python scripts/flow_bound.py RESULT.json --target 180 [--ar-rows 32] [--peak 790]

RESULT is what `cosybatch profile` writes (--result-dir) or a `synth` OUT/timing.json (plain or
.gz). From the run's own counters it takes the flow's work (transformer tokens per Euler step,
CFG twins included, times the steps and the DiT's linear and conv FLOPs per token; attention is
left out, so the work is a lower bound) and the GPU time every other slice kind held. The target
fixes the window (the run's audio over the target audio-s/s); the other stages keep the time they
took in this run, except that AR decode gets its p50 step time with every step full
(`--ar-rows`, the profile's AR admission) and captures and the flow's set-up slices get none. A
mixed step (new rows' prefill inside a decode step, `ar_mixed`) keeps what it took beyond a decode
step's p50: the prefill it carried; its decode part is in the full steps already. Where the AR
engine ran beside the codec on its own stream (a profile result with `scheduler.ar_stream:
beside`), its decode steps and prefills count nothing: they overlap the codec, whose measured
times already carry the slowdown they cause.
What is left is the flow's share, and the figure printed last is the rate the flow would need in
it: compare it with the flow's rate in this run and with the chip's dense bf16 peak (`--peak`,
TFLOP/s; 769-798 measured on the H200 here). Above the peak, the target cannot be met unless the
other stages shrink too.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosybatch.codec.flops import solve_flops  # noqa: E402
from cosybatch.models.config import FlowConfig  # noqa: E402

TOKEN_RATE = 25.0  # speech tokens per second of audio (CosyVoice3)


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        d = json.load(f)
    if "totals" in d:  # synth's timing.json
        t = d["totals"]
        return {"audio_s": t["audio_s"], "wall_s": t["wall_s"], "timeline": t["timeline"], "ar_rows": None,
                "ar_beside": False}
    return {"audio_s": d["total_audio_duration_s"], "wall_s": d["duration"], "timeline": d["timeline"],
            "ar_rows": d["profile"]["ar"]["max_num_seqs"],
            "ar_beside": (d["profile"].get("scheduler") or {}).get("ar_stream") == "beside"}


def bound(run: dict, target: float, ar_rows: int, cfg: FlowConfig) -> dict:
    tl = run["timeline"]
    b, ms = tl["batches"], {k: v["total"] / 1e3 for k, v in tl["slice_ms"].items()}
    tokens = b["flow_tokens_per_step"] * b["flow_calls"]  # per Euler step, over the run
    work = solve_flops(cfg, tokens)  # attention pairs left out: older results lack them
    flow_s = ms.get("flow_step", 0.0) + ms.get("flow_capture", 0.0)
    window = run["audio_s"] / target
    decode_steps = run["audio_s"] * TOKEN_RATE / ar_rows
    step_s = tl["ar_step_ms"]["p50"] / 1e3
    mixed = tl["slice_ms"].get("ar_mixed") or {}
    beside = run["ar_beside"]
    ar = {"ar_decode": decode_steps * step_s,
          "ar_mixed_prefill": max(0.0, mixed.get("total", 0.0) / 1e3 - mixed.get("count", 0) * step_s),
          "ar_prefill": ms.get("ar_prefill", 0.0)}
    others = {**{k: 0.0 if beside else v for k, v in ar.items()}, **{k: ms.get(k, 0.0) for k in ("hift", "frontend")}}
    left = window - sum(others.values())
    return {"measured_audio_s_per_s": run["audio_s"] / run["wall_s"], "target_audio_s_per_s": target,
            "flow_work_pflop": work / 1e15, "flow_gpu_s": flow_s, "flow_tflops_measured": work / flow_s / 1e12,
            "target_window_s": window, "other_stages_s": others, "flow_share_s": left,
            "flow_tflops_needed": work / left / 1e12 if left > 0 else float("inf")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--target", type=float, required=True, help="audio-s/s")
    ap.add_argument("--ar-rows", type=int, help="AR rows per decode step (a profile result has it)")
    ap.add_argument("--peak", type=float, default=790.0, help="dense bf16 TFLOP/s of the chip")
    args = ap.parse_args(argv)
    run = load(args.result)
    ar_rows = args.ar_rows or run["ar_rows"]
    if not ar_rows:
        ap.error("a synth timing.json does not say the AR admission: pass --ar-rows (default profile: 256)")
    out = bound(run, args.target, ar_rows, FlowConfig())
    print(json.dumps(out, indent=1))
    need = out["flow_tflops_needed"]
    print(f"flow needs >= {need:.0f} TFLOP/s of linear work (measured here {out['flow_tflops_measured']:.0f}; "
          f"x{need / out['flow_tflops_measured']:.2f}; {need / args.peak:.0%} of a {args.peak:.0f} TFLOP/s peak)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
