"""AR engine on a CUDA GPU (run on the H200: ``pytest -m gpu tests/test_engine_gpu.py``).

Full-size random CosyVoice3LM (``LLMConfig()`` defaults, seeded), bf16, Triton executor:
kernels are row-independent, graph replay equals eager, tokens are batch invariant with
stochastic RAS and standard sampling, requests beyond KV capacity complete; and the tiny fixture
reproduces the official tokens through the Triton path in float32.
"""

import random

import pytest
import torch

from conftest import ROWS, load_ref
from cosybatch.models.config import LLMConfig

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines
    pytest.skip("needs CUDA", allow_module_level=True)

from cosybatch.engine import LLMEngine, SamplingParams  # noqa: E402
from cosybatch.profiles.resolve import engine_config  # noqa: E402
from cosybatch.engine import triton_kernels as K  # noqa: E402
from cosybatch.bench.random_lm import random_lm  # noqa: E402
from helpers import mixed_plan, run_alone, run_together  # noqa: E402

DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def big_lm():
    return random_lm(LLMConfig(), seed=0, device=DEV, dtype=torch.bfloat16)


def _requests(n: int, seed: int, cfg: LLMConfig) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = [rng.randrange(1000, 150000) for _ in range(rng.randint(20, 40))]
        k = rng.randint(8, 14)
        speech = [rng.randrange(cfg.speech_token_size) for _ in range(rng.randint(40, 150))]
        if i % 2:
            p = SamplingParams.standard(0.7, 0.8, 20, 1.21, seed=rng.randrange(2**62), enforce_min_len=True)
        else:
            p = SamplingParams(top_k=25, top_p=0.8, win_size=10, tau_r=0.1, seed=rng.randrange(2**62),
                               enforce_min_len=True)
        out.append(dict(text_ids=text[-k:], prompt_text_ids=text[:-k], prompt_speech_tokens=speech, params=p))
    return out


def _engine(lm, **kw):
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("dtype", "auto")  # bfloat16 on CUDA
    kw.setdefault("cuda_graphs", True)
    return LLMEngine(lm, engine_config(**kw))


def _free(*engines):
    for e in engines:
        del e
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_matmul_rows_do_not_depend_on_the_batch(phase):
    """A row's bits whatever the batch around it; in the decode phase also across the switch
    to wide tiles at ``K.WIDE_DECODE_ROWS`` rows (a mixed step or a prefill of many tokens)."""
    g = torch.Generator(device=DEV).manual_seed(0)
    rows = 700
    assert K.WIDE_DECODE_ROWS < rows
    for n, k in [(1152, 896), (896, 896), (9728, 896), (896, 4864), (6784, 896)]:
        w = torch.randn(n, k, device=DEV, generator=g).to(torch.bfloat16)
        x = torch.randn(rows, k, device=DEV, generator=g).to(torch.bfloat16)
        ref = K.matmul(x[7:8].contiguous(), w, phase=phase)
        for m in (2, 16, 64, 65, 256, 300, K.WIDE_DECODE_ROWS - 1, K.WIDE_DECODE_ROWS, rows):
            y = K.matmul(x[:m].contiguous() if m > 7 else torch.cat([x[7:8], x[:m - 1]]), w, phase=phase)
            row = y[7] if m > 7 else y[0]
            assert torch.equal(row, ref[0]), (n, k, m)
        perm = torch.randperm(rows, device=DEV, generator=g)
        assert torch.equal(K.matmul(x[perm].contiguous(), w, phase=phase), K.matmul(x, w, phase=phase)[perm])


