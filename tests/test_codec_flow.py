"""Packed flow runner (cosybatch.codec) against the official recompute semantics (CPU, fp32)."""

import json

import pytest
import torch

from conftest import ROWS, load_ref
from cosybatch.codec.attention import Launch, SdpaBackend, _cu_with_gaps, _VarlenBase
from cosybatch.codec.flow_runner import FlowJob, FlowRunner
from cosybatch.codec.hops import Chunk, HopSchedule, plan_segment
from cosybatch.codec.packing import RowSpec, pack, subsequences
from cosybatch.reference.token2wav import PromptTensors, flow_chunk, flow_full

MEL_TOL = 1e-4


@pytest.fixture(scope="module")
def flow(model_dir):
    from cosybatch.checkpoint import load_models

    torch.set_num_threads(1)
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


def _prompt(ref) -> PromptTensors:
    return PromptTensors(ref["frontend.prompt_speech_token"].long(), ref["frontend.prompt_speech_feat"], ref["frontend.embedding"])


def _fixture_jobs(reference_dir, row):
    """(streaming jobs with their official mels, full-response jobs with theirs) of one row."""
    ref = load_ref(reference_dir, row)
    meta = json.loads((reference_dir / f"{row}.json").read_text())
    pr = _prompt(ref)
    stream = []
    for c in meta["stream_chunks"]:
        s = c["segment"]
        chunk = Chunk(end=c["n_token_in"], offset=c["token_offset"], finalize=c["finalize"], index=c["chunk"])
        job = FlowJob(row, ref[f"stream.seg{s}.speech_token"].long(), pr, chunk, segment=s)
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
    for _, f0, f1, klen in subsequences(frames, q_start, chunk):
        for i in range(f0, f1):
            seen[i] = klen
    assert sorted(seen) == list(range(q_start, frames))
    for i, klen in seen.items():
        assert klen == (frames if chunk == 0 else min(frames, (i // chunk + 1) * chunk))


def test_pack_maps_between_layouts():
    rows = [RowSpec(120, 0, 0, 0), RowSpec(250, 150, 90, 50, ((0, 0), (0, 512))), RowSpec(90, 0, 0, 30), RowSpec(61, 30, 0, 30, ((1, 64), (0, 1024)))]
    lay = pack(rows, conv_context=4, device="cpu")
    assert lay.job_tokens == sum(r.frames - r.q_start for r in rows)
    want_pos = torch.cat([torch.arange(r.q_start, r.frames) for r in rows] * 2)
    assert torch.equal(lay.positions[lay.row_to_att], want_pos)
    assert torch.equal(lay.att_to_conv[lay.row_to_att], lay.conv_of_row)
    assert lay.conv_valid[lay.conv_of_row].all() and lay.conv_valid[lay.margin_conv].all()
    assert lay.conv_valid.numel() - int(lay.conv_valid.sum()) == 4 * 2 * len(rows)
    assert lay.margin_conv.numel() == 2 * (60 + 30)
    for ln in lay.launches:  # launches tile the attention layout; query runs never exceed a chunk
        assert ln.q_end - ln.q_start == sum(ln.q_lens)
        assert ln.source[0] == "self" or ln.max_q <= 50
    assert sum(ln.q_end - ln.q_start for ln in lay.launches) == lay.tokens
    assert lay.scratch_frames == 2 * 90


def test_varlen_offsets_cover_keys_with_dummies():
    ln = Launch(("pool", 0), 0, 7, (3, 4), (5, 20), (10, 6))
    cu_q, cu_k = _cu_with_gaps(ln, 40)
    assert cu_q == [0, 0, 3, 3, 7, 7] and cu_k == [0, 5, 15, 20, 26, 40]


class _LoopVarlen(_VarlenBase):
    """The varlen kernel's contract (cu_seqlens, no mask) in plain torch, to test the offsets on CPU."""

    name = "loopvarlen"

    def run(self, q, k, v, prep):
        out = torch.zeros_like(q)
        cq, ck = prep["cu_q"].tolist(), prep["cu_k"].tolist()
        for b in range(len(cq) - 1):
            if cq[b + 1] > cq[b]:
                qs, ks, vs = q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]]
                o = torch.nn.functional.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
                out[cq[b] : cq[b + 1]] = o.transpose(0, 1)
        return out


# --------------------------------------------------------------------------- fixture parity


@pytest.mark.parametrize("row", ROWS)
def test_each_row_alone_matches_official(flow, reference_dir, row):
    stream, full = _fixture_jobs(reference_dir, row)
    runner = FlowRunner(flow)
    for job, want in stream:
        (out,) = runner.run([job])
        _check(out, want, (row, "stream", job.segment, job.chunk.index))
    for job, want in full:
        (out,) = runner.run([job])
        _check(out, want, (row, "full", job.request_id))
    assert runner.cache.used_frames() == 0  # every segment ended with its final hop


@pytest.mark.parametrize("backend", ["sdpa", "loopvarlen"])
def test_all_rows_packed_match_official(flow, reference_dir, backend):
    """Per round, one call holds hop i of every streaming row plus a whole-response job."""
    runner = FlowRunner(flow)
    if backend == "loopvarlen":
        runner.backend = _LoopVarlen()
    streams, fulls = [], []
    for row in ROWS:
        s, f = _fixture_jobs(reference_dir, row)
        # Segments of one request run one after the other: give each its own queue.
        for seg in sorted({j.segment for j, _ in s}):
            streams.append([(j, w) for j, w in s if j.segment == seg])
        fulls += f
    rounds = max(len(q) for q in streams)
    for i in range(max(rounds, len(fulls))):
        batch = [q[i] for q in streams if i < len(q)] + ([fulls[i]] if i < len(fulls) else [])
        outs = runner.run([j for j, _ in batch])
        for (job, want), out in zip(batch, outs):
            _check(out, want, (backend, job.request_id, job.chunk))
    assert runner.stats["cached_tokens"] > 0  # utt5 seg0 hop 1 reused its first hop


# --------------------------------------------------------------------------- prefix reuse


def _long_rows(reference_dir, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for row, n in zip(["utt1", "utt2", "utt5_paragraph"], lengths):
        pr = _prompt(load_ref(reference_dir, row))
        tokens = torch.randint(0, 6561, (n,), generator=g)
        rows.append((row, pr, tokens, plan_segment(HopSchedule(), pr.speech_tokens.shape[1], n)))
    return rows


def _stream_vs_recompute(flow, rows, runner, chunk_causal_final):
    worst = 0.0
    for hop in range(max(len(r[3]) for r in rows)):
        jobs = [FlowJob(name, tok, pr, chunks[hop]) for name, pr, tok, chunks in rows if hop < len(chunks)]
        for job, out in zip(jobs, runner.run(jobs)):
            want = flow_chunk(flow, job.tokens, job.prompt, job.chunk, full_attention_final=not chunk_causal_final)
            worst = max(worst, _check(out, want, (job.request_id, job.chunk)))
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
    runner.cache.slab_frames = 64
    _stream_vs_recompute(flow, rows, runner, False)
    assert runner.stats["cached_tokens"] > 0 and runner.stats["uncached_hops"] > 0  # some fit, some fell back
    nothing = FlowRunner(flow, prefix_budget_bytes=0)
    _stream_vs_recompute(flow, rows[:1], nothing, False)
    assert nothing.stats["cached_tokens"] == 0 and nothing.stats["uncached_hops"] == 4 and not nothing.cache.slabs
    # A request that ends early is freed by release().
    name, pr, tok, chunks = rows[0]
    runner.run([FlowJob("early", tok, pr, chunks[0])])
    assert runner.cache.used_frames() > 0
    runner.release("early")
    assert runner.cache.used_frames() == 0


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


def test_sdpa_backend_matches_dense_attention():
    torch.manual_seed(0)
    ln = Launch(("self",), 0, 9, (4, 5), (0, 7), (4, 12))
    q, k, v = (torch.randn(20, 2, 8) for _ in range(3))
    got = SdpaBackend().run(q[:9], k, v, SdpaBackend().prepare(ln, 20, "cpu"))
    for (a, b), (ko, kl) in zip([(0, 4), (4, 9)], [(0, 4), (7, 12)]):
        want = torch.nn.functional.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[ko : ko + kl].transpose(0, 1), v[ko : ko + kl].transpose(0, 1))
        torch.testing.assert_close(got[a:b], want.transpose(0, 1), rtol=0, atol=1e-6)


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
        for cl in (False, True):
            got = ConvPositionEmbed(dit, cl)(packed, valid)
            torch.testing.assert_close(got[k - 1 : k - 1 + 40], want[0], rtol=0, atol=1e-5)
            torch.testing.assert_close(got[2 * (k - 1) + 40 :], want[1], rtol=0, atol=1e-5)


def test_functional_block_variant_used_under_compile_is_exact(flow, reference_dir):
    from cosybatch.codec.dit_step import block_pre_functional

    (name, pr, tok, chunks), = _long_rows(reference_dir, [120], seed=3)
    runner = FlowRunner(flow)
    runner._pre = block_pre_functional  # what compile=True wraps
    for c in chunks:
        (out,) = runner.run([FlowJob(name, tok, pr, c)])
        _check(out, flow_chunk(flow, tok, pr, c), c)
