"""A bounded pool of captured flow Euler steps, one per layout bucket (design.md D16).

An entry owns a bucket's step buffers (the graph's static inputs, allocated outside the graph
pool) and, once captured, the graph of one Euler step over them. A solve fills the buffers,
then replays the step once per Euler step. Entries are evicted least recently used at
``capacity``; a capture that fails (out of memory, an op that cannot be captured) disables
that bucket, logs once and leaves its solves to run the same step eagerly on the same
buffers, so a request never fails because of a graph. The capture mechanism is injectable
(``capture``), so the pool logic is tested on the CPU with the class the runner uses.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from cosybatch.codec.flow_step import StepBuffers
from cosybatch.gpu.cuda_graphs import GraphPool
from cosybatch.gpu.graph_cache import stats_dict

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
    failures: int = 0
    evictions: int = 0
    entries: int = 0
    keys: int = 0  # distinct buckets seen: with ``captures`` it tells capacity from key spread
    buffer_bytes: int = 0  # static inputs the live entries hold
    pool_bytes: int = 0  # the shared graph pool's growth during captures (CUDA)
    failed_keys: list = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Share of steps replayed from a graph."""
        return self.replays / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return stats_dict(self)


@dataclass
class _Entry:
    buffers: StepBuffers
    replay: Callable[[], None] | None = None
    disabled: bool = False
    nbytes: int = 0


class CudaCapture(GraphPool):
    """A ``Capture`` of ``torch.cuda`` graphs in one shared pool: safe because replays run one
    after another on one stream and a step keeps nothing allocated in the pool past its end."""

    def __call__(self, fn: Callable[[], None]) -> Callable[[], None]:
        graph, _ = self.capture(fn)
        return graph.replay


class FlowGraphs:
    def __init__(self, step: StepFn, capacity: int = 32, capture: Capture | None = None, enabled: bool = True):
        if capacity < 1:
            raise ValueError("flow graph capacity must be >= 1")
        self.step_fn = step
        self.capacity = capacity
        self.capture = capture if capture is not None else CudaCapture()
        self.enabled = enabled
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._seen: set = set()
        self.stats = FlowGraphStats()

    def entry(self, key: Hashable, make: Callable[[], StepBuffers]) -> _Entry:
        """The bucket's entry (buffers reused from solve to solve), made on first use."""
        e = self._entries.get(key)
        if e is not None:
            self._entries.move_to_end(key)
            return e
        while len(self._entries) >= self.capacity:
            self._evict(next(iter(self._entries)))
        self._seen.add(key)
        self.stats.keys = len(self._seen)
        buffers = make()
        e = _Entry(buffers, nbytes=_nbytes(buffers))
        self._entries[key] = e
        self.stats.entries = len(self._entries)
        self.stats.buffer_bytes += e.nbytes
        return e

    def run_step(self, key: Hashable, e: _Entry) -> None:
        """One Euler step over ``e.buffers``: replayed, captured now, or eager."""
        st = self.stats
        st.steps += 1
        if e.replay is None and self.enabled and not e.disabled:
            self._capture(key, e)
        if e.replay is not None:
            st.replays += 1
            e.replay()
            return
        st.eager_steps += 1
        self.step_fn(e.buffers)

    def clear(self) -> None:
        for key in list(self._entries):
            self._evict(key)

    def _capture(self, key: Hashable, e: _Entry) -> None:
        b = e.buffers
        # The capture's warm-up runs the step for real: keep the state it advances. (Its K/V
        # and trajectory writes are rewritten with the same values by the step that follows.)
        x, step = b.x.clone(), b.step.clone()
        before = torch.cuda.memory_reserved() if b.x.is_cuda else 0
        try:
            e.replay = self.capture(lambda: self.step_fn(b))
        except Exception as exc:
            e.disabled = True
            self.stats.failures += 1
            self.stats.failed_keys = (self.stats.failed_keys + [key])[-8:]
            log.warning("flow: CUDA graph capture failed for bucket %s; that bucket runs eager (%s: %s)",
                        key, type(exc).__name__, exc)
        finally:
            b.x.copy_(x)
            b.step.copy_(step)
        if e.replay is not None:
            self.stats.captures += 1
            if b.x.is_cuda:
                self.stats.pool_bytes += max(0, torch.cuda.memory_reserved() - before)

    def _evict(self, key: Hashable) -> None:
        e = self._entries.pop(key)
        self.stats.evictions += 1
        self.stats.entries = len(self._entries)
        self.stats.buffer_bytes -= e.nbytes
        e.replay = None  # drops the graph (its pool memory stays shared with the others)


def _nbytes(b: StepBuffers) -> int:
    n = 0
    for v in vars(b).values():
        ts = v.tensors.values() if hasattr(v, "tensors") else [v]
        n += sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))
    return n
