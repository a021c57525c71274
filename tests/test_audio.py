"""cosybatch.audio against the official (torchaudio / whisper / matcha) features in the fixtures.

The log spectra are compared with tests/parity.py's per-bin bound (tight at a frame's peak,
growing as a bin falls below it), not one max-abs: MKL picks its FFT kernels by CPU, the
fixtures match its SSE4.2 kernels bit for bit, and float32 FFT rounding is absolute, so the
AVX2 / AVX-512 kernels move the quietest bins by up to 2e-3 nats (the fixture itself is ~1e-3
from a float64 computation). Configurations A-H as in test_reference_e2e.py (A default,
B MKL + oneDNN AVX2, C ATen AVX2, D 1 thread, E 3 threads, F = B + C + 3 threads, G = B + C +
4 threads, H MKL SSE4.2); "ratio" = worst |diff| / allowed, must stay <= 1.

| quantity                         | A      | B      | C      | D      | E      | F      | G      | H      | bound   |
|----------------------------------|--------|--------|--------|--------|--------|--------|--------|--------|---------|
| whisper log-mel, max (units)     | 5.3e-5 | 3.4e-5 | 5.3e-5 | 5.3e-5 | 5.3e-5 | 3.4e-5 | 3.4e-5 | 1.2e-7 | (1e-5)  |
| whisper log-mel, ratio           | 0.055  | 0.055  | 0.055  | 0.055  | 0.055  | 0.055  | 0.055  | 0.048  | 1       |
| kaldi fbank, max (nats)          | 9.6e-4 | 9.2e-4 | 9.6e-4 | 9.6e-4 | 9.6e-4 | 9.2e-4 | 9.2e-4 | 1.9e-6 | (1e-4)  |
| kaldi fbank, ratio               | 0.067  | 0.067  | 0.067  | 0.067  | 0.067  | 0.067  | 0.067  | 0.0095 | 1       |
| prompt mel, max (nats)           | 1.8e-3 | 1.2e-3 | 1.8e-3 | 1.8e-3 | 1.8e-3 | 1.2e-3 | 1.2e-3 | 9.5e-7 | (1e-4)  |
| prompt mel, ratio                | 0.032  | 0.038  | 0.032  | 0.032  | 0.032  | 0.038  | 0.038  | 0.032  | 1       |
| resampled prompt, max            | 0      | 0      | 0      | 0      | 0      | 0      | 0      | 0      | 1e-6    |

(In parentheses: the old max-abs bound.) At frame peaks (bins within 1 nat of it) the spread is
1.1e-6 / 1.3e-5 / 4.8e-7 nats (whisper / kaldi / prompt mel) everywhere but H. Wrong
implementations, ratio: prompt mel without the 1e-9 under the sqrt 62, with 1e-8 417, symmetric
Hann 557, zero padding 2.5e4, clamp 1e-6 9e4, fmax 11 kHz 8.5e4; whisper symmetric Hann 5.9e3,
floor max - 7.9 1.2e4; kaldi pre-emphasis 0.96 2e3, low_freq 21 Hz 1.5e3, Hamming 1.4e4,
no DC removal 1.2e4 (tests/test_parity.py keeps some of them as tests).
"""

import math

import numpy as np
import pytest
import soundfile as sf
import torch

from conftest import ROWS, load_ref
from parity import KALDI_FBANK_TOL, PROMPT_MEL_TOL, WHISPER_LOGMEL_TOL, assert_log_spectrum_close
from cosybatch.audio import (
    AudioError,
    kaldi_fbank,
    kaldi_mel_banks,
    load_audio,
    prompt_mel,
    resample,
    slaney_mel_filterbank,
    to_mono,
    whisper_log_mel,
)
from cosybatch.audio.mel import hz_to_mel_slaney, mel_to_hz_slaney
from cosybatch.models.config import MelConfig

pytestmark = pytest.mark.numeric

PROMPT_OF = {"utt1": "p1_16k", "utt2": "p2_24k", "utt3": "p3_16k", "utt4": "p4_24k", "utt5_paragraph": "p5_16k"}


@pytest.fixture(scope="module")
def prompts(fixtures_dir, reference_dir):
    out = {}
    for utt in ROWS:
        wav, sr = load_audio(fixtures_dir / "prompts" / f"{PROMPT_OF[utt]}.wav")
        wav = to_mono(wav)
        out[utt] = dict(
            ref=load_ref(reference_dir, utt),
            sr=sr,
            wav16=resample(wav, sr, 16000),
            wav24=resample(wav, sr, 24000),
        )
    return out


@pytest.mark.parametrize("utt", ROWS)
def test_resample_matches_torchaudio(prompts, utt):
    p = prompts[utt]
    ref = p["ref"]
    key = "wav24k" if p["sr"] == 16000 else "wav16k"
    got = p["wav24"] if key == "wav24k" else p["wav16"]
    assert got.shape[1] == int(ref[f"frontend.{key}_len"])
    h = ref[f"frontend.{key}_head"].shape[1]
    assert (got[:, :h] - ref[f"frontend.{key}_head"]).abs().max() <= 1e-6
    assert (got[:, -h:] - ref[f"frontend.{key}_tail"]).abs().max() <= 1e-6


@pytest.mark.parametrize("utt", ROWS)
def test_whisper_log_mel(prompts, utt):
    ref = prompts[utt]["ref"]["frontend.whisper_logmel"]
    got = whisper_log_mel(prompts[utt]["wav16"], n_mels=128)
    assert_log_spectrum_close(got, ref, utt, WHISPER_LOGMEL_TOL, bin_dim=1)


