"""timing.json: the run's per-row and total timings, rewritten atomically as the run goes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from cosybatch.atomic import atomic_write_bytes


TIMING_SCHEMA = "cosybatch.timing/1"


def timing_files(out_dir: Path) -> list[Path]:
    return sorted(p for p in out_dir.glob("timing*.json") if p.is_file())


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
