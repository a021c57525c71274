"""Flow graph buckets (cosybatch.codec.flow_buckets, design.md D27): the bounded key set a run can
use, that every solve the real planning and packing make falls in it, and that pre-capture
captures each key once so that solves afterwards capture nothing (CPU: a fake capture that
re-runs the step, and a torch twin of the Triton attention with its real tile tables)."""

import random
import types

import pytest
import torch

from conftest import load_ref
from cosybatch.codec import flow_buckets as fb
from cosybatch.codec.flow_runner import FlowJob, FlowRunner
from cosybatch.hops import HopSchedule, plan_segment
from cosybatch.prompt import PromptFeatures

triton_attention = pytest.importorskip("cosybatch.codec.triton_attention")

G32 = fb.Geometry(chunk=50, conv_gap=30, conv_margin=60, max_jobs=32)  # the full-size DiT at C32


def test_stride_ladder_golden():
    assert list(fb.strides(8192)) == [64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1472,
                                      1728, 2048, 2496, 2944, 3456, 4096, 4928, 5824, 6912, 8192]
    assert all(fb.geometric(n) == s for s, n in fb.strides(3000).items())
    assert fb.geometric(1280) == 1472  # why the ladder keeps a token count that rounds to each stride


def test_key_set_golden_counts():
    streaming = fb.launch_flags(True, True)
    assert streaming == [(True, True)]
    assert fb.launch_flags(False, False) == [(False, True)]
    assert fb.launch_flags(True, True, merges=False) == [(True, False), (False, True), (True, True)]
    counts = {(j, s): len(fb.keys(fb.Geometry(50, 30, 60, j), s, streaming))
              for j in (16, 32, 64) for s in (4096, 8192)}
    assert counts == {(16, 4096): 60, (16, 8192): 64, (32, 4096): 80, (32, 8192): 84, (64, 4096): 100,
                      (64, 8192): 108}
    keys = [dict(k) for k in fb.keys(G32, 8192, streaming)]
    assert len({fb.key(k) for k in keys}) == len(keys)
    # at a large stride only the jobs levels that stride can need: >= 8192 / 256 = 32
    assert [(k["stride"], k["jobs"]) for k in keys if k["stride"] >= 4928] == [(4928, 32), (5824, 32), (6912, 32),
                                                                                (8192, 32)]
    assert [k["jobs"] for k in keys if k["stride"] == 64] == [1, 2, 4, 8, 16, 32]
    # a lower bound keeps the buckets from its own stride up: 4,000 tokens round to 4,096
    ranged = [(k["stride"], k["jobs"]) for k in map(dict, fb.keys(G32, 8192, streaming, min_stride=4000))]
    assert ranged == [(k["stride"], k["jobs"]) for k in keys if k["stride"] >= 4096] and ranged[0][0] == 4096
    k = keys[0]
    assert k == {"stride": 64, "jobs": 1, "margin": 60, "records": 60, "conv_len": 2 * (30 + 64 + 60) + 1,
                 "pool_seqs": 4 * (1 + 1 + 1) + 1, "self_seqs": 13, "self_max_q": 64}


def test_coarse_sizes_follow_stride_and_jobs_only():
    a = fb.sizes(G32, 700, 5, True, True, self_count=1, self_max_q=700)
    b = fb.sizes(G32, 710, 7, True, True, self_count=9, self_max_q=30)
    assert a == b and a["stride"] == 768 and a["jobs"] == 8
    fine = fb.Geometry(50, 30, 60, 32, coarse=False)
    assert fb.sizes(fine, 700, 5, True, True, 1, 700) != fb.sizes(fine, 710, 7, True, True, 9, 30)
    with pytest.raises(ValueError):
        fb.keys(fine, 1024, [(True, True)])


# --------------------------------------------------------------------------- the runner


def _torch_chunk_attention(q, k, v, tiles, k_start, k_len, block_m, block_n=64, num_warps=4, num_stages=2,
                           scale=None, out=None, fill=None, k2=None, v2=None, src=None):
    """``triton_attention.chunk_attention``'s contract in plain torch (tile by tile)."""
    if out is None:
        out = torch.zeros_like(q)
    if fill:
        none = sum(f.long() for f in fill) == 0
        out[none] = 0
    kl = k_len.tolist()
    starts, srcs = k_start.tolist(), (src.tolist() if src is not None else [0] * len(k_start))
    for t, (a, rows, _, kmax) in enumerate(tiles.tolist()):
        if rows == 0:
            continue
        kk, vv = (k2, v2) if srcs[t] else (k, v)
        s = starts[t]
        lens = torch.tensor(kl[a : a + rows])
        mask = torch.arange(max(kmax, 1))[None] < lens[:, None]
        mask[:, 0] = True
        o = torch.nn.functional.scaled_dot_product_attention(
            q[a : a + rows].transpose(0, 1), kk[s : s + max(kmax, 1)].transpose(0, 1),
            vv[s : s + max(kmax, 1)].transpose(0, 1), attn_mask=mask[None])
        out[a : a + rows] = torch.where((lens > 0)[:, None, None], o.transpose(0, 1), 0.0)
    return out


def _twin_backend():
    from cosybatch.codec.attention import TritonBackend

    b = TritonBackend()
    b._k = types.SimpleNamespace(**{n: getattr(triton_attention, n) for n in
                                    ("prepare_tiles", "prepare_tile_pair", "max_tiles")},
                                 chunk_attention=_torch_chunk_attention)
    return b


