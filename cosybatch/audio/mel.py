"""Mel filterbanks: librosa's Slaney bank (whisper, matcha) and Kaldi's bank (CAM++ fbank).

Both are rebuilt here in the same arithmetic order and precision as the originals, so the
features match the official frontend to float32 rounding.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

# Slaney auditory-toolbox scale: linear below 1 kHz (3 mels / 200 Hz), log above.
_F_SP = 200.0 / 3
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = np.log(6.4) / 27.0


def hz_to_mel_slaney(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    mels = hz / _F_SP
    log_part = hz >= _MIN_LOG_HZ
    mels = np.where(log_part, _MIN_LOG_MEL + np.log(np.maximum(hz, 1e-300) / _MIN_LOG_HZ) / _LOGSTEP, mels)
    return mels


def mel_to_hz_slaney(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, dtype=np.float64)
    hz = _F_SP * mels
    log_part = mels >= _MIN_LOG_MEL
    return np.where(log_part, _MIN_LOG_HZ * np.exp(_LOGSTEP * (mels - _MIN_LOG_MEL)), hz)


@lru_cache(maxsize=16)
def _slaney_mel_np(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float | None) -> np.ndarray:
    if fmax is None:
        fmax = float(sr) / 2
    fftfreqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sr)
    mel_pts = np.linspace(hz_to_mel_slaney(fmin), hz_to_mel_slaney(fmax), n_mels + 2)
    mel_f = mel_to_hz_slaney(mel_pts)
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fftfreqs)
    # librosa stores the triangles in a float32 array and scales that array in place by the
    # float64 Slaney norm: two float32 roundings, reproduced here.
    weights = np.zeros((n_mels, n_fft // 2 + 1), dtype=np.float32)
    for i in range(n_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))
    enorm = 2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels])
    weights *= enorm[:, None]
    weights.setflags(write=False)
    return weights


def slaney_mel_filterbank(
    sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> torch.Tensor:
    """[n_mels, n_fft//2+1] float32, equal to ``librosa.filters.mel(sr=, n_fft=, n_mels=, fmin=, fmax=)``
    (Slaney scale, Slaney area normalisation)."""
    w = _slaney_mel_np(int(sr), int(n_fft), int(n_mels), float(fmin), None if fmax is None else float(fmax))
    return torch.from_numpy(w.copy())


def _kaldi_mel(freq: torch.Tensor) -> torch.Tensor:
    return 1127.0 * (1.0 + freq / 700.0).log()


@lru_cache(maxsize=8)
def _kaldi_mel_banks(
    num_bins: int, padded_window_size: int, sample_freq: float, low_freq: float, high_freq: float
) -> torch.Tensor:
    num_fft_bins = padded_window_size // 2
    nyquist = 0.5 * sample_freq
    if high_freq <= 0.0:
        high_freq += nyquist
    if not (0.0 <= low_freq < nyquist and 0.0 < high_freq <= nyquist and low_freq < high_freq):
        raise ValueError(f"bad kaldi mel range low={low_freq} high={high_freq} nyquist={nyquist}")
    fft_bin_width = sample_freq / padded_window_size
    mel_low = 1127.0 * math.log(1.0 + low_freq / 700.0)
    mel_high = 1127.0 * math.log(1.0 + high_freq / 700.0)
    delta = (mel_high - mel_low) / (num_bins + 1)
    # float32 tensor arithmetic like torchaudio.compliance.kaldi.get_mel_banks.
    b = torch.arange(num_bins).unsqueeze(1)
    left = mel_low + b * delta
    center = mel_low + (b + 1.0) * delta
    right = mel_low + (b + 2.0) * delta
    mel = _kaldi_mel(fft_bin_width * torch.arange(num_fft_bins)).unsqueeze(0)
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = torch.max(torch.zeros(1), torch.min(up, down))
    # Kaldi's bank has no weight on the Nyquist bin of the rfft.
    return torch.nn.functional.pad(banks, (0, 1), value=0.0)


def kaldi_mel_banks(
    num_bins: int, padded_window_size: int, sample_freq: float, low_freq: float = 20.0, high_freq: float = 0.0
) -> torch.Tensor:
    """[num_bins, padded_window_size//2+1] float32 triangular banks on Kaldi's mel scale
    (``high_freq <= 0`` is an offset from Nyquist, as in Kaldi)."""
    return _kaldi_mel_banks(int(num_bins), int(padded_window_size), float(sample_freq), float(low_freq), float(high_freq)).clone()
