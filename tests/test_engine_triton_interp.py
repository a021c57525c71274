"""The Triton executor's kernels and engine path, run by Triton's CPU interpreter.

Only where ``triton`` is importable and no GPU is present (the GPU itself runs
tests/test_engine_gpu.py): the kernels against plain PyTorch, and the packed/paged engine path
(including enqueue-ahead decoding) for batch invariance on a small random model.
"""

import pytest
import torch

pytestmark = [pytest.mark.numeric, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

if torch.cuda.is_available():
    pytest.skip("GPU present: tests/test_engine_gpu.py runs the compiled kernels", allow_module_level=True)
pytest.importorskip("triton")

from cosybatch.models.config import LLMConfig, QwenConfig  # noqa: E402
from cosybatch.engine import LLMEngine, SamplingParams  # noqa: E402
from cosybatch.profiles.resolve import engine_config  # noqa: E402
from cosybatch.engine import triton_kernels as K  # noqa: E402
from cosybatch.bench.random_lm import random_lm  # noqa: E402
from helpers import mixed_plan  # noqa: E402




def test_matmul_and_norms_match_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 40, generator=g)
    w = torch.randn(70, 40, generator=g)
    b = torch.randn(70, generator=g)
    for phase in ("decode", "prefill"):
        assert (K.matmul(x, w, b, phase=phase) - torch.nn.functional.linear(x, w, b)).abs().max() < 1e-4
    r = torch.randn(37, 40, generator=g)
    gain = torch.rand(40, generator=g)
    out, res = K.add_rmsnorm(x, r, gain, 1e-6)
    s = x + r
    ref = gain * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(res, s) and (out - ref).abs().max() < 1e-5
    gu = torch.randn(5, 64, generator=g)
    assert (K.silu_mul(gu) - torch.nn.functional.silu(gu[:, :32]) * gu[:, 32:]).abs().max() < 1e-5
    assert torch.equal(K.silu_mul(gu[:, torch.stack([torch.arange(32), torch.arange(32, 64)], 1).reshape(-1)],
                                  pairs=True), K.silu_mul(gu))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_in_the_gate_up_epilogue_is_the_two_kernels_bit_for_bit(dtype):
    """``matmul(silu_pairs=True)`` on (gate, up) row pairs gives silu_mul(matmul([gate | up]))
    bit for bit, in both phases' tiles, with a partial last tile (192 rows under prefill's 128)."""
    g = torch.Generator().manual_seed(2)
    for phase in ("decode", "prefill"):
        for inter, hidden, m in ((96, 64, 5), (128, 96, 37)):
            x = torch.randn(m, hidden, generator=g).to(dtype)
            gate = (torch.randn(inter, hidden, generator=g) * 0.2).to(dtype)
            up = (torch.randn(inter, hidden, generator=g) * 0.2).to(dtype)
            want = K.silu_mul(K.matmul(x, torch.cat([gate, up]), phase=phase))
            got = K.matmul(x, K.gate_up_pairs(gate, up), phase=phase, silu_pairs=True)
            assert torch.equal(got, want), (phase, inter)


@pytest.mark.parametrize("silu_pairs", [False, True])
def test_the_decode_phase_wide_tiles_give_the_narrow_tiles_bits(silu_pairs):
    """From ``K.WIDE_DECODE_ROWS`` rows the decode phase runs on 64x128 tiles (a mixed step or a
    prefill of many tokens, design.md D33): every row gets the bits the narrow tiles give it in a
    smaller batch, also with SiLU in the epilogue."""
    g = torch.Generator().manual_seed(3)
    m = K.WIDE_DECODE_ROWS + 16
    assert K.matmul_tiles("decode", 200, 96, 2, m)[1] != K.matmul_tiles("decode", 200, 96, 2, 100)[1]
    x = torch.randn(m, 96, generator=g).to(torch.bfloat16)
    w = (torch.randn(200, 96, generator=g) * 0.2).to(torch.bfloat16)
    wide = K.matmul(x, w, phase="decode", silu_pairs=silu_pairs)
    narrow = torch.cat([K.matmul(x[i:i + 100].contiguous(), w, phase="decode", silu_pairs=silu_pairs)
                        for i in range(0, m, 100)])
    assert torch.equal(wide, narrow)


