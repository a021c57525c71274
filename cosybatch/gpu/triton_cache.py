"""Triton's on-disk kernel cache on this machine: whether it holds this package's kernels, the
launches a run makes (recorded once), and compiling them ahead of a run (design.md D37).

A run compiles each variant of a Triton kernel (its dtypes, constexprs, launch options and the
integer arguments' specialisation) the first time it launches it, inside its window, unless
Triton's cache already holds it: a first run on a machine is that much slower (a 16-row job
28.4 s against 9.0 on an H200, the 1,088-row `synth` 138 against ~255 audio-s/s). The variants
a profile launches at a model size are a small fixed set, so they can be listed once
(``install_recorder``, on a GPU) and compiled ahead on a machine whose cache lacks them
(``precompile``), through Triton's own ``warmup``: its JIT derives the same cache key from
these arguments as from a real launch's, and a run then finds the compiled kernels on disk.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

# The kernels whose compiled forms tell whether Triton has compiled this package's GPU kernels on
# this machine: the HiFT conv, the flow's attention and the AR engine's matmul (each with many
# variants: in a first 1,088-row run on the H200, HiFT's slices alone took ~26 s longer, compiling)
KERNELS_SEEN = ("_conv1d_kernel", "_chunk_attn_kernel", "_matmul_kernel")
# The launches recorded on a GPU (``install_recorder``): compiled ahead on a cold cache, preloaded on a warm one
LAUNCHES = Path(__file__).with_name("triton_launches.json")
# The marker of the one process of a machine compiling ahead, and when one is taken as stale
CLAIM_NAME, CLAIM_S = ".cosybatch-compiling-ahead", 600.0
# What a helper leaves in the cache once its share of a launch list is compiled (``done_marker``):
# a run's exit kills unfinished helpers, so a cache can hold part of the list
DONE_PREFIX = ".cosybatch-compiled-"


def triton_cache_dir() -> Path:
    """Where Triton keeps what it compiled (``TRITON_CACHE_DIR``, else ``~/.triton/cache``)."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def kernel_cache_state(cache: Path | None = None, path: Path | None = None) -> str:
    """"cold" when Triton's cache holds none of ``KERNELS_SEEN`` (a first run on this machine,
    or a cleared cache); "warm" when it also holds the launch list (``path``, the shipped one by
    default) compiled ahead whole, every share's helper done (``compiled_ahead``); else
    "partial": some kernels are there (an earlier run's, one whose helpers its exit ended, or
    another version's), the rest of the list is compiled ahead again."""
    cache = cache or triton_cache_dir()
    try:
        seen = any(entry.is_dir() and any(os.path.exists(os.path.join(entry.path, f"{k}.json")) for k in KERNELS_SEEN)
                   for entry in os.scandir(cache))
    except OSError:
        seen = False
    if not seen:
        return "cold"
    return "warm" if compiled_ahead(cache, path) else "partial"


def list_digest(path: Path | None = None) -> str:
    """What compiling a launch list ahead depends on: the list, Triton's version and the source of
    each module its kernels live in (an edit there changes their cache keys); "" without a list."""
    path = path or LAUNCHES
    try:
        listing = path.read_bytes()
    except OSError:
        return ""
    h = hashlib.sha256(listing)
    try:
        import triton

        h.update(triton.__version__.encode())
    except ImportError:
        pass
    root = Path(__file__).resolve().parents[1]  # the package: its modules are files under it
    for name in kernel_modules(_records(listing)):
        parts = name.split(".")
        if parts[0] == root.name:
            try:
                h.update(root.joinpath(*parts[1:]).with_suffix(".py").read_bytes())
            except OSError:
                pass
    return h.hexdigest()[:20]


def done_marker(cache: Path, digest: str, share: int, shares: int) -> Path:
    return cache / f"{DONE_PREFIX}{digest}-{share}-of-{shares}"


def compiled_ahead(cache: Path | None = None, path: Path | None = None) -> bool:
    """Whether every share of some split of the launch list left its ``done_marker`` in the
    cache (true of no list: nothing to compile)."""
    cache, digest = cache or triton_cache_dir(), list_digest(path)
    if not digest:
        return True
    shares: dict[int, set[int]] = {}
    try:
        names = os.listdir(cache)
    except OSError:
        return False
    for name in names:
        if name.startswith(f"{DONE_PREFIX}{digest}-"):
            try:
                share, _, n = name.removeprefix(f"{DONE_PREFIX}{digest}-").split("-")
                shares.setdefault(int(n), set()).add(int(share))
            except ValueError:
                continue
    return any(got >= set(range(n)) for n, got in shares.items())


# ------------------------------------------------------------------ recording


