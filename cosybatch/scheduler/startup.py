"""Start-up, timed by phase: what a run pays before its first row (loading weights, the
frontend's warm-up, the AR engine's graph captures). The window a run's throughput is measured
over starts after all of it, so the summary and timing.json report it beside that figure
rather than hide it."""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

log = logging.getLogger(__name__)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere). A clock's first phase,
    "process start and imports", is this age when the clock starts: the interpreter's start,
    the imports and what the command did before loading (reading the manifest; for ``profile``
    without one, building its workload the first time)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.phases: dict[str, float] = {}
        age = process_age_s()
        if age is not None:
            self.phases["process start and imports"] = round(age, 3)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block; on CUDA its queued work is waited for, so a phase owns its GPU time.
        Its start is logged: start-up takes tens of seconds on a GPU, and a person watching
        should see which part is running."""
        log.info("start-up: %s ...", name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.phases[name] = round(self.phases.get(name, 0.0) + time.perf_counter() - t0, 3)

    @property
    def total_s(self) -> float:
        return round(sum(self.phases.values()), 3)

    def as_dict(self) -> dict:
        return {"total_s": self.total_s, "phases_s": dict(self.phases)}

    def log(self) -> None:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in self.phases.items())
        log.info("start-up %.1f s: %s", self.total_s, parts)
