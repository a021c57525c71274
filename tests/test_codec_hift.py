"""HiftRunner (bounded streaming state, batched decode) and CachedISTFT against the official path."""

import json

import pytest
import torch

from cosybatch.codec.hift_runner import HiftJob, HiftRunner, continue_phase, left_context
from cosybatch.codec.istft import CachedISTFT
from cosybatch.models.config import HiFTConfig
from cosybatch.models.hift import CausalHiFTGenerator, Snake, fold_weight_norm, hann_window_periodic
from cosybatch.reference.token2wav import HiftStream
from conftest import ROWS, load_ref
from parity import SAME_MEL_MAX_ABS, SAME_MEL_MIN_SNR_DB, assert_wave_close, wave_error

pytestmark = pytest.mark.numeric

TOL = 1e-4  # the CUDA test's bound for the bounded-window stream vs the official re-run (design.md D10)


def _wave(got, want, what=""):
    """Same mel in, so the tight same-mel criterion (tests/parity.py): the float32 f0 can land one
    ulp away with another batch or window and the sine phase carries it (measured <= 6.3e-5)."""
    assert_wave_close(got, want, what, max_abs=SAME_MEL_MAX_ABS, min_snr_db=SAME_MEL_MIN_SNR_DB)


@pytest.fixture(scope="module")
def cfg(model_dir):
    from cosybatch.checkpoint.loader import load_config

    return load_config(model_dir)


@pytest.fixture(scope="module")
def hift(cfg, model_dir):
    sd = torch.load(model_dir / "hift.pt", map_location="cpu", weights_only=True)
    sd = {k.replace("generator.", ""): v for k, v in sd.items()}
    model = CausalHiFTGenerator(cfg.hift, model_cfg=cfg)
    model.load_state_dict(fold_weight_norm(sd), strict=True)
    return model.eval()


def random_mel(frames, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 80, frames, generator=g) * scale


def official_chunks(hift, mel, hops):
    ref, pos, out = HiftStream(hift), 0, []
    for i, n in enumerate(hops):
        out.append(ref.push(mel[:, :, pos:pos + n], i == len(hops) - 1))
        pos += n
    return out