def _int_class(v: int) -> tuple:
    """What Triton's JIT can specialise an integer argument on: 1, divisibility by 16, and the
    integer type its range needs (a launch list keeps one value per class)."""
    return (v == 1, v % 16 == 0, -(2**31) <= v < 2**31, v < 2**63)


def encode_arg(v: Any, exact: bool = False, any_class: bool = False) -> dict | None:
    """The argument as a launch list stores it, or None for one it cannot replay (a tensor off a
    16-byte boundary: ``warmup`` assumes aligned pointers, so the variant it compiled would not
    be the one launched). ``exact``: a constexpr or a launch option, whose value is the variant
    (an integer argument's is only its class, ``_key``); ``any_class``: an integer the kernel
    does not specialise on (``do_not_specialize``), whose value counts only by its type."""
    if hasattr(v, "data_ptr") and hasattr(v, "dtype"):  # a tensor
        return None if v.data_ptr() % 16 else {"tensor": str(v.dtype).removeprefix("torch.")}
    if isinstance(v, (bool, int, float, str)) or v is None:
        return {"value": v, **({"exact": True} if exact else {}), **({"any": True} if any_class else {})}
    return None


def launch_record(kernel: Any, args: tuple, kwargs: dict) -> dict | None:
    """A launch list entry for ``kernel[grid](*args, **kwargs)``, or None where an argument
    cannot be replayed. Keyword arguments are constexprs or launch options unless the kernel's
    parameters say otherwise."""
    params = getattr(kernel, "params", None)
    names = [p.name for p in params] if params else []
    runtime = {p.name for p in params if not p.is_constexpr} if params else set()
    anyc = {p.name for p in params if getattr(p, "do_not_specialize", False)} if params else set()
    out_args = [encode_arg(a, exact=bool(params) and i < len(names) and names[i] not in runtime,
                           any_class=i < len(names) and names[i] in anyc)
                for i, a in enumerate(args)]
    out_kw = {k: encode_arg(v, exact=k not in runtime) for k, v in kwargs.items()}
    if None in out_args or None in out_kw.values():
        return None
    return {"kernel": f"{kernel.fn.__module__}:{kernel.fn.__name__}", "args": out_args, "kwargs": out_kw}


def install_recorder(path: Path, prefix: str = "cosybatch.") -> Callable[[], None]:
    """From now on, note every distinct variant of a kernel of module ``prefix...`` this process
    launches, in ``path`` (JSON, rewritten on each new one, merged with what it already held, so
    that several runs together list a profile's launches); returns the function that stops it.
    ``COSYBATCH_RECORD_LAUNCHES=PATH`` turns it on for a ``synth`` or ``profile`` run."""
    from triton.runtime.jit import JITFunction

    records: list[dict] = load_launches(path)
    seen = {_key(r) for r in records}
    unlisted: set[str] = set()
    lock = threading.Lock()
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup and self.fn.__module__.startswith(prefix):
            rec = launch_record(self, args, kwargs)
            if rec is None:
                name = f"{self.fn.__module__}:{self.fn.__name__}"
                with lock:
                    if name not in unlisted:  # its variant is compiled in the run: a launch to mend
                        unlisted.add(name)
                        log.warning("a launch of %s cannot be listed (a tensor off a 16-byte boundary)", name)
            else:
                key = _key(rec)
                with lock:
                    if key not in seen:
                        seen.add(key)
                        records.append(rec)
                        tmp = path.with_suffix(".tmp")
                        tmp.write_text(json.dumps(records, indent=0))
                        os.replace(tmp, path)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = run

    def stop() -> None:
        JITFunction.run = original

    return stop


def _key(rec: dict) -> tuple:
    """What a launch list entry's compiled variant depends on (its de-duplication key)."""
    def one(e: dict) -> tuple:
        if "tensor" in e:
            return ("tensor", e["tensor"])
        v = e["value"]
        if isinstance(v, bool) or v is None or isinstance(v, str) or e.get("exact"):
            return ("value", v)
        if not isinstance(v, int):
            return ("float",)
        return ("int", _int_class(v)[2:] if e.get("any") else _int_class(v))

    return (rec["kernel"], tuple(one(a) for a in rec["args"]),
            tuple((k, one(v)) for k, v in sorted(rec["kwargs"].items())))


# ------------------------------------------------------------------ watching a run


