"""Prompt-frontend throughput: onnxruntime on the CPU against the batched PyTorch path.

Builds real-structure stand-ins of ``--size`` (``full`` = the official dimensions, ~1 GB of
tokenizer) in a temporary directory unless ``--model-dir`` is given, synthesises speech-like
prompts of ``--seconds`` at 24 kHz, and measures prompts/s of the device part (whisper log-mel
+ S3TokenizerV3, Kaldi fbank + CAM++, prompt mel, host copies) for onnxruntime (one prompt per
call, ``--ort-threads``) and for torch at each batch size and precision, each figure with the share
of token positions identical to onnxruntime's and the largest embedding difference. It also
times the first prompt of a run (its waveform in hand -> PromptFeatures on the host) right
after the frontend is built. Precisions (``frontend.precision``): float32 (strict), 3xtf32
(float32 with the tokenizer's GEMMs as three TF32 products each, what the shipped profiles run)
and bfloat16; the frontend keeps
its own float32 switches whatever the process's are. ``--kernels N`` prints the N costliest CUDA
kernels of one call at the largest batch for each precision.

  python scripts/bench_frontend.py                      # CUDA: full size; CPU: small size
  python scripts/bench_frontend.py --size small --device cpu --batches 1,16
Every measurement stops after ``--seconds-per-config``, so the whole run stays within minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cosybatch.models.config import ModelConfig  # noqa: E402
from cosybatch.frontend.frontend import Frontend  # noqa: E402
from cosybatch.checkpoint.synthetic_audio import speech_like  # noqa: E402
from cosybatch.profiles.resolve import resolve_frontend  # noqa: E402
from cosybatch.profiles.schema import FrontendProfile  # noqa: E402
from profile_flow import kernel_table  # noqa: E402

PRECISIONS = ("float32", "3xtf32", "bfloat16")  # the values of the profile key frontend.precision


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _agreement(raws, ref) -> tuple[float, float]:
    same = total = 0
    worst = 0.0
    for raw, (codes, emb) in zip(raws, ref):
        n = min(len(codes), len(raw.tokens))
        same += int((raw.tokens[:n] == codes[:n]).sum())
        total += max(len(codes), len(raw.tokens))
        worst = max(worst, float((raw.embedding - emb).abs().max()))
    return same / max(total, 1), worst


def bench_ort(model_dir, loaded, n_ref, threads, budget):
    fe = Frontend(model_dir, ModelConfig(), backend="onnxruntime", onnx_threads=threads, cache_size=0)
    ref, t0, done = [], time.perf_counter(), 0
    for p in loaded:
        raw = fe.raw_features([p])[0]
        if len(ref) < n_ref:
            ref.append((raw.tokens, raw.embedding))
        done += 1
        if done >= n_ref and time.perf_counter() - t0 > budget:
            break
    dt = time.perf_counter() - t0
    return ref, {"backend": f"onnxruntime cpu x{threads}", "dtype": "float32", "batch": 1, "prompts": done,
                 "prompts_per_s": done / dt, "ms_per_prompt": dt / done * 1e3, "agree": 1.0, "emb_diff": 0.0}


def kernels(fe, loaded, top: int, what: str) -> None:
    """Print the ``top`` CUDA kernels of one ``raw_features(loaded)`` call by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    fe.raw_features(loaded)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fe.raw_features(loaded)
        torch.cuda.synchronize()
    kernel_table(prof, what, top)


