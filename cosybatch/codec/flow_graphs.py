"""A bounded pool of captured flow Euler steps, one per layout bucket (design.md D16).

An entry owns a bucket's step buffers (the graph's static inputs, allocated outside the graph
pool) and, once captured, the graph of one Euler step over them. A solve fills the buffers,
then replays the step once per Euler step. Entries live in a ``GraphSlots`` cache (the one the
HiFT and frontend graph caches use too): evicted least recently used at ``capacity``; a capture
that fails (out of memory, an op that cannot be captured) disables that bucket, logs once and
leaves its solves to run the same step eagerly on the same buffers, so a request never fails
because of a graph. The capture mechanism is injectable
(``capture``), so the pool logic is tested on the CPU with the class the runner uses.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from cosybatch.codec.flow_step import StepBuffers
from cosybatch.gpu.cuda_graphs import GraphPool
from cosybatch.gpu.graph_cache import GraphSlots, stats_dict

log = logging.getLogger(__name__)

StepFn = Callable[[StepBuffers], None]
# capture(fn) -> replay: a callable that re-runs what fn did; raises if it cannot capture
Capture = Callable[[Callable[[], None]], Callable[[], None]]


@dataclass
class FlowGraphStats:
    solves: int = 0
    steps: int = 0
    replays: int = 0
    eager_steps: int = 0
    captures: int = 0
    precaptures: int = 0  # of ``captures``, those made at start-up (``precapture``)
    failures: int = 0
    evictions: int = 0
    entries: int = 0
    keys: int = 0  # distinct buckets seen: with ``captures`` it tells capacity from key spread
    buffer_bytes: int = 0  # static inputs the live entries hold
    pool_bytes: int = 0  # the shared graph pool's growth during captures (CUDA)
    failed_keys: list = field(default_factory=list)
    # the first LOGGED captures, each [tokens per branch, jobs, host ms, at start-up]: which
    # buckets a run met that start-up did not capture, and what each cost the thread that owns
    # the GPU (its queue drained, the GPU idle meanwhile)
    capture_log: list = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Share of steps replayed from a graph."""
        return self.replays / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return stats_dict(self)


LOGGED = 32


def _bucket_label(key: Hashable) -> tuple:
    """(tokens per branch, jobs) of a bucket key (``flow_buckets.key``); the key itself otherwise."""
    try:
        d = dict(key)
        return d["stride"], d["jobs"]
    except (TypeError, ValueError, KeyError):
        return (str(key),)


@dataclass
class _Entry:
    buffers: StepBuffers
    replay: Callable[[], None] | None = None  # dropped with the entry when evicted (its pool memory stays shared)
    nbytes: int = 0


class CudaCapture(GraphPool):
    """A ``Capture`` of ``torch.cuda`` graphs in one shared pool: safe because replays run one
    after another on one stream and a step keeps nothing allocated in the pool past its end."""

    def __call__(self, fn: Callable[[], None]) -> Callable[[], None]:
        graph, _ = self.capture(fn)
        return graph.replay


class FlowGraphs:
    """Step buffers and graphs per layout bucket, on the ``GraphSlots`` cache every graph cache
    shares: a bucket's slot holds its buffers and, once captured (at first sight, D16), its graph."""

    def __init__(self, step: StepFn, capacity: int = 32, capture: Capture | None = None, enabled: bool = True):
        if capacity < 1:
            raise ValueError("flow graph capacity must be >= 1")
        self.step_fn = step
        self.capture = capture if capture is not None else CudaCapture()
        self.enabled = enabled
        self.slots = GraphSlots(capacity, max_counters=max(capacity, 128), name="flow")
        self._seen: set = set()
        self.stats = FlowGraphStats()

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    def entry(self, key: Hashable, make: Callable[[], StepBuffers]) -> _Entry:
        """The bucket's entry (buffers reused from solve to solve), made on first use."""
        e = self.slots.get(key)
        if e is not None:
            return e
        self._seen.add(key)
        buffers = make()
        e = _Entry(buffers, nbytes=_nbytes(buffers))
        self.slots.add(key, e, static_bytes=e.nbytes)
        self._sync()
        return e

    def captured(self, key: Hashable) -> bool:
        """Whether the bucket's step is captured already (its next solve captures nothing)."""
        e = self.slots.get(key)
        return e is not None and e.replay is not None

    def run_step(self, key: Hashable, e: _Entry) -> None:
        """One Euler step over ``e.buffers``: replayed, captured now, or eager."""
        st = self.stats
        st.steps += 1
        if e.replay is None and self.enabled and not self.slots.disabled(key):
            self._capture(key, e)
        if e.replay is not None:
            st.replays += 1
            e.replay()
            return
        st.eager_steps += 1
        self.step_fn(e.buffers)

    def precapture(self, key: Hashable, make: Callable[[], StepBuffers]) -> int:
        """Make the bucket's entry and capture its step now (start-up); 1 if captured. Like live
        traffic, a bucket beyond ``capacity`` evicts the least recently used one."""
        if not self.enabled or self.slots.disabled(key):
            return 0
        e = self.entry(key, make)
        if e.replay is not None:
            return 0
        self._capture(key, e, startup=True)
        if e.replay is None:
            return 0
        self.stats.precaptures += 1
        return 1

    def clear(self) -> None:
        self.slots.clear()
        self._sync()

    def _capture(self, key: Hashable, e: _Entry, startup: bool = False) -> None:
        b = e.buffers
        t0 = time.perf_counter()
        # The capture's warm-up runs the step for real: keep the state it advances. (Its K/V
        # and trajectory writes are rewritten with the same values by the step that follows.)
        x, step = b.x.clone(), b.step.clone()
        before = torch.cuda.memory_reserved() if b.x.is_cuda else 0
        try:
            e.replay = self.capture(lambda: self.step_fn(b))
        except Exception as exc:
            self.slots.disable(key, exc, f"bucket {key}")
        finally:
            b.x.copy_(x)
            b.step.copy_(step)
        if e.replay is not None:
            self.stats.captures += 1
            if b.x.is_cuda:
                self.slots.add_pool_bytes(key, max(0, torch.cuda.memory_reserved() - before))
            if len(self.stats.capture_log) < LOGGED:
                ms = round(1e3 * (time.perf_counter() - t0), 1)
                self.stats.capture_log.append([*_bucket_label(key), ms, startup])
        self._sync()

    def _sync(self) -> None:
        s, st = self.slots, self.stats
        st.entries, st.keys, st.evictions, st.failures = len(s), len(self._seen), s.evictions, s.failures
        st.buffer_bytes, st.pool_bytes, st.failed_keys = s.static_bytes, s.pool_bytes, s.failed_keys


def _nbytes(b: StepBuffers) -> int:
    n = 0
    for v in vars(b).values():
        ts = v.tensors.values() if hasattr(v, "tensors") else [v]
        n += sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))
    return n
