"""The GPU-timeline policy on synthetic timelines: a fake clock, fixed slice costs, no GPU."""

import math

import pytest

from cosybatch.scheduler.costs import CostModel
from cosybatch.scheduler.policy import (INF, Costs, ReadyHop, Limits, Mel, Solve, codec_turn, iteration_budget,
                                       launch_prompts, pick_jobs, plan, worth_starting)

COSTS = Costs(flow_step_ms_per_token=1e-3, flow_step_ms=0.0, hift_ms_per_frame=1e-2, hift_ms=0.0)
# solve_tokens=0: every ready hop is worth a solve at once (the waiting rule has its own test)
STREAM = Limits(streaming=True, budget_ms=4.0, max_jobs=8, max_hift=8, solve_tokens=0)
FULL = Limits(streaming=False, budget_ms=20.0, max_jobs=8, max_hift=8, solve_tokens=0)


def hop(seg, order, first=False, deadline=INF, tokens=1000, ready_at=0.0):
    return ReadyHop(seg, order, first, deadline, tokens, ready_at)


def test_pick_jobs_orders_imminent_deadlines_first_hops_deadlines_arrival():
    hops = [hop("a", 1, deadline=9.0), hop("b", 2, first=True), hop("c", 3, deadline=5.0), hop("d", 4, deadline=5.0),
            hop("e", 5, first=True), hop("f", 6, deadline=0.2)]
    got = [h.segment_id for h in pick_jobs(hops, STREAM, COSTS, ar_active=False)]
    assert got == ["f", "b", "e", "c", "d", "a"]
    # time passes: c and d become imminent and overtake the first hops
    got = [h.segment_id for h in pick_jobs(hops, STREAM, COSTS, ar_active=False, now=4.9)]
    assert got == ["f", "c", "d", "b", "e", "a"]
    # full responses: arrival order (no players, no first-chunk latency to protect)
    got = [h.segment_id for h in pick_jobs(hops, FULL, COSTS, ar_active=False)]
    assert got == ["a", "b", "c", "d", "e", "f"]


def test_pick_jobs_one_hop_per_segment_and_caps():
    hops = [hop("a", 1), hop("a", 2), hop("b", 3), hop("c", 4)]
    assert [h.order for h in pick_jobs(hops, STREAM, COSTS, ar_active=False)] == [1, 3, 4]
    lim = Limits(streaming=True, budget_ms=4.0, max_jobs=2, max_hift=8)
    assert len(pick_jobs(hops, lim, COSTS, ar_active=False)) == 2
    # With the AR engine busy a solve holds at most 1.5x the target size (6000 tokens here)
    lim = Limits(streaming=True, budget_ms=4.0, max_jobs=8, max_hift=8, solve_tokens=4000)
    big = [hop("x", 1, tokens=3000), hop("y", 2, tokens=3500), hop("z", 3, tokens=900)]
    assert [h.segment_id for h in pick_jobs(big, lim, COSTS, ar_active=True)] == ["x", "z"]
    assert len(pick_jobs(big, lim, COSTS, ar_active=False)) == 3
    # ...but a solve always gets at least one hop, however large
    assert [h.segment_id for h in pick_jobs([hop("w", 1, tokens=10**6)], lim, COSTS, ar_active=True)] == ["w"]


def test_a_solve_waits_until_it_is_worth_its_fixed_cost():
    costs = Costs(flow_step_ms_per_token=1e-3, flow_step_ms=2.0, hift_ms_per_frame=1e-2, hift_ms=0.0)
    assert costs.efficient_tokens() == 6000  # the fixed 2 ms is a quarter of a 6000-token step
    lim = Limits(streaming=True, budget_ms=4.0, max_jobs=8, max_hift=8)
    few = [hop("a", 1, tokens=2000, ready_at=1.0), hop("b", 2, tokens=2000, ready_at=1.0)]
    assert not worth_starting(1.01, lim, costs, True, few)  # 4000 < 6000 tokens, nobody waited long
    assert worth_starting(1.01, lim, costs, True, few + [hop("c", 3, tokens=2000, ready_at=1.0)])
    assert worth_starting(1.01, lim, costs, False, few)  # the AR engine is idle: no more are coming
    assert worth_starting(1.3, lim, costs, True, few)  # waited max_wait_s
    first = [hop("f", 1, first=True, tokens=600, ready_at=1.0)]
    assert not worth_starting(1.02, lim, costs, True, first) and worth_starting(1.06, lim, costs, True, first)
    assert worth_starting(1.0, lim, costs, True, [hop("d", 1, tokens=10, deadline=1.1, ready_at=1.0)])
    assert plan(1.01, lim, costs, True, None, few, []).start == ()


