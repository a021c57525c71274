"""Prefill GPU time per token bucket under alternative fixed matmul tiles (one H200).

The batch-invariant prefill fixes its matmul tiles by weight shape, never by row count. At the
sizes continuous batching produces (a few prompts, 300-1,300 tokens) a 128x128 tile leaves most
of the GPU's SMs idle on the narrow projections (q/k/v 1,152 wide, o and down 896 wide). This
times each tile set on the prefill graphs the engine replays (CUDA events around replays of the
captured bucket, so only GPU time counts), checks that its logits equal the shipped tiles', and
profiles the kernels of one bucket. The BK-128 variants ask whether prefill can run on the decode
phase's reduction order (what a prefill riding along a decode step needs), and at what cost:

A last table times a decode step of 16-48 rows plus a separate prefill of one prompt, against one
forward over both on the decode phase's tiles (a prefill riding along the decode step):

    python scripts/bench_prefill.py [--tokens 256,640,1280,2560] [--mixed-rows 16,32,48] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosybatch.models.config import LLMConfig  # noqa: E402
from cosybatch.engine import LLMEngine  # noqa: E402
from cosybatch.profiles.resolve import engine_config  # noqa: E402
from cosybatch.engine import triton_kernels as K  # noqa: E402
from cosybatch.engine.prefill_graphs import PrefillGraphs  # noqa: E402
from cosybatch.bench.random_lm import random_lm  # noqa: E402

SHIPPED = K.matmul_tiles
# name -> (BM, BN, BK, warps, stages) for prefill matmuls, or a function of (n, k)
VARIANTS = {
    "shipped 128x128": None,
    "64x128": (64, 128, 64, 4, 3),
    "128x64": (128, 64, 64, 4, 3),
    "64x64": (64, 64, 64, 4, 4),
    "narrow N 64x64, wide 128x128": lambda n, k, m: (64, 64, 64, 4, 4) if n < 2048 else (128, 128, 64, 8, 3),
    "narrow N 64x64, wide 64x128": lambda n, k, m: (64, 64, 64, 4, 4) if n < 2048 else (64, 128, 64, 4, 3),
    # One BK for both phases (a prefill riding along a decode step must give a decode token the
    # bits it gets alone): the decode phase's own tiles, and BK 128 under wider tiles. The
    # "vs decode tiles" difference says whether BM and BN alone move a row's bits.
    "decode's narrow tiles (BK 128)": lambda n, k, m: SHIPPED("decode", n, k),
    # what a prefill on the decode phase gets (ar.mixed_prefill): narrow tiles, wide from
    # K.WIDE_DECODE_ROWS tokens
    "decode phase (BK 128)": lambda n, k, m: SHIPPED("decode", n, k, 2, m),
    "128x128, BK 128": (128, 128, 128, 8, 2),
    "64x128, BK 128": (64, 128, 128, 4, 3),
}
DECODE_TILES = "decode's narrow tiles (BK 128)"


def tiles_for(variant):
    if variant is None:
        return SHIPPED

    def tiles(phase, n, k, elem_bytes=2, m=0):
        if phase != "prefill":
            return SHIPPED(phase, n, k, elem_bytes, m)
        return variant(n, k, m) if callable(variant) else variant
    return tiles


def inputs(t: int, scratch_row: int, vocab: int, seqs: int) -> tuple[torch.Tensor, list[int]]:
    """A prefill of ``seqs`` prompts of text ids packed into ``t`` tokens (rows: the scratch
    row; slots: the first t, which the benchmark owns)."""
    g = torch.Generator().manual_seed(t)
    ids = torch.randint(1000, vocab, (t,), generator=g)
    per = t // seqs
    pos = torch.arange(t) % per
    last = [min(t, (i + 1) * per) - 1 for i in range(seqs)]
    return torch.stack([ids, torch.zeros(t, dtype=torch.long), pos, torch.full((t,), scratch_row), torch.arange(t)]), last


def mixed_inputs(rows: int, t: int, scratch_row: int, vocab: int) -> tuple[torch.Tensor, list[int]]:
    """``rows`` one-token sequences (decode-like: each its own last token) followed by one
    ``t``-token prompt: what a step that runs a prefill beside the decode rows feeds the forward
    (the decode tokens attend to one position here, not to their rows' histories: a lower
    bound on their attention, small beside the GEMMs at these sizes)."""
    g = torch.Generator().manual_seed(rows * 100_003 + t)
    n = rows + t
    ids = torch.randint(1000, vocab, (n,), generator=g)
    pos = torch.cat([torch.zeros(rows, dtype=torch.long), torch.arange(t)])
    last = list(range(rows)) + [n - 1]
    return torch.stack([ids, torch.zeros(n, dtype=torch.long), pos, torch.full((n,), scratch_row), torch.arange(n)]), last


def mixed_table(ex, runner, scratch: int, vocab: int, rows_list: list[int], prompt_tokens: list[int],
                reps: int) -> list[dict]:
    """GPU ms of a decode step of ``rows`` plus a separate prefill of one prompt (shipped
    tiles), against one forward over both on the decode phase's tiles (what a prefill riding
    along the decode step would cost, alone on the GPU: beside the flow every launch also waits
    for SMs, so the separate prefill's ~220 launches cost more there)."""
    out = []
    for rows in rows_list:
        for t in prompt_tokens:
            sizes = (rows, t, rows + t)
            try:
                K.matmul_tiles = SHIPPED
                pg = PrefillGraphs(ex, scratch, scratch, (t,), runner._graph_pool)
                prefill_ms, _ = time_bucket(pg, *inputs(t, scratch, vocab, 1), reps)
                K.matmul_tiles = tiles_for(VARIANTS[DECODE_TILES])
                pg = PrefillGraphs(ex, scratch, scratch, (rows, rows + t), runner._graph_pool)
                decode_ms, _ = time_bucket(pg, *inputs(rows, scratch, vocab, rows), reps)  # one token a row
                mixed_ms, _ = time_bucket(pg, *mixed_inputs(rows, t, scratch, vocab), reps)
            except Exception as e:  # a size that does not capture: say so, go on
                out.append({"rows": rows, "prompt_tokens": t, "error": f"{type(e).__name__}: {e}"})
                continue
            finally:
                K.matmul_tiles = SHIPPED
            out.append({"rows": rows, "prompt_tokens": t, "sizes": sizes, "decode_ms": decode_ms,
                        "prefill_ms": prefill_ms, "mixed_ms": mixed_ms})
            print(f"mixed: {rows} rows + {t}-token prompt: decode {decode_ms:.3f} + prefill {prefill_ms:.3f} ms "
                  f"against {mixed_ms:.3f} ms in one forward", flush=True)
    return out


