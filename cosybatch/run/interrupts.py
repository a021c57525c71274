"""Signals during a run: SIGINT/SIGTERM become ``Interrupted`` where the run can stop cleanly."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

from cosybatch.run.exits import Interrupted


class DeferredInterrupts:
    """SIGINT/SIGTERM raise ``Interrupted``, except inside ``commit()`` where they wait, so the
    run's first and last records are never cut in half. (Rows are committed on the writer
    thread, where signals never arrive.)"""

    def __init__(self) -> None:
        self._pending: int | None = None
        self._depth = 0
        self._saved: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self._depth:
            self._pending = signum
            return
        raise Interrupted(signum)

    def __enter__(self) -> "DeferredInterrupts":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._saved[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._saved.items():
            signal.signal(s, h)

    @contextlib.contextmanager
    def commit(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0 and self._pending is not None:
            signum, self._pending = self._pending, None
            raise Interrupted(signum)


@contextlib.contextmanager
def signals_decide_setup() -> Iterator[None]:
    """While a synthesizer is imported and built: SIGINT/SIGTERM raise ``Interrupted``, and any
    error that follows one of them *is* that interrupt.

    Native extensions turn an exception raised during their initialization into another one
    (pybind11 modules such as onnxruntime's raise ``ImportError: initialization failed`` when
    Ctrl-C lands while they load), which the set-up would otherwise report as a broken
    synthesizer (exit 2). The signal that arrived decides the exit: 130 or 143.
    """
    noted: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        noted.append(signum)
        raise Interrupted(signum)

    saved: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            saved[s] = signal.signal(s, handler)
    try:
        yield
    except Exception as e:
        if noted:
            raise Interrupted(noted[0]) from e
        raise
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
