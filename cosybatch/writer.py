"""Everything synth leaves in OUT: WAVs, the ledger, timing.json.

Crash safety rests on two rules: a final name (``<utt_id>.wav``, ``timing.json``) only
ever appears through ``os.replace`` of a fully written and fsynced temp file, and the
ledger is append-only with one fsynced line per event, so a ``kill -9`` at any moment
leaves at worst an orphan temp file, a torn last ledger line, or a WAV whose ok line was
not appended yet (all tolerated: resume redoes a row without its ok line).

A full disk is the other way a long run meets its end. Every write goes through plain
``os.write`` (WAVs too: no soundfile/cffi callback that could swallow the error), so
ENOSPC arrives as an OSError here; a write that fails for a reason every later write
shares (``STORAGE_ERRNOS``) becomes one :class:`OutputFault` naming the final file, after
the temp file is removed and a partial ledger line is cut off again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import struct
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

log = logging.getLogger(__name__)

WAV_SUBTYPES = ("PCM_16", "FLOAT")
TMP_MARK = ".cbtmp"  # temp names: .<final name>.cbtmp<tag>; never end in .wav/.json
TIMING_SCHEMA = "cosybatch.timing/1"
# The disk (not this one file) is the problem: full, over quota, failing, or remounted read-only.
STORAGE_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EIO, errno.EROFS)
                           if e is not None)


class OutputFault(Exception):
    """Writing into OUT failed in a way every later write would share: the run must stop.

    Deliberately not an OSError, so that code treating an OSError as one row's problem
    cannot mistake a full disk for it.
    """

    def __init__(self, path: Path, err: OSError):
        self.path, self.errno = Path(path), err.errno
        self.reason = _reason(err)
        super().__init__(f"cannot write {self.path}: {self.reason}")


def _reason(err: OSError) -> str:
    text = os.strerror(err.errno) if err.errno else str(err)
    return text[:1].lower() + text[1:]


def is_storage_fault(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in STORAGE_ERRNOS


@contextlib.contextmanager
def _faults_as(path: Path, every_oserror: bool = False) -> Iterator[None]:
    """Turn a storage OSError (or, for the run's records, any OSError) into an OutputFault."""
    try:
        yield
    except OSError as e:
        if every_oserror or is_storage_fault(e):
            raise OutputFault(path, e) from e
        raise


def fsync_dir(path: Path) -> None:
    """Make a rename durable; some filesystems refuse directory fds, which is harmless."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _tmp_path(final: Path, tag: str) -> Path:
    return final.with_name(f".{final.name}{TMP_MARK}{tag}")


def _write_all(fd: int, data: bytes) -> None:
    """os.write until done: near a full disk the kernel writes part and fails the rest."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _write_synced(path: Path, chunks: Iterable[bytes]) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        size = 0
        for chunk in chunks:
            _write_all(fd, chunk)
            size += len(chunk)
        os.fsync(fd)  # some filesystems (NFS, delayed allocation) only report ENOSPC here
    finally:
        os.close(fd)  # ... or here
    return size


def _replace_atomically(final: Path, chunks: Iterable[bytes], tag: str) -> int:
    tmp = _tmp_path(final, tag)
    try:
        size = _write_synced(tmp, chunks)
        os.replace(tmp, final)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_dir(final.parent)
    return size


@contextlib.contextmanager
def replaced_on_success(final: Path) -> Iterator[Path]:
    """A temporary path beside ``final`` for a library that writes to a path (safetensors,
    ONNX): renamed onto ``final`` when the block ends normally, removed otherwise, so no reader
    sees a torn file. Unique per process and thread. (The run's own records go through
    ``atomic_write_bytes``, which also fsyncs and reports storage faults.)"""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        _unlink_quietly(tmp)


def atomic_write_bytes(final: Path, data: bytes, tag: str = "") -> None:
    """Write ``final`` atomically; any OSError is an OutputFault (these files are the run's records)."""
    with _faults_as(final, every_oserror=True):
        _replace_atomically(final, [data], tag)


# ---- WAV ------------------------------------------------------------------------------------
# What libsndfile (soundfile.write) writes for a mono WAV, byte for byte: PCM_16 is the plain
# 44-byte RIFF header; FLOAT adds a 'fact' chunk (frame count) and a 'PEAK' chunk (largest
# |sample|, its first position, and a Unix timestamp), as libsndfile does for float data.

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
    with _faults_as(final):
        return _replace_atomically(final, [header, data], tag)


def _unlink_quietly(p: Path) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def remove_quietly(p: Path) -> bool:
    """Remove a file (and make that durable) if it is there; False if it could not be removed."""
    try:
        os.unlink(p)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    fsync_dir(p.parent)
    return True


def remove_stale_tmp(out_dir: Path, tag: str) -> int:
    """Delete temp files a killed run with the same shard tag left behind."""
    n = 0
    suffix = f"{TMP_MARK}{tag}"
    for p in out_dir.iterdir():
        if p.name.startswith(".") and p.name.endswith(suffix) and p.is_file():
            _unlink_quietly(p)
            n += 1
    return n


class Ledger:
    """Append-only JSON-lines record of run starts, row outcomes and run ends.

    Unbuffered (``os.write`` on an O_APPEND descriptor): a failed append leaves nothing
    queued that a later flush or close could write after the fact. Any OSError while
    appending is an OutputFault: a run that cannot keep its records must stop.
    """

    def __init__(self, path: Path):
        self.path = path
        with _faults_as(path, every_oserror=True):
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                self._end_torn_line()
            except BaseException:
                os.close(self._fd)
                raise

    def _end_torn_line(self) -> None:
        # A kill during the previous append can leave a torn line without its newline;
        # terminate it so the next record starts on a line of its own.
        if os.fstat(self._fd).st_size == 0:
            return
        with open(self.path, "rb") as r:
            r.seek(-1, os.SEEK_END)
            if r.read(1) != b"\n":
                self._append_bytes(b"\n")

    def append(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 3), **record}
        # Serialized before anything is written: a NaN raises ValueError with the ledger untouched.
        line = json.dumps(record, ensure_ascii=False, allow_nan=False, default=str) + "\n"
        with _faults_as(self.path, every_oserror=True):
            self._append_bytes(line.encode("utf-8"))

    def _append_bytes(self, data: bytes) -> None:
        start = os.fstat(self._fd).st_size  # O_APPEND: this is where the line lands (one writer: the lock)
        try:
            _write_all(self._fd, data)
            os.fsync(self._fd)
        except OSError:
            # Part of the line may be on disk; cut it off so the ledger holds whole records only.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            raise

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ledger_files(out_dir: Path) -> list[Path]:
    """All ledgers in OUT: the unsharded one and any shard's."""
    return sorted(p for p in out_dir.glob("ledger*.jsonl") if p.is_file())


