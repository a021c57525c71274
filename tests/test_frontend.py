"""cosybatch.frontend.frontend.Frontend against the official frontend_zero_shot outputs in the fixtures."""

import numpy as np
import pytest
import soundfile as sf
import torch

from conftest import ROWS, load_ref
from parity import PROMPT_MEL_TOL, assert_log_spectrum_close
from cosybatch.audio import AudioError, load_audio, resample, to_mono
from cosybatch.models.config import MelConfig, ModelConfig
from cosybatch.frontend.frontend import Frontend, PromptFeatures

pytestmark = pytest.mark.numeric

PROMPT_OF = {"utt1": "p1_16k", "utt2": "p2_24k", "utt3": "p3_16k", "utt4": "p4_24k", "utt5_paragraph": "p5_16k"}


@pytest.fixture(scope="module")
def frontend(model_dir):
    return Frontend(model_dir, ModelConfig(), tokenizer=None)


def _wav(fixtures_dir, utt):
    return fixtures_dir / "prompts" / f"{PROMPT_OF[utt]}.wav"


@pytest.mark.parametrize("utt", ROWS)
def test_prompt_matches_official(frontend, fixtures_dir, reference_dir, utt):
    ref = load_ref(reference_dir, utt)
    feats = frontend.prompt(_wav(fixtures_dir, utt))
    assert isinstance(feats, PromptFeatures)

    wav, sr = load_audio(_wav(fixtures_dir, utt))
    raw = frontend.speech_tokens(resample(to_mono(wav), sr, 16000))
    assert torch.equal(raw, ref["frontend.speech_token_raw"][0].long())

    assert feats.speech_tokens.dtype == torch.long
    assert torch.equal(feats.speech_tokens, ref["frontend.prompt_speech_token"][0].long())
    assert feats.embedding.shape == (1, 192) and feats.embedding.dtype == torch.float32
    # CAM++ (|values| ~5) moves with its fbank input and onnxruntime's kernels: measured <= 3.9e-6
    # over ISAs and threads (8e-7 from the fixture's own fbank); a pre-emphasis of 0.96 or a
    # kaldi low_freq of 21 Hz moves it >= 6e-3, fbank noise of 1e-3 by 7.5e-5.
    assert (feats.embedding - ref["frontend.embedding"]).abs().max() <= 3e-5
    assert_log_spectrum_close(feats.mel, ref["frontend.prompt_speech_feat"], utt, PROMPT_MEL_TOL, bin_dim=2)
    assert feats.mel.shape[1] == 2 * feats.speech_tokens.shape[0]


def test_alignment_cut_uses_the_shorter_side(frontend, fixtures_dir, reference_dir):
    # utt2: 66 raw tokens but only 131 mel frames -> 65 tokens / 130 frames.
    ref = load_ref(reference_dir, "utt2")
    assert ref["frontend.speech_token_raw"].shape[1] == 66
    feats = frontend.prompt(_wav(fixtures_dir, "utt2"))
    assert feats.speech_tokens.shape[0] == 65 and feats.mel.shape[1] == 130


def test_prompt_cache(model_dir, fixtures_dir):
    fe = Frontend(model_dir, ModelConfig(), cache_size=1)
    a = fe.prompt(_wav(fixtures_dir, "utt1"))
    a.speech_tokens.zero_()  # callers get copies: mutating one must not poison the cache
    b = fe.prompt(str(_wav(fixtures_dir, "utt1")))
    assert (fe.cache_stats()["misses"], fe.cache_stats()["hits"]) == (1, 1)
    assert torch.equal(b.speech_tokens, fe.extract(_wav(fixtures_dir, "utt1")).speech_tokens)
    fe.prompt(_wav(fixtures_dir, "utt3"))  # evicts utt1 (size 1)
    fe.prompt(_wav(fixtures_dir, "utt1"))
    assert fe.cache_stats()["misses"] == 3  # 2 first misses + re-miss after eviction


def test_stereo_prompt_is_channel_mean(frontend, fixtures_dir, tmp_path):
    data, sr = sf.read(_wav(fixtures_dir, "utt1"), dtype="int16")
    p = tmp_path / "stereo.wav"
    sf.write(p, np.stack([data, data], 1), sr, subtype="PCM_16")
    a = frontend.prompt(p)
    b = frontend.prompt(_wav(fixtures_dir, "utt1"))
    assert torch.equal(a.speech_tokens, b.speech_tokens)
    assert torch.equal(a.mel, b.mel)


