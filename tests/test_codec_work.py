"""``CodecWork`` (the codec's queues, solves and retries) under any plan the policy may give.

The policy's answers depend on the host clock, so which combinations of slices meet in one
iteration differs from host to host: a start planned beside a solve apart reached an IndexError
on a 2-core CI machine only. Here a seeded random plan stands for the policy: each iteration it
solves some ready first hops apart, decodes some mels, steps the solve in progress and starts a
new one from some of the other ready segments, any mix of them, as the policy's contract allows
(``scheduler/policy.SlicePlan``). Fake flow and HiFT runners tag each mel and waveform with its
hop, and fail on chosen rows (every call that holds one) or at random (a batch of several, which
``CodecWork`` retries on halves). Whatever the plans and faults, every hop of a row that does not
fail comes back once, in order, carrying its own audio; a failing row gets an error before any
hop is lost (what was in flight may still come back, and is dropped, as the pipeline drops it);
and every segment's state is released once.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from cosybatch.scheduler import codec_work, policy
from cosybatch.scheduler.accounting import Accounting
from cosybatch.scheduler.costs import CostModel
from cosybatch.scheduler.policy import Limits, SlicePlan

STEPS = 10


class _Solve:
    def __init__(self, flow, jobs):
        self.flow, self.jobs, self.steps_left = flow, jobs, STEPS
        self.buffers = SimpleNamespace(stride=8)

    def step(self, n):
        self.flow.maybe_fail(self.jobs, "step")
        self.steps_left -= n
        assert self.steps_left >= 0, "stepped past the solve's end"
        return self.steps_left

    def finish(self):
        assert self.steps_left == 0
        return [torch.full((1, 80, 3), float(j.tag)) for j in self.jobs]


class _Flow:
    def __init__(self, rng, poison, p_fail, p_none):
        self.rng, self.poison, self.p_fail, self.p_none = rng, poison, p_fail, p_none
        self.released: list[str] = []
        self.started: list[list[str]] = []  # each solve's segments, as planned

    def maybe_fail(self, jobs, what):
        if any(j.segment_id in self.poison for j in jobs) or (len(jobs) > 1 and self.rng.random() < self.p_fail):
            raise RuntimeError(f"flow {what} failed")

    def start(self, jobs, beside=None):
        if beside is not None and self.rng.random() < self.p_none:
            return None  # nothing planned beside that solve (no prefix arena yet)
        self.maybe_fail(jobs, "start")
        self.started.append([j.segment_id for j in jobs])
        return _Solve(self, jobs)

    def release(self, seg):
        self.released.append(seg)


class _Hift:
    def __init__(self, rng, poison, p_fail):
        self.rng, self.poison, self.p_fail = rng, poison, p_fail
        self.released: list[str] = []

    def run(self, jobs):
        if any(j.segment_id in self.poison for j in jobs) or (len(jobs) > 1 and self.rng.random() < self.p_fail):
            raise RuntimeError("HiFT failed")
        return [j.mel[:, 0, :].clone() for j in jobs]  # [1, 3]: every sample the hop's tag

    def release(self, seg):
        self.released.append(seg)


def _random_plan(rng, streaming):
    """A stand-in for ``policy.plan``: any mix of slices its contract allows."""

    def plan(now, lim, costs, ar_active, solve, hops, mels, ar_rows=0, ar_deadline=policy.INF):
        pick = lambda xs, p: tuple(x for x in xs if rng.random() < p)  # noqa: E731
        apart = pick([h.segment_id for h in hops if h.first], 0.5) if streaming else ()
        hift = pick(list(dict.fromkeys(m.segment_id for m in mels)), 0.6)
        steps = rng.randint(0, solve.steps_left) if solve is not None else 0
        start = list(pick([h.segment_id for h in hops if h.segment_id not in apart], 0.6))
        rng.shuffle(start)  # the plan's order, which the start keeps
        return SlicePlan(hift, steps, tuple(start), rng.randint(0, STEPS) if start else 0, apart)

    return plan


def _drain_plan(now, lim, costs, ar_active, solve, hops, mels, ar_rows=0, ar_deadline=policy.INF):
    """Everything at once: what lets a run end."""
    return SlicePlan(tuple(m.segment_id for m in mels), solve.steps_left if solve else 0,
                     tuple(h.segment_id for h in hops), STEPS)


def _work(flow, hift, limits):
    return codec_work.CodecWork(flow=flow, hift=hift, acct=Accounting(torch.device("cpu")), costs=CostModel(),
                                limits=limits, device=torch.device("cpu"))


def test_a_start_planned_beside_a_solve_apart_skips_the_segment_it_emptied(monkeypatch):
    """The iteration the 2-core CI machine met: a solve apart pops a row's only queued hop,
    leaving that segment's queue empty, and the start planned beside it takes the other
    segments' heads without tripping on the emptied queue."""
    rng = random.Random(0)
    flow, hift = _Flow(rng, set(), p_fail=0.0, p_none=0.0), _Hift(rng, set(), p_fail=0.0)
    work = _work(flow, hift, Limits(streaming=True, budget_ms=4.0, max_jobs=4, max_hift=4, first_apart=True))
    for order, (seg, first) in enumerate((("f", True), ("l", False), ("m", False))):
        work.add(codec_work.QueuedHop(SimpleNamespace(segment_id=seg, tag=order), seg, order, first, True, 100))
    monkeypatch.setattr(codec_work.policy, "plan", lambda *a: SlicePlan((), 0, ("l", "f", "m"), 0, ("f",)))
    assert work.run(0.0, True, lambda row: 1.0)
    assert flow.started == [["f"], ["l", "m"]]  # "f" solved apart; the start takes what is still queued
    assert not work.hops["f"] and work.counts["first_jobs"] == 1
    assert [h.job.segment_id for h in work.active.hops] == ["l", "m"]


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_every_hop_comes_back_once_in_order_whatever_the_plans_and_faults(monkeypatch, streaming, seed):
    rng = random.Random(seed)
    n_rows = rng.randint(1, 8)
    hops_of = {f"r{i}#0": rng.randint(1, 4) for i in range(n_rows)}
    poison_flow = {s for s in hops_of if rng.random() < 0.15}
    poison_hift = {s for s in hops_of if rng.random() < 0.15} - poison_flow
    flow = _Flow(rng, poison_flow, p_fail=0.2 * rng.random(), p_none=0.3)
    hift = _Hift(rng, poison_hift, p_fail=0.2 * rng.random())
    work = _work(flow, hift, Limits(streaming=streaming, budget_ms=4.0, max_jobs=rng.randint(1, 6),
                                    max_hift=rng.randint(1, 6), first_apart=streaming))
    tags, queued, order = {}, dict.fromkeys(hops_of, 0), 0
    got = {s: [] for s in hops_of}
    errors = {s: 0 for s in hops_of}
    failed: set[str] = set()

    def queue_some():
        nonlocal order
        for seg, n in hops_of.items():
            if seg not in failed and queued[seg] < n and rng.random() < 0.4:
                i = queued[seg]
                order += 1
                tags[order] = (seg, i)
                job = SimpleNamespace(segment_id=seg, tag=order)
                work.add(codec_work.QueuedHop(job, seg.split("#")[0], order, i == 0, i == n - 1, 100 * (i + 1)))
                queued[seg] += 1

    def collect():
        for o in work.take_audio():
            seg = o.segment_id
            if seg in failed:
                continue  # what was already in flight when the row failed: the pipeline drops it too
            if o.error is not None:
                errors[seg] += 1
                failed.add(seg)
                work.drop_row(o.row_id, seg)  # as the pipeline does
                continue
            tag = int(o.audio[0])
            assert (o.audio == tag).all() and tags[tag] == (seg, len(got[seg])), (seg, tags[tag], got[seg])
            got[seg].append(tag)
            assert o.finalize == (len(got[seg]) == hops_of[seg])
            if o.finalize:
                work.release(seg)

    monkeypatch.setattr(codec_work.policy, "plan", _random_plan(rng, streaming))
    for it in range(200):
        queue_some()
        work.run(float(it), rng.random() < 0.7, lambda row: float("inf"))
        collect()
    monkeypatch.setattr(codec_work.policy, "plan", _drain_plan)
    for seg in hops_of:  # the rest of every live row's hops
        while seg not in failed and queued[seg] < hops_of[seg]:
            queue_some()
    for _ in range(200):
        if not work.has_work():
            break
        work.run(1e6, False, lambda row: float("inf"))
        collect()
    assert not work.has_work()
    for seg, n in hops_of.items():
        if seg in failed:
            assert errors[seg] == 1 and len(got[seg]) < n, seg  # errors after the first are not counted
        else:
            assert len(got[seg]) == n and errors[seg] == 0, (seg, got[seg])
    assert failed >= poison_flow | poison_hift
    for runner in (flow, hift):  # each segment's state released once, finished or failed
        assert sorted(runner.released) == sorted(hops_of), runner.released
