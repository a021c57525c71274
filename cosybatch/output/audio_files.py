"""Audio files: the one place that knows how a row's waveform is encoded, what its file is called,
and how big such files get.

Formats: ``wav`` (mono, PCM_16 or FLOAT; the default), ``flac`` (16-bit), ``ogg`` (Ogg Vorbis),
``opus`` (Ogg Opus) and ``mp3`` (MPEG layer III); the last four through libsndfile (``soundfile``),
whose installed build is asked what it can write, so an error names what it lacks. Optionally the
audio is resampled and loudness-normalized first (``cosybatch.output.mastering``).

Every file is encoded in memory and written through ``cosybatch.atomic`` by plain ``os.write``, so a
full disk arrives as an ordinary OSError and never inside a C callback. WAVs are built with the
standard library (RIFF header plus samples, byte-identical to what soundfile writes); the other
formats are encoded by libsndfile into a BytesIO.
"""

from __future__ import annotations

import importlib
import io
import math
import struct
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from cosybatch.atomic import faults_as, replace_atomically


FORMATS = ("wav", "flac", "ogg", "opus", "mp3")
# format -> (libsndfile major format, subtype). FLAC is 16-bit: the same samples as the default
# WAV, losslessly; the lossy codecs run at libsndfile's default settings.
_SNDFILE = {"flac": ("FLAC", "PCM_16"), "ogg": ("OGG", "VORBIS"), "opus": ("OGG", "OPUS"),
            "mp3": ("MP3", "MPEG_LAYER_III")}
_SUFFIX = {"wav": ".wav", "flac": ".flac", "ogg": ".ogg", "opus": ".opus", "mp3": ".mp3"}
# What the free-space estimate assumes per second of audio and per file, for the compressed
# formats (their size depends on the signal). Stated upper bounds, not averages: FLAC at 16 bits
# never stores more than the raw samples plus frame headers (white noise: +0.2 %), so 2.02 bytes a
# sample; Vorbis and Opus at libsndfile's defaults stayed under 13 and 8 kB/s on every signal tried
# (white noise, full-scale square, chirp, clicks; 8-48 kHz), so 16 kB/s; MP3 is bounded by the
# format's highest bitrate, 320 kbit/s = 40 kB/s. Headers: Vorbis carries ~3.7 kB of codebooks.
_BYTES_PER_SAMPLE_FLAC = 2.02
_BYTES_PER_S = {"ogg": 16000, "opus": 16000, "mp3": 40000}
_HEADER_BYTES = {"flac": 8192, "ogg": 8192, "opus": 4096, "mp3": 4096}
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8000, 192000
MIN_LUFS, MAX_LUFS = -70.0, 0.0  # -70 LUFS is BS.1770's absolute gate: nothing quieter is measured


def audio_name(utt_id: str, fmt: str = "wav") -> str:
    """The file name of a row's audio: ``<utt_id>`` plus its format's suffix."""
    return f"{utt_id}{_SUFFIX[fmt]}"


def audio_path(out_dir: str | Path, utt_id: str, fmt: str = "wav") -> Path:
    """Where a row's audio lives in OUT."""
    return Path(out_dir) / audio_name(utt_id, fmt)


def format_of(utt_id: str, name: str) -> str | None:
    """The format whose file ``name`` is for ``utt_id``, or None when it is no row's audio name
    (a ledger is data: it may not point anywhere else)."""
    return next((f for f in FORMATS if name == audio_name(utt_id, f)), None)


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


# ---- the other formats, through libsndfile ---------------------------------------------------

def _libsndfile_says(e: Exception) -> str:
    # soundfile's message starts with "Error opening <_io.BytesIO ...>: "; libsndfile's own part is the news
    text = getattr(e, "error_string", None) or str(e)
    return text.split("Error : ", 1)[-1].strip().rstrip(".")


