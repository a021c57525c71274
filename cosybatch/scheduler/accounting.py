"""Where the GPU timeline's time went: per-slice GPU durations from CUDA events read later.

Every slice the pipeline queues is bracketed by two events; their elapsed time is read only
once the end event has completed (``poll`` never blocks), so measuring costs the host two
event records per slice and never a sync. On the CPU the work is synchronous and wall time is
the slice's time. ``summary`` gives what tells the next optimisation where to go: AR step
p50/p90 inside the pipeline, GPU busy share per slice kind and idle share, host milliseconds
per iteration, and the host milliseconds spent queueing each kind of slice (a slice whose GPU
time is close to its queueing time kept the GPU waiting for the host).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from collections import defaultdict, deque
from typing import Callable

import numpy as np
import torch


class Accounting:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._free: list = []
        self._open: deque = deque()  # (kind, start, end, on_done, when queued) in queue order
        self.ms: dict[str, list[float]] = defaultdict(list)
        # host time spent queueing each slice: close to its GPU time means the GPU waited for the host
        self.queue_ms: dict[str, float] = defaultdict(float)
        self.host_ms: list[float] = []
        self.wait_ms: list[float] = []  # per iteration: host time blocked on the GPU
        self.ends: list[float] = []  # per iteration: when it ended (host clock)
        self.starts: dict[str, list[float]] = defaultdict(list)  # per slice of ``ms``: when it was queued
        self.queued: dict[str, list[float]] = defaultdict(list)  # per slice of ``ms``: host ms queueing it
        self.sizes: dict[str, list[int]] = defaultdict(list)  # per slice of ``ms``: its rows or prompts
        self.marks: dict[str, list[tuple[float, int]]] = defaultdict(list)  # (when, how many) per named event
        self._waiting = 0.0
        self._t0 = time.perf_counter()

    def _event(self):
        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

    def start(self, kind: str, on_done: Callable[[float], None] | None = None):
        """Open a slice; pass the token to ``end`` after queueing its work."""
        if self.cuda:
            ev = self._event()
            ev.record()
            return (kind, ev, on_done, time.perf_counter())
        t = time.perf_counter()
        return (kind, t, on_done, t)

    def mark(self, name: str, n: int = 1) -> None:
        """Count ``n`` events of ``name`` now (e.g. prompts whose audio finished loading), for
        the window by tenth."""
        self.marks[name].append((time.perf_counter(), n))

    def end(self, token, as_kind: str | None = None, size: int = 0) -> None:
        """Close a slice. ``as_kind``: count it under another kind (a slice that captured a CUDA
        graph: its time is not what a replay costs, so it teaches ``on_done`` nothing).
        ``size``: the rows or prompts it served (by tenth: how large the launches were)."""
        kind, start, on_done, t0 = token
        if as_kind is not None:
            kind, on_done = as_kind, None
        queued = (time.perf_counter() - t0) * 1e3
        self.queue_ms[kind] += queued
        if self.cuda:
            ev = self._event()
            ev.record()
            self._open.append((kind, start, ev, on_done, t0, queued, size))
            return
        self._done(kind, (time.perf_counter() - start) * 1e3, on_done, t0, queued, size)

    def cancel(self, token) -> None:
        """Drop a slice that queued no work."""
        if self.cuda:
            self._free.append(token[1])

    def _done(self, kind: str, ms: float, on_done, t0: float, queued: float, size: int) -> None:
        self.ms[kind].append(ms)
        self.starts[kind].append(t0)
        self.queued[kind].append(queued)
        self.sizes[kind].append(size)
        if on_done is not None:
            on_done(ms)

    def poll(self) -> None:
        """Read every finished slice (in queue order, so it stops at the first unfinished)."""
        while self._open and self._open[0][2].query():
            kind, start, end, on_done, t0, queued, size = self._open.popleft()
            self._done(kind, start.elapsed_time(end), on_done, t0, queued, size)
            self._free += [start, end]

    @contextmanager
    def waiting(self):
        """Bracket host code that blocks on the GPU (a sync, a device-to-host read) or on the
        frontend's workers (nothing else to do): what is
        left of an iteration is the host's own work, which tells a host-bound run from a
        GPU-bound one (slice times include any gap the GPU spent waiting for the host)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._waiting += time.perf_counter() - t0

    def reset(self) -> None:
        """Start a new window (slices still open are counted in it)."""
        self.ms.clear()
        self.starts.clear()
        self.queued.clear()
        self.sizes.clear()
        self.marks.clear()
        self.queue_ms.clear()
        self.host_ms.clear()
        self.wait_ms.clear()
        self.ends.clear()
        self._t0 = time.perf_counter()

    def iteration(self, host_ms: float) -> None:
        self.host_ms.append(host_ms)
        self.ends.append(time.perf_counter())
        self.wait_ms.append(self._waiting * 1e3)
        self._waiting = 0.0

    def busy_s(self) -> dict[str, float]:
        return {k: sum(v) / 1e3 for k, v in self.ms.items()}

    def summary(self, wall_s: float | None = None, settle: bool = True) -> dict:
        """``settle``: wait for the GPU first, so slices still running are counted; without it
        only the finished ones are (a snapshot that never stalls the pipeline)."""
        if self.cuda and settle:
            torch.cuda.synchronize()
        self.poll()
        wall = wall_s if wall_s is not None else time.perf_counter() - self._t0
        busy = self.busy_s()
        out: dict = {"wall_s": round(wall, 4), "iterations": len(self.host_ms)}
        ar = np.array(self.ms.get("ar_decode", []))
        if ar.size:
            out["ar_step_ms"] = {"p50": round(float(np.median(ar)), 4), "p90": round(float(np.percentile(ar, 90)), 4),
                                 "mean": round(float(ar.mean()), 4), "count": int(ar.size)}
        out["slice_ms"] = {k: {"total": round(sum(v), 3), "count": len(v), "mean": round(sum(v) / len(v), 4)}
                           for k, v in sorted(self.ms.items()) if v}
        out["slice_queue_ms"] = {k: round(v, 3) for k, v in sorted(self.queue_ms.items()) if v}
        out["busy_share"] = {k: round(v / wall, 4) for k, v in sorted(busy.items())} if wall > 0 else {}
        out["gpu_idle_share"] = round(max(0.0, 1.0 - sum(busy.values()) / wall), 4) if wall > 0 and self.cuda else None
        if self.host_ms:
            h = np.array(self.host_ms)
            out["host_ms_per_iteration"] = {"p50": round(float(np.median(h)), 4), "mean": round(float(h.mean()), 4)}
            w = np.array(self.wait_ms)
            own = h - w
            out["host_busy_ms_per_iteration"] = {"p50": round(float(np.median(own)), 4), "mean": round(float(own.mean()), 4)}
            out["host_wait_share"] = round(float(w.sum() / h.sum()), 4) if h.sum() > 0 else None
        if wall > 0:
            out["by_tenth"] = self._by_tenth(wall)
        return out

    def _by_tenth(self, wall: float) -> dict:
        """The window in ten equal parts: each slice kind's GPU milliseconds (by when it was
        queued) and the host's own milliseconds (its iterations less their waits for the GPU),
        as shares of a part. Where a run's ramp or drain goes, beside NVML's kernel-active share
        by tenth: a part with little GPU work and a busy host was host-bound, one with little
        of either had nothing to do. Beside them, per tenth: how many slices of each kind, the
        host's milliseconds queueing them (as shares of a part: close to the GPU's share, the
        GPU waited for the host), the rows or prompts they served where the caller said, and
        each named event's count (``mark``)."""
        edges = self._t0 + wall * np.arange(1, 10) / 10
        part_ms = wall * 100.0  # a tenth, in ms

        def sums(times, values) -> np.ndarray:  # ``values`` summed by the tenth of their ``times``
            idx = np.searchsorted(edges, np.asarray(times, dtype=float), side="right")
            return np.bincount(idx, weights=np.asarray(values, dtype=float), minlength=10)[:10]

        def shares(times, values) -> list[float]:
            return [round(float(v / part_ms), 3) for v in sums(times, values)]

        def counts(times, values) -> list[int]:
            return [int(v) for v in sums(times, values)]

        own = np.array(self.host_ms) - np.array(self.wait_ms)
        kinds = [k for k, v in sorted(self.ms.items()) if v]
        return {"slices": {k: shares(self.starts[k], self.ms[k]) for k in kinds},
                "host_own": shares(self.ends, own) if self.ends else None,
                "count": {k: counts(self.starts[k], [1] * len(self.ms[k])) for k in kinds},
                "queue": {k: shares(self.starts[k], self.queued[k]) for k in kinds},
                "size": {k: counts(self.starts[k], self.sizes[k]) for k in kinds if any(self.sizes[k])},
                "marks": {k: counts([t for t, _ in v], [n for _, n in v]) for k, v in sorted(self.marks.items()) if v}}