def timing_files(out_dir: Path) -> list[Path]:
    return sorted(p for p in out_dir.glob("timing*.json") if p.is_file())


def read_ledger(path: Path) -> Iterator[dict[str, Any]]:
    """Records of one ledger; torn or foreign lines are skipped with a warning."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                log.warning("%s:%d: unreadable ledger line skipped (torn by a crash?)", path, n)
                continue
            if isinstance(rec, dict):
                yield rec


def read_ledgers(out_dir: Path) -> list[dict[str, Any]]:
    """Every record from every ledger in OUT, oldest first (stable within a file)."""
    recs: list[dict[str, Any]] = []
    for p in ledger_files(out_dir):
        recs.extend(read_ledger(p))
    recs.sort(key=lambda r: r.get("time", 0.0) if isinstance(r.get("time"), (int, float)) else 0.0)
    return recs


def latest_rows(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Last row record per utt_id (later lines supersede earlier ones)."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.get("event") == "row" and isinstance(r.get("utt_id"), str):
            out[r["utt_id"]] = r
    return out


def rates(audio_s: float, wall_s: float) -> dict[str, float | None]:
    """The timing document's throughput figures: audio seconds per wall second, and its inverse."""
    return {"audio_s_per_s": audio_s / wall_s if wall_s > 0 else None,
            "rtf": wall_s / audio_s if audio_s > 0 else None}


class TimingWriter:
    """Rewrites timing.json atomically now and then, so even a killed run leaves a valid one.

    The interval grows with the cost of a rewrite, keeping it a small share of wall time
    on very large manifests.
    """

    def __init__(self, path: Path, min_interval_s: float = 10.0, tag: str = ""):
        self.path = path
        self.min_interval_s = min_interval_s
        self.tag = tag
        self._last: float | None = None
        self._cost = 0.0

    def write(self, doc: dict[str, Any]) -> None:
        """Rewrite the file; raises OutputFault (the previous version stays) when it cannot."""
        t0 = time.monotonic()
        data = json.dumps(doc, indent=1, ensure_ascii=False, allow_nan=False, default=str).encode("utf-8")
        atomic_write_bytes(self.path, data + b"\n", tag=self.tag)
        self._last = time.monotonic()
        self._cost = self._last - t0

    def due(self) -> bool:
        if self._last is None:
            return True
        return time.monotonic() - self._last >= max(self.min_interval_s, 20 * self._cost)


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on path's filesystem (None where unknown)."""
    try:
        st = os.statvfs(path)
    except (AttributeError, OSError):  # not POSIX, or a filesystem that will not say
        return None
    return st.f_bavail * st.f_frsize
