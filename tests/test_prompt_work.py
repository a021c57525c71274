"""PromptWork with a GPU frontend: prompts gather into full launches while the AR engine has
rows queued, cached prompts pass at once, and an idle pipeline launches what it has."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from cosybatch.scheduler.protocol import SynthRequest
from cosybatch.scheduler.accounting import Accounting
from cosybatch.scheduler.prompt_work import PromptWork


@dataclass
class _Loaded:
    source: str
    cached: object = None


@dataclass
class _Row:
    utt_id: str
    prompt_wav: str
    prompt_text: str = "p"
    target_text: str = "t"


class _Frontend:
    def __init__(self, cached: set[str]):
        self.cached, self.launches = cached, []
        self.gates: dict[str, threading.Event] = {}  # prompts whose loading waits for their event

    def load(self, path):
        if path in self.gates:
            self.gates[path].wait(10)
        return _Loaded(path, "features" if path in self.cached else None)

    def prepare(self, prompt_text, target_text):
        return "text"

    def launch_features(self, prompts):
        self.launches.append(sorted(p.source for p in prompts))

        class Done:
            def ready(self):
                return True

            def result(self):
                return [p.source for p in prompts]
        return Done()


def _work(cached=(), batch=4, gather_s=0.0):
    fe = _Frontend(set(cached))
    return fe, PromptWork(fe, workers=2, on_device=True, acct=Accounting(torch.device("cpu")), batch=batch,
                          gather_s=gather_s)


def _add(work, names):
    for n in names:
        work.add(SynthRequest(n, _Row(n, n)))
    deadline = time.monotonic() + 10
    while any(not work.preparing[n][1].done() for n in names if n in work.preparing) and time.monotonic() < deadline:
        time.sleep(0.001)


def _ids(ready):
    return sorted(req.request_id for req, _, _ in ready)


def test_prompts_gather_while_the_engine_has_a_full_batch_queued():
    fe, work = _work(cached={"c1"})
    try:
        _add(work, ["a", "b", "c1"])
        ready, failed, moved = work.take(backlog=10)
        assert fe.launches == [["c1"]] and moved and not failed  # the cached prompt passes at once
        assert _ids(ready) == ["c1"] and work.has_work()
        _add(work, ["d"])
        assert work.take(backlog=10)[0] == [] and fe.launches == [["c1"]]  # three of four gathered
        _add(work, ["e"])
        ready, _, _ = work.take(backlog=10)  # a full batch: one launch of all four
        assert fe.launches[-1] == ["a", "b", "d", "e"] and _ids(ready) == ["a", "b", "d", "e"]
        assert not work.has_work()
    finally:
        work.close()


def test_a_short_engine_queue_or_an_idle_pipeline_launches_what_has_gathered():
    fe, work = _work()
    try:
        _add(work, ["a"])
        assert _ids(work.take(backlog=3)[0]) == ["a"]  # fewer than a batch queued ahead: needed now
        _add(work, ["b", "c"])
        assert work.take(backlog=4)[0] == []
        assert _ids(work.take(wait=True, backlog=4)[0]) == ["b", "c"]  # idle: nothing to gather for
        assert fe.launches == [["a"], ["b", "c"]]
    finally:
        work.close()


def test_with_a_gather_time_a_short_queue_waits_for_the_oldest_prompt_s_time():
    """``frontend.gather_ms``: with fewer than a batch queued and prompts still loading,
    gathered prompts launch together once the oldest has waited that long (not one launch
    each as they load), even while the pipeline is idle (a bulk run's ramp); a full batch, a
    cached prompt, or the last prompts (none still loading) go at once."""
    fe, work = _work(cached={"c"}, gather_s=0.2)
    gate = fe.gates["z"] = threading.Event()
    try:
        work.add(SynthRequest("z", _Row("z", "z")))  # loading until the gate opens
        _add(work, ["a"])
        t0 = time.perf_counter()
        assert work.take(backlog=0)[0] == [] and fe.launches == []  # the engine could use it, yet it waits
        _add(work, ["b", "c"])
        ready, _, _ = work.take(backlog=0)
        assert _ids(ready) == ["c"] and fe.launches == [["c"]]  # the cached one passes
        assert work.take(wait=True, backlog=0)[0] == []  # idle, yet "z" is on its way: gather on
        work.idle()
        assert fe.launches == [["c"]]
        while time.perf_counter() - t0 < 0.2:
            assert work.take(backlog=0)[0] == [] or time.perf_counter() - t0 >= 0.2
            time.sleep(0.01)
        ready, _, _ = work.take(backlog=0)
        assert _ids(ready) == ["a", "b"] and fe.launches[-1] == ["a", "b"]  # one launch for both
        _add(work, ["d", "e", "f", "g"])
        assert _ids(work.take(backlog=0)[0]) == ["d", "e", "f", "g"]  # a full batch goes at once
        _add(work, ["h"])
        assert work.take(backlog=0)[0] == []
        gate.set()
        while not work.preparing["z"][1].done():
            time.sleep(0.001)
        # nothing more loading: the last prompts go at once, on a take as when idle
        assert _ids(work.take(backlog=0)[0]) == ["h", "z"] and fe.launches[-1] == ["h", "z"]
    finally:
        gate.set()
        work.close()


def test_every_frontend_call_goes_on_the_frontend_stream(monkeypatch):
    """``scheduler.frontend_stream=beside`` (design.md D34): launches, the prompt-by-prompt redo
    of a failed launch and the warm-up all run with the frontend's stream current (its graphs
    must replay on one stream only), and the launch's slice is opened and closed there (its
    events time it on that stream)."""
    from helpers import record_current_stream

    current = record_current_stream(monkeypatch)

    class _Fe(_Frontend):
        def __init__(self):
            super().__init__(set())
            self.on: list[tuple[str, object]] = []

        def launch_features(self, prompts):
            self.on.append(("launch", current[0]))
            if any(p.source == "bad" for p in prompts):
                raise RuntimeError("launch failed")
            return super().launch_features(prompts)

        def features(self, prompts):
            self.on.append(("features", current[0]))
            return [p.source for p in prompts]

    class _Acct(Accounting):
        def start(self, kind, on_done=None):
            fe.on.append(("start " + kind, current[0]))
            return super().start(kind, on_done)

    fe, marker = _Fe(), object()
    work = PromptWork(fe, workers=2, on_device=True, acct=_Acct(torch.device("cpu")), batch=1, stream=marker)
    try:
        _add(work, ["a"])
        assert _ids(work.take(wait=True)[0]) == ["a"]
        _add(work, ["bad"])
        assert _ids(work.take(wait=True)[0]) == ["bad"]  # redone prompt by prompt
        assert work.warm(["w1", "w2"]) == 2
    finally:
        work.close()
    assert [k for k, _ in fe.on] == ["start frontend", "launch", "start frontend", "launch", "features", "features"]
    assert all(s is marker for _, s in fe.on) and current[0] is None