class CompileWatch:
    """The kernel variants this process's launches had to compile or read from the disk cache
    (a launch the in-memory cache did not hold), through Triton's JIT hooks: ``log`` lists
    (kernel, compiled) in order, compiled True when the variant's cache entry was written after
    the launch asked for it (compiled here, or by a helper meanwhile: the launch waited), False
    when it was read from the disk cache. The timeline counts them inside its window, as it
    counts graph captures. Warm-ups (``preload``) are not launches and are not listed."""

    def __init__(self) -> None:
        self.log: list[tuple[str, bool]] = []
        self._asked = threading.local()
        self._lock = threading.Lock()

    def install(self) -> bool:
        """Chain the hooks onto Triton's (False where this Triton has none)."""
        try:
            from triton import knobs
        except ImportError:
            return False
        rt = knobs.runtime
        if not (hasattr(rt, "jit_cache_hook") and hasattr(rt, "jit_post_compile_hook")):
            return False
        before, after = rt.jit_cache_hook, rt.jit_post_compile_hook

        def asked(**kw):
            if not kw.get("is_manual_warmup"):
                self._asked.t = time.time()
            return before(**kw) if before else None  # (a true value would skip the compile)

        def done(**kw):
            t0 = getattr(self._asked, "t", None)
            self._asked.t = None
            if t0 is not None and not kw.get("is_manual_warmup"):
                name, compiled = self._entry(kw, t0)
                with self._lock:
                    self.log.append((name, compiled))
            return after(**kw) if after else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = asked, done
        return True

    def _entry(self, kw: dict, t0: float) -> tuple[str, bool]:
        fn, spec = kw.get("fn"), kw.get("compile") or {}
        jit = getattr(fn, "jit_function", None)
        name = f"{getattr(fn, 'module', '?')}:{getattr(fn, 'name', '?')}"
        try:
            from triton.runtime.cache import get_cache_manager

            kernel = jit.device_caches[spec["device"]][0][spec["key"]]
            meta = get_cache_manager(kernel.hash).get_file(f"{kernel.name}.json")
            # File times are coarse (a few ms): an entry written in the last 50 ms before the
            # launch asked is one a helper just finished, which the launch waited for too.
            return name, meta is None or os.stat(meta).st_mtime >= t0 - 0.05
        except (ImportError, AttributeError, KeyError, IndexError, TypeError, OSError):
            return name, True  # not found on disk: not read from it

    def since(self, start: int) -> dict:
        """What the launches from entry ``start`` of the log compiled and read."""
        with self._lock:
            part = self.log[start:]
        compiled = sorted({k for k, c in part if c})
        return {"compiled": sum(c for _, c in part), "loaded": sum(not c for _, c in part),
                "compiled_kernels": compiled}


WATCH = CompileWatch()
_watching = False


def watch_compiles() -> CompileWatch | None:
    """Install ``WATCH`` once per process (on a GPU with Triton; None where it cannot)."""
    global _watching
    if not _watching:
        _watching = WATCH.install()
    return watching()


def watching() -> CompileWatch | None:
    """``WATCH`` once installed, else None."""
    return WATCH if _watching else None


# ------------------------------------------------------------------ compiling ahead


def _decode(e: dict) -> Any:
    if "tensor" in e:
        import torch

        return getattr(torch, e["tensor"])  # warmup stands a dtype in for an aligned tensor
    return e["value"]


def _warmup(rec: dict) -> Any:
    """Triton's ``warmup`` of a launch list entry: its compiled kernel, from the process's
    in-memory cache, else the disk cache, else compiled now (raises for a stale entry)."""
    module, name = rec["kernel"].split(":")
    kernel = getattr(importlib.import_module(module), name)
    return kernel.warmup(*map(_decode, rec["args"]), grid=(1,), **{k: _decode(v) for k, v in rec["kwargs"].items()})


def _launcher(compiled: Any) -> None:
    """Build a compiled kernel's launcher as its first launch would (Triton's private step; some
    Triton versions compile a C launcher per signature into the cache), without loading the
    kernel onto a GPU: a helper process needs no CUDA context for it."""
    from triton.runtime import driver

    driver.active.launcher_cls(compiled.src, compiled.metadata)


def precompile(records: list[dict], share: int = 0, shares: int = 1) -> tuple[int, int]:
    """Compile every ``shares``-th entry of ``records`` from the ``share``-th (into Triton's
    cache, through ``warmup``, for this process's current device), each with its launcher;
    (compiled, failed). An entry that fails (a kernel renamed or gone, an argument list that no
    longer fits) is skipped: the run then compiles that variant itself."""
    done = failed = 0
    for rec in records[share::shares]:
        try:
            _launcher(_warmup(rec))
            done += 1
        except Exception as e:  # one stale entry must not stop the others
            failed += 1
            log.debug("precompile %s: %s", rec.get("kernel"), e)
    return done, failed