def test_48k_prompt_resamples_both_ways(frontend, fixtures_dir, tmp_path):
    data, sr = sf.read(_wav(fixtures_dir, "utt2"), dtype="float32")
    x48 = resample(torch.from_numpy(data)[None], sr, 48000)[0].numpy()
    p = tmp_path / "p48.wav"
    sf.write(p, x48, 48000, subtype="FLOAT")
    feats = frontend.prompt(p)
    ref = frontend.prompt(_wav(fixtures_dir, "utt2"))
    assert feats.mel.shape[1] == 2 * feats.speech_tokens.shape[0]
    assert abs(feats.speech_tokens.shape[0] - ref.speech_tokens.shape[0]) <= 1
    n = min(feats.mel.shape[1], ref.mel.shape[1]) - 2
    assert (feats.mel[:, 2:n] - ref.mel[:, 2:n]).abs().mean() < 0.2


def test_rejects_low_rate_long_and_short(frontend, tmp_path):
    p8 = tmp_path / "p8k.wav"
    sf.write(p8, np.random.default_rng(0).uniform(-0.1, 0.1, 8000).astype(np.float32), 8000)
    with pytest.raises(AudioError, match="below"):
        frontend.prompt(p8)
    plong = tmp_path / "long.wav"
    sf.write(plong, np.zeros(16000 * 31, dtype=np.float32), 16000)
    with pytest.raises(AudioError, match="30"):
        frontend.prompt(plong)
    pshort = tmp_path / "short.wav"
    sf.write(pshort, np.zeros(200, dtype=np.float32), 16000)
    with pytest.raises(AudioError):
        frontend.prompt(pshort)
    with pytest.raises(AudioError):
        frontend.prompt(tmp_path / "missing.wav")


def test_prompt_audio_read_in_helper_processes_is_the_same(model_dir, fixtures_dir, tmp_path):
    """``frontend.audio=process``: each prompt's audio is read, resampled and fbanked in a helper
    process, with the same bits as in this process (16 and 24 kHz prompts), and a bad file is
    refused with the same message (the call runs here again when the helper fails it)."""
    from cosybatch.frontend.prompt_audio import warm_helper
    from cosybatch.helper_process import HelperPool

    here = Frontend(model_dir, ModelConfig(), cache_size=1, cache_bytes=1)
    there = Frontend(model_dir, ModelConfig(), cache_size=1, cache_bytes=1)
    there.audio_helpers = pool = HelperPool("prompt audio", 2, warm=(warm_helper, torch.get_num_threads()))
    try:
        for utt in ("utt1", "utt2", "utt5_paragraph"):
            a, b = here.load(_wav(fixtures_dir, utt)), there.load(_wav(fixtures_dir, utt))
            assert a.key == b.key
            for name in ("wav16", "wav_mel", "fbank"):
                assert torch.equal(getattr(a, name), getattr(b, name)), (utt, name)
        assert pool.fallbacks == 0 and pool.alive
        p8 = tmp_path / "p8k.wav"
        sf.write(p8, np.zeros(8000, dtype=np.float32), 8000)
        with pytest.raises(AudioError, match=f"{p8}: sample rate 8000 Hz is below"):
            there.load(p8)
        assert pool.fallbacks == 1  # the helper refused it, the call ran here and raised the same
    finally:
        there.close()
    assert there.audio_helpers is None and not pool.alive


