"""Triton's cache on this machine (``gpu/triton_cache.py``): launches recorded, replayed into the
cache ahead of a run with the same cache key as the launch itself, and the helper processes
that do it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cosybatch.gpu import triton_cache as T

REPO = Path(__file__).resolve().parents[1]


def _kernel(module: str, name: str):
    return SimpleNamespace(fn=SimpleNamespace(__module__=module, __name__=name))


def test_a_launch_is_recorded_by_what_its_compiled_variant_depends_on():
    """Tensors by dtype, integers by the classes Triton specialises on (1, multiples of 16,
    the integer type), constexprs and launch options by value: two launches that differ only
    in a length of the same class are one entry; a tensor off a 16-byte boundary cannot be
    replayed (``warmup`` assumes alignment)."""
    k = _kernel("cosybatch.codec.x", "_k")
    x = torch.zeros(64)
    rec = T.launch_record(k, (x, 32, 7, 1.5, None), {"BLOCK": 64, "FLAG": True, "num_warps": 4})
    key = T._key(rec)
    assert rec == {"kernel": "cosybatch.codec.x:_k",
                   "args": [{"tensor": "float32"}, {"value": 32}, {"value": 7}, {"value": 1.5}, {"value": None}],
                   "kwargs": {"BLOCK": {"value": 64, "exact": True}, "FLAG": {"value": True, "exact": True},
                              "num_warps": {"value": 4, "exact": True}}}
    same = T.launch_record(k, (x, 48, 9, 2.5, None), {"BLOCK": 64, "FLAG": True, "num_warps": 4})
    assert T._key(same) == key
    for other in ((x.half(), 32, 7, 1.5, None), (x, 33, 7, 1.5, None), (x, 32, 1, 1.5, None), (x, 32, 2**40, 1.5, None)):
        assert T._key(T.launch_record(k, other, {"BLOCK": 64, "FLAG": True, "num_warps": 4})) != key
    assert T._key(T.launch_record(k, (x, 32, 7, 1.5, None), {"BLOCK": 128, "FLAG": True, "num_warps": 4})) != key
    assert T.launch_record(k, (x[1:], 32, 7, 1.5, None), {}) is None  # 4 bytes past an aligned start


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_recorder_says_once_which_kernel_launched_what_it_cannot_list(tmp_path, monkeypatch, caplog):
    """A launch off a 16-byte boundary compiles a variant no list entry can stand for (the run
    then compiles it in its window), so recording names its kernel, once, and lists the rest."""
    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **kw: None)  # no GPU to launch on
    listing = tmp_path / "list.json"
    stop = T.install_recorder(listing)
    k = _kernel("cosybatch.codec.x", "_k")
    x = torch.zeros(64)
    try:
        with caplog.at_level("WARNING", logger=T.log.name):
            for t in (x[2:], x[2:], x):
                JITFunction.run(k, t, 32, grid=(1,), warmup=False)
    finally:
        stop()
    said = [r.getMessage() for r in caplog.records]
    assert said == ["a launch of cosybatch.codec.x:_k cannot be listed (a tensor off a 16-byte boundary)"]
    assert [r["args"][0] for r in T.load_launches(listing)] == [{"tensor": "float32"}]


def _lengths(x_ptr, n, T, BLOCK):  # a kernel's signature (its body is never compiled here)
    pass


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_an_integer_the_kernel_does_not_specialise_on_counts_only_by_its_type():
    """``do_not_specialize`` lengths: every value of one integer type is one variant (Triton's
    key keeps only the type), so a launch list holds each such variant once."""
    from triton.runtime.jit import JITFunction

    k = JITFunction(_lengths, do_not_specialize=["T"])
    x = torch.zeros(64)
    rec = T.launch_record(k, (x, 32, 1600), {"BLOCK": 64})
    assert rec["args"][2] == {"value": 1600, "any": True} and rec["args"][1] == {"value": 32}
    key = T._key(rec)
    assert all(T._key(T.launch_record(k, (x, 32, t), {"BLOCK": 64})) == key for t in (1, 17, 24001))
    assert T._key(T.launch_record(k, (x, 32, 2**40), {"BLOCK": 64})) != key  # another integer type
    assert T._key(T.launch_record(k, (x, 33, 1600), {"BLOCK": 64})) != key  # n is specialised


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_shipped_launch_list_names_the_package_s_kernels_as_they_are():
    """Every entry of ``gpu/triton_launches.json`` names a kernel of the package, with as many
    arguments as it has runtime parameters and keywords among its constexprs and launch
    options; an integer the kernel does not specialise on is marked so (what the recorder
    writes now: a kernel that stopped specialising a length no longer needs one entry per
    divisibility class); no two entries are one variant."""
    import importlib

    from triton.runtime.jit import JITFunction

    records = T.load_launches()
    assert records, "the package ships a launch list"
    keys = set()
    for rec in records:
        module, name = rec["kernel"].split(":")
        kernel = getattr(importlib.import_module(module), name)
        if not isinstance(kernel, JITFunction):  # Triton's interpreter (the CPU tests) wraps the function
            kernel = JITFunction(kernel.fn, **kernel.kwargs)
        params = kernel.params
        runtime = [p for p in params if not p.is_constexpr]
        assert len(rec["args"]) <= len(params) and len(rec["args"]) >= len(runtime), rec["kernel"]
        for p, a in zip(params, rec["args"]):
            if isinstance(a.get("value"), int) and not isinstance(a["value"], bool) and not p.is_constexpr:
                assert a.get("any", False) == bool(p.do_not_specialize), (rec["kernel"], p.name)
        constexprs = {p.name for p in params if p.is_constexpr}
        assert set(rec["kwargs"]) <= constexprs | {"num_warps", "num_stages", "enable_fp_fusion"}, rec["kernel"]
        keys.add(T._key(rec))
    assert len(keys) == len(records)


def test_a_missing_or_broken_launch_list_is_empty(tmp_path):
    assert T.load_launches(tmp_path / "none.json") == []
    (tmp_path / "bad.json").write_text("{not json")
    assert T.load_launches(tmp_path / "bad.json") == []
    assert T.precompile([{"kernel": "cosybatch.nowhere:_k", "args": [], "kwargs": {}}]) == (0, 1)


_NVIDIA = importlib.util.find_spec("triton") is not None and importlib.util.find_spec("triton.backends.nvidia") is not None

# A CUDA target without a GPU: Triton's NVIDIA backend compiles (its bundled ptxas, sm_90) and
# writes the cache as on a GPU; the launch itself then fails, after the compile.
_FAKE_GPU = r"""
import json, os, sys
from pathlib import Path
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

