"""A bounded cache of CUDA graphs for one deterministic function of tensors.

What it fixes in the design it was modelled on (design.md D11):

* a capture failure (OOM, a sync inside the function, stream activity) disables that key,
  logs a warning and returns the eager result -- a request never fails because of a graph;
  capture runs in ``thread_local`` error mode on a side stream;
* at capacity the least recently used graph is evicted, so a shape that becomes hot late
  still gets a graph; the use counters are bounded (LRU) as well;
* shapes known in advance are captured at start-up (``precapture``), so the capture cost
  does not land on a live request, and the memory the graphs hold is reported;
* the capture mechanism is injectable (``backend``), so the cache logic is tested on the
  CPU with the same class the runner uses; GPU tests exercise ``CudaGraphBackend``.

A key is the exact shapes, dtypes and devices of the inputs, any ``static`` values the
function depends on, and the float32 precision flags (a graph captured with TF32 kernels
must not serve a call made with TF32 off). Replays return a clone the caller owns: the
graph's output buffer is overwritten by the next replay. The call that captures returns its
eager warm-up's result (also owned) instead of replaying the same computation.
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Protocol, Sequence

import torch

from cosybatch.gpu.cuda_graphs import GraphPool

log = logging.getLogger(__name__)

Fn = Callable[..., "torch.Tensor | tuple[torch.Tensor, ...]"]


class Captured(Protocol):
    static_inputs: Sequence[torch.Tensor]
    static_output: torch.Tensor
    # the warm-up call's result (or None): the call that captured returns it instead of a
    # replay, which would compute the same again (a backend may leave it out)
    warm_output: "torch.Tensor | tuple[torch.Tensor, ...] | None"

    def replay(self) -> None: ...


class CaptureBackend(Protocol):
    def capture(self, fn: Fn, inputs: Sequence[torch.Tensor]) -> Captured: ...

    def release(self, captured: Captured) -> None: ...


def precision_flags() -> tuple:
    """The float32 math settings a captured kernel choice depends on."""
    with warnings.catch_warnings():  # newer torch deprecates reading allow_tf32
        warnings.simplefilter("ignore")
        flags = [torch.get_float32_matmul_precision()]
        try:
            flags.append(bool(torch.backends.cuda.matmul.allow_tf32))
        except Exception:  # pragma: no cover - attribute layout changes across versions
            flags.append(None)
        cudnn = torch.backends.cudnn
        for name in ("allow_tf32", "enabled", "deterministic", "benchmark"):
            try:
                flags.append(bool(getattr(cudnn, name)))
            except Exception:  # pragma: no cover
                flags.append(None)
    return tuple(flags)


@dataclass
class _CudaCaptured:
    graph: object
    static_inputs: list
    static_output: torch.Tensor
    reserved_delta: int = 0
    warm_output: object = None

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphBackend:
    """``torch.cuda.graph`` capture on a private side stream, in thread-local error mode.

    All graphs share one ``GraphPool`` (sharing is safe here: replays are sequential on one
    stream, inputs live outside the pool, and every output is cloned right after its replay).
    """

    def __init__(self, warmup: int = 1, share_pool: bool = True) -> None:
        self.warmup = warmup
        self._graphs = GraphPool(share=share_pool)

    def capture(self, fn: Fn, inputs: Sequence[torch.Tensor]) -> _CudaCaptured:
        static_inputs = [x.clone() for x in inputs]  # ordinary allocations, not the pool
        run = lambda: fn(*static_inputs)  # noqa: E731
        warm = None
        for _ in range(self.warmup):  # before measuring, so the pool's growth is the graph's own
            warm = run()  # an eager call on the caller's stream, into ordinary memory
        # The graph's private pool never takes blocks from the general cache, so the growth of
        # reserved memory across the capture is the pool's own (no need to empty the cache,
        # which every later allocation would pay for; see ``cuda_graphs``).
        before = torch.cuda.memory_reserved()
        graph, out = self._graphs.capture(run, warmup=0)
        delta = max(0, torch.cuda.memory_reserved() - before)
        return _CudaCaptured(graph, static_inputs, out, delta, warm)

    def release(self, captured: Captured) -> None:
        reset = getattr(getattr(captured, "graph", None), "reset", None)
        if reset is not None:
            reset()


@dataclass
class GraphCacheStats:
    calls: int = 0
    hits: int = 0
    eager: int = 0
    captures: int = 0
    precaptures: int = 0
    failures: int = 0
    evictions: int = 0
    graphs: int = 0
    counters: int = 0
    disabled: int = 0
    pool_reserved_bytes: int = 0  # growth of reserved memory during the live graphs' captures
    static_bytes: int = 0  # inputs + outputs the live graphs keep
    failed_keys: list = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Share of calls served by replaying an existing graph (captures not counted)."""
        return self.hits / self.calls if self.calls else 0.0

    def as_dict(self) -> dict:
        return stats_dict(self)