def test_budget_splits_a_solve_across_iterations():
    solve = Solve(tokens=1000, steps_left=10, deadline=INF)  # 1 ms per step
    p = plan(0.0, STREAM, COSTS, True, solve, [hop("n", 1)], [])
    assert (p.flow_steps, p.start) == (4, ())  # 4 ms of budget; no new solve while this one runs
    p = plan(0.0, STREAM, COSTS, True, Solve(1000, 3, INF), [hop("n", 1, tokens=500)], [])
    assert p.flow_steps == 3 and p.start == ("n",) and p.start_steps == 2  # 1 ms left: two 0.5 ms steps
    p = plan(0.0, STREAM, COSTS, True, Solve(10_000, 10, INF), [], [])
    assert p.flow_steps == 1  # a step larger than the budget still advances


def test_an_idle_ar_engine_lifts_the_budget():
    p = plan(0.0, STREAM, COSTS, False, Solve(1000, 10, INF), [hop("n", 1)], [Mel("m", 0, False, INF, 100)])
    assert p.hift == ("m",) and p.flow_steps == 10 and p.start == ("n",) and p.start_steps == 10


def test_an_imminent_deadline_overruns_the_budget():
    near = Solve(tokens=1000, steps_left=10, deadline=0.2)
    assert plan(0.0, STREAM, COSTS, True, near, [], []).flow_steps == 10
    far = Solve(tokens=1000, steps_left=10, deadline=5.0)
    assert plan(0.0, STREAM, COSTS, True, far, [], []).flow_steps == 4
    p = plan(0.0, STREAM, COSTS, True, None, [hop("u", 1, deadline=0.1)], [])
    assert p.start == ("u",) and p.start_steps == 10


def test_hift_runs_for_first_chunks_and_deadlines_else_batches_up():
    waiting = [hop("n", 9)]
    lazy = [Mel("a", 1, False, 5.0, 100)]
    assert plan(0.0, STREAM, COSTS, True, None, waiting, lazy).hift == ()  # flow waits: let the batch grow
    assert plan(0.0, STREAM, COSTS, True, None, waiting, [Mel("b", 2, True, INF, 100)]).hift == ("b",)
    assert plan(4.9, STREAM, COSTS, True, None, waiting, lazy).hift == ("a",)  # its player runs dry soon
    assert plan(0.0, STREAM, COSTS, True, None, [], lazy).hift == ("a",)  # nothing else competes
    full = [Mel(f"m{i}", i, False, INF, 10) for i in range(8)]
    assert len(plan(0.0, STREAM, COSTS, True, None, waiting, full).hift) == 8  # a full batch goes


def test_full_responses_batch_hift_and_solves_for_throughput():
    """In full mode every mel is its row's first (and only) chunk: that alone does not send it
    to HiFT. A batch goes when full, when the flow has nothing else to do, when the AR engine
    is idle, or when a mel has waited max_wait_s; and a solve does not start early for a first hop."""
    lim = Limits(streaming=False, budget_ms=20.0, max_jobs=8, max_hift=4, max_wait_s=0.25)
    waiting = [hop("n", 9, first=True, ready_at=1.0)]
    mels = [Mel(f"m{i}", i, True, INF, 100, ready_at=1.0) for i in range(3)]
    assert plan(1.01, lim, COSTS, True, None, waiting, mels).hift == ()  # the flow has work: grow the batch
    assert plan(1.01, lim, COSTS, True, None, waiting, mels + [Mel("m3", 3, True, INF, 100, 1.0)]).hift == \
        ("m0", "m1", "m2", "m3")  # full
    assert plan(1.01, lim, COSTS, True, None, [], mels).hift == ("m0", "m1", "m2")  # nothing else to do
    assert plan(1.01, lim, COSTS, False, None, waiting, mels).hift == ("m0", "m1", "m2")  # no more tokens coming
    assert plan(1.26, lim, COSTS, True, None, waiting, mels).hift == ("m0", "m1", "m2")  # waited max_wait_s
    costs = Costs(flow_step_ms_per_token=1e-3, flow_step_ms=2.0, hift_ms_per_frame=1e-2, hift_ms=0.0)
    first = [hop("f", 1, first=True, tokens=600, ready_at=1.0)]
    assert not worth_starting(1.06, lim, costs, True, first)  # streaming would start here (first_wait_s)
    assert worth_starting(1.26, lim, costs, True, first)
    # the same mels in streaming go at once: a listener waits for each first chunk
    assert plan(1.01, STREAM, COSTS, True, None, waiting, mels).hift == ("m0", "m1", "m2")