def test_rope_cache_and_paged_attention_match_torch():
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, bs, nb = 4, 2, 16, 16, 8
    t = 21  # one sequence of 21 tokens spread over blocks 5, 2
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    pos = torch.arange(t)
    blocks = [5, 2]
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(t)])
    inv = 1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(64).float()[:, None] * inv
    kc = torch.zeros(nb, bs, hkv, d)
    vc = torch.zeros(nb, bs, hkv, d)
    q = K.rope_cache(qkv, pos, slots, ang.cos(), ang.sin(), kc.view(-1, hkv, d), vc.view(-1, hkv, d), hq, hkv, d)

    def rope(x):  # HF rotate-half on [T, H, D]
        c, s = torch.cat([ang[:t].cos()] * 2, -1)[:, None], torch.cat([ang[:t].sin()] * 2, -1)[:, None]
        return x * c + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * s

    q_ref = rope(qkv[:, : hq * d].view(t, hq, d))
    k_ref = rope(qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d))
    v_ref = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    assert (q - q_ref).abs().max() < 1e-5
    assert (kc.view(-1, hkv, d)[slots] - k_ref).abs().max() < 1e-5 and torch.equal(vc.view(-1, hkv, d)[slots], v_ref)
    bt = torch.zeros(3, 4, dtype=torch.int32)
    bt[1, :2] = torch.tensor(blocks, dtype=torch.int32)
    out = K.paged_attention(q, kc, vc, bt, torch.ones(t, dtype=torch.long), pos, d ** -0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q_ref.transpose(0, 1), k_ref.repeat_interleave(2, 1).transpose(0, 1),
        v_ref.repeat_interleave(2, 1).transpose(0, 1), is_causal=True)
    assert (out - ref.transpose(0, 1).reshape(t, -1)).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_attention_is_rope_cache_then_paged_attention_bit_for_bit(dtype):
    """A decode step's fused launch (ar.rope_in_attention) stores the same key and value in the
    same slots and returns the same attention output, bit for bit, as the two kernels it
    replaces, for rows at different positions in scattered blocks (a row's first token, one at
    a block's last slot, one starting a new block)."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, bs, nb = 6, 2, 16, 16, 12
    pos = torch.tensor([0, 15, 16, 37])
    tables = torch.tensor([[3, 0, 0], [7, 0, 0], [1, 9, 0], [4, 11, 2]], dtype=torch.int32)
    slots = torch.stack([tables[r, p // bs].long() * bs + p % bs for r, p in enumerate(pos.tolist())])
    inv = 1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(64).float()[:, None] * inv
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    qkv = torch.randn(4, (hq + 2 * hkv) * d, generator=g).to(dtype)
    cache = torch.randn(2, nb, bs, hkv, d, generator=g).to(dtype)  # earlier tokens' keys and values
    rows = torch.arange(4)
    kc, vc = cache[0].clone(), cache[1].clone()
    q = K.rope_cache(qkv, pos, slots, cos, sin, kc.view(-1, hkv, d), vc.view(-1, hkv, d), hq, hkv, d)
    want = K.paged_attention(q, kc, vc, tables, rows, pos, d ** -0.5)
    kf, vf = cache[0].clone(), cache[1].clone()
    got = K.rope_paged_attention(qkv, pos, slots, cos, sin, kf, vf, tables, rows, d ** -0.5, hq, hkv, d)
    assert torch.equal(kf, kc) and torch.equal(vf, vc)
    assert torch.equal(got, want)


def test_uniforms_kernel_is_the_torch_hash_bit_for_bit():
    """The sampler's random numbers from one launch (``K.uniforms``) equal ``engine.rng``'s
    tensor ops for every row and draw: seeds across the 64-bit range and the word boundaries,
    token indices small and past 2**32 (the hash reads their low 32 bits)."""
    import random

    from cosybatch.engine.rng import split_seed, uniforms

    g = random.Random(0)
    seeds = [g.randrange(2**63) for _ in range(45)] + [0, 1, 2**32 - 1, 2**32, 2**63 - 1]
    lo = torch.tensor([split_seed(s)[0] for s in seeds])
    hi = torch.tensor([split_seed(s)[1] for s in seeds])
    step = torch.tensor([g.randrange(5000) for _ in seeds])
    step[:3] = torch.tensor([0, 2**32 + 7, 2**40 - 1])
    for draws in (1, 2, 3):
        assert torch.equal(K.uniforms(lo, hi, step, draws), uniforms(lo, hi, step, draws))


def _bound_sampler(draw=None, scores=None):
    """8 rows over a 300-id vocabulary (stop ids from 280): RAS and standard rows, min_len 2."""
    from cosybatch.engine.sampler import SamplerState

    st = SamplerState(8, 300, 280, 280, 64, torch.device("cpu"), uniforms=K.uniforms, draw=draw, scores=scores)
    for r in range(8):
        st.bind(r, SamplingParams.standard(0.7, 0.8, 20, 1.21, seed=r, enforce_min_len=r % 4 == 1) if r % 2 else
                SamplingParams(top_k=25, top_p=0.8, win_size=10, tau_r=0.1, seed=r), 2)
    return st


def test_sampler_scores_kernel_is_the_tensor_ops():
    """``K.sampler_scores`` (the sampler's steps before the sort in one launch) against
    ``SamplerState._scores``: the penalised, tempered and masked scores bit for bit (IEEE
    division both), for RAS and standard rows, seen ids, early steps (sos only, every stop id)
    and forced lengths. The fixed-point probabilities within 2 ulp of exp: the interpreter's exp
    is numpy's, the tensor ops' PyTorch's (on a GPU both are the CUDA math library's expf, and
    the GPU test asks for the same bits)."""
    from cosybatch.engine.sampler import _C, _FIXED_ONE

    st = _bound_sampler()
    st.bind(6, SamplingParams(seed=6, force_length=9), 2)
    g = torch.Generator().manual_seed(7)
    st.seen[:, ::3] = True
    for step in range(4):  # steps 0 and 1 are before min_len (2): the early masks
        logits = torch.randn(8, st.vocab_padded, generator=g) * (0.5 + 3 * step)
        logits[:, st.vocab:] = float("-inf")
        n_gen = torch.full((8,), step)
        sel = slice(0, 8) if step % 2 else torch.arange(8)
        p, seen = st.params[sel], st.seen[sel]
        want_s, want_q = st._scores(logits, p, seen, n_gen)
        got_s, got_q = K.sampler_scores(logits, p, seen, n_gen, _C, st.stop_start, st.vocab, st.sos, _FIXED_ONE)
        assert torch.equal(got_s, want_s)
        assert torch.isneginf(got_s[:, st.vocab:]).all() and (got_q[:, st.vocab:] == 0).all()
        assert ((got_q - want_q).abs().double() <= want_q.double() * 2.0**-22 + 1).all()
        assert (got_q.amax(1) == 2**40).all()  # the max id gets exactly FIXED_ONE
    assert torch.isneginf(want_s[6, 280:300]).all()  # the forced row never stops


def test_sampler_kernels_draw_the_tensor_ops_tokens():
    """The sampler with its Triton kernels (the steps before the sort, the random numbers, the
    draw after it) picks the same ids as with tensor ops, step after step with the history it
    records: RAS and standard rows, rows given as a slice and as indices, flat and peaked
    logits, a RAS row whose pick repeats (the redraw from the rest) and one with no mass left
    besides it (the runner-up)."""
    g = torch.Generator().manual_seed(5)
    ops, kernel = _bound_sampler(), _bound_sampler(K.sampler_draw, K.sampler_scores)
    picks = []
    for step in range(24):
        logits = torch.randn(8, ops.vocab_padded, generator=g) * (0.5 + step % 4)
        logits[0, 7] += 12.0  # row 0 (RAS) keeps picking 7 first: its repeats redraw from the rest
        logits[2, :] = -1e4
        logits[2, 9] = 0.0  # row 2 (RAS): only 9 has any mass, so its redraw takes the runner-up
        logits[:, ops.vocab:] = float("-inf")
        n_gen = torch.full((8,), step)
        sel = slice(0, 8) if step % 2 else torch.arange(8)
        want = ops.sample(logits, sel, n_gen)
        got = kernel.sample(logits, sel, n_gen)
        assert torch.equal(got, want), (step, got, want)
        ops.record(sel, n_gen, want)
        kernel.record(sel, n_gen, got)
        picks.append(want)
    picks = torch.stack(picks)
    assert (picks[1:, 0] != 7).any() and (picks[1:, 2] != 9).any()  # both redraws happened


# The interpreter runs every program of a launch in Python, so the cost is the number of tile
# programs times the decode steps: a 256-token speech vocabulary (the head's 456 rows are 15
# decode tiles, not 6761 rows in 106) and short rows keep the engine test at a fifth of its cost
# while it still packs 6 rows into 4 slots (two join mid-run) in both sampling modes.
SMALL = LLMConfig(qwen=QwenConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=96),
                  llm_input_size=64, llm_output_size=64, speech_token_size=256)


def _requests() -> list[dict]:
    """Six requests of both sampling modes, of 5-9 tokens."""
    reqs = []
    for i in range(6):
        text = [(7 * i + j * 13) % 5000 + 10 for j in range(5 + i % 3)]
        p = (SamplingParams(seed=i, force_length=4 + i) if i % 2 else
             SamplingParams.standard(0.8, 0.9, 30, 1.3, seed=i, enforce_min_len=True))
        reqs.append(dict(text_ids=text[2:], prompt_text_ids=text[:2], prompt_speech_tokens=[i, 5, 9, 200 + i], params=p))
    return reqs


def _engine(lm, n, **kw):
    return LLMEngine(lm, engine_config(max_num_seqs=n, max_model_len=256, kv_block_size=16, executor="triton",
                                       max_token_text_ratio=4, **kw))


def _alone(lm, reqs, **kw) -> list[list[int]]:
    """Each request's tokens in an engine of one row."""
    e1, out = _engine(lm, 1, **kw), []
    for i, r in enumerate(reqs):
        rid = e1.add_request(**r, request_id=f"a{i}")
        e1.run()
        out.append(e1.seqs[rid].tokens)
    return out


