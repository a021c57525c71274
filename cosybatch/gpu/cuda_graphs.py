"""One way to capture CUDA graphs, shared by the AR engine and the codec's graph caches.

Capture runs on a side stream in thread-local error mode after a warm-up (lazy kernel
initialisation and autotuning must not happen inside the capture). A failed capture leaves
the process as it was: the caller's stream is current again and the CUDA RNG is out of
capture mode, so the caller can fall back to eager and carry on (design.md D11).

It calls ``CUDAGraph.capture_begin`` / ``capture_end`` itself rather than entering
``torch.cuda.graph``, whose entry also empties PyTorch's device cache and its pinned host cache:
graphs are captured while requests run (a new flow bucket, a HiFT shape), and after each such
capture every allocation and every pinned upload (``hostcopy.h2d``) would go back to
``cudaMalloc`` / ``cudaHostAlloc`` until the caches refill.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)


def capture_graph(fn: Callable[[], Any], *, pool=None, stream: "torch.cuda.Stream | None" = None,
                  warmup: int = 1) -> tuple["torch.cuda.CUDAGraph", Any]:
    """(graph, fn's output inside the graph's memory). ``pool`` shares a memory pool between
    graphs that are replayed one after another; ``stream`` is the side stream to capture on."""
    side = stream if stream is not None else torch.cuda.Stream()
    caller = torch.cuda.current_stream()
    side.wait_stream(caller)
    try:
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        caller.wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            graph.capture_begin(*(() if pool is None else (pool,)), capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                graph.capture_end()  # also when fn failed: it ends the capture (and raises)
    except BaseException:
        torch.cuda.set_stream(caller)  # whatever failed, the caller's stream is current again
        _unpoison_cuda_rng()
        raise
    return graph, out


class GraphPool:
    """Graphs captured one after another on one side stream, sharing one memory pool.

    Sharing is safe when the graphs are replayed one at a time on one stream and none keeps
    memory of the pool in use past its replay (its inputs live outside the pool, its outputs
    are read or copied before the next replay). After a failed capture the stream and pool are
    replaced, so a half-finished capture cannot leak into the next one. ``share=False``: each
    graph gets its own pool.
    """

    def __init__(self, share: bool = True):
        self.share = share
        self._pool = None
        self._anchor = None
        self._stream = None

    def capture(self, fn: Callable[[], Any], warmup: int = 1) -> tuple["torch.cuda.CUDAGraph", Any]:
        """``capture_graph`` into this pool: (graph, fn's output inside the graph's memory)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        try:
            if self.share and self._pool is None:
                # The allocator counts the graphs alive in a private pool; once the count is 0
                # (every graph in it evicted) a capture into that pool fails an internal assert,
                # unless torch.cuda.graph's cache emptying, which this module skips, has freed
                # the pool. A tiny graph that is never replayed keeps the count above 0.
                self._anchor, _ = capture_graph(lambda: torch.zeros(1, device="cuda"), stream=self._stream, warmup=0)
                self._pool = self._anchor.pool()
            graph, out = capture_graph(fn, pool=self._pool, stream=self._stream, warmup=warmup)
        except BaseException:
            self._pool = self._anchor = self._stream = None
            raise
        return graph, out


def _unpoison_cuda_rng() -> None:
    """After a failed capture the default CUDA generator's state stays in capture mode
    (capture_end raised before its epilogue) and every later random op fails with
    "Offset increment outside graph capture". Swap in a clone of that state: same seed
    and offset, not capturing. Graphs here are deterministic, so none depends on the
    old state object."""
    try:
        gen = torch.cuda.default_generators[torch.cuda.current_device()]
        if hasattr(gen, "clone_state") and hasattr(gen, "graphsafe_set_state"):
            gen.graphsafe_set_state(gen.clone_state())
    except Exception as exc:  # pragma: no cover - best effort, GPU only
        log.warning("could not reset the CUDA RNG state after a failed capture: %s", exc)