# ---------------------------------------------------------------------------- ISTFT
@pytest.mark.parametrize("n_fft,hop", [(16, 4), (HiFTConfig().n_fft, HiFTConfig().hop_len), (32, 8)])
def test_cached_istft_bit_equal_to_torch(n_fft, hop):
    w = hann_window_periodic(n_fft)
    ist = CachedISTFT(n_fft, hop, w)
    g = torch.Generator().manual_seed(1)
    for frames in (2, 3, 121, 1201):
        re, im = torch.randn(2, 2, n_fft // 2 + 1, frames, generator=g)
        ref = torch.istft(torch.complex(re, im), n_fft, hop, n_fft, window=w)
        assert torch.equal(ist(re, im), ref)
    env = ist.envelope(121, "cpu")
    assert ist.envelope(121, "cpu") is env  # cached per frame count


def test_cached_istft_checks_nola_once_when_made():
    """A window whose overlap-add vanishes somewhere is refused at construction (torch.istft
    refuses it at every call); a valid one never checks again, so no call syncs a GPU."""
    w = hann_window_periodic(16)
    with pytest.raises(ValueError, match="NOLA"):
        CachedISTFT(16, 16, w)  # no overlap: the periodic Hann window is 0 at every frame start
    for frames in (2, 3, 5):  # what torch.istft says of the same window
        with pytest.raises(RuntimeError):
            torch.istft(torch.ones(1, 9, frames, dtype=torch.complex64), 16, 16, 16, window=w)
    ist = CachedISTFT(16, 4, w)
    for n in range(2, 40):  # every count's envelope is what torch.istft divides by: bounded away from 0
        assert float(ist.envelope(n, "cpu").min()) > 0.1


def test_cached_istft_ragged_rows_equal_their_own_istft():
    w = hann_window_periodic(16)
    ist = CachedISTFT(16, 4, w)
    g = torch.Generator().manual_seed(2)
    counts, width = [121, 50, 7, 130], 130
    re, im = torch.randn(2, 4, 9, width, generator=g)
    out = ist(re, im, ist.envelopes(counts, width, "cpu"), ist.frame_mask(counts, width, "cpu"))
    for b, n in enumerate(counts):
        ref = torch.istft(torch.complex(re[b:b + 1, :, :n], im[b:b + 1, :, :n]), 16, 4, 16, window=w)
        # the batched irfft rounds differently from a single row (pocketfft SIMD): ~1 ulp
        torch.testing.assert_close(out[b:b + 1, : ref.shape[1]], ref, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- pieces
def test_phase_continuation_is_bit_exact():
    g = torch.Generator().manual_seed(3)
    rad = torch.rand(2, 300, 9, generator=g)
    whole = torch.cumsum(rad.to(torch.float64), dim=1)
    s, c = 120, 128  # window from s, anchor c: acc = sum of frames < c
    got = continue_phase(rad[:, s:], [c - s, c - s], whole[:, c - 1])
    assert torch.equal(got[:, c - s:], whole[:, c:])
    assert torch.equal(continue_phase(rad, [0, 0], torch.zeros(2, 9, dtype=torch.float64)), whole)


def test_source_from_frame_zero_is_bit_exact(hift):
    runner = HiftRunner(hift)
    mel = random_mel(60, 4)
    f0, ref = hift.f0_and_source(mel, finalize=True)
    rad = hift.m_source.frame_phase_increments(f0, torch.zeros(1, 9))
    cycles = continue_phase(rad, [0], torch.zeros(1, 9, dtype=torch.float64))
    got = runner._source(f0, cycles, runner._noise([0], 60 * hift.samples_per_frame))
    assert torch.equal(got, ref)


def test_f0_predictor_as_gemms_equals_its_convolutions(hift):
    """``F0Gemm`` (what CUDA runs) against the predictor module, in float64: the same sums in
    another order, so equal to a few float64 ulps."""
    from cosybatch.codec.f0_gemm import F0Gemm

    for frames, rows in ((1, 1), (57, 3), (300, 2)):
        mel = torch.cat([random_mel(frames, seed) for seed in range(rows)])
        want = hift.f0_predictor(mel, finalize=True)
        got = F0Gemm(hift.f0_predictor)(mel)
        assert got.dtype == torch.float64 and got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-12 * max(1.0, want.abs().max().item())


@pytest.fixture(scope="module")
def long_stream(hift):
    """A stream much longer than the receptive field, hops not aligned to anything."""
    mel, hops = random_mel(170, 5), [37, 50, 13, 70]
    return mel, hops, official_chunks(hift, mel, hops)


def stream_max_diff(runner, mel, hops, ref):
    pos, worst = 0, 0.0
    for i, (n, r) in enumerate(zip(hops, ref)):
        got = runner.run([HiftJob("a", mel[:, :, pos:pos + n], i == len(hops) - 1)])[0]
        pos += n
        assert got.shape == r.shape
        worst = max(worst, (got - r).abs().max().item() if r.numel() else 0.0)
    return worst


def test_left_context_is_sufficient_and_needed(hift, long_stream):
    f0_ctx, dec_ctx = left_context(hift)
    assert f0_ctx == 8 and dec_ctx > f0_ctx
    assert stream_max_diff(HiftRunner(hift, context_frames=dec_ctx // 2), *long_stream) > 1e-3


@pytest.mark.parametrize("hops,f0_gemm", [(None, False), (None, True), ([50, 60, 7], False), ([8, 1, 40, 3, 30], True),
                                          ([9, 90], False)])
def test_bounded_stream_equals_official_rerun(hift, long_stream, hops, f0_gemm):
    mel, hops, ref = long_stream if hops is None else (random_mel(sum(hops), sum(hops)), hops, None)
    ref = ref or official_chunks(hift, mel, hops)
    runner = HiftRunner(hift, f0_gemm=f0_gemm)
    f0_ctx, dec_ctx = left_context(hift)
    bound = f0_ctx + dec_ctx + hift.f0_predictor.look_ahead + hift.cfg.conv_pre_look_right + 1
    pos = 0
    for i, (n, r) in enumerate(zip(hops, ref)):
        fin = i == len(hops) - 1
        got = runner.run([HiftJob("a", mel[:, :, pos:pos + n], fin)])[0]
        pos += n
        assert got.shape == r.shape
        _wave(got, r, i)
        if not fin:  # state stays O(receptive field), not O(history)
            assert runner._states["a"].tail.shape[1] <= bound
    assert runner.active() == 0


def test_fixture_rows_streamed_together(hift, reference_dir):
    """All rows' segments stream through one runner, batched in the same calls."""
    runner = HiftRunner(hift)
    per_stream, expect = {}, {}
    for row in ROWS:
        ref = load_ref(reference_dir, row)
        for ch in json.loads((reference_dir / f"{row}.json").read_text())["stream_chunks"]:
            key = (row, ch["segment"])
            per_stream.setdefault(key, []).append(
                (ref[f"stream.seg{ch['segment']}.chunk{ch['chunk']}.mel"], ch["finalize"]))
            expect.setdefault(key, []).append(ref[f"stream.seg{ch['segment']}.chunk{ch['chunk']}.wav"])
    rounds = max(len(c) for c in per_stream.values())
    for k in range(rounds):
        keys = [key for key, c in per_stream.items() if k < len(c)]
        outs = runner.run([HiftJob(key, *per_stream[key][k]) for key in keys])
        for key, got in zip(keys, outs):
            _wave(got, expect[key][k], (key, k))  # the official outputs themselves
    assert runner.active() == 0


def test_batched_equals_per_request(hift):
    plans = {"a": [50, 70, 30], "b": [60, 7, 60], "c": [110], "d": [20, 20, 20, 20, 20]}
    mels = {k: random_mel(sum(h), 10 + i) for i, (k, h) in enumerate(plans.items())}

    def jobs_at(k):
        out = []
        for rid, hops in plans.items():
            if k < len(hops):
                a = sum(hops[:k])
                out.append(HiftJob(rid, mels[rid][:, :, a:a + hops[k]], k == len(hops) - 1))
        return out

    together = HiftRunner(hift)
    alone = HiftRunner(hift, max_batch=1)
    for k in range(5):
        jobs = jobs_at(k)
        both = together.run(jobs)
        single = [alone.run([j])[0] for j in jobs]
        for x, y in zip(both, single):
            assert x.shape == y.shape
            # float32 convs round differently with the batch size (oneDNN): ~1e-5, more via the f0 ulp
            _wave(x, y, k)


def test_snake_pad_torch_backend_is_the_models_own_path(hift):
    """The fused-activation hook of ``decode_spec`` (``SnakePad``) computes what the model's own
    Snake + causal conv compute: with the torch backend the same ops, so bit for bit. The
    Triton backend is checked against the same eager path on the GPU."""
    from cosybatch.codec.snake import SnakePad

    mel = random_mel(37, 11)
    s_stft = hift.source_stft(hift.f0_and_source(mel)[1])
    with torch.inference_mode():
        want = hift.decode_spec(mel, s_stft)
        got = hift.decode_spec(mel, s_stft, snake_pad=SnakePad(hift, "torch"))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="backend"):
        SnakePad(hift, "cuda")


def test_full_response_mode(hift, reference_dir):
    runner = HiftRunner(hift)
    refs = [load_ref(reference_dir, row) for row in ROWS[:3]]
    mels = [r["nonstream.seg0.mel"] for r in refs]
    outs = runner.run([HiftJob(i, m, True) for i, m in enumerate(mels)])
    for m, r, got in zip(mels, refs, outs):
        official, _ = hift.inference(m, finalize=True)
        _wave(got, official, "official re-run")
        _wave(got, r["nonstream.seg0.wav"], "fixture")


def test_graph_path_with_fake_backend_equals_eager(hift):
    from helpers import FakeBackend

    backend = FakeBackend()
    graphed = HiftRunner(hift, graphs=dict(backend=backend, capture_after=1), frame_bucket=16)
    eager = HiftRunner(hift)
    mels = [random_mel(n, n) for n in (40, 50, 70)]
    for step in range(2):  # the second pass replays the captured shapes
        jobs = [HiftJob((step, i), m, True) for i, m in enumerate(mels)]
        for x, y in zip(graphed.run(jobs), eager.run(jobs)):
            _wave(x, y, step)
    assert backend.captures >= 1 and graphed.graphs.stats.hits >= 1


def test_coarse_frame_buckets_change_nothing(hift):
    """Eager windows padded to a multiple of 64 frames (the padding is masked) give the exact
    windows' audio (``optimizations.hift_frame_bucket``)."""
    padded, exact = HiftRunner(hift, frame_bucket=64), HiftRunner(hift)
    assert (padded.frame_bucket, exact.frame_bucket) == (64, 1)
    mels = [random_mel(n, n) for n in (40, 50, 70)]
    jobs = [HiftJob(("b", i), m, True) for i, m in enumerate(mels)]
    for x, y in zip(padded.run(jobs), exact.run(jobs)):
        _wave(x, y, "bucket 64")


def test_precapture_serves_the_first_request(hift):
    from helpers import FakeBackend

    backend = FakeBackend()
    runner = HiftRunner(hift, graphs=dict(backend=backend, capture_after=3), frame_bucket=16)
    assert runner.precapture([(3, 40)]) == 1  # 3 rows -> 4, 40 frames -> 48
    outs = runner.run([HiftJob(i, random_mel(n, n), True) for i, n in enumerate((30, 35, 40))])
    assert [o.shape[1] for o in outs] == [n * hift.samples_per_frame for n in (30, 35, 40)]
    st = runner.graphs.stats
    assert (st.precaptures, st.hits, st.eager, backend.captures) == (1, 1, 0, 1)


def test_same_request_twice_in_one_call_and_release(hift):
    mel = random_mel(100, 7)
    ref = official_chunks(hift, mel, [60, 40])
    runner = HiftRunner(hift)
    outs = runner.run([HiftJob("r", mel[:, :, :60], False), HiftJob("r", mel[:, :, 60:], True)])
    for x, y in zip(outs, ref):
        _wave(x, y)
    runner.run([HiftJob("s", mel[:, :, :4], False)])  # shorter than the look-ahead
    assert runner.active() == 1
    runner.release("s")
    assert runner.active() == 0


def test_does_not_touch_global_rng_and_rejects_too_long(hift):
    runner = HiftRunner(hift)
    state = torch.get_rng_state()
    runner.run([HiftJob("x", random_mel(30, 8), True)])
    assert torch.equal(torch.get_rng_state(), state)
    limit = hift.cfg.sine_table_len // hift.samples_per_frame
    with pytest.raises(ValueError):
        runner.run([HiftJob("y", torch.zeros(1, 80, limit + 1), True)])
    assert runner.active() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("size", ["small", "full"])
def test_bounded_stream_on_cuda_equals_official(size):
    """Module-initialised weights (fixtures do not travel to the GPU box), f0 ~ 150 Hz."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = HiFTConfig() if size == "full" else HiFTConfig(base_channels=64, f0_cond_channels=32)
    torch.manual_seed(0)
    model = CausalHiFTGenerator(cfg)
    with torch.no_grad():
        model.f0_predictor.classifier.bias.fill_(150.0)
    model = model.cuda().eval()
    hops = [50, 100, 200, 200, 31]
    mel = (random_mel(sum(hops), 9, scale=1.0) - 5).cuda()
    ref = official_chunks(model, mel, hops)
    for graphs in (False, dict(capture_after=1)):
        runner, pos = HiftRunner(model, graphs=graphs), 0
        for i, (n, r) in enumerate(zip(hops, ref)):
            got = runner.run([HiftJob("a", mel[:, :, pos:pos + n], i == len(hops) - 1)])[0]
            pos += n
            torch.testing.assert_close(got, r, rtol=0, atol=TOL)
        if graphs:
            assert runner.graphs.stats.captures >= 1
    other = [(random_mel(n, n, scale=1.0) - 5).cuda() for n in (80, 130, 200)]
    batched = HiftRunner(model).run([HiftJob(i, m, True) for i, m in enumerate(other)])
    for m, got in zip(other, batched):
        torch.testing.assert_close(got, model.inference(m)[0], rtol=0, atol=TOL)
    # The whole batch (F0, phase, source, STFT, decode) from one graph: replay == eager on the
    # same padded shapes (enabled=False: the graph cache's padding, eager calls), bit for bit
    graphed = HiftRunner(model, graphs=dict(capture_after=1))
    for tag in ("capture", "replay"):
        got = graphed.run([HiftJob((tag, i), m, True) for i, m in enumerate(other)])
        assert all(torch.equal(g, e) for g, e in zip(got, HiftRunner(model, graphs=dict(enabled=False)).run(
            [HiftJob((tag, i), m, True) for i, m in enumerate(other)])))
    assert graphed.graphs.stats.hits >= 1


@pytest.mark.gpu
def test_fused_snake_on_cuda_equals_eager():
    """The Triton Snake + pad kernel against the eager ops, alone (odd lengths, every pad of the
    resblocks, a channel count not a power of two, with a conv's bias), the bias + residual
    kernel, one fused resblock step, and whole batched HiFT calls (full size, TF32 convs as the
    pipeline runs them, eager and graphed): bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from cosybatch.codec.snake import SnakePad

    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = CausalHiFTGenerator(HiFTConfig())
    with torch.no_grad():
        model.f0_predictor.classifier.bias.fill_(150.0)
        for m in model.modules():  # alphas away from 1, as trained ones are
            if isinstance(m, Snake):
                m.alpha.uniform_(0.2, 3.0)
    model = model.cuda().eval()
    fused, eager = SnakePad(model, "triton"), SnakePad(model, "torch")
    snake = model.resblocks[0].activations1[0]
    for shape in ((3, 256, 1), (2, 256, 1023), (1, 256, 4099)):
        x = 3 * torch.randn(shape, device="cuda")
        for pad in (0, 2, 10, 30):
            assert torch.equal(fused(x, snake, pad), eager(x, snake, pad)), (shape, pad)
    odd = CausalHiFTGenerator(HiFTConfig(base_channels=96, f0_cond_channels=32)).cuda().eval()
    x = torch.randn(2, 48, 777, device="cuda")
    sn = odd.resblocks[0].activations1[0]
    assert torch.equal(SnakePad(odd, "triton")(x, sn, 5), SnakePad(odd, "torch")(x, sn, 5))
    # conv1's deferred bias inside the Snake kernel, conv2's with the residual add, one whole
    # resblock step against the module's own ops (cuDNN adds a conv's bias as a separate op)
    bias = torch.randn(256, device="cuda")
    x = 3 * torch.randn(2, 256, 1023, device="cuda")
    assert torch.equal(fused(x, snake, 10, bias), eager(x, snake, 10, bias))
    from cosybatch.codec import triton_kernels

    y = torch.randn_like(x)
    assert torch.equal(triton_kernels.bias_residual(y, bias, x), (y + bias[None, :, None]) + x)
    blk = model.resblocks[4]
    c1, c2, a1, a2 = blk.convs1[1], blk.convs2[1], blk.activations1[1], blk.activations2[1]
    x = torch.randn(2, c1.in_channels, 777, device="cuda")
    with torch.inference_mode():
        assert torch.equal(fused.pair(x, c1, a1, c2, a2), c2(a2(c1(a1(x)))) + x)
    mels = [(random_mel(n, n, scale=1.0) - 5).cuda() for n in (80, 130, 200)]
    for graphs in (False, dict(capture_after=1)):
        on, off = HiftRunner(model, graphs=graphs, fused_snake=True), HiftRunner(model, graphs=graphs)
        for step in range(2):
            jobs = [HiftJob((step, i), m, True) for i, m in enumerate(mels)]
            assert all(torch.equal(a, b) for a, b in zip(on.run(jobs), off.run(jobs))), (graphs, step)


def test_cudnn_channels_last_decode_is_the_models_on_cpu():
    """``optimizations.hift_convs: cudnn_channels_last`` without a GPU (PyTorch's ops for its
    Snake and bias kernels): the model's decode at the full geometry (narrow channels), alone
    and through the runner's batched streaming and whole-response calls, float32 reordering
    apart; an unknown name is refused."""
    from cosybatch.codec.hift_convs import CudnnChannelsLastDecode, decoder

    torch.manual_seed(3)
    model = CausalHiFTGenerator(HiFTConfig(base_channels=32, f0_cond_channels=16))
    with torch.no_grad():
        model.f0_predictor.classifier.bias.fill_(150.0)
        for m in model.modules():
            if isinstance(m, Snake):
                m.alpha.uniform_(0.2, 3.0)
    model = model.eval()
    mel, s_stft = torch.randn(2, 80, 9), torch.randn(2, model.cfg.n_fft + 2, 9 * model.up_total + 1)
    with torch.inference_mode():
        want = model.decode_spec(mel, s_stft, finalize=True)
        got = CudnnChannelsLastDecode(model).decode_spec(mel, s_stft)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max()
    mels = [(random_mel(n, n, scale=1.0) - 5) for n in (40, 65)]
    for convs in ("cudnn", "cudnn_channels_last"):
        runner = HiftRunner(model, convs=convs)
        outs = runner.run([HiftJob(i, m, True) for i, m in enumerate(mels)])
        outs += [runner.run([HiftJob("s", mels[1][:, :, a:b], b == 65)])[0] for a, b in ((0, 30), (30, 65))]
        if convs == "cudnn":
            base = outs
    assert all(o.shape == b.shape and (o - b).abs().max() <= 1e-5 for o, b in zip(outs, base))
    with pytest.raises(ValueError, match="hift_convs"):
        decoder(model, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("convs", ["cudnn_channels_last", "triton"])
def test_channels_last_decodes_on_cuda_against_float32(convs):
    """HiFT's decode on channels-last tensors (``HiftRunner(convs=...)``) at the full size, whole
    responses of three lengths batched and one stream in chunks, against strict float32 cuDNN on
    NCL tensors: in TF32 within 10 dB of the NCL path's TF32 SNR (the H200: 66.5 dB on wave 0;
    the first Triton version, whose operands the MMA truncated, 48.9), in float32 at least as
    close as that (Triton 116.6 measured); exact lengths; a graph replay equal to the eager call
    bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    torch.manual_seed(0)
    model = CausalHiFTGenerator(HiFTConfig())
    with torch.no_grad():
        model.f0_predictor.classifier.bias.fill_(150.0)
        for m in model.modules():
            if isinstance(m, Snake):
                m.alpha.uniform_(0.2, 3.0)
    model = model.cuda().eval()
    mels = [(random_mel(n, n, scale=1.0) - 5).cuda() for n in (80, 130, 200)]
    hops = [50, 100, 31]

    def waves(tf32, **kw):
        torch.backends.cudnn.allow_tf32 = tf32
        runner = HiftRunner(model, f0_gemm=True, **kw)
        whole = runner.run([HiftJob(("w", i), m, True) for i, m in enumerate(mels)])
        pos, parts = 0, []
        for i, n in enumerate(hops):
            parts.append(runner.run([HiftJob("s", mels[2][:, :, pos:pos + n], i == len(hops) - 1)])[0])
            pos += n
        return [*whole, torch.cat(parts, 1)]

    try:
        ref = waves(False)
        ncl_tf32 = waves(True, fused_snake=True)
        got_tf32 = waves(True, convs=convs)
        got_f32 = waves(False, convs=convs)
        torch.backends.cudnn.allow_tf32 = True
        graphed = HiftRunner(model, f0_gemm=True, convs=convs, graphs=dict(capture_after=1))
        eager = HiftRunner(model, f0_gemm=True, convs=convs, graphs=dict(enabled=False))
        for tag in ("capture", "replay"):
            jobs = [HiftJob((tag, i), m, True) for i, m in enumerate(mels)]
            assert all(torch.equal(a, b) for a, b in zip(graphed.run(jobs), eager.run(jobs))), tag
        assert graphed.graphs.stats.hits >= 1
    finally:
        torch.backends.cudnn.allow_tf32 = True
    for i, r in enumerate(ref):
        snr = {name: wave_error(w[i], r)[0] for name, w in (("ncl tf32", ncl_tf32), (f"{convs} tf32", got_tf32),
                                                      (f"{convs} float32", got_f32))}
        print(f"HiFT {convs}, wave {i}: SNR dB against float32 NCL cuDNN", {k: round(v, 1) for k, v in snr.items()})
        assert all(w[i].shape == r.shape for w in (ncl_tf32, got_tf32, got_f32))
        assert snr[f"{convs} tf32"] >= snr["ncl tf32"] - 10.0, snr
        assert snr[f"{convs} float32"] >= snr["ncl tf32"], snr
