"""Packed flow runner (cosybatch.codec) against the official recompute semantics (CPU, fp32)."""

import json

import numpy as np
import pytest
import torch

from conftest import ROWS, load_ref
from helpers import solve_beside, solve_in_turn
from cosybatch.codec.attention import SdpaBackend, _VarlenBase
from cosybatch.codec.flow_runner import FUSIONS, FlowJob, FlowRunner
from cosybatch.hops import Hop, HopSchedule, plan_segment
from cosybatch.codec.packing import RowSpec, SubSeqs, pack, subsequences, varlen_offsets
from cosybatch.prompt import PromptFeatures
from cosybatch.reference.token2wav import flow_chunk, flow_full

pytestmark = pytest.mark.numeric

MEL_TOL = 1e-4


@pytest.fixture(scope="module")
def flow(model_dir, one_thread):  # one thread for speed; restored after the module
    from cosybatch.checkpoint import load_models

    return load_models(model_dir).flow


@pytest.fixture(scope="module")
def flow_chunk15(tmp_path_factory):
    """A checkpoint whose attention chunk (15 tokens = 30 frames) does not line up with the hops."""
    from cosybatch.checkpoint import load_models
    from cosybatch.checkpoint.generate import generate_checkpoint

    d = generate_checkpoint(tmp_path_factory.mktemp("ck15"), size="tiny", seed=1, chunk_size=15)
    f = load_models(d).flow
    assert f.cfg.dit.static_chunk_size == 30
    return f


def _prompt(ref) -> PromptFeatures:
    return PromptFeatures(ref["frontend.prompt_speech_token"].long().reshape(-1), ref["frontend.embedding"], ref["frontend.prompt_speech_feat"])


def _fixture_jobs(reference_dir, row):
    """(streaming jobs with their official mels, full-response jobs with theirs) of one row."""
    ref = load_ref(reference_dir, row)
    meta = json.loads((reference_dir / f"{row}.json").read_text())
    pr = _prompt(ref)
    stream = []
    for c in meta["stream_chunks"]:
        s = c["segment"]
        chunk = Hop(end=c["n_token_in"], offset=c["token_offset"], finalize=c["finalize"], index=c["chunk"])
        job = FlowJob((row, s), ref[f"stream.seg{s}.speech_token"].long(), pr, chunk)
        stream.append((job, ref[f"stream.seg{s}.chunk{c['chunk']}.mel"]))
    full, s = [], 0
    while f"nonstream.seg{s}.speech_token" in ref:
        full.append((FlowJob((row, "full", s), ref[f"nonstream.seg{s}.speech_token"].long(), pr), ref[f"nonstream.seg{s}.mel"]))
        s += 1
    return stream, full


def _check(out, want, what):
    assert out.shape == want.shape and out.dtype == torch.float32, what
    err = (out - want).abs().max().item()
    assert err <= MEL_TOL, (what, err)
    return err


# --------------------------------------------------------------------------- layout