def test_triton_engine_is_batch_invariant_and_runs_ahead():
    lm = random_lm(SMALL, seed=4)
    reqs = _requests()

    def engine(n, **kw):
        return _engine(lm, n, **kw)

    alone = _alone(lm, reqs)
    e4 = engine(4)
    for i in (3, 0, 5, 1, 2, 4):
        e4.add_request(**reqs[i], request_id=f"r{i}")
    e4.run()
    assert [e4.seqs[f"r{i}"].tokens for i in range(6)] == alone
    assert [len(alone[i]) for i in (1, 3, 5)] == [5, 7, 9]
    assert e4.runner.can_run_ahead and e4.stats.decode_steps > 0
    # one launch for RoPE and attention in decode; the sampler as tensor ops (the runs above
    # sampled with its Triton kernels): the same tokens either way
    # (three rows of both modes, one joining mid-run, keep the interpreter's cost down)
    fused = engine(2, rope_in_attention=True, sampler_kernels=False)
    assert fused.runner.executor.rope_in_attention and e4.runner.sampler.draw is K.sampler_draw
    assert e4.runner.sampler.scores is K.sampler_scores
    assert fused.runner.sampler.uniforms is not K.uniforms and fused.runner.sampler.draw is None
    assert fused.runner.sampler.scores is None
    for i in (3, 0, 4):
        fused.add_request(**reqs[i], request_id=f"r{i}")
    fused.run()
    assert [fused.seqs[f"r{i}"].tokens for i in (3, 0, 4)] == [alone[i] for i in (3, 0, 4)]


