"""Start-up: the ONNX reader that maps initializers instead of copying them, weights loaded
straight onto their device in their dtype, parts of the start-up run at once (and timed
honestly), the imports a GPU-frontend run does not make, lazily captured prefill graphs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from cosybatch.checkpoint.onnx_file import WireError, read_onnx
from cosybatch.checkpoint.onnx_standins import write_onnx_standins

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    d = tmp_path_factory.mktemp("frontend_tiny")
    write_onnx_standins(d, seed=0, size="tiny")
    return d


# ---------------------------------------------------------------- the ONNX reader ----------
@pytest.mark.parametrize("name", ["speech_tokenizer_v3.onnx", "campplus.onnx"])
def test_read_onnx_equals_onnx_load(standins, name):
    """Every initializer (values, dtype, shape) and every other graph field as ``onnx.load``
    reads them; the raw-data ones are views of the file, not copies."""
    path = standins / name
    ref = onnx.load(str(path)).graph
    got = read_onnx(path)
    want = {t.name: numpy_helper.to_array(t) for t in ref.initializer}
    assert sorted(got.initializers) == sorted(want)
    for k, v in want.items():
        g = got.initializers[k]
        assert g.dtype == v.dtype and g.shape == v.shape and np.array_equal(g, v), k
    views = [a for a in got.initializers.values() if a.size > 16]
    assert views and all(not a.flags.owndata for a in views)
    del ref.initializer[:]
    assert got.graph.SerializeToString() == ref.SerializeToString()


def _model(initializers) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])
    node = helper.make_node("Add", ["x", "w"], ["y"], name="/add/Add")
    return helper.make_model(helper.make_graph([node], "g", [x], [y], initializers))


def test_read_onnx_other_layouts(tmp_path):
    """Typed fields (not raw data), an empty tensor, a scalar and float16: what onnx would give."""
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    inits = [helper.make_tensor("w", onnx.TensorProto.FLOAT, [2, 3], w.ravel().tolist()),  # float_data
             numpy_helper.from_array(np.float16([1.5, -2.0]), "h"),
             numpy_helper.from_array(np.int64(7), "s"),
             numpy_helper.from_array(np.zeros((0, 4), np.float32), "e")]
    path = tmp_path / "m.onnx"
    onnx.save(_model(inits), str(path))
    got = read_onnx(path).initializers
    for t in inits:
        want = numpy_helper.to_array(t)
        assert got[t.name].dtype == want.dtype and np.array_equal(got[t.name], want), t.name
    assert [n.name for n in read_onnx(path).graph.node] == ["/add/Add"]


def test_read_onnx_refuses_what_is_not_a_model(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x0f\xff\xff")  # field 1 with the deprecated group wire type
    with pytest.raises(WireError):
        read_onnx(bad)
    trunc = tmp_path / "trunc.onnx"
    trunc.write_bytes(b"\x3a\x80\x80\x01")  # the graph field claims 16 KB that are not there
    with pytest.raises(WireError):
        read_onnx(trunc)


# ---------------------------------------------------------------- weights to their device --
def test_tokenizer_weights_go_to_the_given_device_in_float32(standins):
    """``load_s3tokenizer(device=...)``: every weight on that device, contiguous, float32 and
    equal to the CPU load (the meta device stands in for a GPU on a CPU machine)."""
    from cosybatch.checkpoint.onnx_weights import load_s3tokenizer

    cpu = load_s3tokenizer(standins / "speech_tokenizer_v3.onnx")
    meta = load_s3tokenizer(standins / "speech_tokenizer_v3.onnx", device="meta")
    for (k, a), (k2, b) in zip(cpu.named_parameters(), meta.named_parameters()):
        assert k == k2 and b.device.type == "meta" and b.dtype == torch.float32 == a.dtype
        assert b.shape == a.shape and b.is_contiguous()
    for a in cpu.parameters():  # aligned copies, not views of the file
        assert a.is_contiguous() and a.data_ptr() % 16 == 0


def test_strict_load_onto_a_device_assigns_in_the_modules_dtypes():
    """``strict_load(device=...)``: the module's tensors are replaced by the file's, moved
    there and cast to the dtype the module had (what copying into it would do); values equal
    the copying load's."""
    from torch import nn

    from cosybatch.checkpoint import strict_load

    def make():
        m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        m[1].double()
        return m

    sd = {k: torch.randn(v.shape, dtype=torch.float64) for k, v in make().state_dict().items()}
    sd["0.weight"] = sd["0.weight"].t().contiguous().t()  # a non-contiguous file tensor
    copied, moved = make(), make()
    strict_load(copied, sd, "x.pt")
    strict_load(moved, sd, "x.pt", device="cpu")
    for (k, a), (_, b) in zip(copied.state_dict().items(), moved.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b) and b.is_contiguous(), k
    assert isinstance(moved[0].weight, nn.Parameter) and moved[1].weight.dtype == torch.float64
    meta = make()
    strict_load(meta, sd, "x.pt", device="meta")
    assert all(p.device.type == "meta" for p in meta.parameters())


