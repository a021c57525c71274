"""Real-structure frontend stand-ins, their PyTorch implementation, batching and the prompt cache.

All on the CPU with the ``tiny`` stand-ins (S3TokenizerV3 2 x 128, CAM++ 2/2/2 layers); the
full-size comparison on a GPU is tests/test_frontend_gpu.py.
"""

from __future__ import annotations

import io
import math
import logging
import shutil
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import soundfile as sf
import torch

from cosybatch.checkpoint.onnx_standins import TOKENIZER_SIZES, write_onnx_standins
from cosybatch.checkpoint.onnx_weights import FrontendModelError, OnnxGraph, load_campplus, load_s3tokenizer
from cosybatch.models.config import ModelConfig
from cosybatch.frontend.frontend import Frontend
from cosybatch.frontend.batch_features import kaldi_fbank_batch, pad_rows, whisper_log_mel_batch
from cosybatch.checkpoint.synthetic_audio import speech_like

SECONDS = (3.3, 4.7, 2.2, 6.1, 3.0)
pytestmark = [pytest.mark.numeric, pytest.mark.usefixtures("one_thread")]  # torch's OpenMP pool stalls on a busy CI box


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    d = tmp_path_factory.mktemp("frontend_tiny")
    write_onnx_standins(d, seed=0, size="tiny")
    return d


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    """16 and 24 kHz speech-like prompt files."""
    d = tmp_path_factory.mktemp("prompts")
    out = []
    for i, s in enumerate(SECONDS):
        sr = 16000 if i % 2 == 0 else 24000
        p = d / f"p{i}.wav"
        sf.write(p, speech_like(s, sr, 40 + i).astype(np.float32), sr, subtype="PCM_16")
        out.append(p)
    return out


def _session(path):
    opt = ort.SessionOptions()
    opt.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opt, providers=["CPUExecutionProvider"])


def _wav16(n_seconds, seed):
    return torch.from_numpy(speech_like(n_seconds, 16000, seed).astype(np.float32))


def test_official_structure_and_counts(standins):
    """Parameters sit where a loader of the official files looks for them (node names +
    input positions); the tokenizer's initializers are exactly its 16 x layers + 6 parameters
    (198 tensors / 242,009,608 values at full size, as in the official file)."""
    g = OnnxGraph.read(standins / "speech_tokenizer_v3.onnx")
    cfg = TOKENIZER_SIZES["tiny"]
    assert len(g.inits) == 16 * cfg.layers + 6
    for name in ("/conv1/Conv", "/conv2/Conv", "/blocks.1/attn/query/MatMul", "/blocks.1/attn/key/MatMul",
                 "/blocks.1/attn/fsmn_block/Conv", "/blocks.1/attn_ln/Mul", "/blocks.1/attn_ln/Add_1",
                 "/blocks.1/mlp/mlp.0/MatMul", "/blocks.1/mlp_ln/Add_1", "/quantizer/project_in/Add"):
        assert name in g.nodes, name
    assert "blocks.1.attn.fsmn_block.weight" in g.inits and "blocks.0.attn_ln.weight" in g.inits
    c = OnnxGraph.read(standins / "campplus.onnx")
    for name in ("/head/layer1/layer1.0/shortcut/shortcut.0/Conv", "/xvector/block1/tdnnd1/cam_layer/linear_local/Conv",
                 "/xvector/block1/tdnnd1/cam_layer/Mul_1", "/xvector/block1/tdnnd1/nonlinear2/relu/Relu",
                 "/xvector/transit3/linear/Conv", "/xvector/out_nonlinear/relu/Relu",
                 "/xvector/dense/nonlinear/batchnorm/BatchNormalization"):
        assert name in c.nodes, name
    bns = [n for n in c.nodes.values() if n.op_type == "BatchNormalization"]
    assert len(bns) == sum((2, 2, 2)) + 3 + 1  # nonlinear1 per layer, transits, dense (others folded)
    assert c.inits["onnx::Conv_1000"].shape[0] == 8  # folded convs get opaque names
    assert "xvector.dense.nonlinear.batchnorm.running_var" in c.inits
    assert "xvector.dense.nonlinear.batchnorm.weight" not in c.inits  # affine-free: constants