def _simulate(lim, arrivals, n_steps=10, iterations=2000, ar_ms=2.0, tokens=1000):
    """Hops of ``tokens`` arrive at given times; each iteration is an AR step (``ar_ms``) plus
    the planned slices at COSTS; returns {segment: (arrival, finished)}."""
    now, solve, solve_hops, queue, done = 0.0, None, [], [], {}
    pending = sorted(arrivals, key=lambda a: a[1])
    order = 0
    for _ in range(iterations):
        while pending and pending[0][1] <= now:
            seg, t, first = pending.pop(0)
            order += 1
            queue.append((hop(seg, order, first=first, deadline=INF if first else (t + 1000.0) / 1e3, tokens=tokens), t))
        if not (queue or solve or pending):
            break
        ar = bool(pending) or bool(queue)
        s = Solve(sum(h.tokens for h in solve_hops), solve, min(h.deadline for h in solve_hops)) if solve else None
        p = plan(now / 1e3, lim, COSTS, ar, s, [h for h, _ in queue], [])
        ms = ar_ms if ar else 0.0
        if p.flow_steps:
            ms += p.flow_steps * COSTS.flow_step(s.tokens)
            solve -= p.flow_steps
            if solve == 0:
                for h in solve_hops:
                    done[h.segment_id] = now + ms
                solve, solve_hops = None, []
        if p.start and solve is None:
            solve_hops = [h for h, _ in queue if h.segment_id in p.start]
            queue = [(h, t) for h, t in queue if h.segment_id not in p.start]
            solve = n_steps - p.start_steps
            ms += p.start_steps * COSTS.flow_step(sum(h.tokens for h in solve_hops))
            if solve == 0:
                for h in solve_hops:
                    done[h.segment_id] = now + ms
                solve, solve_hops = None, []
        now += max(ms, 0.1)
    return {seg: (t, done.get(seg)) for seg, t, _ in arrivals}


def test_no_hop_starves_under_a_stream_of_first_hops():
    # A steady stream of first hops (every 6 ms) beside later hops (every 12 ms, deadline 1 s
    # after arrival), 2 ms of flow each: 0.5 ms of flow per ms against the 4 ms per 6 ms
    # iteration the budget allows. No later hop is starved by the first hops.
    arrivals = [(f"f{i}", 6.0 * i, True) for i in range(300)] + [(f"l{i}", 12.0 * i + 1, False) for i in range(150)]
    result = _simulate(STREAM, arrivals, iterations=20000, tokens=200)
    waits = {s: end - start for s, (start, end) in result.items()}
    assert all(w is not None for w in waits.values()), "a hop never finished"
    late = [w for s, w in waits.items() if s.startswith("l")]
    assert max(late) < 1000.0  # ms: every later hop made its player's deadline


def test_first_hops_overtake_a_backlog():
    arrivals = [(f"late{i}", 0.0, False) for i in range(30)] + [("first", 1.0, True)]
    result = _simulate(STREAM, arrivals)
    first_done = result["first"][1]
    assert sum(1 for s, (_, end) in result.items() if s != "first" and end < first_done) <= 8  # one solve ahead at most


def test_cost_model_learns_fixed_cost_and_slope():
    m = CostModel(flow_ms_per_token=1e-3, flow_ms=0.0)
    for _ in range(300):  # the hardware really does 2 ms + 0.5 us per token
        for tokens in (1000, 4000, 16000):
            m.observe_flow_step(tokens, 2.0 + 5e-4 * tokens)
    c = m.costs()
    assert math.isclose(c.flow_step_ms, 2.0, rel_tol=0.05) and math.isclose(c.flow_step_ms_per_token, 5e-4, rel_tol=0.05)
    frozen = CostModel(learn=False)
    frozen.observe_hift(100, 50.0)
    assert frozen.costs() == CostModel(learn=False).costs()