def test_a_prefill_riding_along_the_decode_step_leaves_every_row_its_tokens():
    """``ar.mixed_prefill`` (design.md D33): rows admitted while others decode prefill inside
    their decode step; every row gets the tokens it gets alone (where its prefill is a step of
    its own, on the same decode-phase tiles), and the steps did mix."""
    lm = random_lm(SMALL, seed=4)
    reqs = _requests()[:3]
    alone = _alone(lm, reqs, mixed_prefill=True)
    e2 = _engine(lm, 2, mixed_prefill=True)
    assert e2.scheduler.mixed and e2.runner.executor.prefill_tiles == "decode"
    for i in (0, 2, 1):  # two run; the third joins when a row frees up
        e2.add_request(**reqs[i], request_id=f"r{i}")
    e2.run()
    assert [e2.seqs[f"r{i}"].tokens for i in range(3)] == alone
    assert e2.stats.mixed_steps >= 1 and e2.stats.prefill_seqs == 3
    # the invariant itself, logit for logit: a mixed forward is a decode step and a prefill
    from cosybatch.gpu.hostcopy import h2d

    e = _engine(lm, 2, mixed_prefill=True)
    plan = mixed_plan(e, reqs[1], reqs[2])
    ex = e.runner.executor
    inp, last = ex.prefill_inputs(plan.seqs)
    inp, last = h2d(inp, device=ex.device), h2d(last, torch.long, ex.device)
    with torch.inference_mode():
        mixed, dec, pre = ex.mixed_from(torch.arange(1), inp, last), ex.decode(1), ex.prefill_from(inp, last)
        assert torch.equal(mixed[:1], dec) and torch.equal(mixed[1:], pre)
        ex.prefill_tiles = "prefill"  # a prefill on its own tiles would not be what the mixed step gives
        assert not torch.equal(mixed[1:], ex.prefill_from(inp, last))
    # the torch executor has no mixed step: the setting leaves it as it was
    assert not LLMEngine(lm, engine_config(max_num_seqs=2, max_model_len=256, kv_block_size=16, executor="torch",
                                           mixed_prefill=True)).scheduler.mixed


