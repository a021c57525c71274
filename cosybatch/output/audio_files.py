"""Audio files: how a row's waveform is encoded and named on disk (today mono WAV, PCM_16 or FLOAT).

WAVs are written with the standard library (RIFF header plus samples, byte-identical to what soundfile
writes), so a full disk arrives as an ordinary OSError and never inside a C callback."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np

from cosybatch.atomic import faults_as, replace_atomically


WAV_SUBTYPES = ("PCM_16", "FLOAT")


_SAMPLE_BYTES = {"PCM_16": 2, "FLOAT": 4}


_WAV_HEADER_BYTES = {"PCM_16": 44, "FLOAT": 80}


_WAV_MAX_BYTES = 0xFFFFFFFF  # RIFF sizes are 32-bit


def wav_size(n_frames: int, subtype: str) -> int:
    """Exact size of a mono WAV file of ``n_frames`` samples."""
    return _WAV_HEADER_BYTES[subtype] + n_frames * _SAMPLE_BYTES[subtype]


def _wav_samples(audio: np.ndarray, subtype: str) -> np.ndarray:
    data = np.asarray(audio, dtype=np.float32).reshape(-1)
    if subtype == "FLOAT":
        return data.astype("<f4", copy=False)
    # Clipped first: out-of-range samples would otherwise wrap. Then what libsndfile 1.2
    # (soundfile's) does: scale by 0x8000 (exact in float32), round down, +1.0 saturates.
    scaled = np.floor(np.clip(data, -1.0, 1.0) * np.float32(0x8000))
    return np.clip(scaled, -0x8000, 0x7FFF).astype("<i2")


def _wav_header(samples: np.ndarray, sample_rate: int, subtype: str, timestamp: int | None) -> bytes:
    width = _SAMPLE_BYTES[subtype]
    data_len = samples.size * width
    fmt_tag = 1 if subtype == "PCM_16" else 3  # WAVE_FORMAT_PCM, WAVE_FORMAT_IEEE_FLOAT
    fmt = struct.pack("<4sIHHIIHH", b"fmt ", 16, fmt_tag, 1, sample_rate, sample_rate * width, width, 8 * width)
    extra = b""
    if subtype == "FLOAT":
        pos = int(np.argmax(np.abs(samples))) if samples.size else 0
        peak = float(abs(samples[pos])) if samples.size else 0.0
        stamp = int(time.time()) if timestamp is None else timestamp
        extra = (struct.pack("<4sII", b"fact", 4, samples.size)
                 + struct.pack("<4sIIIfI", b"PEAK", 16, 1, stamp & 0xFFFFFFFF, peak, pos))
    body = b"WAVE" + fmt + extra + struct.pack("<4sI", b"data", data_len)
    return struct.pack("<4sI", b"RIFF", len(body) + data_len) + body


def encode_wav(audio: np.ndarray, sample_rate: int, subtype: str = "PCM_16",
               timestamp: int | None = None) -> tuple[bytes, bytes]:
    """(header, sample data) of a mono WAV; ``timestamp`` only fills FLOAT's PEAK chunk."""
    if subtype not in WAV_SUBTYPES:
        raise ValueError(f"wav subtype {subtype!r}: expected one of {', '.join(WAV_SUBTYPES)}")
    samples = _wav_samples(audio, subtype)
    if wav_size(samples.size, subtype) > _WAV_MAX_BYTES:
        raise ValueError(f"{samples.size} samples do not fit in a WAV file (4 GiB)")
    return _wav_header(samples, int(sample_rate), subtype, timestamp), samples.tobytes()


def write_wav_atomic(final: Path, audio: np.ndarray, sample_rate: int,
                     subtype: str = "PCM_16", tag: str = "") -> int:
    """Write a mono WAV under its final name atomically; returns the file size.

    A storage error (full disk, quota, I/O) raises OutputFault; any other OSError (this one
    file's problem) is raised as is.
    """
    header, data = encode_wav(audio, sample_rate, subtype)
    with faults_as(final):
        return replace_atomically(final, [header, data], tag)