def _folded_in_official(node: str) -> bool:
    """Convs whose weights the official export renamed: CAM++ convs followed by a BatchNorm
    (folded in; plain convs in our modules) and the tokenizer's whisper-style subsampling
    convs, which cast their weights to the input dtype (a constant-folded Cast)."""
    if node in ("/conv1/Conv", "/conv2/Conv", "/xvector/tdnn/linear/Conv", "/xvector/transit3/linear/Conv"):
        return True
    return node.startswith("/head/") or (node.endswith("/linear1/Conv") and "/cam_layer/" not in node)


def _weight_slots(model):
    inits = {i.name for i in model.graph.initializer}
    return {(n.name, j): i for n in model.graph.node for j, i in enumerate(n.input) if i in inits}


def test_names_are_what_the_torchscript_exporter_gives(standins):
    """Exporting the PyTorch modules with torch's TorchScript exporter (how the official files
    were made) puts every parameter on the same (node, input) as the written stand-ins."""
    if not hasattr(torch.onnx, "export"):
        pytest.skip("no torch.onnx exporter")
    tok, cam = load_s3tokenizer(standins / "speech_tokenizer_v3.onnx"), load_campplus(standins / "campplus.onnx")
    cases = [(tok, (torch.randn(1, 128, 200), torch.tensor([200], dtype=torch.int32)), standins / "speech_tokenizer_v3.onnx"),
             (cam, (torch.randn(1, 300, 80), torch.tensor([300])), standins / "campplus.onnx")]
    for module, args, path in cases:
        f = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                torch.onnx.export(module, args, f, opset_version=16, dynamo=False)
            except Exception as e:  # pragma: no cover - exporter removed in some torch
                pytest.skip(f"TorchScript exporter unavailable: {e}")
        exported, ours = _weight_slots(onnx.load_from_string(f.getvalue())), _weight_slots(onnx.load(str(path)))
        assert set(exported) == set(ours), path.name
        for slot, name in exported.items():
            if ours[slot].startswith("onnx::"):
                assert name.startswith("onnx::") or _folded_in_official(slot[0]), slot
            else:
                assert ours[slot] == name, slot