class Driver:
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")
    def is_active(self): return True
    def launcher_cls(self, src, metadata): return None  # (a launcher would need the CUDA driver)

driver.set_active(Driver())
from cosybatch.codec import triton_conv
from cosybatch.gpu import triton_cache as T

cache, listing = Path(os.environ["TRITON_CACHE_DIR"]), Path(sys.argv[1])
"""
_PROBE = _FAKE_GPU + r"""
entries = lambda: sorted(p.name for p in cache.iterdir())
stop = T.install_recorder(listing)
try:
    triton_conv.bias_residual(torch.zeros(2, 5, 48), torch.zeros(48), torch.zeros(2, 5, 48))
except Exception:
    pass  # no GPU to launch on
stop()
records = T.load_launches(listing)
compiled = entries()
replayed = T.precompile(records)
after = entries()
odd = json.loads(json.dumps(records))
odd[0]["args"][4]["value"] = 17  # a length of another class: another variant
print(json.dumps({"records": records, "compiled": compiled, "replayed": replayed, "after": after,
                  "odd": T.precompile(odd), "after_odd": entries()}))
"""

# A later process on the warm cache: the recorded launch is read from it into the kernel's
# in-memory cache, where the run's launch finds it, and nothing is compiled again.
_PRELOAD = _FAKE_GPU + r"""
before = sorted(p.name for p in cache.iterdir())
k = triton_conv._bias_residual_kernel
records = T.load_launches(listing)
loaded = T.preload(records)
same = before == sorted(p.name for p in cache.iterdir())
odd = json.loads(json.dumps(records))
odd[0]["args"][0] = {"tensor": "float16"}  # a variant no cache entry holds: compiled, so the cache is stale
print(json.dumps({"loaded": loaded, "in_memory": len(k.device_caches[0][0]), "same_entries": same,
                  "stale": T.preload(odd + records)}))
