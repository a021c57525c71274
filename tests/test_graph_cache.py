"""GraphCache: capture policy, LRU bounds, failure fallback, ownership (fake backend on the
CPU, real CUDA graphs under the gpu marker)."""

import logging

import pytest
import torch

from cosybatch.gpu.graph_cache import CudaGraphBackend, GraphCache, precision_flags
from helpers import FakeBackend


def double(x):
    return x * 2


def x_of(n, value=1.0):
    return torch.full((n,), float(value))


def test_captures_on_nth_use_then_replays():
    be = FakeBackend()
    cache = GraphCache(double, capture_after=3, backend=be)
    for i in range(2):
        assert torch.equal(cache(x_of(4, i)), x_of(4, 2 * i))
        assert be.captures == 0
    assert torch.equal(cache(x_of(4, 5)), x_of(4, 10))  # third use: captured and replayed
    assert be.captures == 1
    assert torch.equal(cache(x_of(4, 7)), x_of(4, 14))
    st = cache.stats
    assert (st.calls, st.eager, st.captures, st.hits, st.graphs) == (4, 2, 1, 1, 1)
    assert st.hit_rate == 0.25


def test_the_capturing_call_returns_the_warm_up_result_without_a_replay():
    """The warm-up already computed the capturing call's result: it is returned (owned: later
    replays leave it alone) instead of replaying the same; a warm-up result that aliases the
    static inputs (which replays overwrite) is replayed and cloned instead."""
    made = []
    be = FakeBackend()
    real_capture = be.capture
    be.capture = lambda fn, inputs: made.append(real_capture(fn, inputs)) or made[-1]
    cache = GraphCache(double, capture_after=1, backend=be)
    first = cache(x_of(4, 3))
    assert torch.equal(first, x_of(4, 6)) and made[0].replays == 0
    second = cache(x_of(4, 5))
    assert torch.equal(second, x_of(4, 10)) and made[0].replays == 1
    assert torch.equal(first, x_of(4, 6)) and made[0].warm_output is None  # handed over, not kept

    def identity(x):
        return x  # its result is the static input itself

    cache = GraphCache(identity, capture_after=1, backend=be)
    out = cache(x_of(4, 3))
    assert torch.equal(out, x_of(4, 3)) and made[1].replays == 1
    assert out.untyped_storage().data_ptr() != made[1].static_inputs[0].untyped_storage().data_ptr()
    cache(x_of(4, 9))
    assert torch.equal(out, x_of(4, 3))


def test_key_is_exact_shape_dtype_static_and_precision():
    cache = GraphCache(double, backend=FakeBackend())
    a = cache.key([x_of(4)])
    assert a != cache.key([x_of(5)])
    assert a != cache.key([x_of(4).double()])
    assert a != cache.key([x_of(4)], static=("finalize", True))
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high" if old != "high" else "highest")
        assert cache.key([x_of(4)]) != a
        assert precision_flags() != a[2]
    finally:
        torch.set_float32_matmul_precision(old)
    assert cache.key([x_of(4)]) == a


def test_lru_eviction_at_capacity():
    be = FakeBackend()
    cache = GraphCache(double, capacity=2, capture_after=1, backend=be)
    cache(x_of(1))
    cache(x_of(2))
    cache(x_of(1))  # 1 is now more recent than 2
    cache(x_of(3))  # new hot shape: evicts 2, the least recently used
    assert cache.stats.evictions == 1 and be.released == 1
    assert cache.has_graph([x_of(1)]) and cache.has_graph([x_of(3)])
    assert not cache.has_graph([x_of(2)])
    assert cache.stats.graphs == 2
    cache(x_of(2))  # and a late shape still gets a graph
    assert cache.has_graph([x_of(2)]) and not cache.has_graph([x_of(1)])


def test_counters_are_bounded_lru():
    be = FakeBackend()
    cache = GraphCache(double, max_counters=2, capture_after=2, backend=be)
    cache(x_of(1))
    cache(x_of(2))
    cache(x_of(3))  # counter of shape 1 is dropped
    assert cache.stats.counters == 2
    cache(x_of(1))  # counts as a first use again
    assert be.captures == 0
    cache(x_of(1))
    assert be.captures == 1


def test_capture_failure_falls_back_to_eager_and_disables_key(caplog):
    be = FakeBackend(fail_if=lambda inputs: inputs[0].shape[0] == 3)
    cache = GraphCache(double, capture_after=1, backend=be, name="t")
    with caplog.at_level(logging.WARNING, logger="cosybatch.gpu.graph_cache"):
        out = cache(x_of(3, 4))
    assert torch.equal(out, x_of(3, 8))  # the request succeeds
    assert "capture failed" in caplog.text and "injected capture failure" in caplog.text
    assert cache.stats.failures == 1 and cache.stats.disabled == 1
    for _ in range(3):  # never retried for that key
        assert torch.equal(cache(x_of(3, 1)), x_of(3, 2))
    assert cache.stats.failures == 1
    cache(x_of(4))  # other keys still get graphs
    assert be.captures == 1 and cache.has_graph([x_of(4)])


def test_replay_returns_owned_tensor():
    cache = GraphCache(double, capture_after=1, backend=FakeBackend())
    first = cache(x_of(4, 1))
    second = cache(x_of(4, 2))
    third = cache(x_of(4, 3))
    assert torch.equal(first, x_of(4, 2)) and torch.equal(second, x_of(4, 4))
    assert torch.equal(third, x_of(4, 6))
    captured = next(iter(cache.slots.values()))
    assert third.data_ptr() != captured.static_output.data_ptr()