def test_other_mel_config(model_dir, fixtures_dir):
    # Everything about the prompt mel comes from the config (rate, sizes, bins, ratio).
    mel = MelConfig(n_fft=1024, num_mels=64, sampling_rate=22050, hop_size=256, win_size=1024, fmax=8000.0)
    cfg = ModelConfig(mel=mel, sample_rate=22050)
    fe = Frontend(model_dir, cfg)
    feats = fe.prompt(_wav(fixtures_dir, "utt1"))
    wav, sr = load_audio(_wav(fixtures_dir, "utt1"))
    frames = resample(wav, sr, 22050).shape[1] // 256
    raw = fe.speech_tokens(resample(wav, sr, 16000)).shape[0]
    n = min(frames // cfg.flow.token_mel_ratio, raw)
    assert feats.mel.shape == (1, 2 * n, 64)
    assert feats.speech_tokens.shape == (n,)


@pytest.mark.parametrize("utt", ROWS)
def test_prepare_matches_official(model_dir, reference_dir, fixtures_dir, utt):
    pytest.importorskip("cosybatch.text.tokenizer", reason="H1's tokenizer not written yet")
    pytest.importorskip("cosybatch.text.normalize", reason="H1's normalizer not written yet")
    import json

    from cosybatch.text.tokenizer import CosyVoice3Tokenizer

    meta = json.loads((reference_dir / f"{utt}.json").read_text())
    ref = load_ref(reference_dir, utt)
    # the fixtures were made with no text normaliser installed
    fe = Frontend(model_dir, ModelConfig(), CosyVoice3Tokenizer.from_dir(model_dir / "CosyVoice-BlankEN"),
                  text_normalizer="none")
    out = fe.prepare(meta["prompt_text_raw"], meta["target_text"])
    assert out.prompt_text_ids.dtype == torch.long
    assert torch.equal(out.prompt_text_ids, ref["frontend.prompt_text_token"][0].long())
    n_seg = len([k for k in ref if k.startswith("seg") and k.endswith(".text_token")])
    assert len(out.segments) == n_seg == len(out.segment_texts)
    for s, ids in enumerate(out.segments):
        assert torch.equal(ids, ref[f"seg{s}.text_token"][0].long())


def test_a_prompt_in_flight_is_not_computed_twice(model_dir, fixtures_dir):
    """Bulk runs repeat prompts: a launch whose prompt an earlier launch still computes takes it
    from that launch (read in either order), and computes it alone if that launch fails."""
    fe = Frontend(model_dir, ModelConfig(), cache_size=8)
    computed = []
    real = fe._compute
    fe._compute = lambda prompts: computed.extend(p.source for p in prompts) or real(prompts)
    p1, p2, p3 = (fe.load(_wav(fixtures_dir, u)) for u in ("utt1", "utt2", "utt3"))
    a = fe.launch_features([p1, p2])
    b = fe.launch_features([p2, p3, p2])
    assert computed == [p1.source, p2.source, p3.source]  # p2 once
    got_b = b.result()  # before a: b reads a's results itself
    got_a = a.result()
    assert torch.equal(got_b[0].speech_tokens, got_a[1].speech_tokens)
    assert torch.equal(got_b[2].embedding, got_a[1].embedding)
    assert not fe._inflight
    assert fe.launch_features([fe.load(_wav(fixtures_dir, "utt2"))]).result()[0].speech_tokens.equal(got_a[1].speech_tokens)
    assert len(computed) == 3  # the cache serves it now

    fe2 = Frontend(model_dir, ModelConfig(), cache_size=8)
    q1, q2 = fe2.load(_wav(fixtures_dir, "utt1")), fe2.load(_wav(fixtures_dir, "utt2"))
    a = fe2.launch_features([q1])
    b = fe2.launch_features([q1, q2])

    def broken():
        raise RuntimeError("device fault")
    a._raws.result = broken
    with pytest.raises(RuntimeError, match="device fault"):
        a.result()
    assert list(fe2._inflight) == [q2.key]  # a's q1 is released; b still computes q2
    got = b.result()  # q1 computed here, alone
    assert torch.equal(got[0].speech_tokens, fe.prompt(_wav(fixtures_dir, "utt1")).speech_tokens)
    assert not fe2._inflight


def test_launches_on_worker_threads_compute_side_by_side(model_dir, fixtures_dir):
    """The CPU frontend runs on worker threads: one launch computing a prompt must not hold up
    another launch's different prompt, and a launch of the same prompt waits for that one
    instead of computing it again."""
    import threading

    fe = Frontend(model_dir, ModelConfig(), cache_size=8)
    p1, p2 = fe.load(_wav(fixtures_dir, "utt1")), fe.load(_wav(fixtures_dir, "utt2"))
    real, release, computed = fe._compute, threading.Event(), []

    def compute(prompts):
        computed.extend(p.source for p in prompts)
        if prompts[0].key == p1.key:
            assert release.wait(30), "p1's compute was never released"
        return real(prompts)

    fe._compute = compute
    out = {}
    t1 = threading.Thread(target=lambda: out.__setitem__("a", fe.features([p1])[0]))
    t1.start()
    for _ in range(3000):  # until t1's launch has registered p1 (at most 30 s)
        if p1.key in fe._inflight:
            break
        threading.Event().wait(0.01)
    assert p1.key in fe._inflight
    t2 = threading.Thread(target=lambda: out.__setitem__("b", fe.features([p2])[0]))
    t3 = threading.Thread(target=lambda: out.__setitem__("c", fe.features([p1])[0]))
    t2.start()
    t2.join(30)
    assert not t2.is_alive() and "b" in out  # p2 computed while p1's compute is still blocked
    t3.start()
    release.set()
    t1.join(30)
    t3.join(30)
    assert computed == [p1.source, p2.source]  # p1 once, although two launches asked for it
    assert torch.equal(out["a"].speech_tokens, out["c"].speech_tokens)