def _sndfile_bytes(audio: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    import soundfile as sf

    major, subtype = _SNDFILE[fmt]
    if fmt == "flac":
        # Quantized here exactly like the 16-bit WAV: libsndfile's own float->int conversion does not
        # clip (a sample past full scale would wrap), and so FLAC decodes to the WAV's very samples.
        data = _wav_samples(audio, "PCM_16")
    else:
        # The lossy encoders take floats; past full scale is clipped as in every other format.
        data = np.clip(np.asarray(audio, dtype=np.float32).reshape(-1), -1.0, 1.0)
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", samplerate=int(sample_rate), channels=1, format=major, subtype=subtype) as f:
        f.write(data)
    return buf.getvalue()


@lru_cache(maxsize=64)
def _sndfile_problem(fmt: str, sample_rate: int | None) -> str | None:
    """Why the installed libsndfile cannot write ``fmt`` (at ``sample_rate``), or None."""
    import soundfile as sf

    major, subtype = _SNDFILE[fmt]
    lib = f"the installed libsndfile ({sf.__libsndfile_version__})"
    if major not in sf.available_formats() or subtype not in sf.available_subtypes(major):
        can = [f for f, (m, st) in _SNDFILE.items() if m in sf.available_formats() and st in sf.available_subtypes(m)]
        return (f"--format {fmt}: {lib} cannot write {major}/{subtype}; it can write: "
                f"{', '.join(['wav', *can])}")
    if sample_rate is None:
        return None
    try:  # the one sure way to learn which rates this build's encoder takes
        _sndfile_bytes(np.zeros(int(sample_rate) // 50 + 1, np.float32), int(sample_rate), fmt)
    except Exception as e:
        return f"--format {fmt} at {sample_rate} Hz: {lib} refuses: {_libsndfile_says(e)}"
    return None


# ---- a run's output settings -----------------------------------------------------------------

@dataclass(frozen=True)
class EncodedAudio:
    """A row's file in memory, and what the ledger says about it."""
    chunks: list[bytes] = field(repr=False)
    info: dict[str, Any]  # format, sample_rate, audio_s, loudness ... (the ledger's fields)


@dataclass(frozen=True)
class AudioFormat:
    """What a run's audio files are: format, WAV subtype, sample rate (None: the synthesizer's own)
    and loudness target in LUFS (None: as synthesized)."""
    format: str = "wav"
    wav_subtype: str = "PCM_16"
    sample_rate: int | None = None
    loudness: float | None = None

    @property
    def suffix(self) -> str:
        return _SUFFIX[self.format]

    def path(self, out_dir: str | Path, utt_id: str) -> Path:
        return audio_path(out_dir, utt_id, self.format)

    def problem(self) -> str | None:
        """Why these settings cannot be used, in one line (None when they can); the sample rate is
        checked here only when it was given (see ``problem_at`` for the synthesizer's own)."""
        if self.format not in FORMATS:
            return f"--format {self.format!r}: expected one of {', '.join(FORMATS)}"
        if self.wav_subtype not in WAV_SUBTYPES:
            return f"--wav-subtype {self.wav_subtype!r}: expected one of {', '.join(WAV_SUBTYPES)}"
        if self.sample_rate is not None and not MIN_SAMPLE_RATE <= self.sample_rate <= MAX_SAMPLE_RATE:
            return f"--sample-rate {self.sample_rate}: expected {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz"
        if self.loudness is not None and not (math.isfinite(self.loudness) and MIN_LUFS <= self.loudness <= MAX_LUFS):
            return f"--loudness {self.loudness}: expected {MIN_LUFS:g} to {MAX_LUFS:g} LUFS"
        return self.problem_at(self.sample_rate) if self.format != "wav" else None

    def problem_at(self, native_rate: int | None) -> str | None:
        """Why libsndfile cannot write these files at the rate they will have (``native_rate``: the
        synthesizer's, used when no rate was asked for)."""
        if self.format == "wav":
            return None
        return _sndfile_problem(self.format, self.sample_rate or native_rate)

    def output_rate(self, native_rate: int) -> int:
        return int(self.sample_rate or native_rate)

    def fingerprint(self, native_rate: int | None) -> dict[str, Any]:
        """What of these settings changes the files, for the resume fingerprint. Today's WAV at the
        synthesizer's rate keeps exactly the key it always had, so an OUT written before formats
        existed still resumes; every other setting adds its keys."""
        fp: dict[str, Any] = ({"wav_subtype": self.wav_subtype} if self.format == "wav"
                              else {"format": self.format, "codec": "/".join(_SNDFILE[self.format])})
        if self.sample_rate is not None and self.sample_rate != native_rate:
            from cosybatch.output.mastering import RESAMPLER

            fp.update(output_sample_rate=self.sample_rate, resampler=RESAMPLER)
        if self.loudness is not None:
            from cosybatch.output.mastering import PEAK_CEILING_DBFS

            fp.update(loudness_lufs=self.loudness, peak_ceiling_dbfs=PEAK_CEILING_DBFS)
        return fp

    def settings(self, native_rate: int | None) -> dict[str, Any]:
        """For timing.json's ``settings``."""
        return {"format": self.format, **({"wav_subtype": self.wav_subtype} if self.format == "wav" else {}),
                "output_sample_rate": self.sample_rate or native_rate, "loudness_lufs": self.loudness}

    def estimated_bytes(self, seconds: float, native_rate: int) -> int:
        """A file of ``seconds`` of audio: exact for WAV, an upper bound for the others."""
        rate = self.output_rate(native_rate)
        n = int(seconds * rate)
        if self.format == "wav":
            return wav_size(n, self.wav_subtype)
        if self.format == "flac":
            return _HEADER_BYTES["flac"] + math.ceil(n * _BYTES_PER_SAMPLE_FLAC)
        return _HEADER_BYTES[self.format] + math.ceil(seconds * _BYTES_PER_S[self.format])

    def prepare(self) -> None:
        """Import what encoding needs (scipy, through pyloudnorm, takes about a second) before the
        first row, not inside its commit, where it would hold back every row behind it."""
        for name in ("cosybatch.output.mastering", "pyloudnorm", "soxr") + (("soundfile",) if self.format != "wav" else ()):
            importlib.import_module(name)

    def encode(self, audio: np.ndarray, sample_rate: int) -> EncodedAudio:
        """Resample, normalize and encode one row's mono float32 audio (ValueError if libsndfile
        refuses it: that row fails alone)."""
        from cosybatch.output.mastering import change_rate, measure_loudness, normalize_loudness, sample_peak_dbfs

        rate = self.output_rate(sample_rate)
        x = change_rate(audio, sample_rate, rate)
        info: dict[str, Any] = {"format": self.format, "sample_rate": rate, "audio_s": round(len(x) / rate, 6)}
        if self.loudness is not None:
            norm = normalize_loudness(x, rate, self.loudness)
            x = norm.audio
            lufs, measure = norm.lufs, norm.measure
            info.update(gain_db=round(norm.gain_db, 3), peak_limited=norm.limited)
        else:
            level = measure_loudness(x, rate)
            lufs, measure = level.lufs, level.measure
        peak = sample_peak_dbfs(x)
        info.update(loudness_lufs=None if lufs is None else round(lufs, 3), loudness_measure=measure,
                    peak_dbfs=None if peak is None else round(peak, 3))
        if self.format == "wav":
            chunks = list(encode_wav(x, rate, self.wav_subtype))
        else:
            try:
                chunks = [_sndfile_bytes(x, rate, self.format)]
            except Exception as e:  # libsndfile's errors come as several types; this row's problem
                raise ValueError(f"cannot encode {self.format} at {rate} Hz: {_libsndfile_says(e)}") from None
        return EncodedAudio(chunks, info)


def write_audio_atomic(final: Path, encoded: EncodedAudio, tag: str = "") -> int:
    """Write an encoded file under its final name atomically; returns its size. A storage error
    raises OutputFault; any other OSError (this one file's problem) is raised as is."""
    with faults_as(final):
        return replace_atomically(final, encoded.chunks, tag)
