"""The Triton attention backend (``codec.attention=triton``) through Triton's CPU interpreter,
against the ``sdpa`` backend on packed layouts like the flow's.

Only where ``triton`` is importable and no GPU is present (tests/test_codec_attention_gpu.py runs
the compiled kernel in bf16). The interpreter evaluates in float32; the bound is the spread of the
float32 ``sdpa`` backend itself around a float64 reference, measured on the same inputs, so it
follows whatever CPU kernels run here rather than a fixed figure.
"""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.numeric, pytest.mark.usefixtures("one_thread")]

if torch.cuda.is_available():
    pytest.skip("GPU present: the GPU tests run the compiled kernel", allow_module_level=True)
pytest.importorskip("triton")

from cosybatch.codec.attention import SdpaBackend, TritonBackend, make_backend  # noqa: E402
from cosybatch.codec.packing import RowSpec, SubSeqs, pack  # noqa: E402
from cosybatch.codec.triton_attention import max_tiles  # noqa: E402

HEADS, DH = 2, 16
# The float32 kernel reorders its sums against SDPA (online softmax, base-2 exponentials): a few
# roundings, where a wrong mask moves outputs by a key's whole weight.
SPREAD_FACTOR = 4


def _rows(rng, chunk: int, n: int) -> list[RowSpec]:
    """Cached chunk-causal rows (pool launch), uncached chunk-causal and full-attention rows (self launch)."""
    rows, region = [], 0
    for i in range(n):
        kind = i % 3
        frames = int(rng.integers(chunk + 1, 5 * chunk))
        if kind == 0:
            q_start = chunk * int(rng.integers(1, frames // chunk + 1)) if frames > chunk else 0
            q_start = min(q_start, (frames - 1) // chunk * chunk)
            rows.append(RowSpec(frames, q_start, q_start, chunk, pool=(region, region + 5 * chunk)))
            region += 10 * chunk
        else:
            rows.append(RowSpec(frames, 0, 0, chunk if kind == 1 else 0))
    return rows


def _qkv(n: int, gen, dtype=torch.float32):
    """q, k, v as the flow makes them: strided views of one [N, 3, H, Dh] buffer."""
    return torch.randn(n, 3, HEADS, DH, generator=gen, dtype=dtype).unbind(1)


def _covered(seqs: SubSeqs, n: int) -> torch.Tensor:
    m = torch.zeros(n, dtype=torch.bool)
    for q0, ql in zip(seqs.q_start, seqs.q_len):
        m[q0 : q0 + ql] = True
    return m


def _run(backend, seqs, q, k, v, keys_at=None, **sizes):
    meta = backend.prepare(seqs, q.shape[0], "cpu", **sizes)
    keys = None if keys_at is None else backend.layer_keys(meta, keys_at)[-1]
    return backend.run(q, k, v, meta, keys)


def _check(seqs: SubSeqs, q, k, v, keys_at=None, tilings=((16, False), (32, True)), **sizes) -> None:
    """Every Triton tiling within the float32 spread of the reference; a mask one key too long
    outside it; zeros outside the sub-sequences."""
    ref64 = _run(SdpaBackend(), seqs, q.double(), k.double(), v.double(), keys_at).float()
    ref32 = _run(SdpaBackend(), seqs, q, k, v, keys_at)
    cov = _covered(seqs, q.shape[0])
    bound = SPREAD_FACTOR * max((ref32 - ref64)[cov].abs().max().item(), torch.finfo(torch.float32).eps)
    for bm, merge in tilings:
        got = _run(TritonBackend(block_m=bm, block_n=32, merge=merge), seqs, q, k, v, keys_at, **sizes)
        assert (got - ref64)[cov].abs().max().item() <= bound, (bm, merge)
        assert torch.equal(got[~cov], torch.zeros_like(got[~cov]))
    # The test can fail: one key too many in the sub-sequence with the fewest keys.
    live = np.flatnonzero(seqs.q_len > 0)
    i = live[np.argmin(seqs.k_len[live])]
    k_len = seqs.k_len.copy()
    k_len[i] += 1
    wrong = SubSeqs(seqs.q_start, seqs.q_len, seqs.k_start, k_len)
    bm, merge = tilings[-1]
    got = _run(TritonBackend(block_m=bm, block_n=32, merge=merge), wrong, q, k, v, keys_at, **sizes)
    assert (got - ref64)[cov].abs().max().item() > bound


@pytest.mark.parametrize("chunk", [15, 50])
def test_triton_attention_matches_sdpa_on_packed_flow_layouts(chunk):
    rng = np.random.default_rng(chunk)
    gen = torch.Generator().manual_seed(chunk)
    lay = pack(_rows(rng, chunk, 3 if chunk > 32 else 6), conv_gap=3)
    assert len(lay.pool) and len(lay.self)
    n = lay.tokens
    q, k, v = _qkv(n, gen)
    # Tiles sized to the chunk (one or two chunks a tile) and smaller than it (chunks span tiles).
    tilings = ((16, False), (32, True)) if chunk < 32 else ((32, False), (128, True))
    _check(lay.self, q, k, v, tilings=tilings)  # keys: the call's own tokens (full rows and uncached chunks)
    # Pool launch: keys in place in an arena of two (step, layer) slots, read from the second.
    slot = 2 * 10 * chunk * 6 + 1
    arena = torch.randn(2 * slot, 2, HEADS, DH, generator=gen).unbind(1)
    _check(lay.pool, q, *arena, keys_at=torch.tensor([0, slot]), tilings=tilings)


def test_triton_attention_on_random_overlapping_ragged_and_empty_subsequences():
    """Arbitrary key ranges (overlapping, ragged, different starts within one run of tokens),
    empty sub-sequences, gaps of tokens no sub-sequence covers; padded to a graph bucket."""
    rng = np.random.default_rng(7)
    gen = torch.Generator().manual_seed(7)
    q_len = rng.integers(0, 40, size=12)
    q_len[[2, 9]] = 0
    gaps = rng.integers(0, 3, size=12)
    q_start = np.cumsum(gaps + np.concatenate(([0], q_len[:-1])))
    k_len = rng.integers(1, 90, size=12)
    k_start = rng.integers(0, 30, size=12)
    k_start[4] = k_start[3]  # adjacent sub-sequences with one key start: merged into shared tiles
    seqs = SubSeqs(q_start, q_len, k_start, k_len)
    n = int(q_start[-1] + q_len[-1]) + 5
    q = _qkv(n, gen)[0]
    k, v = torch.randn(120, 2, HEADS, DH, generator=gen).unbind(1)
    _check(seqs, q, k, v)
    _check(seqs, q, k, v, tilings=((32, True),), n_seqs=20, max_q=64, max_k=128)


def test_bucket_padding_fixes_the_tile_count():
    """A graph replays one grid: the tile table's size depends on the bucket alone."""
    seqs = SubSeqs(np.array([0, 50, 100]), np.array([50, 50, 30]), np.array([0, 0, 7]), np.array([300, 350, 40]))
    b = TritonBackend(block_m=64, merge=True)
    fewer = SubSeqs(seqs.q_start[:1], seqs.q_len[:1], seqs.k_start[:1], seqs.k_len[:1])
    shapes = {b.prepare(s, 200, "cpu", n_seqs=7, max_q=50, max_k=500).tensors["tiles"].shape for s in (seqs, fewer)}
    assert shapes == {(max_tiles(7, 50, 200, 64), 4)}
    with pytest.raises(ValueError, match="bucket"):
        b.prepare(seqs, 200, "cpu", n_seqs=2, max_q=50, max_k=500)


def test_triton_is_a_codec_attention_choice():
    from cosybatch.profiles import load_profile

    assert load_profile("default", ["codec.attention=triton"]).codec.attention == "triton"
    assert make_backend("triton", "cpu", torch.float32).name == "triton"  # the interpreter runs it here


def test_shared_output_and_zero_fill_in_the_launch():
    """Two launches over disjoint tokens written into one uninitialised output, the zeros of the
    tokens neither covers written by the second launch's fill programs: equal to the zero-filled
    outputs merged with torch.where (no memset, no select), whatever the output held before."""
    from cosybatch.codec.triton_attention import chunk_attention

    gen = torch.Generator().manual_seed(11)
    n = 70
    seqs = lambda *cols: SubSeqs(*(np.array(c, dtype=np.int64) for c in cols))  # noqa: E731
    a = seqs([0, 20], [12, 8], [0, 0], [12, 20])  # tokens 0-11, 20-27
    b = seqs([40, 50], [5, 9], [40, 40], [5, 14])  # 40-44, 50-58; 12-19, 28-39, 59-69 in neither
    q, k, v = _qkv(n, gen)
    be = TritonBackend(block_m=16, block_n=32)
    ma, mb = be.prepare(a, n, "cpu"), be.prepare(b, n, "cpu")
    want_a, want_b = be.run(q, k, v, ma), be.run(q, k, v, mb)
    in_a = _covered(a, n)[:, None, None]
    want = torch.where(in_a, want_a, want_b)
    out = torch.full((n, HEADS, DH), float("nan"))
    be.run(q, k, v, ma, out=out)
    be.run(q, k, v, mb, out=out, fill=(ma, mb))
    assert torch.equal(out, want)
    alone = be.run(q, k, v, mb, fill=(mb,))  # one launch: its own zeros, in a fresh output
    assert torch.equal(alone, want_b)
    t = ma.tensors
    with pytest.raises(ValueError, match="fill"):
        chunk_attention(q, k, v, t["tiles"], t["k_start"], t["k_len"], 16, fill=(t["k_len"],) * 3)


def test_two_launches_as_one_equal_each_alone():
    """``prepare_pair``: a pool-like launch (keys from an arena, moved by a layer offset) and a
    self launch (keys from this call's k/v) over disjoint tokens as one kernel launch, padded to
    a bucket's tile count: equal to the two launches merged by torch.where, zeros elsewhere."""
    gen = torch.Generator().manual_seed(12)
    n = 70
    seqs = lambda *cols: SubSeqs(*(np.array(c, dtype=np.int64) for c in cols))  # noqa: E731
    pool = seqs([0, 10, 40], [10, 10, 6], [3, 3, 30], [25, 30, 9])  # arena rows, before the offset
    self_ = seqs([20, 50], [12, 9], [20, 50], [12, 14])  # 20-31, 50-58; 32-39, 46-49, 59-69 in neither
    q, k, v = _qkv(n, gen)
    arena = torch.randn(2, 100, HEADS, DH, generator=gen)
    offset = torch.tensor([0, 41])  # two layers' slots
    be = TritonBackend(block_m=16, block_n=32)
    mp, ms = be.prepare(pool, n, "cpu"), be.prepare(self_, n, "cpu")
    pair = be.prepare_pair(pool, self_, n, "cpu", (4, 16, None), (3, 16, None))
    tiles = pair.tensors["tiles"]
    assert tiles.shape[0] == 7 and int((tiles[:, 1] > 0).sum()) == 5  # padded to both bounds (4 + 3)
    in_pool = _covered(pool, n)[:, None, None]
    for layer in range(2):
        want = torch.where(in_pool, be.run(q, arena[0], arena[1], mp, be.layer_keys(mp, offset)[layer]),
                           be.run(q, k, v, ms))
        keys = be.layer_keys(pair, offset)[layer]
        for fill in (None, (pair,)):
            assert torch.equal(be.run(q, arena[0], arena[1], pair, keys, fill=fill, k2=k, v2=v), want)
    with pytest.raises(ValueError, match="k2"):
        be.run(q, arena[0], arena[1], pair)


def test_fused_flow_layers_match_the_unfused_step():
    """A small float32 flow with the fused parts (design.md D26) against the unfused step: a
    streaming hop with prefix reuse (the pool launch and its K/V writes) beside a final hop (the
    self launch) in one call. The chained residual + LayerNorm, the rotary writing the arena, the
    attention's own zeros and both launches as one (the GELU epilogue is CUDA's: its CPU form is
    the eager pair):
    float32 reordering only (measured max abs 8e-7, bound 1e-5; a wrong arena row or a missed
    zero moves outputs by O(1)). One Euler step per call: the interpreter's cost is per program."""
    from cosybatch.codec.flow_runner import FUSIONS, FlowJob, FlowRunner
    from cosybatch.hops import HopSchedule, plan_segment
    from cosybatch.models.config import DiTConfig, FlowConfig
    from cosybatch.models.flow import CausalMaskedDiffWithDiT
    from cosybatch.prompt import PromptFeatures

    torch.manual_seed(0)
    cfg = FlowConfig(pre_lookahead_channels=16, n_timesteps=1,
                     dit=DiTConfig(dim=32, depth=2, heads=HEADS, dim_head=DH, static_chunk_size=10))
    flow = CausalMaskedDiffWithDiT(cfg).eval()
    g = torch.Generator().manual_seed(1)
    rows = []
    for i, (p, n) in enumerate([(5, 17), (4, 12)]):  # 3 and 2 hops of one attention chunk
        pr = PromptFeatures(torch.randint(0, cfg.vocab_size, (p,), generator=g), torch.randn(1, cfg.spk_embed_dim, generator=g),
                            torch.randn(1, 2 * p, cfg.output_size, generator=g))
        tok = torch.randint(0, cfg.vocab_size, (n,), generator=g)
        rows.append((f"r{i}", pr, tok, plan_segment(HopSchedule(hop=5, max_hop=5, scale=1), p, n)))

    def run_all(runner):
        outs = []
        for hop in range(2):  # hop 1: row 0 reuses its prefix (pool), row 1 is final (self)
            outs += runner.run([FlowJob(name, tok, pr, ch[hop]) for name, pr, tok, ch in rows])
        assert runner.stats["cached_tokens"] > 0
        return outs

    base = run_all(FlowRunner(flow, attention="triton", triton_kernels=True, fusions=()))
    fused = FlowRunner(flow, attention="triton", triton_kernels=True)
    assert fused.fusions == FUSIONS and fused.tables.chain and fused.tables.kv_writes and fused.tables.fill \
        and fused.tables.merge
    pairs = []
    prepare_pair = fused.backend.prepare_pair
    fused.backend.prepare_pair = lambda *a, **kw: pairs.append(1) or prepare_pair(*a, **kw)
    got = run_all(fused)
    assert pairs  # the second call ran its pool and self launches as one
    err = max((x - y).abs().max().item() for x, y in zip(got, base))
    assert len(got) == len(base) == 4 and err <= 1e-5, err
    with pytest.raises(ValueError, match="fusions"):
        FlowRunner(flow, attention="triton", fusions=("nope",))
