"""What a row's waveform goes through on its way into a file: a band-limited rate change and BS.1770
loudness normalization with a sample-peak ceiling (each only when asked for), and the loudness
measurement every ledger ok line records. (Here, not in ``cosybatch.audio``: that package imports
torch, which a run with the fake synthesizer, or ``--help``, must not pay for.)

The rate change uses soxr (libsoxr, the SoX resampler) at its "HQ" setting, not
``cosybatch.audio.resample``: that one copies torchaudio's 6-zero-crossing Hann sinc because the
prompt features must match the official frontend bit for bit, and its transition band straddles the
new Nyquist (a tone at 0.55x the new rate comes back as an alias only ~14 dB down). soxr HQ passes
everything up to 0.46x the new rate within 0.01 dB, rolls off in the last 4 % below the new Nyquist
and rejects everything from 0.5x the new rate by more than 120 dB (measured; the tests hold it to
100 dB), and its one-shot call removes the filter's
delay, so output sample k lines up with input time k / new_rate and the length is n * new / old
(rounded).

Loudness is ITU-R BS.1770-4 integrated loudness (K-weighting, 400 ms blocks with 75 % overlap, the
-70 LUFS absolute and -10 LU relative gates) as measured by pyloudnorm. Two cases BS.1770 leaves open:

* a clip shorter than one 400 ms gating block has no gated loudness; it is measured as one block the
  clip's own length (K-weighted mean square over the whole clip, no gating), so a one-word row is
  normalized like the others instead of being left at whatever level it came out at;
* a clip whose loudness is below the -70 LUFS absolute gate (silence, or near it) gets no gain:
  raising it to the target would only raise the noise floor.

The gain never takes a sample above ``PEAK_CEILING_DBFS`` (-1 dBFS sample peak, the headroom EBU R128
leaves for true-peak overshoot and lossy encoders): where the target would, the gain stops at the
ceiling and the file is quieter than the target; the ledger records the loudness actually reached.
The ceiling is on samples, not true peak (inter-sample peaks, or a lossy codec's overshoot, may go
up to about 1 dB higher, which the -1 dBFS margin is there to absorb).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

RESAMPLER = "soxr-HQ"  # named in the resume fingerprint: another resampler is another output
PEAK_CEILING_DBFS = -1.0
GATING_BLOCK_S = 0.4  # BS.1770's gating block
ABSOLUTE_GATE_LUFS = -70.0


def change_rate(audio: np.ndarray, sr: int, new_sr: int) -> np.ndarray:
    """``audio`` (mono float32) at ``new_sr`` Hz, band-limited to below the lower Nyquist."""
    if int(sr) == int(new_sr):
        return audio
    import soxr

    return soxr.resample(np.asarray(audio, dtype=np.float32), int(sr), int(new_sr), quality="HQ").astype(
        np.float32, copy=False)


@dataclass(frozen=True)
class Loudness:
    lufs: float | None  # None: below the absolute gate (silence)
    measure: str  # "bs1770" (gated integrated), "short" (one ungated block: the clip), "silent"


def measure_loudness(audio: np.ndarray, sr: int) -> Loudness:
    """Integrated loudness of a mono clip (see the module doc for short and silent clips)."""
    import pyloudnorm

    x = np.asarray(audio, dtype=np.float64).reshape(-1)
    n = x.size
    if n == 0:
        return Loudness(None, "silent")
    if n >= GATING_BLOCK_S * sr:
        meter, measure = pyloudnorm.Meter(sr), "bs1770"
    else:
        # one block exactly as long as the clip; pyloudnorm refuses a block longer than the data,
        # and n / sr * sr may round to a hair above n
        block = n / sr
        while block * sr > n:
            block = math.nextafter(block, 0.0)
        meter, measure = pyloudnorm.Meter(sr, block_size=block), "short"
    lufs = float(meter.integrated_loudness(x))
    if not math.isfinite(lufs) or lufs < ABSOLUTE_GATE_LUFS:
        return Loudness(None, "silent")
    return Loudness(lufs, measure)


def sample_peak_dbfs(audio: np.ndarray) -> float | None:
    """Largest |sample| in dBFS (None for all-zero audio)."""
    peak = float(np.max(np.abs(audio))) if np.size(audio) else 0.0
    return 20.0 * math.log10(peak) if peak > 0 else None


@dataclass(frozen=True)
class Normalized:
    audio: np.ndarray
    gain_db: float
    lufs: float | None  # the loudness reached (None: silent, left as it was)
    measure: str
    limited: bool  # the peak ceiling, not the target, set the gain


def normalize_loudness(audio: np.ndarray, sr: int, target_lufs: float,
                       ceiling_dbfs: float = PEAK_CEILING_DBFS) -> Normalized:
    """``audio`` scaled by one gain to ``target_lufs``, or less where a sample would pass the ceiling."""
    x = np.asarray(audio, dtype=np.float32)
    level = measure_loudness(x, sr)
    if level.lufs is None:
        return Normalized(x, 0.0, None, level.measure, False)
    gain_db = target_lufs - level.lufs
    peak = sample_peak_dbfs(x)
    limited = peak is not None and peak + gain_db > ceiling_dbfs
    if limited:
        gain_db = ceiling_dbfs - peak
    # float32 rounding of the product could put the peak a hair over the ceiling: shave it
    gain = np.float32(10.0 ** (gain_db / 20.0))
    y = x * gain
    top = float(np.max(np.abs(y)))
    ceiling = np.float32(10.0 ** (ceiling_dbfs / 20.0))
    while top > ceiling:
        gain = np.float32(np.nextafter(gain, np.float32(0)))
        y = x * gain
        top = float(np.max(np.abs(y)))
    gain_db = 20.0 * math.log10(float(gain))
    # loudness scales exactly with a gain, so the reached value needs no second measurement
    return Normalized(y, gain_db, level.lufs + gain_db, level.measure, limited)