def test_torch_matches_onnxruntime(standins, fixtures_dir):
    """Same tokens and embeddings (1e-5) as onnxruntime on the same files, per prompt."""
    from cosybatch.audio import load_audio, resample, to_mono

    tok, cam = load_s3tokenizer(standins / "speech_tokenizer_v3.onnx"), load_campplus(standins / "campplus.onnx")
    st, sc = _session(standins / "speech_tokenizer_v3.onnx"), _session(standins / "campplus.onnx")
    prompts = [_wav16(s, 10 + i) for i, s in enumerate(SECONDS)]
    for p in sorted((fixtures_dir / "prompts").glob("*.wav")):
        w, sr = load_audio(p)
        prompts.append(resample(to_mono(w), sr, 16000)[0])
    codes = []
    for w in prompts:
        x, n = pad_rows([w])
        feats, frames = whisper_log_mel_batch(x, n)
        fb, fb_n = kaldi_fbank_batch(x, n)
        with torch.no_grad():
            ours, ours_len = tok(feats, frames)
            emb = cam(fb, fb_n)
        ref = st.run(None, {"feats": feats.numpy(), "feats_length": frames.numpy().astype(np.int32)})[0]
        assert ref.shape == (1, int(ours_len[0])) and np.array_equal(ref, ours.numpy().astype(np.int32))
        ref_emb = sc.run(None, {"input": fb.numpy()})[0]
        assert np.abs(ref_emb - emb.numpy()).max() <= 1e-5
        codes.extend(ref[0].tolist())
    # calibrated FSQ: codes spread over the codebook, every digit takes all three values
    assert len(set(codes)) > 0.5 * len(codes)
    digits = np.array([[(c // 3**k) % 3 for k in range(8)] for c in codes])
    assert all(len(np.unique(digits[:, k])) == 3 for k in range(8))


def test_batch_does_not_change_a_prompt(standins):
    """A prompt alone and padded among longer and shorter ones: identical tokens and mel, and an
    embedding within 4e-6 of its largest magnitude (the masks make padding invisible), through
    Frontend.features. CAM++'s GEMMs block a batch differently from one prompt: measured on an
    AMD EPYC over 1-4 threads and SSE4.2 / AVX2 / default kernels, <= 1.27e-6 of the largest
    magnitude (1.0e-5 absolute for |embedding| <= 7.9 at AVX2 with 3 threads, which failed an
    absolute 1e-5); 0.1 s of silence that leaked past the mask moves it by >= 0.17."""
    fe = Frontend(standins, ModelConfig(), backend="torch", device="cpu", cache_size=0)
    loaded = [fe.load_waveform(_wav16(s, 70 + i), 16000, f"w{i}") for i, s in enumerate(SECONDS)]
    together = fe.features(loaded)
    for p, f in zip(loaded, together):
        alone = fe.features([p])[0]
        assert torch.equal(alone.speech_tokens, f.speech_tokens)
        assert (alone.embedding - f.embedding).abs().max() <= 4e-6 * f.embedding.abs().max()
        assert alone.mel.shape == f.mel.shape and (alone.mel - f.mel).abs().max() <= 1e-5
    # the ONNX tokenizer honours feats_length the same way (official length handling)
    st = _session(standins / "speech_tokenizer_v3.onnx")
    x, n = pad_rows([p.wav16 for p in loaded])
    feats, frames = whisper_log_mel_batch(x, n)
    batch = st.run(None, {"feats": feats.numpy(), "feats_length": frames.numpy().astype(np.int32)})[0]
    for i in range(len(loaded)):
        t = int(frames[i])
        alone = st.run(None, {"feats": feats[i : i + 1, :, :t].numpy(), "feats_length": np.array([t], np.int32)})[0]
        assert np.array_equal(batch[i, : alone.shape[1]], alone[0])


def test_fast_campplus_and_bucketing_change_nothing(standins):
    """The GEMM formulation of CAM++ equals the module-structured one on a padded batch, and
    length buckets (padding the models mask) or a device-side fbank leave the results alone."""
    from cosybatch.models.campplus_fast import CAMPPlusFast

    cam = load_campplus(standins / "campplus.onnx")
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([317, 250, 120, 45])
    x = torch.randn(4, 317, 80, generator=g) * (torch.arange(317)[None, :, None] < lengths[:, None, None])
    with torch.no_grad():
        assert (CAMPPlusFast(cam)(x, lengths) - cam(x, lengths)).abs().max() <= 1e-5
    outs = {}
    for name, kw in {"exact": {"bucket_s": 0}, "buckets": {"bucket_s": 0.5}, "device_fbank": {"fbank": "device"}}.items():
        fe = Frontend(standins, ModelConfig(), backend="torch", device="cpu", cache_size=0, **kw)
        loaded = [fe.load_waveform(_wav16(s, 90 + i), 16000, f"w{i}") for i, s in enumerate(SECONDS)]
        outs[name] = fe.features(loaded)
    for a, b, c in zip(outs["exact"], outs["buckets"], outs["device_fbank"]):
        assert torch.equal(a.speech_tokens, b.speech_tokens) and torch.equal(a.speech_tokens, c.speech_tokens)
        assert (a.embedding - b.embedding).abs().max() <= 1e-5 and (a.mel - b.mel).abs().max() <= 1e-5
        assert (a.embedding - c.embedding).abs().max() <= 1e-3  # float64 fbank vs the reference's float32


def test_fast_campplus_dense_layers_fuse_their_relus_and_averages(standins):
    """Each dense layer's two 1x1 convs that a ReLU follows (and the last transit) are one GEMM
    with the bias and ReLU in its epilogue, and the gate's segment + global mean one averaging
    GEMM: the GPU frontend's launches are bound by their kernel count (a graphed launch of 1-4
    prompts, an eager one of 64), so a layer's kernels are what it costs."""
    import sys
    from pathlib import Path

    from cosybatch.models.campplus_fast import CAMPPlusFast

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        from kernel_census import launches
    finally:
        sys.path.pop(0)
    cam = load_campplus(standins / "campplus.onnx")
    fast = CAMPPlusFast(cam)
    x, lengths = torch.randn(2, 250, 80), torch.tensor([250, 180])
    with torch.inference_mode():  # as the frontend runs it (composite ops stay whole: linear, matmul)
        fast(x, lengths)  # the BatchNorm folds are made once, then cached
        ops = launches(lambda: fast(x, lengths))
    layers = sum(cam.cfg.block_layers)
    assert ops.count("_addmm_activation") == 2 * layers + 1  # and the last transit with out_nonlinear's ReLU
    assert not any(a == "linear" and b in ("relu", "relu_") for a, b in zip(ops, ops[1:]))
    assert ops.count("matmul") == layers + 2  # a gate's averages per layer; the pooling's mean and std


def test_row_buckets_change_nothing(standins):
    """``row_bucket``: a launch of 3 prompts padded to 8 rows with copies of the last (their
    results dropped) gives each prompt what the exact 3-row launch gives."""
    outs = {}
    for rb in (1, 8):
        fe = Frontend(standins, ModelConfig(), backend="torch", device="cpu", cache_size=0, row_bucket=rb)
        impl, rows = fe._impl, []
        run = impl._features
        impl._features = lambda x16, *a: rows.append(x16.shape[0]) or run(x16, *a)
        loaded = [fe.load_waveform(_wav16(s, 130 + i), 16000, f"w{i}") for i, s in enumerate(SECONDS[:3])]
        outs[rb] = fe.raw_features(loaded)
        assert rows == [3 if rb == 1 else 8]  # the batch the models ran
    assert len(outs[8]) == 3
    for a, b in zip(outs[1], outs[8]):
        assert torch.equal(a.tokens, b.tokens)
        assert (a.embedding - b.embedding).abs().max() <= 1e-5
        assert a.mel.shape == b.mel.shape and (a.mel - b.mel).abs().max() <= 1e-5


def test_batch_length_buckets_change_nothing_and_leave_small_chunks_alone(standins):
    """``batch_bucket_s``: a chunk of more than ``SMALL_ROWS`` prompts is padded to a multiple of
    that many seconds, graphed or not (the models mask the padding: each prompt gets what the
    0.5 s buckets give it); a chunk of at most that many keeps ``bucket_s``, the warm-up's
    shapes (on the CPU the graph cache runs its function eagerly, as in the test below)."""
    from cosybatch.frontend.torch_backend import SMALL_ROWS
    from cosybatch.gpu.graph_cache import GraphCache

    assert len(SECONDS) == SMALL_ROWS + 1
    outs, widths = {}, {}
    for bb, graph_rows in ((None, 4), (2.0, 4), (2.0, 8)):
        fe = Frontend(standins, ModelConfig(), backend="torch", device="cpu", cache_size=0, batch_bucket_s=bb)
        impl, seen = fe._impl, []
        impl.graph_rows = graph_rows
        impl.graphs = GraphCache(lambda *t, impl=impl: impl._features(*t, True, True), enabled=False)
        run = impl._features
        impl._features = lambda x16, *a, seen=seen, run=run: seen.append(x16.shape[:2]) or run(x16, *a)
        loaded = [fe.load_waveform(_wav16(s, 150 + i), 16000, f"w{i}") for i, s in enumerate(SECONDS)]
        outs[bb, graph_rows] = fe.raw_features(loaded)  # five prompts: eager with 4 graph rows, graphed with 8
        fe.raw_features(loaded[:2])  # two: graphed
        widths[bb, graph_rows] = [tuple(w) for w in seen]

    def width(seconds, bucket):
        return int(math.ceil(seconds / bucket) * bucket * 16000)

    small = (2, width(max(SECONDS[:2]), 0.5))
    assert widths[None, 4] == [(5, width(max(SECONDS), 0.5)), small]
    assert widths[2.0, 4] == [(5, width(max(SECONDS), 2.0)), small]
    assert widths[2.0, 8] == [(8, width(max(SECONDS), 2.0)), small]  # graphed: rows to a power of two
    for key in ((2.0, 4), (2.0, 8)):
        for a, b in zip(outs[None, 4], outs[key]):
            assert torch.equal(a.tokens, b.tokens)
            assert (a.embedding - b.embedding).abs().max() <= 1e-5
            assert a.mel.shape == b.mel.shape and (a.mel - b.mel).abs().max() <= 1e-5


def test_prime_is_one_eager_launch_and_a_no_op_off_cuda(standins):
    """``frontend.prime``: ``TorchBackend.prime`` runs one chunk of one prompt more than a graph
    takes, so it goes the eager way (a process's one-time set-up is what it pays for, not a
    graph); ``Frontend.prime`` does that on CUDA only."""
    from cosybatch.gpu.graph_cache import GraphCache

    fe = Frontend(standins, ModelConfig(), backend="torch", device="cpu", cache_size=0)
    impl, rows = fe._impl, []
    impl.graph_rows = 4
    impl.graphs = GraphCache(lambda *t: impl._features(*t, True, True), enabled=False)
    run = impl._features
    impl._features = lambda x16, *a: rows.append(x16.shape[0]) or run(x16, *a)
    impl.prime()
    assert rows == [5] and impl.graphs.stats.calls == 0
    impl.prime = lambda: rows.append("primed")
    fe.prime()  # a CPU frontend: nothing to set up
    assert rows == [5]


def test_the_graphed_path_equals_the_exact_path(standins):
    """Chunks of at most ``graph_rows`` prompts run the models' masked path (what a CUDA graph
    captures, whether or not a row is padded) and come back packed in one tensor: the same
    tokens, embeddings and mels as the exact path, prompt by prompt. On the CPU the cache runs
    that function eagerly; GPU tests replay it from graphs. A chunk of 3 is padded to 4 rows."""
    from cosybatch.gpu.graph_cache import GraphCache

    fe = Frontend(standins, ModelConfig(), backend="torch", device="cpu", cache_size=0)
    loaded = [fe.load_waveform(_wav16(s, 110 + i), 16000, f"w{i}") for i, s in enumerate(SECONDS)]
    exact = [fe.raw_features([p])[0] for p in loaded]
    impl = fe._impl
    impl.graph_rows = 4
    impl.graphs = GraphCache(lambda *t: impl._features(*t, True, True), enabled=False)
    masked = [fe.raw_features([p])[0] for p in loaded]
    assert impl.graphs.stats.calls == len(loaded)
    three = fe.raw_features(loaded[:3])  # padded to 4 rows with a copy of the last prompt
    assert impl.graphs.stats.calls == len(loaded) + 1 and len(three) == 3
    for a, b in zip(exact + exact[:3], masked + three):
        assert torch.equal(a.tokens, b.tokens)
        assert (a.embedding - b.embedding).abs().max() <= 1e-5
        assert a.mel.shape == b.mel.shape and (a.mel - b.mel).abs().max() <= 1e-5


def test_torch_frontend_equals_reference_frontend(standins, wavs):
    """Frontend(backend='torch') on the CPU and the onnxruntime reference give the same
    PromptFeatures for files at 16 and 24 kHz (batched vs one by one)."""
    ref = Frontend(standins, ModelConfig(), backend="onnxruntime")
    fast = Frontend(standins, ModelConfig(), backend="torch", device="cpu")
    got = fast.features([fast.load(p) for p in wavs])
    for p, f in zip(wavs, got):
        r = ref.prompt(p)
        assert torch.equal(r.speech_tokens, f.speech_tokens)
        assert (r.embedding - f.embedding).abs().max() <= 1e-5
        assert (r.mel - f.mel).abs().max() <= 1e-4


def test_loader_refuses_contract_only_files(model_dir, caplog):
    """The fixtures' stand-ins have the I/O contract but not the structure: the loader says
    what is missing, "auto" logs one line and falls back to onnxruntime, "torch" raises."""
    with pytest.raises(FrontendModelError, match=r"not the S3TokenizerV3 structure \(no node '/conv1/Conv'\)"):
        load_s3tokenizer(model_dir / "speech_tokenizer_v3.onnx")
    with pytest.raises(FrontendModelError, match="not the CAM\\+\\+ structure"):
        load_campplus(model_dir / "campplus.onnx")
    with caplog.at_level(logging.INFO, logger="cosybatch.frontend.frontend"):
        fe = Frontend(model_dir, ModelConfig(), device="cuda")  # loader runs before CUDA is needed
    assert fe.backend == "onnxruntime" and "/conv1/Conv" in fe.backend_reason
    lines = [r for r in caplog.records if r.name == "cosybatch.frontend.frontend"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and "onnxruntime" in lines[0].getMessage()
    with pytest.raises(FrontendModelError):
        Frontend(model_dir, ModelConfig(), backend="torch", device="cpu")
    assert Frontend(model_dir, ModelConfig()).backend == "onnxruntime"  # CPU default


def test_cache_hits_a_copied_file(standins, wavs, tmp_path):
    fe = Frontend(standins, ModelConfig(), backend="torch", device="cpu")
    a = fe.prompt(wavs[1])
    copy = tmp_path / "elsewhere" / "same_audio.wav"
    copy.parent.mkdir()
    shutil.copy(wavs[1], copy)
    loaded = fe.load(copy)
    assert loaded.cached is not None and loaded.wav16 is None  # no decoding at all
    b = fe.features([loaded])[0]
    assert fe.cache_stats()["hits"] == 1 and fe.cache_stats()["misses"] == 1
    assert torch.equal(a.speech_tokens, b.speech_tokens) and torch.equal(a.mel, b.mel)
    b.mel.zero_()  # a caller's copy
    assert not torch.equal(fe.prompt(copy).mel, b.mel)
    # same path, new content -> new key
    sf.write(copy, speech_like(2.5, 16000, 99).astype(np.float32), 16000)
    assert fe.load(copy).cached is None


def test_features_keeps_order_and_dedupes(standins, wavs):
    fe = Frontend(standins, ModelConfig(), backend="torch", device="cpu")
    first = fe.prompt(wavs[0])
    loaded = [fe.load(p) for p in (wavs[2], wavs[0], wavs[2], wavs[3])]
    assert loaded[1].cached is not None and loaded[0].cached is None
    out = fe.features(loaded)
    assert torch.equal(out[1].speech_tokens, first.speech_tokens)
    assert torch.equal(out[0].mel, out[2].mel) and out[0].mel is not out[2].mel
    assert fe.cache_stats()["entries"] == 3


def test_memory_cache_is_bounded_by_bytes(standins, wavs):
    fe = Frontend(standins, ModelConfig(), backend="torch", device="cpu", cache_bytes=150_000)
    for p in wavs:
        fe.prompt(p)
    s = fe.cache_stats()
    assert s["evictions"] > 0 and s["entries"] < len(wavs)


def test_disk_cache_round_trip_and_torn_files(standins, wavs, tmp_path):
    disk = tmp_path / "prompt_cache"
    a = Frontend(standins, ModelConfig(), backend="torch", device="cpu", disk_cache=disk)
    want = a.prompt(wavs[0])
    a.close()
    entries = list(disk.rglob("*.safetensors"))
    assert len(entries) == 1
    # a resumed run: a fresh frontend reads it back without computing
    b = Frontend(standins, ModelConfig(), backend="torch", device="cpu", disk_cache=disk)
    got = b.features([b.load(wavs[0])])[0]
    assert b.cache_stats()["disk_hits"] == 1 and b.cache_stats()["misses"] == 0
    assert torch.equal(got.speech_tokens, want.speech_tokens) and torch.equal(got.mel, want.mel)
    assert torch.equal(got.embedding, want.embedding)
    # a crash mid-write leaves a temp file (never read); a damaged entry is a miss, rewritten
    (entries[0].parent / f".{entries[0].name}.123.456.tmp").write_bytes(b"\x00" * 10)
    entries[0].write_bytes(entries[0].read_bytes()[:100])
    c = Frontend(standins, ModelConfig(), backend="torch", device="cpu", disk_cache=disk)
    again = c.prompt(wavs[0])
    c.close()
    assert c.cache_stats()["misses"] == 1 and torch.equal(again.speech_tokens, want.speech_tokens)
    d = Frontend(standins, ModelConfig(), backend="torch", device="cpu", disk_cache=disk)
    assert d.load(wavs[0]).cached is not None and d.cache_stats()["disk_hits"] == 1


def test_disk_cache_is_keyed_by_the_models(standins, wavs, tmp_path):
    disk = tmp_path / "shared_cache"
    a = Frontend(standins, ModelConfig(), backend="torch", device="cpu", disk_cache=disk)
    a.prompt(wavs[0])
    a.close()
    other = tmp_path / "other_models"
    write_onnx_standins(other, seed=5, size="tiny")
    b = Frontend(other, ModelConfig(), backend="torch", device="cpu", disk_cache=disk)
    assert b.load(wavs[0]).cached is None  # another checkpoint: another namespace
    r = Frontend(standins, ModelConfig(), backend="onnxruntime", disk_cache=disk)
    assert r.load(wavs[0]).cached is None  # the reference backend keeps its own entries


def test_rejects_bad_prompts_in_load(standins, tmp_path):
    from cosybatch.audio import AudioError

    fe = Frontend(standins, ModelConfig(), backend="torch", device="cpu")
    p8 = tmp_path / "p8k.wav"
    sf.write(p8, np.zeros(8000, np.float32), 8000)
    with pytest.raises(AudioError, match="below"):
        fe.load(p8)
    with pytest.raises(AudioError, match="30"):
        fe.load_waveform(torch.zeros(16000 * 31), 16000)
    with pytest.raises(AudioError, match="too short"):
        fe.load_waveform(torch.zeros(300), 16000)
    with pytest.raises(AudioError, match="not found"):
        fe.load(tmp_path / "missing.wav")


def test_prompt_cache_close_stops_its_writer_and_later_entries_still_land(tmp_path):
    import torch

    from cosybatch.frontend.cache import PromptCache
    from cosybatch.prompt import PromptFeatures

    cache = PromptCache(disk_dir=tmp_path, namespace="t")
    f = PromptFeatures(torch.arange(4), torch.zeros(1, 192), torch.zeros(1, 8, 80))
    cache.put("a" * 64, f)
    cache.close()
    assert not cache._thread.is_alive()
    cache.put("b" * 64, f)  # after close: written on the caller's thread
    again = PromptCache(disk_dir=tmp_path, namespace="t", max_entries=0)
    assert again.get("a" * 64) is not None and again.get("b" * 64) is not None
    again.close()