# ---------------------------------------------------------------- parallel parts -----------
def test_parallel_phase_is_its_wall_time_with_each_part_inside():
    from cosybatch.scheduler.startup import StartupClock

    clock = StartupClock(torch.device("cpu"))
    with clock.parallel("loading (parallel)") as par:
        a = par.start("a", lambda: time.sleep(0.2) or "A")
        with par.part("b"):
            time.sleep(0.1)
    assert a.result() == "A"
    wall, parts = clock.phases["loading (parallel)"], clock.parallel_parts["loading (parallel)"]
    assert 0.2 <= wall < 0.29 and parts["a"] >= 0.2 and 0.1 <= parts["b"] < 0.2
    assert clock.total_s == pytest.approx(sum(clock.phases.values()), abs=1e-3)  # the parts add nothing
    assert clock.as_dict()["parallel_s"] == {"loading (parallel)": parts}


def test_parallel_phase_joins_every_part_and_raises_the_first_error():
    from cosybatch.scheduler.startup import StartupClock

    clock = StartupClock(None)
    finished = threading.Event()

    def slow():
        time.sleep(0.1)
        finished.set()

    with pytest.raises(KeyError, match="thread"):
        with clock.parallel("p") as par:
            par.start("slow", slow)
            par.start("bad", lambda: {}["thread"])
    assert finished.is_set()  # no part outlives its phase
    with pytest.raises(ValueError, match="caller"):  # the calling thread's error comes first
        with clock.parallel("q") as par:
            par.start("bad", lambda: {}["thread"])
            raise ValueError("caller")