@pytest.mark.parametrize("frames,q_start,chunk", [(250, 0, 50), (250, 150, 50), (251, 240, 30), (37, 0, 0), (90, 60, 30), (61, 30, 30)])
def test_subsequences_reproduce_chunk_mask(frames, q_start, chunk):
    seen = {}
    for f0, f1, klen in subsequences(frames, q_start, chunk):
        for i in range(f0, f1):
            seen[i] = klen
    assert sorted(seen) == list(range(q_start, frames))
    for i, klen in seen.items():
        assert klen == (frames if chunk == 0 else min(frames, (i // chunk + 1) * chunk))


ROWS4 = [RowSpec(120, 0, 0, 0), RowSpec(250, 150, 90, 50, (0, 512)), RowSpec(90, 0, 0, 30), RowSpec(61, 30, 0, 30, (64, 1024))]


def test_pack_golden_layout():
    lay = pack(ROWS4, conv_gap=4)
    nj = sum(r.frames - r.q_start for r in ROWS4)
    assert lay.job_tokens == lay.stride == nj == 341  # 120 + 100 + 90 + 31
    want_pos = np.concatenate([np.arange(r.q_start, r.frames) for r in ROWS4] * 2)
    assert np.array_equal(lay.positions, want_pos)
    assert lay.conv_valid[lay.conv_of_token].all() and lay.conv_valid[lay.margin_conv].all()
    assert int((~lay.conv_valid).sum()) == 4 * 2 * len(ROWS4) + 1  # gaps + the sink
    assert lay.margin_conv.shape == (2, 60 + 30)
    assert list(lay.conv_first[0]) == [4, 128, 292, 386]
    # pool: row 1's two hop chunks and row 3's chunk + 1-frame tail, per branch, keys in the
    # row's arena region (branch 1 tokens start at 341)
    assert list(lay.pool.q_start) == [120, 170, 310, 340, 461, 511, 651, 681]
    assert list(lay.pool.q_len) == [50, 50, 30, 1, 50, 50, 30, 1]
    assert list(lay.pool.k_start) == [0, 0, 64, 64, 512, 512, 1024, 1024]
    assert list(lay.pool.k_len) == [200, 250, 60, 61, 200, 250, 60, 61]
    # self: row 0 is one full-attention sequence; row 2's chunks see overlapping prefixes
    assert list(lay.self.q_start) == [0, 220, 250, 280, 341, 561, 591, 621]
    assert list(lay.self.k_start) == [0, 220, 220, 220, 341, 561, 561, 561]
    assert list(lay.self.k_len) == [120, 30, 60, 90, 120, 30, 60, 90]
    assert (lay.pool_slots >= 0).sum() == 2 * (100 + 31)
    assert lay.pool_slots[120] == 0 + 150 and lay.pool_slots[341 + 310] == 1024 + 30


def test_pack_padding_points_at_the_sink():
    real = pack(ROWS4, conv_gap=4)
    lay = pack(ROWS4, conv_gap=4, stride=400, conv_len=real.conv_len + 50, margin=128)
    sink = real.conv_len - 1
    assert not lay.conv_valid[sink:].any()
    for b in (0, 1):
        got = lay.conv_of_token[b * 400 : b * 400 + 341]
        assert np.array_equal(got, real.conv_of_token[b * 341 : (b + 1) * 341])
        assert (lay.conv_of_token[b * 400 + 341 : (b + 1) * 400] == sink).all()
    assert lay.margin_conv.shape == (2, 128) and (lay.margin_conv[:, 90:] == sink).all()
    assert list(lay.pool.q_start) == [120, 170, 310, 340, 520, 570, 710, 740]  # branch 1 moved by the stride
    with pytest.raises(ValueError, match="bucket too small"):
        pack(ROWS4, conv_gap=4, stride=300)


def test_varlen_offsets_fill_gaps_and_pad():
    seqs = pack(ROWS4, conv_gap=4).pool
    cu_q, k0, used = varlen_offsets(seqs, 700, 16, key_base=7)
    assert list(cu_q) == [0, 120, 170, 220, 310, 340, 341, 461, 511, 561, 651, 681, 682] + [700] * 4
    assert list(used) == [0, 200, 250, 0, 60, 61, 0, 200, 250, 0, 60, 61, 0] + [0] * 3  # gaps: no keys
    assert list(k0) == [7, 7, 7, 7, 71, 71, 7, 519, 519, 7, 1031, 1031, 7] + [7] * 4
    with pytest.raises(ValueError, match="do not fit"):
        varlen_offsets(seqs, 700, 4)


class _LoopVarlen(_VarlenBase):
    """The varlen kernel's contract (cu_seqlens_q, key start + used count, zeros for no keys)
    in plain torch, to test the offsets on the CPU."""

    name = "loopvarlen"

    def run(self, q, k, v, meta, keys=None):
        out = torch.zeros_like(q)
        t = meta.tensors
        cq, k0, used = t["cu_q"].tolist(), self._starts(meta, keys).tolist(), t["k_used"].tolist()
        for b in range(len(used)):
            if cq[b + 1] > cq[b] and used[b]:
                ks, vs = k[k0[b] : k0[b] + used[b]], v[k0[b] : k0[b] + used[b]]
                o = torch.nn.functional.scaled_dot_product_attention(q[cq[b] : cq[b + 1]].transpose(0, 1),
                                                                     ks.transpose(0, 1), vs.transpose(0, 1))
                out[cq[b] : cq[b + 1]] = o.transpose(0, 1)
        return out


# --------------------------------------------------------------------------- fixture parity


@pytest.mark.parametrize("row", ROWS)
def test_each_row_alone_matches_official(flow, reference_dir, row):
    stream, full = _fixture_jobs(reference_dir, row)
    runner = FlowRunner(flow)
    for job, want in stream:
        (out,) = runner.run([job])
        _check(out, want, (row, "stream", job.segment_id, job.chunk.index))
    for job, want in full:
        (out,) = runner.run([job])
        _check(out, want, (row, "full", job.segment_id))
    assert runner.cache.used_frames() == 0  # every segment ended with its final hop


@pytest.mark.parametrize("backend", ["sdpa", "loopvarlen", "fused"])
def test_all_rows_packed_match_official(flow, reference_dir, backend):
    """Per round, one call holds hop i of every streaming row plus a whole-response job.
    ``fused``: the fused layer's wiring (design.md D26) with its eager twins (the chained residual
    + LayerNorm, the rotary + K/V copies; the GELU epilogue is CUDA's, the eager pair here)."""
    runner = FlowRunner(flow, fusions=FUSIONS if backend == "fused" else None)
    if backend == "loopvarlen":
        runner.backend = _LoopVarlen()
    streams, fulls = [], []
    for row in ROWS:
        s, f = _fixture_jobs(reference_dir, row)
        # Segments of one request run one after the other: give each its own queue.
        for seg in sorted({j.segment_id for j, _ in s}):
            streams.append([(j, w) for j, w in s if j.segment_id == seg])
        fulls += f
    rounds = max(len(q) for q in streams)
    for i in range(max(rounds, len(fulls))):
        batch = [q[i] for q in streams if i < len(q)] + ([fulls[i]] if i < len(fulls) else [])
        outs = runner.run([j for j, _ in batch])
        for (job, want), out in zip(batch, outs):
            _check(out, want, (backend, job.segment_id, job.chunk))
    assert runner.stats["cached_tokens"] > 0  # utt5 seg0 hop 1 reused its first hop


# --------------------------------------------------------------------------- prefix reuse


def _long_rows(reference_dir, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for row, n in zip(["utt1", "utt2", "utt5_paragraph"], lengths):
        pr = _prompt(load_ref(reference_dir, row))
        tokens = torch.randint(0, 6561, (n,), generator=g)
        rows.append((row, pr, tokens, plan_segment(HopSchedule(), pr.speech_tokens.shape[0], n)))
    return rows


def _stream_vs_recompute(flow, rows, runner, chunk_causal_final):
    worst = 0.0
    for hop in range(max(len(r[3]) for r in rows)):
        jobs = [FlowJob(name, tok, pr, chunks[hop]) for name, pr, tok, chunks in rows if hop < len(chunks)]
        for job, out in zip(jobs, runner.run(jobs)):
            want = flow_chunk(flow, job.tokens, job.prompt, job.chunk, full_attention_final=not chunk_causal_final)
            worst = max(worst, _check(out, want, (job.segment_id, job.chunk)))
    return worst


@pytest.mark.parametrize("variant", ["chunk25", "chunk15"])
@pytest.mark.parametrize("chunk_causal_final", [False, True])
def test_prefix_reuse_equals_recompute_hop_by_hop(flow, flow_chunk15, reference_dir, variant, chunk_causal_final):
    f = flow if variant == "chunk25" else flow_chunk15
    rows = _long_rows(reference_dir, [300, 217, 160])
    assert [(c.end, c.offset) for c in rows[0][3]] == [(48, 0), (98, 45), (198, 95), (298, 195), (300, 295)]
    runner = FlowRunner(f, chunk_causal_final=chunk_causal_final)
    _stream_vs_recompute(f, rows, runner, chunk_causal_final)
    st = runner.stats
    assert st["cached_tokens"] > 0
    # Reuse means each frame goes through the transformer about once, not once per hop.
    assert st["tokens"] < 0.75 * (st["tokens"] + st["cached_tokens"])
    assert runner.cache.used_frames() == 0


def test_budget_fallback_and_release(flow, reference_dir):
    rows = _long_rows(reference_dir, [300, 217, 160], seed=1)
    per_row = FlowRunner(flow).cache.bytes_per_frame * 2 * 1000  # both CFG branches, ~one long row
    runner = FlowRunner(flow, prefix_budget_bytes=per_row)
    _stream_vs_recompute(flow, rows, runner, False)
    assert runner.stats["cached_tokens"] > 0 and runner.stats["uncached_hops"] > 0  # some fit, some fell back
    nothing = FlowRunner(flow, prefix_budget_bytes=0)
    _stream_vs_recompute(flow, rows[:1], nothing, False)
    assert nothing.stats["cached_tokens"] == 0 and nothing.stats["uncached_hops"] == 4 and nothing.cache.k is None
    # A request that ends early is freed by release().
    name, pr, tok, chunks = rows[0]
    runner.run([FlowJob("early", tok, pr, chunks[0])])
    assert runner.cache.used_frames() > 0
    runner.release("early")
    assert runner.cache.used_frames() == 0


def test_arena_growth_keeps_cached_prefixes(flow, reference_dir):
    """A small arena that doubles mid-stream (moving every cached K/V) gives the same hops."""
    rows = _long_rows(reference_dir, [300, 217, 160], seed=8)
    runner = FlowRunner(flow)
    runner.cache.first_frames = 128
    _stream_vs_recompute(flow, rows, runner, False)
    assert runner.cache.version > 1 and runner.cache.frames > 128  # it grew at least once
    assert runner.stats["cached_tokens"] > 0 and runner.stats["uncached_hops"] == 0


def test_changed_tokens_invalidate_prefix(flow, reference_dir):
    (name, pr, tok, chunks), = _long_rows(reference_dir, [200])
    runner = FlowRunner(flow)
    runner.run([FlowJob(name, tok, pr, chunks[0])])
    other = tok.clone()
    other[5] = (other[5] + 1) % 6561
    (out,) = runner.run([FlowJob(name, other, pr, chunks[1])])
    _check(out, flow_chunk(flow, other, pr, chunks[1]), "changed prefix")
    assert runner.stats["cached_tokens"] == 0


def test_full_response_matches_flow_full_for_random_tokens(flow, reference_dir):
    rows = _long_rows(reference_dir, [120, 77, 33], seed=2)
    runner = FlowRunner(flow)
    outs = runner.run([FlowJob(n, t, p) for n, p, t, _ in rows])
    for (n, p, t, _), out in zip(rows, outs):
        _check(out, flow_full(flow, t, p), n)


def test_sdpa_backend_matches_dense_attention_with_overlapping_keys():
    torch.manual_seed(0)
    seqs = SubSeqs(np.array([0, 4, 9]), np.array([4, 5, 3]), np.array([0, 7, 7]), np.array([4, 5, 9]))
    q, k, v = (torch.randn(20, 2, 8) for _ in range(3))
    backend = SdpaBackend()
    for meta in (backend.prepare(seqs, 20, "cpu"), backend.prepare(seqs, 20, "cpu", n_seqs=6, max_q=8, max_k=16)):
        got = backend.run(q, k, v, meta)
        for (a, n), (ko, kl) in zip([(0, 4), (4, 5), (9, 3)], [(0, 4), (7, 5), (7, 9)]):
            want = torch.nn.functional.scaled_dot_product_attention(
                q[a : a + n].transpose(0, 1), k[ko : ko + kl].transpose(0, 1), v[ko : ko + kl].transpose(0, 1))
            torch.testing.assert_close(got[a : a + n], want.transpose(0, 1), rtol=0, atol=1e-6)
        assert (got[12:] == 0).all()  # tokens of no sub-sequence get zeros
        # the same keys 5 frames further into a bigger tensor, found through a layer's offset
        shift = lambda t: torch.cat((torch.randn(5, *t.shape[1:]), t))  # noqa: E731
        keys = backend.layer_keys(meta, torch.tensor([7, 5]))
        assert torch.equal(backend.run(q, shift(k), shift(v), meta, keys[1]), got)


def test_conv_layouts_agree_and_keep_rows_apart(flow):
    from cosybatch.codec.dit_step import ConvPositionEmbed

    dit = flow.decoder.estimator
    k, dim = dit.cfg.conv_pos_kernel, dit.cfg.dim
    torch.manual_seed(0)
    a, b = torch.randn(40, dim), torch.randn(25, dim)
    gap = torch.zeros(k - 1, dim)
    packed = torch.cat((gap, a, gap, b))
    valid = torch.cat((torch.zeros(k - 1), torch.ones(40), torch.zeros(k - 1), torch.ones(25)))
    pe = dit.input_embed
    with torch.no_grad():
        want = [pe.conv_pos_embed(x[None])[0] + x for x in (a, b)]
        for form in ("conv1d", "channels_last"):
            got = ConvPositionEmbed(dit, form)(packed, valid)
            torch.testing.assert_close(got[k - 1 : k - 1 + 40], want[0], rtol=0, atol=1e-5)
            torch.testing.assert_close(got[2 * (k - 1) + 40 :], want[1], rtol=0, atol=1e-5)


def test_functional_block_variant_used_under_compile_is_exact(flow, reference_dir):
    from cosybatch.codec.dit_step import block_pre_functional

    (name, pr, tok, chunks), = _long_rows(reference_dir, [120], seed=3)
    runner = FlowRunner(flow)
    runner.tables.pre = block_pre_functional  # what compile=True wraps
    for c in chunks:
        (out,) = runner.run([FlowJob(name, tok, pr, c)])
        _check(out, flow_chunk(flow, tok, pr, c), c)


# --------------------------------------------------------------------------- graph buckets


class _FakeCapture:
    """Stands in for CUDA capture: replay re-runs the step; can be told to fail."""

    def __init__(self, fail_first: int = 0):
        self.calls, self.fail_first = 0, fail_first

    def __call__(self, fn):
        self.calls += 1
        if self.calls <= self.fail_first:
            raise RuntimeError("injected capture failure")
        fn()  # what CUDA capture's warm-up does: run the step once for real
        return fn


def _bucketed(flow, capacity=32, fail_first=0, **kw):
    runner = FlowRunner(flow, graphs=True, graph_capacity=capacity, capture=_FakeCapture(fail_first), **kw)
    runner.backend = _LoopVarlen()
    return runner


def test_bucket_padding_is_inert(flow, reference_dir):
    """The same hops through padded graph buckets give the exact path's mels: padded tokens,
    sequences and margin frames change nothing a real row reads."""
    rows = _long_rows(reference_dir, [300, 217, 160], seed=4)
    exact = FlowRunner(flow)
    exact.backend = _LoopVarlen()
    padded = _bucketed(flow)
    for hop in range(max(len(r[3]) for r in rows)):
        jobs = [FlowJob(name, tok, pr, c[hop]) for name, pr, tok, c in rows if hop < len(c)]
        for a, b in zip(exact.run(jobs), padded.run(jobs)):
            assert a.shape == b.shape
            # measured 0.0 here; other shapes may round differently in fp32 GEMMs, bound 1e-5
            assert (a - b).abs().max().item() <= 1e-5
    st = padded.graphs.stats
    assert padded.stats["padded_tokens"] > padded.stats["tokens"]  # buckets really padded
    assert st.captures >= 1 and st.replays > 0 and st.steps == st.replays


def test_row_alone_equals_row_packed_with_others(flow, reference_dir):
    rows = _long_rows(reference_dir, [200, 150, 120], seed=5)
    runner = _bucketed(flow)
    name, pr, tok, chunks = rows[0]
    (alone,) = runner.run([FlowJob(name, tok, pr, None)])
    packed = runner.run([FlowJob(n, t, p, None) for n, p, t, _ in rows])
    assert (alone - packed[0]).abs().max().item() <= 1e-5  # measured 9.5e-7 in fp32 (oneDNN picks kernels by shape)


def test_graph_pool_evicts_lru_and_survives_capture_failure(flow, reference_dir):
    rows = _long_rows(reference_dir, [40, 90, 150], seed=6)
    runner = _bucketed(flow, capacity=2, fail_first=1)
    outs = [runner.run([FlowJob(n, t, p, None)])[0] for n, p, t, _ in rows]  # three different buckets
    for (n, p, t, _), out in zip(rows, outs):
        _check(out, flow_full(flow, t, p), n)  # the failed bucket ran eager and is still right
    st = runner.graphs.stats
    assert st.failures == 1 and st.captures == 2 and st.evictions == 1 and st.entries == 2
    assert st.eager_steps == runner.n_steps  # only the failed bucket's solve ran eager
    runner.run([FlowJob("again", rows[2][2], rows[2][1], None)])  # most recent bucket: replayed
    assert runner.graphs.stats.captures == 2


def test_batched_conditioning_matches_per_job_token_features(flow):
    from cosybatch.codec.flow_conditioning import JobInputs, mu_frames

    g = torch.Generator().manual_seed(7)
    r = flow.cfg.token_mel_ratio
    jobs = []
    for n, conv_start, fin in [(40, 0, True), (60, 30, False), (33, 14, True), (80, 100, False)]:
        toks = torch.randint(0, 6561, (n,), generator=g)
        frames = r * (n - (0 if fin else 3))
        jobs.append((toks, JobInputs(toks.numpy(), frames, conv_start, fin, None, None)))
    got = mu_frames(flow, [j for _, j in jobs], "cpu")
    at = 0
    for toks, j in jobs:
        want = flow.token_features(toks[None], j.finalize)[0][j.conv_start : j.frames]
        n = j.frames - j.conv_start
        torch.testing.assert_close(got[at : at + n], want, rtol=0, atol=1e-5)
        at += n


def test_kv_writes_through_wide_views_are_exact():
    """The arena writes K/V as 8-byte elements (``flow_step._wide``): the same bytes as the
    element-wise copy, for bf16 and float32 strided K views; layouts it cannot view stay as they are."""
    from cosybatch.codec.flow_step import _wide

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        qkv = torch.randn(10, 3, 4, 64, generator=g).to(dtype)
        k = qkv[:, 1]  # the strided view block_pre returns
        arena, want = torch.zeros(30, 4, 64, dtype=dtype), torch.zeros(30, 4, 64, dtype=dtype)
        idx = torch.randperm(30, generator=g)[:10]
        assert _wide(k).dtype == torch.int64
        _wide(arena).index_copy_(0, idx, _wide(k))
        want.index_copy_(0, idx, k)
        assert torch.equal(arena, want)
    odd = torch.randn(5, 2, 6).to(torch.bfloat16)[..., 1:]  # 5 elements, unaligned
    assert _wide(odd) is odd


def test_triton_conv_form_only_where_its_tiles_fit():
    """The Triton position conv needs >= 16 (a power of two) channels per group: the full model
    has 64, the small generated checkpoints 2 and 8, which keep cuDNN's form on CUDA."""
    from cosybatch.codec.dit_step import ConvPositionEmbed
    from cosybatch.models.config import DiTConfig
    from cosybatch.models.dit import DiT

    fits = {dim: ConvPositionEmbed.triton_fits(DiT(DiTConfig(dim=dim, depth=1, heads=2, dim_head=dim // 2)))
            for dim in (32, 128, 512, 1024, 768)}
    assert fits == {32: False, 128: False, 512: True, 1024: True, 768: False}
    with pytest.raises(ValueError, match="channels per group"):
        ConvPositionEmbed(DiT(DiTConfig(dim=32, depth=1, heads=2, dim_head=16)), "triton")


# --------------------------------------------------------------------------- a solve beside another (D39)


@pytest.mark.parametrize("bucketed", [None, "new", "captured"])
def test_a_solve_beside_another_gives_both_their_own_mels(flow, reference_dir, bucketed):
    """``FlowRunner.start(beside=...)``: a solve queued while another is part-way through leaves
    that one as it was (its buffers, the arena's address): both give the mels each gives in
    turn, to the bounds the packings allow. Through graph buckets, the beside solve replays only
    an already captured bucket other than the first one's, else runs eagerly, capturing nothing."""
    rows = _long_rows(reference_dir, [300, 217, 160], seed=9)
    make = (lambda: _bucketed(flow)) if bucketed else (lambda: FlowRunner(flow))
    want = solve_in_turn(make(), rows)
    got, moved, captured, _, beside = solve_beside(make(), rows, same_shape_first=bucketed == "captured")
    assert not moved and captured == 0
    for g, w in zip(got, want):
        assert g.shape == w.shape and (g - w).abs().max().item() <= 1e-5
    if bucketed == "new":
        assert beside.entry is None  # its bucket was not captured yet: eager, on its own buffers
    if bucketed == "captured":
        assert beside.entry is not None and beside.entry.replay is not None  # replayed


def test_a_solve_beside_another_does_not_move_the_arena(flow, reference_dir):
    """A beside solve whose first hop does not fit the arena recomputes it instead of growing it
    (the other solve holds its address); with no arena yet, none is made and nothing is planned."""
    rows = _long_rows(reference_dir, [300, 217, 160], seed=10)
    runner = FlowRunner(flow)
    got, moved, _, _, _ = solve_beside(runner, rows, fill=True)
    assert not moved and runner.stats["uncached_hops"] == 1
    ref = FlowRunner(flow)
    (want_first,) = ref.run([FlowJob(rows[2][0], rows[2][2], rows[2][1], rows[2][3][0])])
    assert (got[-1] - want_first).abs().max().item() <= 1e-5
    fresh = FlowRunner(flow)
    whole = fresh.start([FlowJob("whole", rows[0][2], rows[0][1], None)])  # a whole response: no arena
    assert fresh.start([FlowJob(rows[2][0], rows[2][2], rows[2][1], rows[2][3][0])], beside=whole) is None
    assert fresh.cache.k is None