class _FakeCapture:
    def __init__(self):
        self.calls = 0

    def __call__(self, fn):
        self.calls += 1
        fn()
        return fn


@pytest.fixture(scope="module")
def flow(model_dir, one_thread):
    from cosybatch.checkpoint import load_models

    return load_models(model_dir).flow


def _runner(flow, graphs=True, max_jobs=4, budget=1 << 30, **kw):
    r = FlowRunner(flow, graphs=graphs, capture=_FakeCapture(), max_jobs=max_jobs, prefix_budget_bytes=budget,
                   fusions=("merge",), **kw)
    r.backend = _twin_backend()
    return r


def _prompts(reference_dir):
    out = []
    for row in ("utt1", "utt2", "utt5_paragraph"):
        ref = load_ref(reference_dir, row)
        out.append(PromptFeatures(ref["frontend.prompt_speech_token"].long().reshape(-1), ref["frontend.embedding"],
                                  ref["frontend.prompt_speech_feat"]))
    return out


def _random_streams(prompts, n, seed):
    """n segments with random lengths and prompts, each with its official hop schedule."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        pr = rnd.choice(prompts)
        tokens = torch.randint(0, 6561, (rnd.randint(4, 260),), generator=g)
        out.append([f"s{i}", pr, tokens, plan_segment(HopSchedule(), pr.speech_tokens.shape[0], tokens.numel())])
    return out


def _drive(runner, streams, max_jobs, seed):
    """Random admissions: each solve takes the next hop of a random subset of the live segments."""
    rnd = random.Random(seed)
    live = [list(s) for s in streams]
    outs = []
    while live:
        pick = rnd.sample(live, rnd.randint(1, min(max_jobs, len(live))))
        jobs = [FlowJob(name, tok, pr, hops.pop(0)) for name, pr, tok, hops in pick]
        outs.extend(runner.run(jobs))
        live = [s for s in live if s[3]]
    return outs


@pytest.mark.numeric
def test_every_streaming_solve_uses_a_key_of_the_set(flow, reference_dir):
    """Random hop layouts through the real planning and packing: every bucket used is enumerated."""
    max_jobs = 4
    runner = _runner(flow, max_jobs=max_jobs)
    assert runner.geometry.coarse
    streams = _random_streams(_prompts(reference_dir), 9, seed=1)
    _drive(runner, streams, max_jobs, seed=2)
    biggest = max(dict(k)["stride"] for k in runner.graphs._seen)
    allowed = set(runner.bucket_keys(True, biggest))
    assert runner.graphs._seen and runner.graphs._seen <= allowed
    assert {dict(k)["pool_seqs"] > 0 and dict(k)["self_seqs"] > 0 for k in runner.graphs._seen} == {True}


@pytest.mark.numeric
def test_every_whole_response_solve_uses_a_key_of_the_set(flow, reference_dir):
    runner = _runner(flow, max_jobs=3, budget=0)
    prompts = _prompts(reference_dir)
    g = torch.Generator().manual_seed(3)
    rnd = random.Random(3)
    for i in range(4):
        jobs = [FlowJob(f"r{i}.{j}", torch.randint(0, 6561, (rnd.randint(5, 200),), generator=g), rnd.choice(prompts))
                for j in range(rnd.randint(1, 3))]
        runner.run(jobs)
    biggest = max(dict(k)["stride"] for k in runner.graphs._seen)
    assert runner.graphs._seen <= set(runner.bucket_keys(False, biggest))
    # captured at first sight, inside the run: logged as such, one entry per bucket
    log = runner.graphs.stats.capture_log
    assert len(log) == runner.graphs.stats.captures and not any(startup for *_, startup in log)
    assert {(s, j) for s, j, _, _ in log} == {(dict(k)["stride"], dict(k)["jobs"]) for k in runner.graphs._seen}


@pytest.mark.numeric
def test_precapture_captures_each_key_once_and_solves_then_capture_nothing(flow, reference_dir):
    max_jobs = 3
    streams = _random_streams(_prompts(reference_dir), 5, seed=7)
    eager = _runner(flow, graphs=False, max_jobs=max_jobs)
    want = _drive(eager, [list(s[:3]) + [list(s[3])] for s in streams], max_jobs, seed=8)
    runner = _runner(flow, max_jobs=max_jobs)
    keys = runner.bucket_keys(True, 1024)
    assert runner.precapture(keys) == len(keys)
    st = runner.graphs.stats
    assert st.precaptures == st.captures == len(keys) == runner.graphs.capture.calls
    # each capture logged with its bucket (tokens per branch, jobs), its host time, at start-up
    assert [(s, j) for s, j, _, _ in st.capture_log] == [(dict(k)["stride"], dict(k)["jobs"]) for k in keys][:32]
    assert all(ms >= 0 and startup for _, _, ms, startup in st.capture_log)
    assert runner.precapture(keys) == 0  # already there
    got = _drive(runner, streams, max_jobs, seed=8)
    assert st.captures == len(keys) and st.eager_steps == 0 and st.replays == st.steps > 0
    for a, b in zip(want, got):
        assert (a - b).abs().max().item() <= 1e-5  # padded buckets change no real row