def time_bucket(pg: PrefillGraphs, inp, last, reps: int) -> tuple[float, torch.Tensor]:
    out = pg.run(inp, last).clone()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph = pg._graphs[next(b for b in pg.buckets if b >= inp.shape[1])][0]
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, out


def kernel_table(executor, inp, last, top: int = 8) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    dev = executor.device
    x, lst = inp.to(dev), torch.tensor(last, device=dev)
    executor.prefill_from(x, lst)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        executor.prefill_from(x, lst)
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total, e.count) for e in prof.key_averages()), key=lambda r: -r[1])
    total = sum(r[1] for r in rows) or 1.0
    return [f"  {name[:60]:60s} {us / 1e3:7.3f} ms {100 * us / total:5.1f} % x{n}" for name, us, n in rows[:top]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,640,1280,2560")
    ap.add_argument("--seqs", type=int, default=3, help="prompts per prefill (synth averages ~3)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--mixed-rows", default="16,32,48",
                    help="decode rows a prompt's prefill rides along with (mixed table; empty: skip)")
    ap.add_argument("--mixed-prompt", default="256,512", help="that prompt's tokens")
    a = ap.parse_args()
    cfg = LLMConfig()
    lm = random_lm(cfg, device="cuda", dtype=torch.bfloat16)
    tokens = [int(t) for t in a.tokens.split(",")]
    eng = LLMEngine(lm, engine_config(max_num_seqs=64, dtype="bfloat16", executor="triton", cuda_graphs=True,
                                         prefill_graph_tokens=0))
    runner = eng.runner
    ex, scratch = runner.executor, runner.num_rows
    vocab = cfg.qwen.vocab_size
    results, ref, ref_decode = {}, {}, {}
    for name, variant in VARIANTS.items():
        K.matmul_tiles = tiles_for(variant)
        try:
            pg = PrefillGraphs(ex, scratch, scratch, tuple(tokens), runner._graph_pool)
            row = {}
            for t in tokens:
                inp, last = inputs(t, scratch, vocab, a.seqs)
                ms, out = time_bucket(pg, inp, last, a.reps)
                ref.setdefault(t, out)  # the first variant is the shipped one
                real = torch.isfinite(ref[t])  # the padded vocabulary's columns are -inf
                diff = (out[real] - ref[t][real]).abs().max().item() if torch.equal(real, torch.isfinite(out)) else float("inf")
                row[t] = {"ms": ms, "tokens_per_s": t / ms * 1e3, "max_abs_vs_shipped": diff}
                if name == DECODE_TILES:
                    ref_decode[t] = out
                if t in ref_decode and torch.equal(torch.isfinite(ref_decode[t]), torch.isfinite(out)):
                    row[t]["max_abs_vs_decode_tiles"] = (out[real] - ref_decode[t][real]).abs().max().item()
            results[name] = row
            print(f"{name:32s} " + " ".join(f"{t}: {row[t]['ms']:6.3f} ms (diff {row[t]['max_abs_vs_shipped']:.1e}"
                                            + (f", vs decode tiles {row[t]['max_abs_vs_decode_tiles']:.1e}"
                                               if "max_abs_vs_decode_tiles" in row[t] else "") + ")"
                                            for t in tokens), flush=True)
            if variant is None or name == "narrow N 64x64, wide 128x128":
                print("\n".join(kernel_table(ex, *inputs(tokens[1], scratch, vocab, a.seqs))), flush=True)
        except Exception as e:  # a tile set that does not compile or fit: say so, go on
            print(f"{name:32s} failed: {type(e).__name__}: {e}", flush=True)
            results[name] = {"error": str(e)}
        finally:
            K.matmul_tiles = SHIPPED
    print("\n| tiles | " + " | ".join(f"{t} tok ms" for t in tokens) + " | logits equal to decode tiles' |")
    print("|---|" + "---|" * (len(tokens) + 1))
    for name, row in results.items():
        if "error" in row:
            print(f"| {name} | failed |")
            continue
        same = [row[t].get("max_abs_vs_decode_tiles") for t in tokens]
        eq = "-" if any(d is None for d in same) else ("yes" if all(d == 0 for d in same) else f"no ({max(same):.1e})")
        print(f"| {name} | " + " | ".join(f"{row[t]['ms']:.3f}" for t in tokens) + f" | {eq} |")
    if a.mixed_rows:
        mixed = mixed_table(ex, runner, scratch, vocab, [int(r) for r in a.mixed_rows.split(",")],
                            [int(t) for t in a.mixed_prompt.split(",")], a.reps)
        results["mixed"] = mixed
        print("\n| decode rows | prompt tokens | decode ms | + prefill ms (shipped tiles) | one forward, decode tiles |")
        print("|---|---|---|---|---|")
        for m in mixed:
            if "error" in m:
                print(f"| {m['rows']} | {m['prompt_tokens']} | failed: {m['error']} | | |")
            else:
                print(f"| {m['rows']} | {m['prompt_tokens']} | {m['decode_ms']:.3f} | {m['prefill_ms']:.3f} | "
                      f"{m['mixed_ms']:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
