#!/usr/bin/env python3
"""Each part of the fused DiT layer (design.md D26) against the unfused ops it replaces, bf16,
the full-size DiT's widths (dim 1024, 16 heads of 64, FF 2048), on CUDA:

- chain: the feed-forward's gated residual + the next block's modulated LayerNorm (addcmul,
  layer_norm) against ``triton_kernels.gated_residual_ln``;
- gelu: F.linear + GELU(tanh) against cuBLASLt's bias + GELU epilogue (``torch._addmm_activation``);
- kv: the Triton rotary + two (8-byte wide) ``index_copy_`` into the arena against
  ``triton_kernels.rotary_qk_kv_``;
- fill: the attention into a zero-filled output against the attention writing its own zeros
  (a streaming-hop layout: chunks of 50 queries over 400+ arena keys, 10 % of tokens in no chunk);
- merge: that launch beside a self launch (whole rows of 500 frames), both with fill into one
  output, against both as one launch (``prepare_pair``).

    PYTHONPATH=$PWD python3 scripts/bench_layer_parts.py [--tokens 2048,4608,9216] [--json OUT]

Per token count: median µs of ``triton.testing.do_bench``, kernels launched per call (torch
profiler), and the fused output against the unfused one (max |diff|, share of elements that
differ). Table last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from cosybatch.codec import triton_kernels as K  # noqa: E402
from cosybatch.codec.attention import TritonBackend  # noqa: E402
from cosybatch.codec.dit_step import ff1_gelu, ff1_gelu_epilogue, rotary_tables  # noqa: E402
from cosybatch.codec.flow_step import _wide  # noqa: E402
from cosybatch.codec.packing import SubSeqs  # noqa: E402
from cosybatch.models.dit import LN_EPS  # noqa: E402

DIM, HEADS, DH, FF = 1024, 16, 64, 2048


def kernels(fn) -> int:
    """Device activities (kernels, memsets, copies) one call of ``fn`` launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(ev.count for ev in prof.key_averages()
               if (getattr(ev, "self_device_time_total", 0) or getattr(ev, "self_cuda_time_total", 0)) > 0)


def us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def diff(a, b) -> tuple[float, float]:
    a, b = a.float(), b.float()
    return (a - b).abs().max().item(), (a != b).float().mean().item()