def test_precapture_and_disabled_cache():
    be = FakeBackend()
    cache = GraphCache(double, capture_after=3, backend=be)
    assert cache.precapture([(x_of(4),), (x_of(8),), (x_of(4),)]) == 2
    assert cache(x_of(8, 3)).eq(6).all() and cache.stats.hits == 1
    assert cache.stats.precaptures == 2 and cache.stats.static_bytes > 0
    off = GraphCache(double, capture_after=1, backend=be, enabled=False)
    off(x_of(2))
    assert off.stats.eager == 1 and be.captures == 2
    cache.clear()
    assert cache.stats.graphs == 0 and be.released == 2


# ---------------------------------------------------------------------------- real CUDA graphs
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    return torch.device("cuda")


def _net(dev):
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(8, 8, 5, padding=2).to(dev).eval()

    @torch.inference_mode()
    def fn(x):
        return torch.tanh(conv(x)) * 3 + x
    return fn


@pytest.mark.gpu
def test_cuda_replay_equals_eager_and_outputs_are_owned():
    dev = _cuda()
    fn = _net(dev)
    cache = GraphCache(fn, capture_after=1, backend=CudaGraphBackend())
    xs = [torch.randn(2, 8, 100, device=dev) for _ in range(3)]
    outs = [cache(x) for x in xs]  # first captures, then replays
    assert cache.stats.captures == 1 and cache.stats.hits == 2
    for x, y in zip(xs, outs):  # earlier outputs survive later replays
        torch.testing.assert_close(y, fn(x), rtol=0, atol=1e-6)
    assert cache.stats.pool_reserved_bytes >= 0 and cache.stats.static_bytes > 0


@pytest.mark.gpu
def test_cuda_lru_eviction_at_capacity():
    dev = _cuda()
    fn = _net(dev)
    cache = GraphCache(fn, capacity=2, capture_after=1, backend=CudaGraphBackend())
    for n in (50, 60, 50, 70):
        x = torch.randn(1, 8, n, device=dev)
        torch.testing.assert_close(cache(x), fn(x), rtol=0, atol=1e-6)
    assert cache.stats.evictions == 1 and cache.stats.graphs == 2
    assert not cache.has_graph([torch.empty(1, 8, 60, device=dev)])
    x = torch.randn(1, 8, 60, device=dev)
    torch.testing.assert_close(cache(x), fn(x), rtol=0, atol=1e-6)


@pytest.mark.gpu
def test_cuda_captures_after_every_graph_of_the_pool_was_evicted(caplog):
    """Capacity 1: each new shape evicts the only graph in the shared pool. Without the pool's
    anchor graph the allocator's count of live graphs in it drops to 0 and the next capture
    fails an internal assert (it then runs eager, with a warning)."""
    dev = _cuda()
    fn = _net(dev)
    cache = GraphCache(fn, capacity=1, capture_after=1, backend=CudaGraphBackend())
    with caplog.at_level(logging.WARNING, logger="cosybatch.gpu.graph_cache"):
        for n in (50, 60, 70, 50):
            x = torch.randn(1, 8, n, device=dev)
            torch.cuda.synchronize()
            torch.testing.assert_close(cache(x), fn(x), rtol=0, atol=1e-6)
            torch.testing.assert_close(cache(x), fn(x), rtol=0, atol=1e-6)  # a replay
    assert "capture failed" not in caplog.text
    assert cache.stats.failures == 0 and cache.stats.captures == 4 and cache.stats.evictions == 3


@pytest.mark.gpu
def test_cuda_capture_failure_is_survived(caplog):
    dev = _cuda()
    base = _net(dev)

    def syncs_in_capture(x):
        y = base(x)
        if x.shape[-1] == 33 and torch.cuda.is_current_stream_capturing():
            float(y.sum())  # a host sync: illegal while capturing
        return y

    cache = GraphCache(syncs_in_capture, capture_after=1, backend=CudaGraphBackend())
    x = torch.randn(1, 8, 33, device=dev)
    stream, rng = torch.cuda.current_stream(), torch.cuda.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="cosybatch.gpu.graph_cache"):
        out = cache(x)
    torch.testing.assert_close(out, base(x), rtol=0, atol=1e-6)
    assert cache.stats.failures == 1 and "capture failed" in caplog.text
    # the caller's stream and the CUDA RNG survive the failed capture
    assert torch.cuda.current_stream() == stream
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    y = torch.randn(1, 8, 40, device=dev)  # the next capture still works
    torch.testing.assert_close(cache(y), base(y), rtol=0, atol=1e-6)
    torch.testing.assert_close(cache(y * 2), base(y * 2), rtol=0, atol=1e-6)
    assert cache.stats.captures == 1 and cache.stats.hits == 1


def test_tuple_outputs_are_replayed_and_owned():
    cache = GraphCache(lambda x: (x * 2, x.sum(0, keepdim=True).double()), backend=FakeBackend(), capture_after=1)
    a, b = cache(torch.ones(3, 2))
    c, d = cache(torch.full((3, 2), 2.0))  # a replay: the same buffers recomputed
    assert torch.equal(a, torch.full((3, 2), 2.0)) and torch.equal(b, torch.full((1, 2), 3.0, dtype=torch.float64))
    assert torch.equal(c, torch.full((3, 2), 4.0)) and d.dtype == torch.float64 and torch.equal(d, 2 * b)
    assert cache.stats.hits == 1 and cache.stats.static_bytes == 3 * 2 * 4 + 3 * 2 * 4 + 2 * 8