def preload(records: list[dict], stop: threading.Event | None = None) -> tuple[int, bool]:
    """Load the entries of a launch list into this process from Triton's cache (each kernel's
    in-memory cache and its CUDA module), on the current device, so that their first launches
    in the run neither read the disk nor load a module; for a warm cache, on a start-up thread
    beside the weights' loading (design.md D37). Returns (loaded, stale): stale when an entry
    was not in the cache (it was compiled here: the cache holds another version's kernels),
    which ends the loop, as does ``stop`` being set (the weights are loaded)."""
    cache = triton_cache_dir()

    def entries() -> int:
        try:
            return len(os.listdir(cache))
        except OSError:
            return -1

    loaded = 0
    for rec in records:
        if stop is not None and stop.is_set():
            break
        before = entries()  # (loading a module below may add a launcher's entry: not a stale kernel)
        try:
            compiled = _warmup(rec)
        except Exception as e:  # a stale entry: the run loads (or compiles) that variant itself
            log.debug("preload %s: %s", rec.get("kernel"), e)
            continue
        if entries() != before:  # compiled here rather than read from the cache
            return loaded, True
        loaded += 1
        try:  # the CUDA module (Triton's private step; else it is loaded at the first launch)
            getattr(compiled, "_init_handles", lambda: None)()
        except Exception as e:
            log.debug("preload %s: module not loaded: %s", rec.get("kernel"), e)
    return loaded, False


def kernel_modules(records: list[dict]) -> list[str]:
    """The modules a launch list's kernels live in (imported before the start-up's threads)."""
    return sorted({r["kernel"].split(":")[0] for r in records if isinstance(r.get("kernel"), str)})


def load_launches(path: Path | None = None) -> list[dict]:
    """A recorded launch list (the shipped one by default; [] when there is none or it does not
    parse)."""
    try:
        return _records((path or LAUNCHES).read_bytes())
    except OSError:
        return []


def _records(listing: bytes) -> list[dict]:
    """A launch list's entries from its file's bytes ([] when they do not parse as one)."""
    try:
        records = json.loads(listing)
    except ValueError:
        return []
    return records if isinstance(records, list) else []


class AheadCompile:
    """Helper processes that compile a launch list into Triton's cache while this process starts
    up and runs (each its own share: compiling holds a process's GIL, so threads would not run
    it in parallel, and here it would hold the GPU thread's). Each leaves its ``done_marker``
    when its share is compiled, and ends; ``stop`` (this process's exit) kills those still
    going: a kernel half-compiled is never in the cache, whose entries Triton writes whole, and
    the next run compiles the shares left."""

    def __init__(self, path: Path, shares: int, todo: list[int]):
        self.procs: list[subprocess.Popen] = []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        for i in todo:
            try:
                self.procs.append(subprocess.Popen([sys.executable, "-m", __name__, str(path), str(i), str(shares)], env=env,
                                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL, close_fds=True))
            except OSError as e:
                log.debug("cannot start a compiling process: %s", e)
                break
        atexit.register(self.stop)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.procs = []


def _claim(cache: Path) -> bool:
    """Whether this process may compile ahead into ``cache``: one process of a machine at a time
    (``--devices`` workers start together and share the cache), by a marker file that an exiting
    process removes; one older than ``CLAIM_S`` is taken as left by a killed process."""
    marker = cache / CLAIM_NAME
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            if time.time() - marker.stat().st_mtime < CLAIM_S:
                return False
            marker.unlink()
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except OSError:
            return False
    except OSError:
        return False
    os.close(fd)
    atexit.register(marker.unlink, missing_ok=True)
    return True


def start_ahead_compile(cache_state: str, path: Path | None = None, workers: int | None = None) -> AheadCompile | None:
    """Unless the cache is warm, with a launch list (the shipped one by default), start compiling
    it ahead (``AheadCompile``, half the CPUs' worth of processes, at most 8): every share on a
    cold cache, on a partial one those whose helper left no ``done_marker``."""
    if cache_state == "warm":
        return None
    path = path or LAUNCHES
    n = len(load_launches(path))
    if not n:
        return None
    cache = triton_cache_dir()
    if not _claim(cache):
        log.info("another process compiles this package's GPU kernels ahead")
        return None
    shares = min(n, workers or max(1, min(8, (os.cpu_count() or 2) // 2)))
    todo = list(range(shares))
    if cache_state == "partial":
        digest = list_digest(path)
        todo = [i for i in todo if not done_marker(cache, digest, i, shares).exists()]
    if not todo:
        return None
    log.info("compiling %d recorded GPU kernel variants ahead in %d helper processes", n, len(todo))
    return AheadCompile(path, shares, todo)


def _compile_share(path: Path, share: int, shares: int) -> None:
    """One helper's work: its share of the list compiled, then its marker left (a failed entry
    included: compiling it again would fail again; the run compiles that variant itself)."""
    precompile(load_launches(path), share, shares)
    try:
        done_marker(triton_cache_dir(), list_digest(path), share, shares).touch()
    except OSError as e:  # a read-only cache: the next run's helpers find the list compiled and end
        log.debug("cannot mark share %d of %d compiled: %s", share, shares, e)


if __name__ == "__main__":  # one AheadCompile process: python -m cosybatch.gpu.triton_cache LIST SHARE SHARES
    _compile_share(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
