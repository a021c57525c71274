"""``cuda_graphs.capture_graph``'s contract, with torch's CUDA calls replaced by a recorder (the
CPU has no graphs): warm-up on the side stream, capture there in thread-local mode into the
given pool, the caller's stream current again afterwards, and no emptying of PyTorch's device
or pinned-host caches, which every later allocation and upload would pay for."""

from __future__ import annotations

import pytest
import torch

from cosybatch.gpu import cuda_graphs
class _Recorder:
    def __init__(self, fail_capture: bool = False):
        self.log: list[str] = []
        self.current = "caller"
        self.fail_capture = fail_capture
        rec = self

        class Stream:
            def __init__(self, name="side"):
                self.name = name

            def wait_stream(self, other):
                rec.log.append(f"{self.name} waits {other.name}")

        class StreamCtx:
            def __init__(self, s):
                self.s = s

            def __enter__(self):
                self.prev, rec.current = rec.current, self.s.name

            def __exit__(self, *exc):
                rec.current = self.prev

        class Graph:
            def capture_begin(self, *pool, capture_error_mode="global"):
                rec.log.append(f"begin on {rec.current} pool={pool} mode={capture_error_mode}")

            def capture_end(self):
                rec.log.append("end")
                if rec.fail_capture:
                    raise RuntimeError("capture invalidated")

        self.Stream, self.StreamCtx, self.Graph = Stream, StreamCtx, Graph

    def install(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "Stream", self.Stream)
        monkeypatch.setattr(cuda, "current_stream", lambda *a: self.Stream(self.current))
        monkeypatch.setattr(cuda, "stream", self.StreamCtx)
        monkeypatch.setattr(cuda, "set_stream", lambda s: setattr(self, "current", s.name))
        monkeypatch.setattr(cuda, "synchronize", lambda *a: self.log.append("sync"))
        monkeypatch.setattr(cuda, "CUDAGraph", self.Graph)
        monkeypatch.setattr(cuda, "empty_cache", lambda: self.log.append("EMPTY device cache"))
        monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: self.log.append("EMPTY host cache"), raising=False)
        monkeypatch.setattr(cuda_graphs, "_unpoison_cuda_rng", lambda: self.log.append("rng reset"))


def test_capture_warms_up_then_captures_on_the_side_stream(monkeypatch):
    rec = _Recorder()
    rec.install(monkeypatch)
    fn = lambda: rec.log.append(f"fn on {rec.current}") or 7  # noqa: E731
    graph, out = cuda_graphs.capture_graph(fn, pool="P", warmup=2)
    assert out == 7 and isinstance(graph, rec.Graph)
    assert rec.log == ["side waits caller", "fn on side", "fn on side", "caller waits side", "sync",
                       "begin on side pool=('P',) mode=thread_local", "fn on side", "end"]
    assert rec.current == "caller"
    rec.log.clear()
    cuda_graphs.capture_graph(fn, warmup=0)
    assert "begin on side pool=() mode=thread_local" in rec.log  # no pool: the graph's own
    assert not [e for e in rec.log if "EMPTY" in e]


def test_a_failed_capture_leaves_the_caller_stream_current(monkeypatch):
    rec = _Recorder(fail_capture=True)
    rec.install(monkeypatch)
    with pytest.raises(RuntimeError, match="capture invalidated"):
        cuda_graphs.capture_graph(lambda: None, warmup=0)
    assert rec.log[-2:] == ["end", "rng reset"] and rec.current == "caller"