class _RecordingPool:
    """A graph pool without CUDA: "capturing" runs the function once (the warm-up on the
    padding the static buffer holds) and a replay runs it again on whatever the buffer holds
    then, as a replayed graph reads its static inputs."""

    def __init__(self):
        self.captured = 0

    def capture(self, fn, warmup: int = 1):
        for _ in range(warmup):
            fn()
        self.captured += 1

        class _Graph:
            def replay(self):
                fn()
        return _Graph(), None


def test_a_graphed_mixed_step_gives_the_eager_logits():
    """``engine/mixed_graphs.py``: a mixed step replayed from its pair's static buffer -- the
    decode rows padded to the decode bucket with the scratch row, the prompt tokens to the
    token bucket, the last-token indices to ``MAX_SEQS`` -- gives the eager step's logits bit
    for bit (padding inert), captured at the pair's second use; the capture's warm-up on
    padding alone writes nothing a row reads."""
    from cosybatch.engine.mixed_graphs import MixedGraphs

    lm = random_lm(SMALL, seed=4)
    reqs = _requests()[:3]
    e = _engine(lm, 4, mixed_prefill=True)
    plan = mixed_plan(e, reqs[1], reqs[2])
    ex = e.runner.executor
    inp, last = ex.prefill_inputs(plan.seqs)
    pool = _RecordingPool()
    mg = MixedGraphs(ex, e.runner.num_rows, decode_buckets=(2, 4), token_buckets=(inp.shape[1] + 7, 512), pool=pool)
    with torch.inference_mode():
        want = mg.run(1, inp, last)
        assert mg.eager == 1 and mg.pairs == () and pool.captured == 0
        got = mg.run(1, inp, last)
        assert mg.pairs == ((2, inp.shape[1] + 7),) and mg.replays == 1 and pool.captured == 1
        assert got.shape == want.shape == (2, ex.head.shape[0])
        assert torch.equal(got, want)
        # and the runner's own: its mixed step goes through the same class
        assert isinstance(e.runner.mixed_graphs, MixedGraphs) and e.runner.mixed_graphs.pairs == ()


def test_decode_step_launch_census():
    """The kernel launches of one AR decode step of one row, counted as the ops issue them
    (``scripts/kernel_census.py``; on a GPU the step replays from a graph, and batched sampling
    there issues what one row's sampling issues here): the model's 8 per layer (SiLU x up in the
    gate/up GEMM), the sampler's three Triton kernels (design.md D30: 281 launches fewer than its
    tensor ops) and RoPE inside the attention (one launch fewer per layer). A change that adds a launch fails here, with the
    step's ops in the message."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        from kernel_census import launches
    finally:
        sys.path.pop(0)
    lm = random_lm(SMALL, seed=4)
    layers = SMALL.qwen.num_hidden_layers

    def step_ops(**kw):
        eng = LLMEngine(lm, engine_config(max_num_seqs=4, max_model_len=256, kv_block_size=16, executor="triton", **kw))
        eng.add_request([11, 12, 13], [5, 6], [1, 2, 3], params=SamplingParams(seed=0, force_length=6))
        eng.step()  # the prefill
        ops = launches(eng.launch)  # one decode step
        eng.collect()
        return ops

    default, rope, tensor_ops = step_ops(), step_ops(rope_in_attention=True), step_ops(sampler_kernels=False)
    per_layer = ["triton._matmul_kernel", "triton._rope_cache_kernel", "triton._paged_attn_kernel",
                 "triton._matmul_kernel", "triton._rmsnorm_kernel", "triton._matmul_kernel",  # gate/up + SiLU x up
                 "triton._matmul_kernel", "triton._rmsnorm_kernel"]
    start = default.index("triton._rmsnorm_kernel") + 1
    assert default[start: start + 8 * layers] == per_layer * layers, default
    sampling = default[start + 8 * layers + 1:]  # after the head's matmul: sample, record, row state
    assert sampling.count("triton._uniforms_kernel") == 1 and sampling.count("triton._draw_kernel") == 1
    assert sampling.count("triton._scores_kernel") == 1
    assert len(default) == 40, (len(default), default)
    assert len(rope) == len(default) - layers and "triton._rope_paged_attn_kernel" in rope
    assert len(tensor_ops) == len(default) + 281, len(tensor_ops)