class _Clock:
    """``time`` for the accounting module: a clock that moves only when told (host load on a
    shared CI machine stretches real sleeps: a 0 s wait once read 2.5 ms)."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now

    def sleep(self, s):
        self.now += s


def test_accounting_splits_iterations_into_own_work_and_waits(monkeypatch):
    import torch

    from cosybatch.scheduler import accounting

    clock = _Clock()
    monkeypatch.setattr(accounting, "time", clock)
    acct = accounting.Accounting(torch.device("cpu"))
    for wait_s in (0.0, 0.02):
        t0 = clock.perf_counter()
        with acct.waiting():
            clock.sleep(wait_s)
        clock.sleep(0.005)  # the host's own work
        acct.iteration((clock.perf_counter() - t0) * 1e3)
    s = acct.summary()
    assert acct.wait_ms == [0.0, pytest.approx(20.0)]
    assert s["host_wait_share"] == pytest.approx(20 / 30, abs=1e-3)
    assert s["host_busy_ms_per_iteration"]["p50"] == pytest.approx(5.0, abs=1e-3)


def test_accounting_reports_the_host_time_spent_queueing_each_kind_of_slice(monkeypatch):
    import torch

    from cosybatch.scheduler import accounting

    clock = _Clock()
    monkeypatch.setattr(accounting, "time", clock)
    acct = accounting.Accounting(torch.device("cpu"))
    for _ in range(2):
        t = acct.start("frontend")
        clock.sleep(0.01)
        acct.end(t)
    acct.cancel(acct.start("hift"))  # queued nothing: not counted
    q = acct.summary()["slice_queue_ms"]
    assert set(q) == {"frontend"} and q["frontend"] == pytest.approx(20.0, abs=1e-3)


def test_accounting_splits_the_window_into_tenths(monkeypatch):
    """Each slice's GPU time goes to the tenth it was queued in, the host's own time (its
    iteration less the waits) to the tenth the iteration ended in, as shares of a tenth; beside
    them each kind's slice count, the host's time queueing them, the rows they served, and the
    named events (``mark``) per tenth."""
    import torch

    from cosybatch.scheduler import accounting

    now = [0.0]
    monkeypatch.setattr(accounting.time, "perf_counter", lambda: now[0])
    acct = accounting.Accounting(torch.device("cpu"))
    for kind, start, end, size in (("frontend", 0.05, 0.15, 3), ("frontend", 0.07, 0.08, 2),
                                   ("flow_step", 0.95, 1.0, 0)):
        now[0] = start
        t = acct.start(kind)
        now[0] = end
        acct.end(t, size=size)
    now[0] = 0.50
    with acct.waiting():
        now[0] = 0.51
    now[0] = 0.54
    acct.iteration(40.0)
    for when, n in ((0.02, 4), (0.03, 1), (0.61, 2)):
        now[0] = when
        acct.mark("prompts_loaded", n)
    tenths = acct.summary(wall_s=1.0)["by_tenth"]
    assert tenths["slices"] == {"flow_step": [0.0] * 9 + [0.5], "frontend": [1.1] + [0.0] * 9}
    assert tenths["host_own"] == [0.0] * 5 + [0.3] + [0.0] * 4
    assert tenths["count"] == {"flow_step": [0] * 9 + [1], "frontend": [2] + [0] * 9}
    assert tenths["queue"] == {"flow_step": [0.0] * 9 + [0.5], "frontend": [1.1] + [0.0] * 9}
    assert tenths["size"] == {"frontend": [5] + [0] * 9}  # flow_step said no size: left out
    assert tenths["marks"] == {"prompts_loaded": [5, 0, 0, 0, 0, 0, 2, 0, 0, 0]}
    acct.reset()
    assert acct.summary(wall_s=1.0)["by_tenth"]["marks"] == {}


def test_budget_grows_while_few_rows_decode_when_asked():
    """``budget_max_ms``: an AR step serving a quarter of its capacity leaves the codec four
    times the budget, never more than the cap and never less than the base; off by default."""
    grow = Limits(streaming=True, budget_ms=4.0, max_jobs=8, max_hift=8, solve_tokens=0, budget_max_ms=12.0,
                  ar_capacity=32)
    assert [iteration_budget(grow, n) for n in (32, 64, 16, 8, 1)] == [4.0, 4.0, 8.0, 12.0, 12.0]
    assert iteration_budget(grow, 0) == 4.0  # unknown row count: the base budget
    assert iteration_budget(STREAM, 1) == 4.0  # off: the budget is fixed
    solve = Solve(tokens=1000, steps_left=10, deadline=INF)  # 1 ms per step
    assert plan(0.0, grow, COSTS, True, solve, [], [], ar_rows=32).flow_steps == 4
    assert plan(0.0, grow, COSTS, True, solve, [], [], ar_rows=16).flow_steps == 8
    assert plan(0.0, STREAM, COSTS, True, solve, [], [], ar_rows=16).flow_steps == 4


def test_prompts_launch_in_full_batches_while_the_engine_has_rows_queued():
    # (gathered, backlog) -> launch, batch 64
    golden = {(0, 0): False, (1, 0): True, (5, 63): True, (5, 64): False, (63, 200): False, (64, 200): True,
              (100, 200): True}
    assert {k: launch_prompts(*k, batch=64) for k in golden} == golden
    # batch 1: every prompt at once, whatever is queued (the latency setting)
    assert launch_prompts(1, 10_000, batch=1) and not launch_prompts(0, 0, batch=1)
    # a gather time: a short queue launches once the oldest prompt has waited it; a full batch at once
    assert not launch_prompts(5, 0, batch=64, waited_s=0.1, gather_s=0.5)
    assert launch_prompts(5, 0, batch=64, waited_s=0.5, gather_s=0.5)
    assert launch_prompts(64, 0, batch=64, waited_s=0.0, gather_s=0.5)
    assert not launch_prompts(5, 64, batch=64, waited_s=9.0, gather_s=0.5)  # a full batch queued: gather on
    # no prompt still loading: nothing to gather for, unless the engine has a full batch queued
    assert launch_prompts(5, 0, batch=64, waited_s=0.1, gather_s=0.5, more_coming=False)
    assert not launch_prompts(5, 64, batch=64, waited_s=0.1, gather_s=0.5, more_coming=False)


def test_a_slice_closed_as_another_kind_is_counted_there_without_its_learner():
    import torch

    from cosybatch.scheduler.accounting import Accounting

    acct = Accounting(torch.device("cpu"))
    learned = []
    acct.end(acct.start("hift", learned.append))
    acct.end(acct.start("hift", learned.append), "hift_capture")
    assert len(acct.ms["hift"]) == 1 and len(acct.ms["hift_capture"]) == 1 and len(learned) == 1
    assert set(acct.summary()["slice_queue_ms"]) <= {"hift", "hift_capture"}


# ---------------------------------------------------------------- deadline batching (design.md D22)

DEADLINE = Limits(streaming=True, budget_ms=4.0, max_jobs=64, max_hift=64, deadline_lead_s=0.5, deadline_tokens=8000)


def test_a_patient_hop_joins_but_does_not_start_a_solve():
    from cosybatch.scheduler.policy import must_start, patient

    costs = Costs(flow_step_ms_per_token=1e-3, flow_step_ms=2.0, hift_ms_per_frame=1e-2, hift_ms=0.0)  # target 6000
    far = hop("p", 1, deadline=5.0, tokens=1000, ready_at=1.0)  # 4 s of audio left, waited past max_wait_s
    assert patient(far, DEADLINE, 1.3) and not must_start(far, DEADLINE, 1.3)
    assert not worth_starting(1.3, DEADLINE, costs, True, [far])
    off = Limits(streaming=True, budget_ms=4.0, max_jobs=64, max_hift=64)
    assert worth_starting(1.3, off, costs, True, [far])  # today: max_wait_s starts a solve of 1000 tokens
    # its deadline comes within the lead: it starts one (it has waited longer than max_wait_s)
    assert not patient(far, DEADLINE, 4.6) and worth_starting(4.6, DEADLINE, costs, True, [far])
    # first hops stay prompt, rows without a player keep max_wait_s, imminent deadlines go now
    first = hop("f", 2, first=True, tokens=600, ready_at=1.0)
    assert not worth_starting(1.02, DEADLINE, costs, True, [far, first])
    assert worth_starting(1.06, DEADLINE, costs, True, [far, first])
    assert [h.segment_id for h in pick_jobs([far, first], DEADLINE, costs, True, 1.06)] == ["f", "p"]  # it joins
    no_player = hop("n", 3, deadline=INF, tokens=600, ready_at=1.0)
    assert not patient(no_player, DEADLINE, 1.0) and worth_starting(1.26, DEADLINE, costs, True, [no_player])
    assert worth_starting(4.8, DEADLINE, costs, True, [hop("u", 4, deadline=5.0, tokens=10, ready_at=4.8)])
    # full responses have no players: deadline batching changes nothing there
    full = Limits(streaming=False, budget_ms=20.0, max_jobs=64, max_hift=64, deadline_lead_s=0.5, max_wait_s=0.25)
    assert worth_starting(1.26, full, costs, True, [hop("w", 5, deadline=INF, tokens=600, ready_at=1.0)])


def test_deadline_batching_waits_for_its_size_unless_a_decoding_row_runs_dry():
    from cosybatch.scheduler.policy import large_solves

    costs = Costs(flow_step_ms_per_token=1e-3, flow_step_ms=1.0, hift_ms_per_frame=1e-2, hift_ms=0.0)  # target 3000
    ready = [hop(f"h{i}", i, deadline=9.0, tokens=1000, ready_at=1.0) for i in range(7)]
    assert not worth_starting(1.0, DEADLINE, costs, True, ready)  # 7000 < 8000
    assert worth_starting(1.0, DEADLINE, costs, True, ready + [hop("h7", 7, deadline=9.0, tokens=1000)])
    assert len(pick_jobs(ready * 2 + [hop(f"x{i}", 20 + i, deadline=9.0, tokens=1000) for i in range(9)],
                         DEADLINE, costs, True, 1.0)) == 8  # at most deadline_tokens while the AR engine runs
    # a decoding row's player within the lead: its tokens must not wait behind large steps
    assert large_solves(1.0, DEADLINE, ar_deadline=9.0) and not large_solves(1.0, DEADLINE, ar_deadline=1.4)
    assert worth_starting(1.0, DEADLINE, costs, True, ready[:3], large=False)  # the usual target again
    assert plan(1.0, DEADLINE, costs, True, None, ready, [], ar_deadline=9.0).start == ()
    assert len(plan(1.0, DEADLINE, costs, True, None, ready, [], ar_deadline=1.4).start) == 4  # 1.5 x 3000 tokens


def _trace(lim):
    """A C64 streaming run of 200 rows (seeded lengths of 6-24 s of audio, forced like
    ``--force-length``) whose flow step costs 1 ms + 2 us per token: a per-token cost close to
    what a graphed step measured on the H200 (docs/performance.md), so the learned target (a
    quarter of a step fixed) is ~1,500 tokens."""
    import random

    from timeline_sim import simulate

    rng = random.Random(0)
    lengths = [rng.randint(150, 600) for _ in range(200)]
    costs = Costs(flow_step_ms_per_token=2e-3, flow_step_ms=1.0, hift_ms_per_frame=5e-3, hift_ms=1.0)
    return simulate(lim, costs, lengths, concurrency=64, ar_ms=1.9)


def test_deadline_batching_leaves_the_small_solve_regime_and_keeps_deadlines():
    base = dict(streaming=True, budget_ms=4.0, max_jobs=64, max_hift=64, ar_capacity=64)
    today = _trace(Limits(**base))
    new = _trace(Limits(**base, deadline_lead_s=0.5, deadline_tokens=8192))
    target = Costs(2e-3, 1.0, 5e-3, 1.0).efficient_tokens()
    # today's policy starts solves near the learned target; deadline batching at least doubles them
    assert today.tokens_per_step < 2 * target <= new.tokens_per_step, (today.tokens_per_step, new.tokens_per_step)
    assert math.isclose(new.audio_s, today.audio_s)  # the same rows, all of them finished (simulate raises otherwise)
    assert new.underrun_rows <= today.underrun_rows
    # every hop whose player runs started its solve before the player ran dry
    assert all(start < deadline for _, start, deadline, _ in new.waits if deadline != INF)
    # first hops stay prompt: no first hop waited longer than the longest one today
    assert max(new.first_wait_s) <= max(today.first_wait_s)
    assert new.wall_s < today.wall_s  # larger solves pay fewer fixed costs


def test_with_the_ar_step_beside_the_codec_is_fed_without_holding_the_ar_step_back():
    # below the queue's depth: codec work is queued every iteration
    assert codec_turn(0, ar_in_flight=True, most=2) and codec_turn(1, ar_in_flight=True, most=2)
    # full: the AR step goes on alone (its tokens are not held behind a codec slice)...
    assert not codec_turn(2, ar_in_flight=True, most=2)
    # ...unless no AR step is in flight: then the codec is the only work and the host waits for it
    assert codec_turn(2, ar_in_flight=False, most=2)


def test_row_stages_are_the_spans_between_a_rows_host_times():
    from cosybatch.scheduler.pipeline import row_stages

    lives = [{"added": 0.0, "admitted": 0.1, "first_token": 0.2, "first_hop": 0.3, "first_audio": 0.4,
              "last_token": 1.0, "done": 1.5},
             {"added": 0.0, "admitted": 0.3, "first_token": 0.32, "first_hop": 0.4, "first_audio": 0.9,
              "last_token": 2.0, "done": 2.1}]
    got = row_stages(lives)
    assert got["prompt"] == {"p50": 200.0, "mean": 200.0}
    assert got["first_tokens"] == {"p50": 150.0, "mean": 150.0}
    assert got["prefill"] == {"p50": 60.0, "mean": 60.0}  # first_tokens = prefill + first_decode
    assert got["first_decode"] == {"p50": 90.0, "mean": 90.0}
    assert got["first_audio"] == {"p50": 300.0, "mean": 300.0}
    assert got["after_tokens"] == {"p50": 300.0, "mean": 300.0}
    assert got["decoding"] == {"p50": 1300.0, "mean": 1300.0}
    # a row without a time (its first hop was never queued) leaves the stages that need it
    assert set(row_stages([{"added": 0.0, "admitted": 0.5}])) == {"prompt"}


def test_hift_beside_waits_for_its_mels_solves_and_keeps_their_memory(monkeypatch):
    """``scheduler.hift_stream=beside`` (design.md D36): before a HiFT call its stream waits for
    the event recorded after each of its mels' solves (once per event), each mel's memory is
    recorded as used by that stream (the flow's stream must not hand it out again before HiFT
    has read it), and the call, its slice and the copies back all run with that stream current."""
    from types import SimpleNamespace

    import torch

    from cosybatch.scheduler import codec_work
    from cosybatch.scheduler.accounting import Accounting
    from helpers import record_current_stream

    current, log = record_current_stream(monkeypatch), []

    class _Stream:
        def wait_event(self, ev):
            log.append(("wait", ev))

    class _Mel:
        shape = (1, 80, 7)

        def __init__(self, name):
            self.name = name

        def float(self):
            return self

        def record_stream(self, s):
            log.append(("record", self.name, s))

    class _Hift:
        def run(self, jobs):
            log.append(("run", current[0]))
            return [torch.zeros(1, 1, 3) for _ in jobs]

    class _Acct(Accounting):
        def start(self, kind, on_done=None):
            log.append(("start " + kind, current[0]))
            return super().start(kind, on_done)

    hs = _Stream()
    work = codec_work.CodecWork(flow=None, hift=_Hift(), acct=_Acct(torch.device("cpu")), costs=CostModel(),
                                limits=Limits(streaming=False, budget_ms=4.0, max_jobs=4, max_hift=4),
                                device=torch.device("cpu"), hift_stream=hs)
    hop = lambda seg: SimpleNamespace(job=SimpleNamespace(segment_id=seg), row_id=seg, finalize=True)  # noqa: E731
    e1, e2 = object(), object()
    work._hift_batch([codec_work._Mel(hop("a"), _Mel("a"), 0.0, e1), codec_work._Mel(hop("b"), _Mel("b"), 0.0, e1),
                      codec_work._Mel(hop("c"), _Mel("c"), 0.0, e2)])
    assert log == [("wait", e1), ("wait", e2), ("record", "a", hs), ("record", "b", hs), ("record", "c", hs),
                   ("start hift", hs), ("run", hs)]
    assert current[0] is None and [o.row_id for o in work.take_audio()] == ["a", "b", "c"]


# ---------------------------------------------------------------- first hops apart (design.md D39)


def test_first_hops_are_solved_apart_before_a_long_solve_in_progress_when_asked():
    costs = Costs(flow_step_ms_per_token=1e-3, flow_step_ms=1.0, hift_ms_per_frame=1e-2, hift_ms=0.0)
    apart = Limits(streaming=True, budget_ms=4.0, max_jobs=64, max_hift=64, deadline_lead_s=0.5, deadline_tokens=8000,
                   first_apart=True)
    running = Solve(tokens=8000, steps_left=8, deadline=5.0)  # 9 ms a step, 72 ms to go
    first, later = hop("f", 2, first=True, tokens=600, ready_at=1.0), hop("l", 1, deadline=4.0, tokens=600)
    p = plan(1.0, apart, costs, True, running, [later, first], [])
    assert p.apart == ("f",) and p.flow_steps >= 1  # the running solve still advances
    assert plan(1.0, DEADLINE, costs, True, running, [later, first], []).apart == ()  # off: it waits
    assert plan(1.0, apart, costs, True, running, [later], []).apart == ()  # only first hops
    # a player of the running solve about to run dry: that solve finishes first
    dry = plan(1.0, apart, costs, True, Solve(8000, 8, deadline=1.1), [first], [])
    assert dry.apart == () and dry.flow_steps == 8
    # a decoding row's player within the lead of running dry: its tokens go first, no solve apart
    assert plan(1.0, apart, costs, True, running, [later, first], [], ar_deadline=1.4).apart == ()
    assert plan(1.0, apart, costs, True, running, [later, first], [], ar_deadline=1.6).apart == ("f",)
    # no solve in progress: first hops are solved apart and the rest starts as before
    idle = plan(1.0, apart, costs, True, None, [first, later], [])
    assert idle.apart == ("f",) and "f" not in idle.start
    # whole responses: every row's one chunk is its first; nothing is set apart
    full = Limits(streaming=False, budget_ms=20.0, max_jobs=64, max_hift=64, first_apart=True)
    assert plan(1.0, full, costs, True, running, [first], []).apart == ()


@pytest.mark.parametrize("concurrency,ar_ms", [(32, 1.9), (64, 2.3)])
def test_first_hops_apart_bring_first_audio_sooner_in_a_simulated_run(concurrency, ar_ms):
    """Simulated closed-loop streaming runs with deadline batching, every row admitted at once
    (flow costs twice the H200's): a row's first audio waits for the solve in progress and then
    for its own large solve, spread over many iterations; solved apart, it waits for neither.
    Every row still finishes, no player runs dry, and the extra small solves cost little wall
    time. At C64, solving every first hop apart at the start (64 of them) held back the AR steps
    of the rows already playing: 12 of 400 rows ran dry until solves apart waited for a decoding
    row's player to have the lead in hand (with it: first audio 229 -> 170 ms at the median)."""
    import random
    import statistics

    from timeline_sim import simulate

    rng = random.Random(0)
    lengths = [rng.randint(150, 600) for _ in range(400 if concurrency == 64 else 200)]
    costs = Costs(flow_step_ms_per_token=2e-3, flow_step_ms=1.0, hift_ms_per_frame=5e-3, hift_ms=1.0)
    base = dict(streaming=True, budget_ms=4.0, max_jobs=concurrency, max_hift=concurrency, ar_capacity=concurrency,
                deadline_lead_s=0.5, deadline_tokens=8192)
    runs = {on: simulate(Limits(**base, first_apart=on), costs, lengths, concurrency=concurrency, ar_ms=ar_ms)
            for on in (False, True)}
    before, after = (statistics.median(runs[on].first_audio_s) for on in (False, True))
    assert after < 0.8 * before, (before, after)
    assert math.isclose(runs[True].audio_s, runs[False].audio_s)
    assert runs[True].underrun_rows <= runs[False].underrun_rows == 0
    assert runs[True].wall_s < 1.05 * runs[False].wall_s


def test_with_the_ar_engine_idle_a_solve_stays_within_the_graphs_captured_at_start_up():
    """A whole run's last solves (the AR engine idle: nothing limits them by the AR cadence)
    took every ready hop, 32,768-38,976 tokens per branch in a 1,088-row ``synth``, beyond the
    buckets captured before the run: each was captured inside the window or run eagerly. With
    ``max_solve_tokens`` (the captured band's top) they split into solves inside it."""
    ready = [hop(f"h{i}", i, tokens=1200) for i in range(64)]
    costs = Costs(flow_step_ms_per_token=1e-3, flow_step_ms=1.0, hift_ms_per_frame=1e-2, hift_ms=0.0)
    unbounded = Limits(streaming=False, budget_ms=20.0, max_jobs=64, max_hift=64, solve_tokens=8192)
    assert len(plan(1.0, unbounded, costs, False, None, ready, []).start) == 64
    bounded = Limits(streaming=False, budget_ms=20.0, max_jobs=64, max_hift=64, solve_tokens=8192,
                     max_solve_tokens=16384)
    first = plan(1.0, bounded, costs, False, None, ready, [])
    assert len(first.start) == 13 and first.start_steps == bounded.n_steps  # 13 x 1,200 <= 16,384
    # with the AR engine busy the usual 1.5 x target applies, whatever the bound
    assert len(plan(1.0, bounded, costs, True, None, ready, []).start) == 10  # 10 x 1,200 <= 12,288
    assert len(pick_jobs([hop("big", 0, tokens=40000)], bounded, costs, False)) == 1  # always one hop
