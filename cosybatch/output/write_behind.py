"""One thread that commits finished rows while the caller's thread goes on synthesizing.

A row's commit is three fsyncs (its WAV, the folder, its ledger line). On the thread that
issues the GPU's work they leave the GPU idle between two steps; here they overlap it.

Items are committed in the order they were put, one at a time, so the ledger reads exactly
as if the caller had committed them itself. The first exception the commit raises (a full
disk) stops the thread: what is still queued is never committed (the re-run redoes it), and
the exception is raised again in the caller's next ``put`` or in ``drain``. Signals are
delivered to the main thread only, so a commit on this thread is never cut in half by one.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable


class WriteBehind:
    def __init__(self, commit: Callable[[Any], None], depth: int = 64, name: str = "cosybatch-writer"):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._commit = commit
        self._depth = depth
        self._items: deque = deque()
        self._cv = threading.Condition()
        self._busy = False  # an item is being committed
        self._closing = False  # no more items will come: the thread ends once the queue is empty
        self._stop = False  # end after the current item, whatever is queued
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._closing and not self._stop:
                    self._cv.wait()
                if self._stop or not self._items:
                    return
                item = self._items.popleft()
                self._busy = True
                self._cv.notify_all()  # room in the queue
            try:
                self._commit(item)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
                with self._cv:
                    self._error, self._stop = e, True
                    self._busy = False
                    self._items.clear()
                    self._cv.notify_all()
                return
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def put(self, item: Any) -> None:
        """Queue ``item``; waits while ``depth`` items are queued (a slow disk holds the caller
        back instead of filling memory); raises the error that stopped the thread."""
        with self._cv:
            while len(self._items) >= self._depth and self._thread.is_alive() and not self._stop:
                self._cv.wait()
            self._raise_error()
            if self._stop or not self._thread.is_alive():
                raise RuntimeError("the writer thread has stopped")
            self._items.append(item)
            self._cv.notify_all()

    def drain(self) -> None:
        """Wait until every queued item is committed; raises the error that stopped the thread."""
        with self._cv:
            while (self._items or self._busy) and not self._stop:
                self._cv.wait()
            self._raise_error()

    def close(self, finish: bool = True) -> BaseException | None:
        """End the thread and wait for it: after committing what is queued (``finish``), or
        after the item being committed; returns the error that stopped it, if not raised yet.
        A KeyboardInterrupt while waiting turns a finishing close into a stopping one (a second
        Ctrl-C does not wait for the rest of the queue); the wait itself always completes, so
        no commit outlives this call."""
        with self._cv:
            self._closing = True
            self._stop = self._stop or not finish
            self._cv.notify_all()
        while self._thread.is_alive():
            try:
                self._thread.join()
            except KeyboardInterrupt:
                with self._cv:
                    self._stop = True
                    self._cv.notify_all()
        e, self._error = self._error, None
        return e

    def __enter__(self) -> "WriteBehind":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        """Commits what is queued; the thread's error is raised only when no other exception
        is on its way out (that one is the news; the re-run redoes the rows left)."""
        e = self.close(finish=True)
        if e is not None and exc_type is None:
            raise e
