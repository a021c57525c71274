"""The three spectral front-ends of CosyVoice3 prompts.

* ``whisper_log_mel``: input of the v3 speech tokenizer (openai-whisper ``log_mel_spectrogram``).
* ``kaldi_fbank``: input of CAM++ (``torchaudio.compliance.kaldi.fbank`` defaults, dither 0).
* ``prompt_mel``: the flow's prompt mel (Matcha-TTS ``mel_spectrogram``).
Each follows its original's operation order in float32 so features match to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cosybatch.models.config import MelConfig
from cosybatch.audio.mel import kaldi_mel_banks, slaney_mel_filterbank

WHISPER_SAMPLE_RATE = 16000
WHISPER_N_FFT = 400
WHISPER_HOP = 160

_F32_EPS = torch.finfo(torch.float32).eps


def _as_batch(wav: torch.Tensor) -> torch.Tensor:
    if wav.dim() == 1:
        return wav[None]
    if wav.dim() != 2:
        raise ValueError(f"expected a waveform [n] or [1, n], got shape {tuple(wav.shape)}")
    return wav


def whisper_log_mel(
    wav16k: torch.Tensor,
    n_mels: int = 128,
    n_fft: int = WHISPER_N_FFT,
    hop: int = WHISPER_HOP,
    sample_rate: int = WHISPER_SAMPLE_RATE,
) -> torch.Tensor:
    """[B, n] 16 kHz -> [B, n_mels, n // hop] log-mel scaled like whisper.

    Whisper drops the last STFT frame and floors at (global max - 8) before the affine
    (x + 4) / 4; the floor uses the max over the whole tensor, so pass one prompt at a time
    when parity matters.
    """
    wav = _as_batch(wav16k).to(torch.float32)
    window = torch.hann_window(n_fft, device=wav.device)
    stft = torch.stft(wav, n_fft, hop, window=window, center=True, pad_mode="reflect", return_complex=True)
    power = stft[..., :-1].abs() ** 2
    filters = slaney_mel_filterbank(sample_rate, n_fft, n_mels).to(wav.device)
    mel = filters @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def _next_power_of_two(x: int) -> int:
    return 1 if x == 0 else 2 ** (x - 1).bit_length()


def kaldi_fbank(
    wav16k: torch.Tensor,
    num_mel_bins: int = 80,
    sample_rate: int = 16000,
    frame_length_ms: float = 25.0,
    frame_shift_ms: float = 10.0,
    preemphasis: float = 0.97,
    low_freq: float = 20.0,
    high_freq: float = 0.0,
    subtract_mean: bool = True,
) -> torch.Tensor:
    """[1, n] (first channel used) -> [T, num_mel_bins] log mel filterbank energies.

    Kaldi defaults: snip_edges, DC removal per frame, pre-emphasis with the first sample
    replicated, Povey window, zero-pad to a power of two, power spectrum, log floored at
    float32 eps. ``subtract_mean`` removes the per-bin time mean as the CosyVoice frontend
    does before CAM++. Returns [0, num_mel_bins] when the input is shorter than one frame.
    """
    wav = _as_batch(wav16k)[0].to(torch.float32)
    shift = int(sample_rate * frame_shift_ms * 0.001)
    size = int(sample_rate * frame_length_ms * 0.001)
    padded = _next_power_of_two(size)
    n = wav.shape[0]
    if n < size:
        return wav.new_zeros(0, num_mel_bins)
    m = 1 + (n - size) // shift
    frames = wav.as_strided((m, size), (shift * wav.stride(0), wav.stride(0)))
    frames = frames - frames.mean(dim=1, keepdim=True)
    prev = F.pad(frames.unsqueeze(0), (1, 0), mode="replicate").squeeze(0)
    frames = frames - preemphasis * prev[:, :-1]
    window = torch.hann_window(size, periodic=False, device=wav.device, dtype=wav.dtype).pow(0.85)
    frames = frames * window.unsqueeze(0)
    frames = F.pad(frames, (0, padded - size))
    power = torch.fft.rfft(frames).abs().pow(2.0)
    banks = kaldi_mel_banks(num_mel_bins, padded, float(sample_rate), low_freq, high_freq).to(wav.device)
    feats = torch.mm(power, banks.T)
    feats = torch.max(feats, torch.tensor(_F32_EPS, device=wav.device)).log()
    if subtract_mean:
        feats = feats - feats.mean(dim=0, keepdim=True)
    return feats


def prompt_mel(wav: torch.Tensor, cfg: MelConfig) -> torch.Tensor:
    """[B, n] at ``cfg.sampling_rate`` -> [B, num_mels, F] natural-log magnitude mel (Matcha).

    Matcha pads (n_fft - hop)/2 per side itself and runs the STFT uncentred, so F = n // hop
    for the default sizes.
    """
    x = _as_batch(wav).to(torch.float32)
    pad = int((cfg.n_fft - cfg.hop_size) / 2)
    x = F.pad(x.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    window = torch.hann_window(cfg.win_size, device=x.device)
    spec = torch.stft(
        x,
        cfg.n_fft,
        hop_length=cfg.hop_size,
        win_length=cfg.win_size,
        window=window,
        center=cfg.center,
        pad_mode="reflect",
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    spec = torch.view_as_real(spec)
    mag = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
    basis = slaney_mel_filterbank(cfg.sampling_rate, cfg.n_fft, cfg.num_mels, cfg.fmin, cfg.fmax).to(x.device)
    mel = torch.matmul(basis, mag)
    return torch.log(torch.clamp(mel, min=1e-5))


__all__ = ["whisper_log_mel", "kaldi_fbank", "prompt_mel", "WHISPER_SAMPLE_RATE"]