def stats_dict(stats) -> dict:
    """A graph cache's counters for reports: every field but the failed keys, and the hit rate."""
    d = {k: v for k, v in vars(stats).items() if k != "failed_keys"}
    d["hit_rate"] = round(stats.hit_rate, 4)
    return d


class GraphSlots:
    """The bounded cache behind every graph cache of the codec and the frontend.

    At most ``capacity`` keys hold a slot (a captured graph, or a bucket's buffers and its
    graph), the least recently used evicted first, so a key that becomes hot late still gets
    one. Keys without a slot yet are counted, with the counters bounded the same way. A key
    whose capture failed is disabled: logged once, it runs eager from then on, and the
    disabled set is bounded too. Each slot's static bytes and pool growth are summed, so the
    memory the graphs hold is reported. ``on_evict(value)`` releases what a slot held.
    """

    def __init__(self, capacity: int, max_counters: int, name: str,
                 on_evict: Callable[[object], None] | None = None) -> None:
        if capacity < 1 or max_counters < 1:
            raise ValueError("capacity and max_counters must be >= 1")
        self.capacity, self.max_counters, self.name = capacity, max_counters, name
        self.on_evict = on_evict
        self._slots: OrderedDict[Hashable, tuple[object, int, int]] = OrderedDict()
        self._counters: OrderedDict[Hashable, int] = OrderedDict()
        self._disabled: OrderedDict[Hashable, str] = OrderedDict()
        self.evictions = 0
        self.failures = 0
        self.static_bytes = 0
        self.pool_bytes = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def values(self) -> list:
        return [v for v, _, _ in self._slots.values()]

    def get(self, key: Hashable):
        """The key's slot value (now the most recently used), or None."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        self._slots.move_to_end(key)
        return slot[0]

    def count_use(self, key: Hashable) -> int:
        """Uses of a key without a slot, this one included (the counter is dropped when it
        reaches the caller's threshold: the caller then adds a slot or disables the key)."""
        uses = self._counters.pop(key, 0) + 1
        self._counters[key] = uses
        while len(self._counters) > self.max_counters:
            self._counters.popitem(last=False)
        return uses

    def forget_uses(self, key: Hashable) -> None:
        self._counters.pop(key, None)

    def disabled(self, key: Hashable) -> bool:
        return key in self._disabled

    def disable(self, key: Hashable, exc: BaseException, what: str) -> None:
        """A capture of ``key`` failed: it runs eager from now on (logged once)."""
        self.failures += 1
        self._counters.pop(key, None)
        self._disabled[key] = f"{type(exc).__name__}: {exc}"
        while len(self._disabled) > self.max_counters:
            self._disabled.popitem(last=False)
        log.warning("%s: CUDA graph capture failed for %s; %s runs eager (%s: %s)",
                    self.name, what, what, type(exc).__name__, exc)

    @property
    def failed_keys(self) -> list:
        return list(self._disabled)[-8:]

    @property
    def counters(self) -> int:
        return len(self._counters)

    @property
    def disabled_count(self) -> int:
        return len(self._disabled)

    def make_room(self) -> None:
        """Evict least recently used slots until one more fits."""
        while len(self._slots) >= self.capacity:
            self.evict(next(iter(self._slots)))

    def add(self, key: Hashable, value, static_bytes: int = 0, pool_bytes: int = 0) -> None:
        self.make_room()
        self._counters.pop(key, None)
        self._slots[key] = (value, int(static_bytes), int(pool_bytes))
        self.static_bytes += int(static_bytes)
        self.pool_bytes += int(pool_bytes)

    def add_pool_bytes(self, key: Hashable, pool_bytes: int) -> None:
        """A slot's capture came after its slot (a flow bucket's buffers, then its graph)."""
        value, static, pool = self._slots[key]
        self._slots[key] = (value, static, pool + int(pool_bytes))
        self.pool_bytes += int(pool_bytes)

    def evict(self, key: Hashable) -> None:
        value, static, pool = self._slots.pop(key)
        self.evictions += 1
        self.static_bytes -= static
        self.pool_bytes -= pool
        if self.on_evict is not None:
            try:
                self.on_evict(value)
            except Exception as exc:  # pragma: no cover - releasing must not fail a request
                log.warning("%s: releasing an evicted graph failed: %s", self.name, exc)

    def clear(self) -> None:
        for key in list(self._slots):
            self.evict(key)
        self._counters.clear()
        self._disabled.clear()


class GraphCache:
    """Graph-or-eager dispatch for ``fn(*tensors) -> tensor`` (or a tuple of tensors) keyed by
    exact shapes, on a ``GraphSlots`` cache.

    ``fn`` must be deterministic given its inputs' values and shapes, and must read no
    other changing tensor. ``capture_after``: capture on that use of a key (1 = first).
    """

    def __init__(self, fn: Fn, *, capacity: int = 32, max_counters: int = 128,
                 capture_after: int = 3, backend: CaptureBackend | None = None,
                 enabled: bool = True, name: str = "graph") -> None:
        if capture_after < 1:
            raise ValueError("capacity, max_counters and capture_after must be >= 1")
        self.fn = fn
        self.capture_after = capture_after
        self.backend = backend if backend is not None else CudaGraphBackend()
        self.enabled = enabled
        self.name = name
        self.slots = GraphSlots(capacity, max_counters, name, on_evict=self.backend.release)
        self.stats = GraphCacheStats()

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    # ------------------------------------------------------------------ keys
    def key(self, inputs: Sequence[torch.Tensor], static: Hashable = ()) -> tuple:
        shapes = tuple((tuple(x.shape), x.dtype, str(x.device)) for x in inputs)
        return (shapes, static, precision_flags())

    def has_graph(self, inputs: Sequence[torch.Tensor], static: Hashable = ()) -> bool:
        return self.key(inputs, static) in self.slots

    # ------------------------------------------------------------------ dispatch
    def __call__(self, *inputs: torch.Tensor, static: Hashable = ()) -> torch.Tensor:
        st = self.stats
        st.calls += 1
        if not self.enabled:
            st.eager += 1
            return self.fn(*inputs)
        key = self.key(inputs, static)
        captured = self.slots.get(key)
        if captured is not None:
            st.hits += 1
            return self._replay(captured, inputs)
        if not self.slots.disabled(key) and self.slots.count_use(key) >= self.capture_after:
            out = self._capture(key, inputs)
            if out is not None:
                return out
        st.eager += 1
        self._sync_sizes()
        return self.fn(*inputs)

    def precapture(self, examples: Iterable[Sequence[torch.Tensor]], static: Hashable = ()) -> int:
        """Capture a graph for each example input set now (start-up); returns how many exist.

        Examples beyond ``capacity`` evict the oldest precaptured ones, like live traffic.
        """
        made = 0
        for inputs in examples:
            key = self.key(inputs, static)
            if key in self.slots or self.slots.disabled(key):
                continue
            if self._capture(key, inputs, count_call=False) is not None:
                self.stats.precaptures += 1
                made += 1
        return made

    def clear(self) -> None:
        self.slots.clear()
        self._sync_sizes()

    # ------------------------------------------------------------------ internals
    def _replay(self, captured: Captured, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        for dst, src in zip(captured.static_inputs, inputs):
            dst.copy_(src)
        captured.replay()
        return _clone(captured.static_output)

    def _capture(self, key: Hashable, inputs: Sequence[torch.Tensor],
                 count_call: bool = True) -> torch.Tensor | None:
        self.slots.make_room()
        try:
            captured = self.backend.capture(self.fn, inputs)
        except Exception as exc:
            self.slots.disable(key, exc, _short(key))
            self._sync_sizes()
            return None
        static = sum(t.numel() * t.element_size() for t in captured.static_inputs)
        static += sum(t.numel() * t.element_size() for t in _tensors(captured.static_output))
        self.slots.add(key, captured, static, int(getattr(captured, "reserved_delta", 0)))
        self.stats.captures += 1
        self._sync_sizes()
        warm, captured.warm_output = getattr(captured, "warm_output", None), None
        if not count_call:
            return captured.static_output
        # The warm-up already computed this call's result, eagerly: return it rather than pay a
        # replay for the same values (for HiFT in synth, ~70 ms of GPU per capture). Not when it
        # shares memory with the static inputs, which the next replay overwrites.
        if warm is not None and not _aliases(warm, captured.static_inputs):
            return warm
        return self._replay(captured, inputs)

    def _sync_sizes(self) -> None:
        s, st = self.slots, self.stats
        st.graphs, st.counters, st.disabled = len(s), s.counters, s.disabled_count
        st.evictions, st.failures, st.failed_keys = s.evictions, s.failures, s.failed_keys
        st.pool_reserved_bytes, st.static_bytes = s.pool_bytes, s.static_bytes


def _tensors(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _aliases(out, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether any output tensor shares storage with one of ``inputs``."""
    held = {x.untyped_storage().data_ptr() for x in inputs}
    return any(t.untyped_storage().data_ptr() in held for t in _tensors(out))


def _clone(out):
    """An owned copy of a replay's output (a tensor or a tuple of tensors)."""
    return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()


def _short(key: tuple) -> str:
    shapes = key[0] if key else ()
    return "[" + ", ".join("x".join(map(str, s[0])) for s in shapes) + "]"
