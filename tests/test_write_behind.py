"""WriteBehind: commits in order on its own thread; the first error stops it and reaches the caller."""

from __future__ import annotations

import threading

import pytest

from cosybatch.output.write_behind import WriteBehind


def test_commits_every_item_in_order_on_its_own_thread():
    done, threads = [], set()

    def commit(x):
        done.append(x)
        threads.add(threading.current_thread().name)

    with WriteBehind(commit, depth=3) as wb:
        for i in range(50):
            wb.put(i)
        wb.drain()
        assert done == list(range(50))
    assert threads == {"cosybatch-writer"}


def test_put_waits_while_the_queue_is_full():
    release = threading.Event()
    started = threading.Event()
    done = []

    def commit(x):
        started.set()
        release.wait(10)
        done.append(x)

    wb = WriteBehind(commit, depth=1)
    wb.put(0)
    assert started.wait(10)  # 0 is being committed, so the queue is empty again
    wb.put(1)  # fills the queue
    blocked = threading.Thread(target=wb.put, args=(2,))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive()  # no room until the writer takes the next item
    release.set()
    blocked.join(10)
    assert not blocked.is_alive()
    wb.drain()
    wb.close()
    assert done == [0, 1, 2]


def _gated_commit(fail_at: int):
    """(gate, committed items, commit): commit waits for the gate, then fails on ``fail_at``."""
    gate = threading.Event()
    done = []

    def commit(x):
        gate.wait(10)
        if x == fail_at:
            raise OSError("disk full")
        done.append(x)

    return gate, done, commit


def test_the_first_error_stops_the_thread_drops_the_queue_and_reaches_the_caller():
    gate, done, commit = _gated_commit(fail_at=1)
    wb = WriteBehind(commit, depth=10)
    for i in range(4):
        wb.put(i)
    gate.set()
    with pytest.raises(OSError, match="disk full"):
        wb.drain()
    with pytest.raises(RuntimeError, match="stopped"):
        wb.put(9)
    assert wb.close() is None  # raised once, not twice
    assert done == [0]  # 2 and 3 were queued behind the failure and never committed


def test_exit_commits_what_is_queued_and_lets_the_callers_exception_win():
    gate, done, commit = _gated_commit(fail_at=2)
    with pytest.raises(KeyboardInterrupt):
        with WriteBehind(commit) as wb:
            wb.put(0)
            wb.put(1)
            wb.put(2)
            gate.set()
            raise KeyboardInterrupt
    assert done == [0, 1]
    with pytest.raises(OSError, match="disk full"):  # with nothing else on its way out, the error is raised
        with WriteBehind(commit) as wb:
            wb.put(2)


def test_close_without_finishing_stops_after_the_current_item():
    started, release = threading.Event(), threading.Event()
    done = []

    def commit(x):
        started.set()
        release.wait(10)
        done.append(x)

    wb = WriteBehind(commit)
    for i in range(3):
        wb.put(i)
    assert started.wait(10)
    threading.Timer(0.1, release.set).start()
    wb.close(finish=False)
    assert done == [0]