# ---------------------------------------------------------------- imports ------------------
def test_a_gpu_frontend_run_imports_neither_onnxruntime_nor_ray_nor_inflect(standins):
    """The fast path's modules and a PyTorch-backend frontend leave onnxruntime (only the
    CPU frontend runs it), ray (only ``--ray``) and torch._dynamo (~2 s: a factory function
    under the loader's meta device context imported it) unimported, and a text without digits
    inflect (1-3 s to import)."""
    code = f"""
import sys
import cosybatch.cli, cosybatch.synthesizers, cosybatch.scheduler.pipeline, cosybatch.run.synth
from cosybatch.models.config import ModelConfig
from cosybatch.frontend.frontend import Frontend
fe = Frontend({str(standins)!r}, ModelConfig(), backend="torch", device="cpu", warmup=False)
assert fe.backend == "torch"
from cosybatch.text.normalize import split_target_text
assert split_target_text("Hello there, how are you today?", list, normalizer="none")
print(sorted(m for m in ("onnxruntime", "ray", "inflect", "torch._dynamo") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


# ---------------------------------------------------------------- lazy prefill graphs ------
class _Graph:
    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


class _Pool:
    def __init__(self, fail=()):
        self.captured, self.fail = [], set(fail)

    def capture(self, fn, warmup: int = 1):
        for _ in range(warmup):
            fn()
        if len(self.captured) in self.fail:
            self.captured.append(None)
            raise RuntimeError("capture failed")
        self.captured.append(fn)
        return _Graph(fn), None


class _Executor:
    device = torch.device("cpu")
    head = torch.zeros(8, 4)

    def prefill_from(self, inp, last):
        return inp[0].float().sum().expand(len(last), 8).clone()

    def mixed_from(self, drows, inp, last):
        return torch.cat([drows.float().unsqueeze(1).expand(-1, 8), self.prefill_from(inp, last)])


def test_lazy_prefill_buckets_are_captured_at_their_second_use():
    from cosybatch.engine.prefill_graphs import PrefillGraphs

    pool = _Pool()
    pg = PrefillGraphs(_Executor(), scratch_row=4, max_seqs=4, buckets=(128, 256), pool=pool, capture=False)
    assert pg.buckets == () and not pool.captured
    inp = torch.ones(5, 100, dtype=torch.long)
    first = pg.run(inp, [99])
    assert pg.eager == 1 and pg.replays == 0 and pg.buckets == ()
    second = pg.run(inp, [99])
    assert pg.buckets == (128,) and pg.replays == 1 and torch.equal(first, second)
    pg.run(torch.ones(5, 200, dtype=torch.long), [199])  # a larger bucket: eager the first time
    assert pg.buckets == (128,) and pg.eager == 2


def test_prefill_warm_up_runs_the_smallest_and_largest_bucket_of_padding_and_captures_nothing():
    """``PrefillGraphs.warm`` (``ar.graph_capture: warm``): each tile set a prefill can take runs
    once, on padding tokens of the scratch row (text id 0, position 0, slot 0), with every
    last-token index 0; no graph is captured and no bucket counts as used."""
    from cosybatch.engine.prefill_graphs import PrefillGraphs

    class Recording(_Executor):
        calls = []

        def prefill_from(self, inp, last):
            self.calls.append((inp.clone(), last.clone()))
            return super().prefill_from(inp, last)

    ex, pool = Recording(), _Pool()
    pg = PrefillGraphs(ex, scratch_row=4, max_seqs=4, buckets=(128, 256, 512), pool=pool, capture=False)
    pg.warm()
    assert [inp.shape[1] for inp, _ in ex.calls] == [128, 512] and not pool.captured
    for inp, last in ex.calls:
        assert inp[3].eq(4).all() and inp[[0, 1, 2, 4]].eq(0).all() and last.tolist() == [0] * 4
    pg.run(torch.ones(5, 100, dtype=torch.long), [99])
    assert pg.buckets == () and pg.eager == 1  # the warm-up was no use: the bucket still waits for its second


def test_a_failed_lazy_prefill_capture_is_not_tried_again():
    from cosybatch.engine.prefill_graphs import PrefillGraphs

    pool = _Pool(fail={0})
    pg = PrefillGraphs(_Executor(), scratch_row=4, max_seqs=4, buckets=(128,), pool=pool, capture=False)
    inp = torch.ones(5, 100, dtype=torch.long)
    for _ in range(4):
        pg.run(inp, [99])
    assert len(pool.captured) == 1 and pg.eager == 4 and pg.buckets == ()


def test_mixed_step_pairs_are_captured_at_their_second_use_and_the_rest_run_eager():
    """``MixedGraphs``: a (decode bucket, token bucket) pair is captured at its second use and
    replayed from then on; a step beyond the buckets or of more than ``MAX_SEQS`` new sequences
    runs eager, and so does a pair whose capture failed, which is not tried again."""
    from cosybatch.engine.mixed_graphs import MAX_SEQS, MixedGraphs

    pool = _Pool(fail={1})
    mg = MixedGraphs(_Executor(), scratch_row=4, decode_buckets=(2, 4), token_buckets=(128,), pool=pool)
    inp = torch.ones(5, 100, dtype=torch.long)
    first = mg.run(1, inp, [99])
    assert mg.eager == 1 and mg.pairs == () and mg.met_once == ((2, 128),)
    second = mg.run(1, inp, [99])
    assert mg.pairs == ((2, 128),) and mg.replays == 1 and torch.equal(first, second)
    assert [entry[:2] for entry in mg.capture_log] == [[2, 128]] and mg.capture_log[0][2] >= 0  # with its host ms
    assert mg.met_once == ()
    mg.run(3, inp, [99])  # (4, 128): eager, then its capture fails
    mg.run(3, inp, [99])
    mg.run(3, inp, [99])
    assert mg.pairs == ((2, 128),) and len(pool.captured) == 2 and mg.eager == 4
    assert len(mg.capture_log) == 1  # a failed capture is not listed
    mg.run(5, inp, [99])  # more rows than the largest bucket
    mg.run(1, torch.ones(5, 200, dtype=torch.long), [199])  # more tokens
    mg.run(1, inp, list(range(MAX_SEQS + 1)))  # more new sequences
    assert mg.eager == 7 and mg.replays == 1
    assert MixedGraphs(_Executor(), 4, (2,), (128,), pool, graphed=False)._pair(1, 100, 1) is None


def test_mixed_step_pairs_named_at_start_up_are_captured_then_and_replayed_at_first_use():
    """``ar.mixed_graph_precapture``: the pairs covering the given (rows, tokens) are captured
    before any request (logged as at start-up), so a run's first step of such a pair replays;
    a pair outside the buckets is skipped, one whose capture fails runs eager and is not tried
    again, and a pair named twice is captured once."""
    from cosybatch.engine.mixed_graphs import MixedGraphs

    pool = _Pool(fail={1})
    mg = MixedGraphs(_Executor(), scratch_row=4, decode_buckets=(2, 4), token_buckets=(128, 256), pool=pool)
    assert mg.precapture([(1, 100), (3, 200), (2, 120), (9, 100), (4, 999), (4, 100)]) == 2
    assert mg.pairs == ((2, 128), (4, 128)) and [e[:2] + e[3:] for e in mg.capture_log] == [[2, 128, True], [4, 128, True]]
    inp = torch.ones(5, 100, dtype=torch.long)
    mg.run(1, inp, [99])  # first use: a replay
    assert mg.replays == 1 and mg.eager == 0
    mg.run(3, torch.ones(5, 200, dtype=torch.long), [199])  # (4, 256): its capture failed at start-up
    mg.run(3, torch.ones(5, 200, dtype=torch.long), [199])
    assert mg.eager == 2 and len(pool.captured) == 3


# ---------------------------------------------------------------- on a GPU -----------------
@pytest.mark.gpu
def test_models_load_straight_onto_the_gpu_equal_to_the_cpu_load(model_dir):
    """``load_models(device="cuda")`` (weights assigned from the file) gives every tensor of
    the CPU load, bit for bit, in the same dtype, on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from cosybatch.checkpoint import load_models

    cpu, gpu = load_models(model_dir), load_models(model_dir, device="cuda")
    for name in ("llm", "flow", "hift"):
        a, b = getattr(cpu, name), getattr(gpu, name)
        ta = dict(a.named_parameters()) | dict(a.named_buffers())
        tb = dict(b.named_parameters()) | dict(b.named_buffers())
        assert ta.keys() == tb.keys(), name
        for k, v in ta.items():
            assert tb[k].is_cuda and tb[k].dtype == v.dtype and torch.equal(tb[k].cpu(), v), (name, k)
