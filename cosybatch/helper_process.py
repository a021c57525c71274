"""A helper process for a row's CPU work that would otherwise hold this process's GIL.

``synth`` drives the GPU from one Python thread, and every other thread of the process shares
the GIL with it: a row's wetext normalisation (kaldifst compositions and Python loops, ~2.5 ms)
and its loudness measurement (scipy's ``lfilter`` keeps the GIL, and pyloudnorm's gating loop is
Python, ~2.5 ms) stall that thread for as long as they run, whichever thread runs them.
``HelperProcess.run(fn, *args)`` runs such a call in a child process instead: this process only
pickles the arguments and waits on a pipe, with the GIL released. (``scripts/row_cpu_cost.py``
measures what each piece holds.)

The child is the same interpreter with the same ``sys.path``, so it imports the same code and
libraries and returns the same result, bit for bit, that the call would return here. Whatever
goes wrong there -- the child could not start, died, or the call raised -- the call is run
here instead: it then returns, or raises, exactly what it always did, and a failure changes
only where a row's CPU work is done, never its output. The child ignores SIGINT (a Ctrl-C is
the parent's to handle) and ends when its stdin closes: at ``close()``, or when the parent
dies whichever way.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

_PATH_ENV = "COSYBATCH_HELPER_SYS_PATH"
_BOOT = (f"import json, os, sys; sys.path[:] = json.loads(os.environ[{_PATH_ENV!r}]); "
         "from cosybatch.helper_process import serve; serve()")


def serve() -> None:
    """The child's loop: read ``(fn, args)``, answer ``("ok", result)`` or ``("err", why)``.
    Answers go to a copy of the original stdout; fd 1 itself is pointed at stderr, so a library
    that prints (from Python or C) cannot corrupt the answers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    while True:
        try:
            fn, args = pickle.load(requests)
        except EOFError:
            return
        try:
            reply = ("ok", fn(*args))
        except BaseException as e:  # noqa: BLE001 -- the parent runs the call again and sees it
            reply = ("err", f"{type(e).__name__}: {e}")
        try:
            try:
                data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # an unpicklable result: say so, the parent runs the call itself
                data = pickle.dumps(("err", f"result not picklable: {e}"), protocol=pickle.HIGHEST_PROTOCOL)
            answers.write(data)
            answers.flush()
        except OSError:  # the parent is gone (no one reads the answers): end quietly
            return


class _Gone(Exception):
    """The child cannot answer (not started, dead, or the pipe broke)."""


class _NotSent(Exception):
    """This call cannot be sent (it does not pickle); the child is fine."""


class HelperProcess:
    """One child process running calls one at a time for any thread of this one (a lock orders
    them). ``warm``: a first call ``(fn, *args)`` sent at once (imports, a model build), so
    that the first row does not wait for it; its result is dropped."""

    def __init__(self, name: str, warm: tuple | None = None, local_until_warm: bool = False):
        self.name = name
        # Calls made before the warm-up has answered (the child is still importing) run here
        # instead of queueing behind it: a writer's first rows then do not wait seconds for the
        # child's start-up, while a caller whose warm-up builds what every call needs (a text
        # normalizer) keeps waiting for it, so that it is not built twice.
        self._local_until_warm = local_until_warm
        self._lock = threading.Lock()
        self._owed = 0  # answers to calls whose result nobody waits for (the warm-up)
        self._proc: subprocess.Popen | None = None
        self.fallbacks = 0  # calls run here instead (the child failed them or was gone)
        try:
            env = {**os.environ, _PATH_ENV: json.dumps(sys.path)}
            self._proc = subprocess.Popen([sys.executable, "-c", _BOOT], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, env=env, close_fds=True)
        except OSError as e:
            log.warning("%s: cannot start a helper process (%s); its work runs in this process", name, e)
            return
        if warm is not None:
            try:
                self._send(warm[0], warm[1:])
                self._owed += 1
            except (_Gone, _NotSent) as e:
                log.debug("%s: warm-up not sent (%s)", name, e)

    @property
    def alive(self) -> bool:
        return self._proc is not None

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, computed in the child when it can (``fn`` and the arguments must
        pickle: a module-level function, a bound method of a picklable object), else here."""
        with self._lock:
            starting = self._proc is not None and self._owed and self._local_until_warm and not self._answer_ready()
            if self._proc is not None and not starting:
                try:
                    while self._owed:
                        self._receive()
                        self._owed -= 1
                    self._send(fn, args)
                    status, value = self._receive()
                    if status == "ok":
                        return value
                    log.debug("%s: %s failed in the helper (%s); run here", self.name,
                              getattr(fn, "__qualname__", fn), value)
                except _NotSent as e:
                    log.debug("%s: %s; run here", self.name, e)
                except _Gone as e:
                    log.warning("%s: the helper process is gone (%s); its work runs in this process from now on",
                                self.name, e)
                    self._stop()
            if not starting:
                self.fallbacks += 1
        return fn(*args)

    def _answer_ready(self) -> bool:
        """Whether an answer can be read without waiting (nothing of the child's output has been
        read before the warm-up's answer, so the pipe itself tells)."""
        try:
            return bool(select.select([self._proc.stdout], [], [], 0)[0])
        except (OSError, ValueError):
            return True  # let the read find out what is wrong

    def _send(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            data = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # not picklable: a caller's mistake, the call still runs here
            raise _NotSent(f"cannot send {getattr(fn, '__qualname__', fn)}: {e}") from None
        try:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()
        except (OSError, ValueError) as e:
            raise _Gone(str(e) or type(e).__name__) from None

    def _receive(self) -> tuple[str, Any]:
        try:
            return pickle.load(self._proc.stdout)
        except EOFError:
            raise _Gone(f"exit code {self._proc.poll()}") from None
        except Exception as e:
            raise _Gone(f"{type(e).__name__}: {e}") from None

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """End the child (it finishes the call in hand, if any); safe to call twice."""
        with self._lock:
            self._stop()

    def __enter__(self) -> "HelperProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HelperPool:
    """``n`` helper processes for calls from several threads at once: a call takes a free one
    (or waits for one), so ``n`` callers never queue behind each other's calls."""

    def __init__(self, name: str, n: int, warm: tuple | None = None, local_until_warm: bool = False):
        self.helpers = [HelperProcess(f"{name} {i + 1}/{n}", warm, local_until_warm) for i in range(n)]
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for h in self.helpers:
            self._free.put(h)

    @property
    def alive(self) -> bool:
        return any(h.alive for h in self.helpers)

    @property
    def fallbacks(self) -> int:
        return sum(h.fallbacks for h in self.helpers)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``HelperProcess.run`` on a free helper."""
        h = self._free.get()
        try:
            return h.run(fn, *args)
        finally:
            self._free.put(h)

    def close(self) -> None:
        for h in self.helpers:
            h.close()