def bench_torch(model_dir, loaded, ref, device, dtype_name, batches, budget, top_kernels=0):
    f = resolve_frontend(FrontendProfile(precision=dtype_name), torch.device(device))  # as a profile resolves it
    dtype, split_tf32 = f.dtype, f.split_tf32
    t = time.perf_counter()
    fe = Frontend(model_dir, ModelConfig(), backend="torch", device=device, dtype=dtype, split_tf32=split_tf32,
                  cache_size=0, max_batch=max(batches))
    build_s = time.perf_counter() - t
    label = f"torch {device}"
    # the first prompt of a run: waveform in hand -> features on the host, right after start-up
    wav = torch.from_numpy(speech_like(5.0, 24000, 12345).astype(np.float32))
    _sync(device)
    t = time.perf_counter()
    fe.features([fe.load_waveform(wav, 24000, "first")])
    first_ms = (time.perf_counter() - t) * 1e3
    rows = []
    for b in batches:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        fe.raw_features(loaded[:b])  # this batch shape once before timing
        _sync(device)
        raws_ref, done, t0 = [], 0, time.perf_counter()
        while True:
            start = done % len(loaded)
            chunk = loaded[start : start + b]
            raws = fe.raw_features(chunk)
            if start < len(ref):
                raws_ref.extend(raws[: len(ref) - start])
            done += len(chunk)
            if done >= len(ref) and time.perf_counter() - t0 > budget:
                break
        _sync(device)
        dt = time.perf_counter() - t0
        agree, emb = _agreement(raws_ref[: len(ref)], ref)
        peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
        rows.append({"backend": label, "dtype": dtype_name, "batch": b, "prompts": done, "prompts_per_s": done / dt,
                     "ms_per_prompt": dt / done * 1e3, "agree": agree, "emb_diff": emb, "peak_mib": peak})
        print(f"  {label} {dtype_name} batch {b:3d}: {done / dt:8.1f} prompts/s, agree {agree:.4%}, emb {emb:.1e}",
              flush=True)
    if top_kernels and device == "cuda":
        kernels(fe, loaded[: max(batches)], top_kernels, f"{dtype_name}, one call of {max(batches)} prompts")
    del fe
    return rows, {"backend": label, "dtype": dtype_name, "first_prompt_ms": first_ms, "startup_s": build_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--size", default="auto", choices=["auto", "tiny", "small", "full"])
    ap.add_argument("--model-dir", type=Path, help="existing checkpoint dir (else stand-ins are built)")
    ap.add_argument("--ort-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prompts", type=int, default=128, help="distinct prompts cycled through")
    ap.add_argument("--reference-prompts", type=int, default=32, help="prompts compared with onnxruntime")
    ap.add_argument("--seconds", type=float, default=5.0, help="prompt length")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help="any of " + ",".join(PRECISIONS))
    ap.add_argument("--kernels", type=int, default=0, help="print the N costliest CUDA kernels per precision")
    ap.add_argument("--seconds-per-config", type=float, default=4.0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    size = ("full" if device == "cuda" else "small") if a.size == "auto" else a.size
    batches = [int(x) for x in a.batches.split(",")]
    dtypes = [d for d in a.precisions.split(",") if d in PRECISIONS and (device == "cuda" or d == "float32")]
    tmp = None
    model_dir = a.model_dir
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "size": size,
            "torch": torch.__version__, "prompt_s": a.seconds}
    if model_dir is None:
        from cosybatch.checkpoint.onnx_standins import write_onnx_standins

        tmp = tempfile.TemporaryDirectory(prefix="bench_frontend_")
        model_dir = Path(tmp.name)
        t = time.perf_counter()
        write_onnx_standins(model_dir, seed=0, size=size)
        info["build_s"] = time.perf_counter() - t
        print(f"built {size} stand-ins in {info['build_s']:.1f} s", flush=True)
    try:
        loader = Frontend(model_dir, ModelConfig(), backend="onnxruntime", cache_size=0)
        wavs = [torch.from_numpy(speech_like(a.seconds, 24000, i).astype(np.float32)) for i in range(a.prompts)]
        t = time.perf_counter()
        loaded = [loader.load_waveform(w, 24000, f"p{i}") for i, w in enumerate(wavs)]
        info["cpu_load_ms_per_prompt"] = (time.perf_counter() - t) / len(loaded) * 1e3
        n_ref = min(a.reference_prompts, len(loaded))
        print(f"onnxruntime reference on {n_ref} prompts ({a.ort_threads} threads)...", flush=True)
        ref, ort_row = bench_ort(model_dir, loaded, n_ref, a.ort_threads, a.seconds_per_config)
        rows, starts = [ort_row], []
        for dtype_name in dtypes:
            r, s = bench_torch(model_dir, loaded, ref, device, dtype_name, batches, a.seconds_per_config, a.kernels)
            rows += r
            starts.append(s)
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(f"\n# frontend: {info['device']}, {size} stand-ins, {a.seconds:g} s prompts, torch {torch.__version__}; "
          f"CPU part (resample + checks) {info['cpu_load_ms_per_prompt']:.2f} ms/prompt")
    print(f"{'backend':<24} {'precision':<9} {'batch':>5} {'prompts/s':>10} {'ms/prompt':>10} {'tokens = ORT':>13} "
          f"{'emb |diff|':>10} {'peak MiB':>9}")
    for r in rows:
        print(f"{r['backend']:<24} {r['dtype']:<9} {r['batch']:>5} {r['prompts_per_s']:>10.1f} {r['ms_per_prompt']:>10.2f} "
              f"{r['agree']:>12.3%} {r['emb_diff']:>10.1e} {r.get('peak_mib', float('nan')):>9.0f}")
    for s in starts:
        print(f"first prompt after start-up ({s['backend']} {s['dtype']}): {s['first_prompt_ms']:.1f} ms "
              f"(frontend built in {s['startup_s']:.1f} s)")
    if a.json:
        a.json.write_text(json.dumps({"info": info, "rows": rows, "first_prompt": starts}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