"""


@pytest.mark.skipif(not _NVIDIA, reason="needs Triton's NVIDIA backend (it compiles without a GPU)")
def test_a_recorded_launch_compiled_ahead_is_the_variant_the_launch_finds(tmp_path):
    """The premise of compiling ahead: ``precompile`` of a recorded launch makes the cache entry
    the launch itself made (no new entry), while another specialisation makes another; and
    ``preload`` in a later process reads it into the kernel's in-memory cache, compiling nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO), TRITON_DEFAULT_FP_FUSION="1")
    (tmp_path / "cache").mkdir()
    res = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "list.json")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["kernel"] for r in out["records"]] == ["cosybatch.codec.triton_conv:_bias_residual_kernel"]
    kernels = [e for e in out["compiled"] if e != "list.json"]
    assert len(kernels) == 1, out["compiled"]
    assert out["replayed"] == [1, 0] and out["after"] == out["compiled"]
    assert out["odd"] == [1, 0] and len(out["after_odd"]) == len(out["after"]) + 1
    res = subprocess.run([sys.executable, "-c", _PRELOAD, str(tmp_path / "list.json")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"loaded": [1, False], "in_memory": 1, "same_entries": True,
                                                                "stale": [0, True]}


# A run's launches as the compile watch sees them: compiled into an empty cache, then (a later
# process) read from it; a preload's warm-up is not a launch.
_WATCH = _FAKE_GPU + r"""
watch = T.watch_compiles()
if sys.argv[2] == "preload":
    T.preload(T.load_launches(listing))
else:
    T.install_recorder(listing)
try:
    triton_conv.bias_residual(torch.zeros(2, 5, 48), torch.zeros(48), torch.zeros(2, 5, 48))
except Exception:
    pass  # no GPU to launch on: the variant was compiled or read before the launch failed
print(json.dumps({"log": watch.log, "since": watch.since(0)}))
"""


@pytest.mark.skipif(not _NVIDIA, reason="needs Triton's NVIDIA backend")
def test_the_compile_watch_tells_a_compile_in_the_run_from_a_read_of_the_cache(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO), TRITON_DEFAULT_FP_FUSION="1")
    (tmp_path / "cache").mkdir()

    def run(step: str) -> dict:
        res = subprocess.run([sys.executable, "-c", _WATCH, str(tmp_path / "list.json"), step], env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    name = "cosybatch.codec.triton_conv:_bias_residual_kernel"
    first = run("launch")
    assert first["log"] == [[name, True]]
    assert first["since"] == {"compiled": 1, "loaded": 0, "compiled_kernels": [name]}
    assert run("launch")["log"] == [[name, False]]  # the variant read from the disk cache
    assert run("preload")["log"] == []  # preloaded (a warm-up, not listed): the launch found it in memory


def test_ahead_compile_runs_unless_the_cache_is_warm_and_each_helper_marks_its_share_done(tmp_path, monkeypatch):
    """Helper processes start on a cold or partial cache with a list, one process of a machine at
    a time (a marker in the cache, taken over when older than ``CLAIM_S``), skip a stale entry,
    leave their share's marker and end; on a partial cache only the shares without a marker
    start again, and once every share has one the cache is warm."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    listing = tmp_path / "list.json"
    assert T.start_ahead_compile("cold", listing) is None  # no list
    listing.write_text(json.dumps([{"kernel": "cosybatch.nowhere:_k", "args": [], "kwargs": {}}] * 3))
    assert T.start_ahead_compile("warm", listing) is None
    ahead = T.start_ahead_compile("cold", listing, workers=2)
    assert ahead is not None and len(ahead.procs) == 2
    marker = tmp_path / "cache" / T.CLAIM_NAME
    assert marker.exists() and T.start_ahead_compile("cold", listing, workers=2) is None  # claimed
    os.utime(marker, (time.time() - T.CLAIM_S - 1,) * 2)
    again = T.start_ahead_compile("cold", listing, workers=1)  # a marker left by a killed process
    assert again is not None
    again.stop()
    t_end = time.monotonic() + 120
    while any(p.poll() is None for p in ahead.procs) and time.monotonic() < t_end:
        time.sleep(0.1)
    assert [p.returncode for p in ahead.procs] == [0, 0]  # a stale entry is skipped, not fatal
    ahead.stop()
    ahead.stop()
    assert ahead.procs == []
    cache, digest = tmp_path / "cache", T.list_digest(listing)
    assert T.done_marker(cache, digest, 0, 2).exists() and T.done_marker(cache, digest, 1, 2).exists()
    assert T.compiled_ahead(cache, listing)
    marker.unlink(missing_ok=True)
    assert T.start_ahead_compile("partial", listing, workers=2) is None  # nothing left to compile
    T.done_marker(cache, digest, 1, 2).unlink()
    assert not T.compiled_ahead(cache, listing)
    marker.unlink(missing_ok=True)
    rest = T.start_ahead_compile("partial", listing, workers=2)
    assert rest is not None and len(rest.procs) == 1 and rest.procs[0].args[-2:] == ["1", "2"]
    rest.procs[0].wait(timeout=120)
    rest.stop()
    assert T.compiled_ahead(cache, listing)


def test_start_up_marks_the_cache_compiles_ahead_unless_warm_and_preloads_only_a_warm_one(tmp_path, monkeypatch, caplog):
    """``synthesizers._kernel_cache``: on CUDA, a cold or partial cache is recorded, logged and
    handed to the compiling helpers (nothing to preload); a warm one returns the launch list to
    preload (``start_ahead_compile`` then starts nothing)."""
    import cosybatch.gpu.runtime as runtime
    from cosybatch import synthesizers
    from cosybatch.scheduler.startup import StartupClock

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime, "triton_available", lambda: True)
    started = []
    monkeypatch.setattr(T, "start_ahead_compile", lambda state, *a, **k: started.append(state))
    monkeypatch.setattr(T, "watch_compiles", lambda: None)  # (Triton's hooks are process-wide)
    listing = [{"kernel": "cosybatch.codec.triton_conv:_bias_residual_kernel", "args": [], "kwargs": {}}]
    monkeypatch.setattr(T, "load_launches", lambda path=None: listing)
    clock = StartupClock()
    assert synthesizers._kernel_cache(clock, torch.device("cpu")) == [] and clock.kernel_cache is None
    with caplog.at_level("WARNING"):
        assert synthesizers._kernel_cache(clock, torch.device("cuda")) == []
    assert clock.kernel_cache == "cold" and started == ["cold"] and "holds no GPU kernel" in caplog.text
    (tmp_path / "X").mkdir()
    (tmp_path / "X" / "_matmul_kernel.json").write_text("{}")
    monkeypatch.setattr(T, "compiled_ahead", lambda cache=None, path=None: False)
    with caplog.at_level("INFO", logger=synthesizers.log.name):  # (a CLI test before may have set its level)
        assert synthesizers._kernel_cache(clock, torch.device("cuda")) == []  # partial: compiled ahead, not preloaded
    assert clock.kernel_cache == "partial" and started == ["cold", "partial"] and "compile the rest" in caplog.text
    monkeypatch.setattr(T, "compiled_ahead", lambda cache=None, path=None: True)
    assert synthesizers._kernel_cache(clock, torch.device("cuda")) == listing
    assert clock.kernel_cache == "warm" and started == ["cold", "partial", "warm"]
    assert clock.as_dict()["kernel_cache"] == "warm"


# On a GPU, with the Triton it has: record a real launch, compile it ahead into an empty cache in
# another process, then launch it in a third (after ``preload`` in a fourth): no new cache entry.
_GPU_STEP = r"""
import json, os, sys
from pathlib import Path
import torch
from cosybatch.codec import triton_conv
from cosybatch.gpu import triton_cache as T

step, listing = sys.argv[1], Path(sys.argv[2])
cache = Path(os.environ["TRITON_CACHE_DIR"])
launch = lambda: triton_conv.bias_residual(*(torch.zeros(s, device="cuda") for s in ((2, 5, 48), (48,), (2, 5, 48))))
if step == "record":
    stop = T.install_recorder(listing)
    launch()
    stop()
elif step == "ahead":
    print(json.dumps(T.precompile(T.load_launches(listing))))
elif step == "preload":
    print(json.dumps(T.preload(T.load_launches(listing))))
    launch()
else:
    watch = T.watch_compiles()
    launch()
    print(json.dumps(watch.log))
torch.cuda.synchronize()
print(json.dumps(sorted(p.name for p in cache.iterdir())))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_a_launch_compiled_ahead_or_preloaded_is_the_one_the_run_finds(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])

    def step(name: str, cache: str) -> list:
        env["TRITON_CACHE_DIR"] = str(tmp_path / cache)
        (tmp_path / cache).mkdir(exist_ok=True)
        res = subprocess.run([sys.executable, "-c", _GPU_STEP, name, str(tmp_path / "list.json")], env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        return [json.loads(line) for line in res.stdout.strip().splitlines()]

    [launched] = step("record", "a")
    assert [r["kernel"] for r in T.load_launches(tmp_path / "list.json")] == \
        ["cosybatch.codec.triton_conv:_bias_residual_kernel"]
    compiled, after = step("ahead", "b")
    # the entries a launch writes (on a GPU the kernel's and the driver's launcher utilities'),
    # content-hashed, so a cache compiled ahead holds the same names as one a run filled
    assert compiled == [1, 0] and after == launched
    # the launch found what was compiled ahead: read from the disk cache, as the watch tells
    assert step("launch", "b") == [[["cosybatch.codec.triton_conv:_bias_residual_kernel", False]], after]
    loaded, listing = step("preload", "b")
    assert loaded == [1, False] and listing == after
