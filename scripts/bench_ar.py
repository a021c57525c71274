"""AR engine benchmark on one GPU: full-size random CosyVoice3LM (LLMConfig() defaults), bf16.

Decode ms/step and tokens/s versus batch size (CUDA graphs vs eager; Triton fixed-tile linears vs
cuBLAS), prefill tokens/s, sampler time, peak memory. Every request runs ``force_length`` tokens
(stop ids ignored, as ``ignore_eos`` + ``max_tokens`` in vLLM benchmarks), so batches stay full.
A decode step is timed from ``engine.step()`` call to return: graph replay, the single read of
the sampled ids and all host bookkeeping.

    python scripts/bench_ar.py [--batches 1,16,64,128,256] [--out bench.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosybatch.models.config import LLMConfig  # noqa: E402
from cosybatch.engine import LLMEngine, SamplingParams  # noqa: E402
from cosybatch.profiles.resolve import engine_config  # noqa: E402
from cosybatch.bench.random_lm import random_lm  # noqa: E402


def make_requests(n: int, gen: int, seed: int, cfg: LLMConfig, text_len=60, speech_len=190) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = [rng.randrange(1000, 150000) for _ in range(text_len)]
        speech = [rng.randrange(cfg.speech_token_size) for _ in range(speech_len)]
        if i % 2:
            p = SamplingParams.standard(0.7, 0.8, 20, 1.21, seed=i, force_length=gen)
        else:
            p = SamplingParams(seed=i, force_length=gen)
        out.append(dict(text_ids=text[20:], prompt_text_ids=text[:20], prompt_speech_tokens=speech, params=p))
    return out


def run_batch(eng: LLMEngine, b: int, gen: int, cfg: LLMConfig) -> dict:
    reqs = make_requests(b, gen, seed=b, cfg=cfg)
    for r in reqs:
        eng.add_request(**r)
    st = eng.stats
    pre_tok, pre_s, steps = st.prefill_tokens, st.prefill_s, []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    while eng.has_unfinished():
        t0 = time.perf_counter()
        n0 = st.prefill_steps
        outs = eng.step()
        dt = time.perf_counter() - t0
        if st.prefill_steps == n0 and len(outs) == b:
            steps.append(dt)
    pre_tok, pre_s = st.prefill_tokens - pre_tok, st.prefill_s - pre_s
    warm = steps[3:] if len(steps) > 8 else steps
    ms = statistics.median(warm) * 1e3
    return {"batch": b, "ms_per_step": ms, "tokens_per_s": b / ms * 1e3, "steps": len(steps),
            "prefill_tokens_per_s": pre_tok / pre_s if pre_s else None}


def sampler_ms(eng: LLMEngine, b: int, iters: int = 30) -> float:
    """Sampling + recording called eagerly (as it runs when its graph capture failed). Launch
    bound: inside the captured decode step the same kernels cost far less."""
    r = eng.runner
    logits = torch.randn(b, r.vocab_padded, device=r.device)
    n_gen = torch.zeros(b, dtype=torch.long, device=r.device)
    for _ in range(3):
        r.sampler.sample(logits, slice(0, b), n_gen)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        t = r.sampler.sample(logits, slice(0, b), n_gen)
        r.sampler.record(slice(0, b), n_gen, t)
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def cublas_rows_invariant() -> bool:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(896, 4864, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(256, 4864, device="cuda", generator=g).to(torch.bfloat16)
    one = torch.nn.functional.linear(x[:1], w)
    return all(torch.equal(torch.nn.functional.linear(x[:m], w)[0], one[0]) for m in (2, 8, 64, 256))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64,128,256")
    ap.add_argument("--eager-batches", default="1,64,256")
    ap.add_argument("--cublas-batches", default="64,256")
    ap.add_argument("--variant-batches", default="16,32,64",
                    help="graphs+triton with RoPE inside the decode attention kernel (ar.rope_in_attention), "
                         "and with the sampler as tensor ops instead of its two Triton kernels")
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, to check the script")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    cfg = LLMConfig()
    if not cuda:
        from cosybatch.models.config import QwenConfig

        cfg = LLMConfig(qwen=QwenConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128),
                        llm_input_size=64, llm_output_size=64)
        a.batches, a.eager_batches, a.cublas_batches, a.variant_batches, a.gen = "1,4", "", "", "4", 8
    t0 = time.time()
    lm = random_lm(cfg, seed=0, device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32)
    print(f"model built in {time.time() - t0:.1f}s", flush=True)
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "runs": []}
    plans = [("graphs+triton", dict(cuda_graphs=True, linear="triton"), a.batches),
             ("eager+triton", dict(cuda_graphs=False, linear="triton"), a.eager_batches),
             ("graphs+cublas", dict(cuda_graphs=True, linear="torch"), a.cublas_batches),
             ("graphs+triton+rope_in_attention", dict(cuda_graphs=True, linear="triton", rope_in_attention=True),
              a.variant_batches),
             ("graphs+triton, sampler as tensor ops", dict(cuda_graphs=True, linear="triton", sampler_kernels=False),
              a.variant_batches)]
    for name, kw, batches in plans:
        bl = [int(x) for x in batches.split(",") if x]
        if not bl:
            continue
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        try:
            eng = LLMEngine(lm, engine_config(max_num_seqs=max(bl), max_model_len=512, **{"dtype": "auto", "cuda_graphs": True, **kw}))
            setup = time.time() - t0
            print(f"[{name}] engine ready in {setup:.1f}s graph modes {eng.runner.graph_modes}", flush=True)
            for b in bl:
                r = run_batch(eng, b, a.gen, cfg)
                r.update(config=name)
                if cuda and name == "graphs+triton" and b >= 16:
                    r["sampler_eager_ms"] = sampler_ms(eng, b)
                results["runs"].append(r)
                print(json.dumps(r), flush=True)
        except Exception as e:  # keep what was measured so far
            print(f"[{name}] failed: {e!r}", flush=True)
            results[f"{name}_error"] = repr(e)
            continue
        results[f"{name}_setup_s"] = setup
        if cuda:
            results[f"{name}_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        del eng
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        results["cublas_rows_batch_invariant"] = cublas_rows_invariant()
    print("\n| config | batch | ms/step | tokens/s | prefill tok/s | eager sampler ms |")
    print("|---|---|---|---|---|---|")
    for r in results["runs"]:
        pf = f"{r['prefill_tokens_per_s']:.0f}" if r["prefill_tokens_per_s"] else "-"
        sm = f"{r['sampler_eager_ms']:.3f}" if "sampler_eager_ms" in r else "-"
        print(f"| {r['config']} | {r['batch']} | {r['ms_per_step']:.3f} | {r['tokens_per_s']:.0f} | {pf} | {sm} |")
    for k, v in results.items():
        if k != "runs":
            print(f"{k}: {v}")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