@pytest.mark.parametrize("utt", ROWS)
def test_kaldi_fbank(prompts, utt):
    ref = prompts[utt]["ref"]["frontend.kaldi_fbank"][0]
    got = kaldi_fbank(prompts[utt]["wav16"], num_mel_bins=80, sample_rate=16000)
    assert got.mean(0).abs().max() < 1e-4  # time mean removed
    # Compare with the (same) mean added back to both, so a bin's level below its frame's peak
    # is the real one; the differences are unchanged.
    mean = kaldi_fbank(prompts[utt]["wav16"], num_mel_bins=80, sample_rate=16000, subtract_mean=False).mean(0)
    assert_log_spectrum_close(got + mean, ref + mean, utt, KALDI_FBANK_TOL, bin_dim=1)


@pytest.mark.parametrize("utt", ROWS)
def test_prompt_mel(prompts, utt):
    ref = prompts[utt]["ref"]["frontend.speech_feat_raw"]  # stored [1, F, 80]
    got = prompt_mel(prompts[utt]["wav24"], MelConfig())
    assert got.shape == (1, 80, ref.shape[1])
    assert_log_spectrum_close(got.transpose(1, 2), ref, utt, PROMPT_MEL_TOL, bin_dim=2)


def test_resample_identity_and_shapes():
    x = torch.randn(2, 3, 1000)
    assert resample(x, 16000, 16000) is x
    y = resample(x, 16000, 24000)
    assert y.shape == (2, 3, 1500)
    # batch rows are independent
    assert torch.allclose(y[1, 2], resample(x[1, 2], 16000, 24000), atol=1e-6)
    # torchaudio length rule: ceil(new * n / orig) after gcd reduction
    assert resample(torch.zeros(1, 44101), 44100, 16000).shape[1] == math.ceil(16000 * 44101 / 44100)
    assert resample(torch.zeros(1, 7), 24000, 16000).shape[1] == 5


@pytest.mark.parametrize("orig,new", [(16000, 24000), (24000, 16000), (44100, 16000), (48000, 24000)])
def test_resample_preserves_inband_sine(orig, new):
    f = 440.0
    n = orig // 2
    x = torch.sin(2 * math.pi * f * torch.arange(n, dtype=torch.float64) / orig).float()[None]
    y = resample(x, orig, new)[0]
    t = torch.arange(y.shape[0], dtype=torch.float64) / new
    want = torch.sin(2 * math.pi * f * t).float()
    m = y.shape[0] // 10  # edges see the zero padding
    assert (y[m:-m] - want[m:-m]).abs().max() < 2e-3


def test_resample_removes_out_of_band_tone():
    # 11 kHz is above the 8 kHz Nyquist of the target and must be filtered out.
    x = torch.sin(2 * math.pi * 11000 * torch.arange(24000) / 24000.0)[None]
    y = resample(x, 24000, 16000)[0]
    assert y[2000:-2000].abs().max() < 0.02


def test_slaney_scale():
    assert hz_to_mel_slaney(np.array(0.0)) == 0.0
    assert abs(hz_to_mel_slaney(np.array(1000.0)) - 15.0) < 1e-12
    hz = np.array([0.0, 300.0, 999.0, 1000.0, 4321.0, 12000.0])
    assert np.allclose(mel_to_hz_slaney(hz_to_mel_slaney(hz)), hz, rtol=1e-12, atol=1e-9)


def test_slaney_filterbank_shape_and_area():
    sr, n_fft, n_mels = 24000, 1920, 80
    w = slaney_mel_filterbank(sr, n_fft, n_mels)
    assert w.shape == (n_mels, n_fft // 2 + 1) and w.dtype == torch.float32
    assert (w >= 0).all()
    # Slaney norm makes every triangle integrate to 1 over Hz (exact for well-sampled ones).
    area = w.double().sum(1) * (sr / n_fft)
    assert (area[20:] - 1).abs().max() < 0.02
    # fmax restricts the support
    w2 = slaney_mel_filterbank(sr, n_fft, n_mels, fmin=100.0, fmax=8000.0)
    freqs = torch.arange(n_fft // 2 + 1) * sr / n_fft
    assert w2[:, freqs > 8000].abs().max() == 0 and w2[:, freqs < 100].abs().max() == 0


def test_kaldi_mel_banks():
    b = kaldi_mel_banks(80, 512, 16000.0)
    assert b.shape == (80, 257)
    assert b[:, -1].abs().max() == 0
    assert b.max() <= 1.0 and (b >= 0).all()
    peaks = b.argmax(1)
    assert (peaks[1:] >= peaks[:-1]).all()


def test_kaldi_fbank_short_input():
    assert kaldi_fbank(torch.zeros(1, 399)).shape == (0, 80)
    assert kaldi_fbank(torch.randn(1, 400)).shape == (1, 80)
    assert kaldi_fbank(torch.randn(1, 400 + 160 * 5 + 10)).shape == (6, 80)


def test_load_audio_int16_scale_and_channels(tmp_path):
    data = np.array([[16384, -32768], [0, 8192], [-16384, 32767]], dtype=np.int16)
    p = tmp_path / "st.wav"
    sf.write(p, data, 22050, subtype="PCM_16")
    wav, sr = load_audio(p)
    assert sr == 22050 and wav.shape == (2, 3) and wav.dtype == torch.float32
    assert wav[0, 0] == 0.5 and wav[1, 0] == -1.0
    mono = to_mono(wav)
    assert mono.shape == (1, 3)
    assert torch.allclose(mono[0], wav.mean(0))


def test_load_audio_errors(tmp_path):
    with pytest.raises(AudioError, match="not found"):
        load_audio(tmp_path / "missing.wav")
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"this is not audio at all" * 10)
    with pytest.raises(AudioError, match="cannot read"):
        load_audio(bad)
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros((0, 1), dtype=np.float32), 16000)
    with pytest.raises(AudioError, match="empty"):
        load_audio(empty)
