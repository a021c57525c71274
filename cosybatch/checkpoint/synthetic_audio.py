"""Deterministic speech-like waveforms: calibration data for random frontend weights, and prompts
for tests and benchmarks.

Not speech, but with speech's spectral statistics where the frontend features look: a voiced
source (harmonics of a drifting 80-260 Hz pitch) shaped by three slowly moving formant
resonances, unvoiced noise bursts, syllable-rate (~4 Hz) loudness and short pauses. Only numpy
and float64 arithmetic, so the same seed gives the same samples everywhere (up to libm ulps).
"""

from __future__ import annotations

import numpy as np


def _formant_gain(freqs: np.ndarray, centers: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Sum of three resonance bumps: freqs [G, K] against centers [G, 1, 3], widths [3]."""
    d = (freqs[..., None] - centers) / widths
    return (1.0 / (1.0 + d**2)).sum(-1)


def speech_like(seconds: float, sample_rate: int, seed: int, peak: float = 0.5) -> np.ndarray:
    """float64 [n] waveform in [-peak, peak]."""
    rng = np.random.default_rng([seed, 0x5EEC])
    n = max(1, int(round(seconds * sample_rate)))
    t = np.arange(n) / sample_rate
    f0_base = rng.uniform(80.0, 260.0)
    f0 = f0_base * (1 + 0.12 * np.sin(2 * np.pi * rng.uniform(0.2, 0.9) * t + rng.uniform(0, 6.3)))
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    # formants drift per 50 ms control point; harmonic gains on a 5 ms grid, interpolated
    ctrl = np.arange(0, seconds + 0.05, 0.05)
    centers = np.stack([rng.uniform(lo, hi, ctrl.size) for lo, hi in ((300, 900), (900, 2400), (2300, 3400))], -1)
    grid = np.arange(0, seconds + 0.005, 0.005)
    centers = np.stack([np.interp(grid, ctrl, centers[:, j]) for j in range(3)], -1)
    f0_grid = np.interp(grid, t, f0)
    n_harm = int(min(40, (0.45 * sample_rate) // (1.15 * f0_base)))
    k = np.arange(1, n_harm + 1)
    gains = _formant_gain(f0_grid[:, None] * k, centers[:, None, :], np.array([90.0, 140.0, 200.0])) / np.sqrt(k)
    voiced = np.zeros(n)
    c2 = 2 * np.cos(phase)
    s_prev, s_cur = np.zeros(n), np.sin(phase)  # sin(k phase) by the Chebyshev recursion
    for j in range(n_harm):
        voiced += np.interp(t, grid, gains[:, j]) * s_cur
        s_prev, s_cur = s_cur, c2 * s_cur - s_prev
    noise = rng.standard_normal(n)
    noise = noise - np.concatenate([[0.0], noise[:-1]]) * 0.9  # tilt towards high frequencies
    # syllables: 4 Hz-ish envelope; each syllable voiced or a fricative; ~12% pauses
    syl = np.cumsum(rng.uniform(0.12, 0.35, int(seconds / 0.12) + 2))
    idx = np.searchsorted(syl, t)
    kind = rng.uniform(0, 1, syl.size + 1)
    start = np.concatenate([[0.0], syl])[idx]
    dur = np.diff(np.concatenate([[0.0], syl]), append=syl[-1] + 0.2)[idx]
    env = np.sin(np.pi * np.clip((t - start) / dur, 0, 1)) ** 0.6
    mix = np.where(kind[idx] < 0.7, voiced, np.where(kind[idx] < 0.88, 3.0 * noise, 0.0))
    x = env * mix + 0.003 * noise  # a little background noise everywhere
    return (peak * x / max(np.abs(x).max(), 1e-9)).astype(np.float64)


def prompt_lengths(n: int, seed: int, lo: float = 3.0, hi: float = 30.0, short_share: float = 0.9,
                   short_hi: float = 6.0) -> list[float]:
    """Prompt durations for tests/benchmarks: ``short_share`` of them in [lo, short_hi] s, the
    rest spread over [short_hi, hi] with the longest exactly ``hi`` (onnxruntime on a CPU is the
    reference and costs ~25 ms per second of prompt at full size, so long ones are few)."""
    rng = np.random.default_rng([seed, 0x1E9])
    n_long = max(1, n - int(round(n * short_share)))
    out = list(rng.uniform(lo, short_hi, n - n_long)) + list(np.linspace(short_hi, hi, n_long))
    return [float(x) for x in rng.permutation(out)]


__all__ = ["speech_like", "prompt_lengths"]