def test_norm_and_attention_rows_do_not_depend_on_the_batch():
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(300, 896, device=DEV, generator=g).to(torch.bfloat16)
    r = torch.randn(300, 896, device=DEV, generator=g).to(torch.bfloat16)
    w = torch.rand(896, device=DEV, generator=g).to(torch.bfloat16)
    full = K.add_rmsnorm(x, r, w, 1e-6)
    one = K.add_rmsnorm(x[5:6].contiguous(), r[5:6].contiguous(), w, 1e-6)
    assert torch.equal(full[0][5], one[0][0]) and torch.equal(full[1][5], one[1][0])
    # attention: 8 rows of a paged cache, one query each, alone vs together
    nb, bs, hkv, d, hq = 64, 64, 2, 64, 14
    kc = torch.randn(nb, bs, hkv, d, device=DEV, generator=g).to(torch.bfloat16)
    vc = torch.randn(nb, bs, hkv, d, device=DEV, generator=g).to(torch.bfloat16)
    bt = torch.randperm(nb, device=DEV, generator=g)[:48].view(8, 6).to(torch.int32)
    q = torch.randn(8, hq, d, device=DEV, generator=g).to(torch.bfloat16)
    rows = torch.arange(8, device=DEV)
    pos = torch.randint(0, 6 * bs, (8,), device=DEV, generator=g)
    both = K.paged_attention(q, kc, vc, bt, rows, pos, d ** -0.5)
    for i in range(8):
        alone = K.paged_attention(q[i:i + 1].contiguous(), kc, vc, bt, rows[i:i + 1], pos[i:i + 1], d ** -0.5)
        assert torch.equal(alone[0], both[i])
    # and it is attention: compare with SDPA in float32 for one row
    i = 3
    keys = torch.cat([kc[b] for b in bt[i].tolist()])[: int(pos[i]) + 1].float()  # [S, hkv, d]
    vals = torch.cat([vc[b] for b in bt[i].tolist()])[: int(pos[i]) + 1].float()
    kk = keys.repeat_interleave(hq // hkv, 1).transpose(0, 1)
    vv = vals.repeat_interleave(hq // hkv, 1).transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q[i].float().unsqueeze(1), kk, vv)
    assert (ref.squeeze(1).reshape(-1) - both[i].float()).abs().max() < 2e-2


# ---------------------------------------------------------------- engine, full size


@pytest.fixture(scope="module")
def reqs():
    return _requests(20, seed=7, cfg=LLMConfig())


@pytest.fixture(scope="module")
def alone_tokens(big_lm, reqs):
    eng = _engine(big_lm, max_num_seqs=16)
    out = run_alone(eng, reqs)
    _free(eng)
    assert sum(len(t) for t in out) > 17 * len(reqs)
    return out


@pytest.mark.parametrize("max_num_seqs", [4, 16])
def test_batch_invariance_full_size(big_lm, reqs, alone_tokens, max_num_seqs):
    eng = _engine(big_lm, max_num_seqs=max_num_seqs)
    assert eng.runner.executor.name == "triton" and eng.runner.graphs
    order = list(range(len(reqs)))
    random.Random(max_num_seqs).shuffle(order)
    got = run_together(eng, reqs, order)
    replays = eng.runner.prefill_graphs.replays
    _free(eng)
    assert got == alone_tokens
    assert replays > 0  # prefills replayed from graphs (alone_tokens: one prompt each, also graphed)
    for r, toks in zip(reqs, got):
        assert len(toks) >= 2 * len(r["text_ids"])


def test_prefills_riding_along_decode_steps_give_the_tokens_alone_gpu(big_lm, reqs):
    """``ar.mixed_prefill`` (design.md D33) on CUDA, graphed: rows joining while others decode
    prefill inside the decode step (eager), prefills alone replay graphs on the decode tiles;
    every row gets its tokens alone."""
    alone_eng = _engine(big_lm, max_num_seqs=16, mixed_prefill=True)
    alone = run_alone(alone_eng, reqs)
    _free(alone_eng)
    eng = _engine(big_lm, max_num_seqs=4, mixed_prefill=True)
    got = run_together(eng, reqs, list(range(len(reqs))))
    mixed, mg = eng.stats.mixed_steps, eng.runner.mixed_graphs
    print(f"mixed steps {mixed}: {mg.replays} replayed from {len(mg.pairs)} graphs, {mg.eager} eager")
    _free(eng)
    assert got == alone and mixed > 0 and mg.replays + mg.eager == mixed


def test_mixed_steps_captured_at_start_up_give_the_tokens_alone_gpu(big_lm, reqs):
    """``ar.mixed_graph_precapture``: the named pairs are captured before the first request
    (writing only the scratch row), and rows joining while others decode get their tokens alone,
    the pairs met replayed from their first use."""
    alone_eng = _engine(big_lm, max_num_seqs=16, mixed_prefill=True)
    alone = run_alone(alone_eng, reqs)
    _free(alone_eng)
    pairs = [(d, t) for d in (1, 2, 4) for t in (128, 256, 512, 1024)]
    eng = _engine(big_lm, max_num_seqs=4, mixed_prefill=True, mixed_graph_precapture=pairs)
    mg = eng.runner.mixed_graphs
    at_start = len(mg.pairs)
    got = run_together(eng, reqs, list(range(len(reqs))))
    mixed = eng.stats.mixed_steps
    print(f"mixed steps {mixed}: {mg.replays} replayed, {mg.eager} eager; {at_start} pairs captured at start-up")
    _free(eng)
    assert at_start > 0 and all(e[3] for e in mg.capture_log[:at_start])
    assert got == alone and mixed > 0 and mg.replays > 0


def test_a_graphed_mixed_step_gives_the_eager_logits_gpu(big_lm, reqs):
    """``engine/mixed_graphs.py`` on CUDA at full size: a mixed step's pair captured at its
    second use and replayed gives the first (eager) use's logits bit for bit."""
    eng = _engine(big_lm, max_num_seqs=4, mixed_prefill=True)
    plan = mixed_plan(eng, reqs[0], reqs[1])
    runner = eng.runner
    mg = runner.mixed_graphs
    inp, last = runner.executor.prefill_inputs(plan.seqs)
    with torch.inference_mode():
        want = mg.run(1, inp, last).clone()
        got = mg.run(1, inp, last).clone()
    pairs, replays = mg.pairs, mg.replays
    _free(eng)
    assert len(pairs) == 1 and replays == 1
    assert torch.equal(got, want)


def test_decode_steps_are_fully_graphed(big_lm):
    eng = _engine(big_lm, max_num_seqs=8)
    modes = dict(eng.runner.graph_modes)
    _free(eng)
    assert modes == {b: "step" for b in (1, 2, 4, 8)}  # forward + sampling + state update


@pytest.mark.parametrize("capture", ["lazy", "warm"])
def test_lazy_capture_gives_the_same_tokens_and_captures_only_what_runs(big_lm, reqs, alone_tokens, capture):
    """``graph_capture="lazy"``: nothing captured before the first request; a decode bucket is
    captured right after its first (eager) step without stepping the rows twice, a prefill
    bucket at its second use; the tokens are those of the start-up captures. ``"warm"``: the
    same after a start-up decode step and padded prefills that leave no trace in the rows."""
    eng = _engine(big_lm, max_num_seqs=16, graph_capture=capture)
    assert eng.runner.graphed and not eng.runner.graphs and not eng.runner.prefill_graphs.buckets
    got = run_together(eng, reqs, list(range(len(reqs))))
    modes = dict(eng.runner.graph_modes)
    buckets = eng.cfg.buckets()
    _free(eng)
    assert got == alone_tokens
    assert modes and set(modes.values()) == {"step"} and set(modes) <= set(buckets)


def test_uniforms_kernel_is_the_torch_hash_on_cuda():
    """The sampler's random numbers from one Triton launch equal ``engine.rng``'s int64 tensor
    ops on the GPU, bit for bit."""
    from cosybatch.engine.rng import split_seed, uniforms

    g = random.Random(1)
    seeds = [g.randrange(2**63) for _ in range(300)] + [0, 2**32 - 1, 2**63 - 1]
    lo = torch.tensor([split_seed(s)[0] for s in seeds], device=DEV)
    hi = torch.tensor([split_seed(s)[1] for s in seeds], device=DEV)
    step = torch.tensor([g.randrange(5000) for _ in seeds], device=DEV)
    step[0] = 2**32 + 7
    assert torch.equal(K.uniforms(lo, hi, step, 2), uniforms(lo, hi, step, 2))


def test_sampler_scores_kernel_is_the_tensor_ops_on_cuda():
    """The sampler's steps before its sort in one Triton launch (IEEE division, libdevice's expf)
    give the bits of its tensor ops on the GPU: the scores and the fixed-point probabilities, at
    the full model's vocabulary, for RAS and standard rows with seen ids, early steps and forced
    lengths, over logits from flat to peaked."""
    from cosybatch.engine.sampler import SamplerState, _C, _FIXED_ONE

    cfg = LLMConfig()
    rows = 64
    st = SamplerState(rows, cfg.speech_vocab, cfg.speech_token_size, cfg.sos, 256, DEV)
    for r in range(rows):
        p = (SamplingParams.standard(0.7, 0.8, 20, 1.21, seed=r, enforce_min_len=r % 4 == 1) if r % 2 else
             SamplingParams(seed=r, force_length=9 if r % 6 == 0 else None))
        st.bind(r, p, 2)
    g = torch.Generator(device=DEV).manual_seed(11)
    st.seen[:, ::5] = True
    for step in range(6):
        logits = torch.randn(rows, st.vocab_padded, generator=g, device=DEV) * (0.3 + 4 * step)
        logits[:, st.vocab:] = float("-inf")
        n_gen = torch.full((rows,), step, device=DEV)
        p, seen = st.params[:rows], st.seen[:rows]
        want = st._scores(logits, p, seen, n_gen)
        got = K.sampler_scores(logits, p, seen, n_gen, _C, st.stop_start, st.vocab, st.sos, _FIXED_ONE)
        assert torch.equal(got[0], want[0]), step
        assert torch.equal(got[1], want[1]), (step, (got[1] - want[1]).abs().max().item())


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_silu_in_the_gate_up_epilogue_is_the_two_kernels_on_cuda(phase):
    """SiLU x up in the gate/up GEMM's epilogue (weights as (gate, up) row pairs) gives the bits
    of the GEMM over [gate | up] followed by silu_mul, at the full model's shapes in bf16."""
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(37, 896, generator=g, device=DEV).to(torch.bfloat16)
    gate, up = (torch.randn(2, 4864, 896, generator=g, device=DEV) * 0.05).to(torch.bfloat16)
    want = K.silu_mul(K.matmul(x, torch.cat([gate, up]), phase=phase))
    assert torch.equal(K.matmul(x, K.gate_up_pairs(gate, up), phase=phase, silu_pairs=True), want)


def test_rope_in_attention_gives_the_same_tokens_graphed(big_lm, reqs, alone_tokens):
    """``ar.rope_in_attention``: RoPE and the K/V cache write inside the decode attention kernel
    (design.md D30), graphed, and the sampler as tensor ops instead of its two Triton kernels
    (``sampler_kernels``, on in ``alone_tokens``): a row's tokens do not change."""
    eng = _engine(big_lm, max_num_seqs=16, rope_in_attention=True, sampler_kernels=False)
    assert eng.runner.executor.rope_in_attention and eng.runner.sampler.draw is None
    got = run_together(eng, reqs, list(range(len(reqs))))
    _free(eng)
    assert got == alone_tokens


def test_graphed_prefill_equals_eager_bits(big_lm, reqs):
    eng = _engine(big_lm, max_num_seqs=16)
    pg = eng.runner.prefill_graphs
    assert pg is not None and pg.buckets
    for r in reqs[:3]:
        eng.add_request(**r)
    seqs = eng.scheduler.schedule().seqs
    for s in seqs:
        eng.runner.bind(s, s.row)
    inp, last = eng.runner.executor.prefill_inputs(seqs)
    assert len(seqs) == 3 and inp.shape[1] not in pg.buckets  # the bucket's padding is exercised
    with torch.inference_mode():  # as the runner calls them (its static buffers are inference tensors)
        graphed = pg.run(inp, last).clone()
        eager = eng.runner.executor.prefill(seqs)
    _free(eng)
    assert torch.equal(graphed, eager)


class _NoSync:
    """``torch.cuda.set_sync_debug_mode('error')`` inside: any operation that waits for the GPU
    (a pageable copy, ``.item()``, a stream sync) raises instead."""

    def __enter__(self):
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)


def test_row_writes_and_step_launches_never_wait_for_the_gpu(big_lm, reqs):
    """The host runs ahead of the GPU only if queueing a step never syncs: a prefill launch
    (binding its rows), decode launches and a row's release are checked with CUDA's sync debug
    mode set to raise (collecting a step's tokens is the one sync by design, outside it)."""
    eng = _engine(big_lm, max_num_seqs=16)
    for r in reqs[:3]:
        eng.add_request(**r)
    torch.cuda.synchronize()
    for _ in range(12):
        with _NoSync():
            assert eng.launch()
        eng.collect()
    seq = next(iter(eng.scheduler.running))
    with _NoSync():
        eng.runner.unbind(seq.row)
        eng.runner.bind(seq, seq.row)
    torch.cuda.synchronize()
    _free(eng)


def test_graph_replay_equals_eager(big_lm, reqs, alone_tokens):
    eng = _engine(big_lm, max_num_seqs=16, cuda_graphs=False)
    assert not eng.runner.graphs
    got = run_together(eng, reqs, list(range(len(reqs))))
    _free(eng)
    assert got == alone_tokens


def test_more_requests_than_kv_capacity_gpu(big_lm, reqs, alone_tokens):
    need = max(-(-(len(r["text_ids"]) + len(r["prompt_speech_tokens"]) + 2 + 20 * 40 + 1) // 64) for r in reqs)
    eng = _engine(big_lm, max_num_seqs=16, num_kv_blocks=1 + 3 * need)
    got = run_together(eng, reqs, list(range(len(reqs))))
    assert max(eng.stats.batch_hist) < 16
    _free(eng)
    assert got == alone_tokens


# ---------------------------------------------------------------- fixture parity through Triton


def test_fixture_tokens_triton_fp32(model_dir, reference_dir):
    from cosybatch.checkpoint import llm_state_dict, load_config, read_state_dict, strict_load
    from cosybatch.models.speech_lm import CosyVoice3LM

    cfg = load_config(model_dir)
    lm = CosyVoice3LM(cfg.llm)
    strict_load(lm, llm_state_dict(read_state_dict(model_dir / "llm.pt")), "llm.pt")
    lm = lm.to(DEV).eval()
    reqs, want = [], []
    for row in ROWS:
        ref = load_ref(reference_dir, row)
        s = 0
        while f"seg{s}.text_token" in ref:
            reqs.append(dict(text_ids=ref[f"seg{s}.text_token"], prompt_text_ids=ref["frontend.prompt_text_token"],
                             prompt_speech_tokens=ref["frontend.prompt_speech_token"]))
            want.append(ref[f"nonstream.seg{s}.llm_tokens_raw"].tolist())
            s += 1
    eng = _engine(lm, max_num_seqs=4, dtype="float32", kv_block_size=16, max_model_len=2048)
    assert eng.runner.executor.name == "triton"
    got = run_together(eng, reqs, list(reversed(range(len(reqs)))))
    assert got == want
