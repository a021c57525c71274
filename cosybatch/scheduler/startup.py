"""Start-up, timed by phase: what a run pays before its first row (loading weights, the
frontend's warm-up, the AR engine's graph captures). The window a run's throughput is measured
over starts after all of it, so the summary and timing.json report it beside that figure
rather than hide it.

Independent parts of it run at once (``StartupClock.parallel``): their phase is the wall time
of the whole group, so the phases still add up to the start-up, and each part's own time is
reported inside that phase (``parallel_s``), never as a phase of its own."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

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


def bytecode_state(module: str = "torch") -> str:
    """"missing" when ``module`` (imported already) was compiled from its Python source and left
    no bytecode for the next run, else "cached". Bytecode goes where ``importlib`` looks for it
    (the package's ``__pycache__``, or ``PYTHONPYCACHEPREFIX``'s tree); an import writes it
    unless ``PYTHONDONTWRITEBYTECODE`` is set or it cannot write there. pip writes it at install;
    ``pip --no-compile``, uv without ``--compile-bytecode`` and many container images do not, and
    such an image often sets ``PYTHONDONTWRITEBYTECODE`` too: then every process compiles torch
    again (its ~700 modules: ``import torch`` 2.2-2.7 s against 0.9-1.0 s from bytecode on a
    2-core CPU machine)."""
    spec = importlib.util.find_spec(module)
    cached = getattr(spec, "cached", None) if spec is not None else None
    return "missing" if cached and not os.path.exists(cached) else "cached"


_told_bytecode = False


class StartupClock:
    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.phases: dict[str, float] = {}
        self.parallel_parts: dict[str, dict[str, float]] = {}  # a parallel phase -> its parts' times
        # "cold", "partial" or "warm" on CUDA (gpu.triton_cache.kernel_cache_state): whether the
        # run's figures include compiling the GPU kernels (all, some, none of the launch list's)
        self.kernel_cache: str | None = None
        age = process_age_s()
        # "missing": this run's imports compiled torch's source, as every later run's will
        self.bytecode = bytecode_state()
        global _told_bytecode
        if self.bytecode == "missing" and not _told_bytecode:
            _told_bytecode = True
            log.warning("torch's Python bytecode is not installed and was not written (%s): every run compiles its "
                        "source again (this one's start and imports: %.1f s); the cosybatch command keeps it in a "
                        "cache folder unless COSYBATCH_PYCACHE=off or the folder is not writable (set COSYBATCH_PYCACHE "
                        "or PYTHONPYCACHEPREFIX to a writable one)",
                        "PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode else "its folder is not writable",
                        age or 0.0)
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

    @contextlib.contextmanager
    def parallel(self, name: str):
        """A phase whose parts run at once: ``start(part, fn)`` runs ``fn`` on a thread of its
        own and returns a ``Part`` (``result()`` waits for it); ``part(part)`` times a block of
        the calling thread. The phase ends when every part has (each is joined, also when
        another failed: no thread of the start-up outlives it); the first error (the calling
        thread's first) is raised then."""
        group = _Parallel()
        with self.phase(name):
            try:
                yield group
            finally:
                errors = group.join()
                self.parallel_parts[name] = {k: round(v, 3) for k, v in group.times.items()}
            if errors:
                raise errors[0]

    @property
    def total_s(self) -> float:
        return round(sum(self.phases.values()), 3)

    def as_dict(self) -> dict:
        out = {"total_s": self.total_s, "phases_s": dict(self.phases)}
        if self.parallel_parts:
            out["parallel_s"] = {k: dict(v) for k, v in self.parallel_parts.items()}
        if self.kernel_cache is not None:
            out["kernel_cache"] = self.kernel_cache
        out["bytecode"] = self.bytecode
        return out

    def log(self) -> None:
        def one(k: str, v: float) -> str:
            inside = self.parallel_parts.get(k)
            return f"{k} {v:.1f} s" + (f" ({', '.join(f'{p} {t:.1f} s' for p, t in inside.items())})" if inside else "")
        log.info("start-up %.1f s: %s", self.total_s, ", ".join(one(k, v) for k, v in self.phases.items()))


class Part:
    """One part of a parallel phase running on its own thread."""

    def __init__(self, group: "_Parallel", name: str, fn: Callable[[], Any]):
        self._value: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(group, name, fn), name=f"start-up: {name}")

    def _run(self, group: "_Parallel", name: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            self._value = fn()
        except BaseException as e:  # handed to the thread that waits for it
            self.error = e
        finally:
            group.times[name] = time.perf_counter() - t0

    def result(self) -> Any:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self._value


class _Parallel:
    def __init__(self):
        self.times: dict[str, float] = {}
        self._parts: list[Part] = []

    def start(self, name: str, fn: Callable[[], Any]) -> Part:
        p = Part(self, name, fn)
        self._parts.append(p)
        p._thread.start()
        return p

    @contextlib.contextmanager
    def part(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = time.perf_counter() - t0

    def join(self) -> list[BaseException]:
        for p in self._parts:
            p._thread.join()
        return [p.error for p in self._parts if p.error is not None]
