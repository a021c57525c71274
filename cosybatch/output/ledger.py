"""The ledger: append-only JSON lines, one per run start, row outcome and run end; reading it back."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

from cosybatch.atomic import faults_as, write_all

log = logging.getLogger(__name__)


class Ledger:
    """Append-only JSON-lines record of run starts, row outcomes and run ends.

    Unbuffered (``os.write`` on an O_APPEND descriptor): a failed append leaves nothing
    queued that a later flush or close could write after the fact. Any OSError while
    appending is an OutputFault: a run that cannot keep its records must stop.
    """

    def __init__(self, path: Path):
        self.path = path
        with faults_as(path, every_oserror=True):
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
        with faults_as(self.path, every_oserror=True):
            self._append_bytes(line.encode("utf-8"))

    def _append_bytes(self, data: bytes) -> None:
        start = os.fstat(self._fd).st_size  # O_APPEND: this is where the line lands (one writer: the lock)
        try:
            write_all(self._fd, data)
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
