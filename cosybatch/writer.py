"""Everything synth leaves in OUT: WAVs, the ledger, timing.json.

Crash safety rests on two rules: a final name (``<utt_id>.wav``, ``timing.json``) only
ever appears through ``os.replace`` of a fully written and fsynced temp file, and the
ledger is append-only with one fsynced line per event, so a ``kill -9`` at any moment
leaves at worst an orphan temp file and a torn last ledger line (both tolerated).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

log = logging.getLogger(__name__)

WAV_SUBTYPES = ("PCM_16", "FLOAT")
TMP_MARK = ".cbtmp"  # temp names: .<final name>.cbtmp<tag>; never end in .wav/.json


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


def atomic_write_bytes(final: Path, data: bytes, tag: str = "") -> None:
    tmp = _tmp_path(final, tag)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_dir(final.parent)


def write_wav_atomic(final: Path, audio: np.ndarray, sample_rate: int,
                     subtype: str = "PCM_16", tag: str = "") -> int:
    """Write a mono WAV under its final name atomically; returns the file size."""
    import soundfile as sf

    if subtype not in WAV_SUBTYPES:
        raise ValueError(f"wav subtype {subtype!r}: expected one of {', '.join(WAV_SUBTYPES)}")
    data = np.asarray(audio, dtype=np.float32).reshape(-1)
    if subtype == "PCM_16":
        # libsndfile does not clip float->int by default; out-of-range samples would wrap.
        data = np.clip(data, -1.0, 1.0)
    tmp = _tmp_path(final, tag)
    try:
        with open(tmp, "wb") as f:
            sf.write(f, data, int(sample_rate), subtype=subtype, format="WAV")
            f.flush()
            os.fsync(f.fileno())
        size = os.path.getsize(tmp)
        os.replace(tmp, final)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_dir(final.parent)
    return size


def _unlink_quietly(p: Path) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


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
    """Append-only JSON-lines record of run starts, row outcomes and run ends."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "ab")
        # A kill during the previous append can leave a torn line without its newline;
        # terminate it so the next record starts on a line of its own.
        if self._f.tell() > 0:
            with open(path, "rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    self._f.write(b"\n")
                    self._f.flush()

    def append(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 3), **record}
        line = json.dumps(record, ensure_ascii=False, allow_nan=False, default=str) + "\n"
        self._f.write(line.encode("utf-8"))
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

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
        t0 = time.monotonic()
        data = json.dumps(doc, indent=1, ensure_ascii=False, allow_nan=False, default=str).encode("utf-8")
        atomic_write_bytes(self.path, data + b"\n", tag=self.tag)
        self._last = time.monotonic()
        self._cost = self._last - t0

    def due(self) -> bool:
        if self._last is None:
            return True
        return time.monotonic() - self._last >= max(self.min_interval_s, 20 * self._cost)