def parts(n: int, g) -> dict:
    bf = torch.bfloat16
    rnd = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=g) * scale).to(bf)  # noqa: E731
    out = {}

    h, y = rnd(n, DIM, scale=4), rnd(n, DIM, scale=4)
    gate, scale1, shift = rnd(DIM), rnd(DIM), rnd(DIM)

    def chain_eager():
        r = torch.addcmul(h, gate, y)
        return r, F.layer_norm(r, (DIM,), scale1, shift, eps=LN_EPS)

    def chain_fused():
        return K.gated_residual_ln(h, gate, y, scale1, shift, LN_EPS)

    out["chain"] = (chain_eager, chain_fused, diff(chain_eager()[1], chain_fused()[1]))

    x, w1, b1 = rnd(n, DIM), rnd(FF, DIM, scale=1 / 32), rnd(FF, scale=0.25)
    out["gelu"] = (lambda: ff1_gelu(x, w1, b1), lambda: ff1_gelu_epilogue(x, w1, b1),
                   diff(ff1_gelu(x, w1, b1), ff1_gelu_epilogue(x, w1, b1)))

    qkv0 = rnd(n, 3, DIM)
    pos = torch.arange(n, device="cuda", dtype=torch.float32)[:, None]
    cos, sin = rotary_tables(pos * torch.rand(DH // 2, device="cuda", generator=g).repeat_interleave(2))
    slots = 4 * n + 1
    rows = torch.randperm(slots, device="cuda", generator=g)[:n]
    ka, va, kb, vb = (torch.zeros(slots, HEADS, DH, device="cuda", dtype=bf) for _ in range(4))
    qa, qb = qkv0.clone(), qkv0.clone()

    def kv_eager():  # in place: timed calls rotate again (a rotation: the values stay bounded)
        K.rotary_qk_(qa, cos, sin)
        _, k, v = qa.unflatten(-1, (HEADS, DH)).unbind(1)
        _wide(ka).index_copy_(0, rows, _wide(k))
        _wide(va).index_copy_(0, rows, _wide(v))

    def kv_fused():
        K.rotary_qk_kv_(qb, cos, sin, kb, vb, rows)

    kv_eager(), kv_fused()  # from the same q/k/v: compared before any timed call
    same = torch.equal(qa, qb) and torch.equal(ka, kb) and torch.equal(va, vb)
    out["kv"] = (kv_eager, kv_fused, (0.0 if same else float("nan"), 0.0 if same else 1.0))

    # A hop-like pool launch: rows of two 50-query chunks over an arena prefix of 400 keys.
    q0, ql, k0, kl = [], [], [], []
    t, arena_at = 0, 0
    while t + 100 <= int(0.9 * n):
        for c in range(2):
            q0.append(t + 50 * c), ql.append(50), k0.append(arena_at), kl.append(450 + 50 * c)
        t += 100
        arena_at += 500
    seqs = SubSeqs(*(np.array(a, dtype=np.int64) for a in (q0, ql, k0, kl)))
    q = rnd(n, 3, HEADS, DH)[:, 0]
    arena = rnd(2, max(arena_at, 1), HEADS, DH)
    be = TritonBackend()
    meta = be.prepare(seqs, n, "cuda")
    out["fill"] = (lambda: be.run(q, arena[0], arena[1], meta), lambda: be.run(q, arena[0], arena[1], meta, fill=(meta,)),
                   diff(be.run(q, arena[0], arena[1], meta), be.run(q, arena[0], arena[1], meta, fill=(meta,))))

    # merge: the same pool launch beside a self launch (whole rows of 500 frames over this call's
    # keys, as many tokens again), each writing its own tokens of one output (with fill), against
    # both as one launch
    m = 2 * n
    k0s = np.arange(n, m - 499, 500, dtype=np.int64)
    self_ = SubSeqs(k0s, np.full(len(k0s), 500), k0s, np.full(len(k0s), 500))
    q2, k2, v2 = rnd(m, 3, HEADS, DH).unbind(1)
    mp, ms = be.prepare(seqs, m, "cuda"), be.prepare(self_, m, "cuda")
    pair = be.prepare_pair(seqs, self_, m, "cuda")

    def two_launches():
        o = q2.new_empty(q2.shape)
        be.run(q2, arena[0], arena[1], mp, out=o)
        return be.run(q2, k2, v2, ms, out=o, fill=(mp, ms))

    def one_launch():
        return be.run(q2, arena[0], arena[1], pair, fill=(pair,), k2=k2, v2=v2)

    out["merge"] = (two_launches, one_launch, diff(two_launches(), one_launch()))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="2048,4608,9216")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    table = []
    for n in (int(x) for x in args.tokens.split(",")):
        for name, (eager, fused, (mx, frac)) in parts(n, g).items():
            row = {"tokens": n, "part": name, "unfused_us": us(eager), "fused_us": us(fused),
                   "unfused_kernels": kernels(eager), "fused_kernels": kernels(fused), "max_abs": mx, "differ": frac}
            table.append(row)
            print(row, flush=True)
    print("\n| tokens | part | unfused µs | fused µs | speed-up | kernels unfused / fused | max abs diff | elements differing |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['tokens']} | {r['part']} | {r['unfused_us']:.1f} | {r['fused_us']:.1f} | "
              f"{r['unfused_us'] / r['fused_us']:.2f} | {r['unfused_kernels']} / {r['fused_kernels']} | "
              f"{r['max_abs']:.1e} | {100 * r['differ']:.3f} % |")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
