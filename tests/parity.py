"""Parity criteria shared by the tests that compare with the official fixtures (or one of our
paths with another). They must hold on any x86-64 CPU (Intel or AMD, AVX2 or AVX-512) at 1-4
intra-op threads, and still fail on a real error.

Why plain max-abs bounds broke on other machines: MKL chooses its FFT and GEMM kernels by the
CPU's vector ISA at run time (``MKL_ENABLE_INSTRUCTIONS``; ``ATEN_CPU_CAPABILITY`` does not
reach it). The fixtures match MKL's SSE4.2 kernels: with ``MKL_ENABLE_INSTRUCTIONS=SSE4_2`` we
reproduce whisper's log-mel to 1 ulp and the HiFT source bit for bit, while the AVX2 and AVX-512
kernels round differently. Float32 FFT rounding is absolute (proportional to the frame's norm),
so in a log spectrum it is largest in the quietest bins (up to 1.8e-3 nats of the prompt mel,
near its 1e-5 clamp); the fixture itself is as far (~1e-3) from a float64 computation as we are.
That moves the flow mel by ~4e-5, and HiFT's sine source, a cumulative sum of f0 over the whole
utterance (~1e4 rad), turns any mel change into ~1e-2 of waveform (a 1e-6 mel change already
gives ~2e-3). Torch's own kernels (ATen ISA, thread count 1-4) change almost nothing here.

Measured spreads per configuration are tabulated in test_reference_e2e.py and test_audio.py;
the scratch scripts that produced them injected real errors too (see the constants), and
tests/test_parity.py checks that such errors still fail. To re-measure on a new machine, set
``COSYBATCH_PARITY_LOG=<file>``: every comparison made through this module appends one JSON line
(test, what, measured values, bounds) before it asserts.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

# ----------------------------------------------------------------------------- waveforms
# End to end (mel computed by us, so the phase amplification applies). Measured on the fixtures
# over 8 ISA/thread configurations: every chunk >= 45.3 dB SNR and <= 1.03e-2 max |diff|.
# Injected errors, each alone: one wrong token <= 8.3 dB, final chunk with the chunk mask instead
# of full attention <= 15 dB, f0 x (1 + 1e-4) ~6 dB, sine phase restarted mid-row ~3 dB, HiFT
# noise table redrawn ~12 dB, waveform one sample late -4 dB; all of them >= 0.29 max |diff|.
WAVE_MIN_SNR_DB = 30.0
WAVE_MAX_ABS = 3e-2
# HiFT given the same mel (ours vs the official decode of the fixture mel, or our batched /
# bounded-window runner vs the whole-history re-run): conv / FFT rounding only, except that a
# float32 f0 may land one ulp away and the phase sum carries that on. Measured >= 96 dB and
# <= 6.3e-5 (batched vs one by one, AVX2, 4 threads; that drift grows with the utterance, these
# are <= 3.2 s); a HiFT left context cut in half gives > 1e-3.
SAME_MEL_MIN_SNR_DB = 80.0
SAME_MEL_MAX_ABS = 2e-4


def _log(kind: str, what, **values) -> None:
    path = os.environ.get("COSYBATCH_PARITY_LOG")
    if path:
        rec = {"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "kind": kind, "what": str(what), **values}
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _flat64(x) -> np.ndarray:
    if torch.is_tensor(x):
        x = x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    """RMS of ``got - want`` over the RMS of ``want``: how mels and other dense outputs of a
    lower-precision path are compared with their reference."""
    return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


def wave_error(got, want) -> tuple[float, float]:
    """(SNR in dB of ``want`` against ``got - want``, max |got - want|); same shapes required."""
    g, w = _flat64(got), _flat64(want)
    diff = g - w
    noise = float((diff**2).sum())
    signal = float((w**2).sum())
    snr = math.inf if noise == 0 else (-math.inf if signal == 0 else 10 * math.log10(signal / noise))
    return snr, float(np.abs(diff).max()) if diff.size else 0.0


def assert_wave_close(got, want, what, *, max_abs: float = WAVE_MAX_ABS,
                      min_snr_db: float = WAVE_MIN_SNR_DB) -> tuple[float, float]:
    """Exact length, SNR >= ``min_snr_db`` and max |diff| <= ``max_abs``.

    Rounding anywhere upstream of HiFT reaches the waveform through the sine phase, so a tight
    max-abs bound cannot hold across machines; a wrong token, chunk boundary or phase cannot
    hide behind the SNR floor, and a local glitch cannot hide behind the max-abs bound.
    Accepts numpy arrays or tensors ([L] or [1, L]); returns (snr_db, max_abs).
    """
    g, w = _flat64(got), _flat64(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    if w.size == 0:
        return math.inf, 0.0
    snr, err = wave_error(g, w)
    _log("wave", what, snr_db=snr, max_abs=err, n=int(w.size), bound_snr_db=min_snr_db, bound_max_abs=max_abs)
    assert snr >= min_snr_db and err <= max_abs, (
        f"{what}: SNR {snr:.1f} dB (need >= {min_snr_db}), max |diff| {err:.3g} (need <= {max_abs:g})")
    return snr, err


# -------------------------------------------------------------------------- log spectra
@dataclass(frozen=True)
class LogSpecTol:
    """Allowed |got - want| of a log spectrum, per bin, in natural-log units:

        atol + peak_rtol * (amplitude of the frame's peak bin / amplitude of this bin)

    FFT rounding is an absolute error of about eps x the frame's norm, so the relative (= log)
    error of a bin grows as the bin falls below its frame's peak; quiet bins get room, bins with
    energy stay tight, and a wrong clamp floor, window, padding or filterbank is still off by
    orders of magnitude (each was injected: >= 60x the tolerance).
    """

    atol: float
    peak_rtol: float
    nats_per_unit: float = 1.0  # feature units -> natural log of the spectrum
    power: bool = False  # a power spectrum: amplitude ratio = exp(delta / 2)


# whisper log-mel, (log10(power) + 4) / 4. Measured: 1.1e-6 nats at frame peaks, quiet bins up
# to 1.1e-6 x the peak/bin amplitude ratio (5.3e-5 feature units at most; 1.2e-7 with MKL SSE4.2).
WHISPER_LOGMEL_TOL = LogSpecTol(atol=1e-5, peak_rtol=1e-5, nats_per_unit=4 * math.log(10), power=True)
# kaldi fbank (ln power, time mean removed: compare it with the mean added back, see test_audio).
# Measured: 1.3e-5 nats at frame peaks, quiet bins up to 1.3e-5 x the amplitude ratio (9.6e-4
# at most; 1.9e-6 with MKL SSE4.2).
KALDI_FBANK_TOL = LogSpecTol(atol=1e-4, peak_rtol=1e-4, power=True)
# Matcha prompt mel (ln magnitude, clamped at 1e-5). Measured: 4.8e-7 nats at frame peaks,
# quiet bins up to 4.7e-7 x the amplitude ratio (1.75e-3 at most; 9.5e-7 with MKL SSE4.2).
PROMPT_MEL_TOL = LogSpecTol(atol=1e-5, peak_rtol=5e-6)


def assert_log_spectrum_close(got: torch.Tensor, want: torch.Tensor, what, tol: LogSpecTol,
                              bin_dim: int) -> float:
    """Exact shape and the per-bin bound of ``tol`` (frame peak taken from ``want`` along
    ``bin_dim``). Returns the largest |diff| / allowed ratio (<= 1 when it passes)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = got.detach().to(torch.float64), want.detach().to(torch.float64)
    diff = (g - w).abs() * tol.nats_per_unit
    below_peak = (w.amax(dim=bin_dim, keepdim=True) - w) * tol.nats_per_unit
    if tol.power:
        below_peak = below_peak / 2
    allowed = tol.atol + tol.peak_rtol * torch.exp(below_peak)
    ratio = diff / allowed
    worst = float(ratio.max()) if ratio.numel() else 0.0
    ok = bool((diff <= allowed).all())  # False on NaN too
    _log("logspec", what, ratio=worst, max_abs_nats=float(diff.max()) if diff.numel() else 0.0, tol=str(tol))
    if not ok:
        i = int(torch.nan_to_num(ratio, nan=math.inf).argmax())
        raise AssertionError(
            f"{what}: |diff| {float(diff.flatten()[i]):.3g} nats at a bin {float(below_peak.flatten()[i]):.1f} nats "
            f"below its frame peak, allowed {float(allowed.flatten()[i]):.3g} (worst ratio {worst:.3g})")
    return worst
