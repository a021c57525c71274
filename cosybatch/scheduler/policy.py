"""What codec work runs between two AR steps: pure functions over queues, budgets and a clock.

The pipeline's one thread issues every kernel in the order these functions choose
(design.md D15). Each iteration queues one AR step, then codec *slices* worth at most a
budget of GPU time: Euler steps of the active flow solve, a batched HiFT call, a new solve.
The budget keeps the AR cadence (time between a row's tokens) bounded; deadlines decide
what the budget buys:

- **imminent deadlines first** (streaming): a row's next chunk must be ready before the audio
  it already has runs out at real time, so players never underrun; such work may overrun the
  budget;
- **then first hops**: a row with no audio yet waits for its first chunk (time to first PCM);
  with ``first_apart`` they are solved at once, apart, before the steps of a solve in
  progress (``first_hops_apart``, design.md D39);
- **then** earliest playback deadline.

Full responses have no players and every row's one chunk is its first, so there the policy
is throughput alone: oldest first, solves as large as the budget allows, and HiFT batches that
fill up (or wait ``max_wait_s``) unless the flow has nothing left to do.

A new solve waits until it is worth its fixed cost: it starts once the ready hops make a
solve of ``solve_tokens`` (a Euler step has a fixed cost of a few hundred kernels, so tiny
solves waste the GPU), or (streaming) a first hop has waited ``first_wait_s``, or any hop
``max_wait_s``, or a deadline is near, or the AR engine is idle (no more tokens are coming
soon).

Deadline batching (streaming, ``deadline_lead_s`` set; design.md D22): a hop whose player has
more than ``deadline_lead_s`` of audio left is *patient*: it joins whatever solve starts, but
its waiting alone does not start one; it starts one once its deadline comes within the lead.
Without it every hop's ``max_wait_s`` starts a solve of whatever is ready, and the solve's own
length then sets how much is ready for the next: small solves finish soon and start the next
one small (the small-solve regime a run can fall into), large ones keep it large.

Starvation-free: a waiting hop's deadline only gets nearer until it is imminent, and imminent
hops outrank everything; within a class the order is by deadline, then arrival; no hop
waits past ``max_wait_s`` for a solve to start, and a patient one waits until its deadline is
``deadline_lead_s`` away, which is then ``max_wait_s``'s rule (it has waited longer than that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INF = math.inf


@dataclass(frozen=True)
class ReadyHop:
    """A hop as the policy sees it (no tensors): a flow job that can run now (its segment's
    previous hop is done)."""

    segment_id: str
    order: int  # arrival order, the FIFO tie-break
    first: bool  # the row's first audio
    deadline: float  # when the row's buffered audio runs out (inf while none plays)
    tokens: int  # transformer tokens the hop adds to a solve (CFG twins included)
    ready_at: float = 0.0  # when it became ready


@dataclass(frozen=True)
class Mel:
    """A flow output waiting for HiFT."""

    segment_id: str
    order: int
    first: bool
    deadline: float
    frames: int  # window frames HiFT will decode
    ready_at: float = 0.0  # when its flow solve was queued


@dataclass(frozen=True)
class Costs:
    """Estimated GPU milliseconds (``timeline.costs.CostModel`` learns them)."""

    flow_step_ms_per_token: float
    flow_step_ms: float  # fixed part of one Euler step
    hift_ms_per_frame: float
    hift_ms: float

    def flow_step(self, tokens: int) -> float:
        return self.flow_step_ms + self.flow_step_ms_per_token * tokens

    def efficient_tokens(self) -> float:
        """Tokens at which a step's fixed cost is a quarter of it."""
        return 3.0 * self.flow_step_ms / max(self.flow_step_ms_per_token, 1e-12)

    def hift(self, frames: int) -> float:
        return self.hift_ms + self.hift_ms_per_frame * frames


@dataclass(frozen=True)
class Limits:
    streaming: bool
    budget_ms: float  # codec GPU time between two AR steps
    max_jobs: int  # hops per flow solve (codec admission)
    max_hift: int  # mels per HiFT batch
    urgent_s: float = 0.25  # a deadline this close may overrun the budget
    n_steps: int = 10  # Euler steps per solve
    solve_tokens: float | None = None  # the solve size worth waiting for; None: from the costs
    first_wait_s: float = 0.05  # a first hop waits at most this long for a bigger solve
    max_wait_s: float = 0.25  # any hop, at most this long
    budget_max_ms: float | None = None  # see iteration_budget; None: the budget is fixed
    ar_capacity: int = 1  # rows an AR step can serve (the AR admission)
    # streaming: a hop whose deadline is further than this waits for a large solve instead of
    # starting one after max_wait_s (None: off, every hop's wait is bounded by max_wait_s)
    deadline_lead_s: float | None = None
    # with deadline batching on: the solve size worth waiting for (and 1.5x it the most a solve
    # takes while the AR engine runs), instead of solve_tokens or the learned target
    deadline_tokens: float = 8192.0
    # the largest solve while the AR engine is idle (a run's last solves; INF: every ready hop):
    # the top of the band of flow graphs captured before the run (design.md D27), since a larger
    # solve is captured inside the window or runs eagerly
    max_solve_tokens: float = INF
    # streaming: rows' first hops solved at once, whole, in a solve of their own queued before
    # the steps of the solve in progress (design.md D39), instead of joining the next solve
    first_apart: bool = False


@dataclass(frozen=True)
class Solve:
    """The flow solve in progress."""

    tokens: int  # padded transformer tokens per step
    steps_left: int
    deadline: float  # the earliest deadline among its jobs


@dataclass(frozen=True)
class SlicePlan:
    hift: tuple[str, ...] = ()  # segments whose pending mels HiFT decodes now (in queue order)
    flow_steps: int = 0  # Euler steps of the active solve to queue
    start: tuple[str, ...] = ()  # segments whose hops start a new solve (after the active one finishes)
    start_steps: int = 0  # Euler steps of the new solve to queue right away
    apart: tuple[str, ...] = ()  # first hops solved whole now, apart, before everything else


def iteration_budget(lim: Limits, ar_rows: int) -> float:
    """Codec GPU milliseconds between two AR steps that serve ``ar_rows`` rows.

    An AR step costs about as much for one row as for a full batch, so its GPU time per token
    grows as rows leave it; while few rows decode (the rest wait for the codec), the codec gets
    proportionally more time per step: ``budget_ms * ar_capacity / ar_rows``, between
    ``budget_ms`` and ``budget_max_ms``. Fixed at ``budget_ms`` when ``budget_max_ms`` is None
    or the row count is unknown (0)."""
    if lim.budget_max_ms is None or ar_rows <= 0:
        return lim.budget_ms
    return min(max(lim.budget_max_ms, lim.budget_ms), lim.budget_ms * max(1.0, lim.ar_capacity / ar_rows))


def launch_prompts(gathered: int, backlog: int, batch: int, waited_s: float = 0.0, gather_s: float = 0.0,
                   more_coming: bool = True) -> bool:
    """Whether the GPU frontend launches the ``gathered`` prompts now (design.md D15).

    A launch has a fixed cost (its kernels are launched one by one, ~1,200 of them), so a
    few prompts at a time waste it, but rows must not wait for their features while the AR
    engine could run them: launch a full ``batch``, or whatever has gathered once the engine
    has fewer than ``batch`` rows queued ahead of them (``backlog``: rows admitted to the
    engine but not running yet, and rows whose features are on their way back) and the oldest
    gathered prompt has waited ``gather_s`` (``waited_s``). Under a fixed concurrency below the
    engine's capacity the backlog is empty and, with ``gather_s`` 0, every prompt launches at
    once; in bulk runs a run's window of rows, not the engine, can keep the backlog short, and
    ``gather_s`` then trades a row's wait for fewer, fuller launches. It holds even while
    the GPU has nothing else to do (a bulk run's ramp): a launch costs the host the same
    whatever its size, so launches of the few prompts that load while the last one was being
    queued keep the ramp host-bound. With no prompt still loading (``more_coming`` false)
    there is nothing to gather for."""
    return gathered > 0 and (gathered >= batch or (backlog < batch and (waited_s >= gather_s or not more_coming)))


def _key(lim: Limits, now: float):
    if lim.streaming:
        return lambda h: (h.deadline - now > lim.urgent_s, not h.first, h.deadline, h.order)
    return lambda h: h.order


def _target(lim: Limits, costs: Costs, large: bool = True) -> float:
    """The solve size worth waiting for. With deadline batching, the larger of the set
    ``deadline_tokens`` and the usual target: the learned one follows the fitted fixed cost of
    a step, and a low fit made solves small, which kept them small (module docstring)."""
    base = lim.solve_tokens if lim.solve_tokens is not None else costs.efficient_tokens()
    return max(base, lim.deadline_tokens) if large and _deadline_batching(lim) else base


def _deadline_batching(lim: Limits) -> bool:
    return lim.streaming and lim.deadline_lead_s is not None


def pick_jobs(hops: list[ReadyHop], lim: Limits, costs: Costs, ar_active: bool, now: float = 0.0,
              large: bool = True) -> list[ReadyHop]:
    """The hops of the next solve: at most one per segment (a segment's hops depend on each
    other), in priority order, at most ``max_jobs``, and with the AR engine busy at most 1.5x
    the target solve size, so one Euler step stays near the budget, with it idle at most
    ``max_solve_tokens`` (always at least one hop)."""
    seen, out, tokens = set(), [], 0
    # With deadline batching the target is already large: a solve beyond it would make each
    # Euler step, which runs between two AR steps whatever the budget, slow the rows' tokens.
    big = large and _deadline_batching(lim)
    cap = (1.0 if big else 1.5) * _target(lim, costs, large) if ar_active else lim.max_solve_tokens
    for h in sorted(hops, key=_key(lim, now)):
        if h.segment_id in seen:
            continue
        if out and (len(out) >= lim.max_jobs or tokens + h.tokens > cap):
            continue  # a smaller later hop may still fit
        seen.add(h.segment_id)
        out.append(h)
        tokens += h.tokens
    return out


def patient(h: ReadyHop, lim: Limits, now: float) -> bool:
    """Whether the hop's waiting alone does not start a solve: streaming with deadline batching
    on, not a first hop (a listener waits for it), and a player with more than
    ``deadline_lead_s`` of audio left (a row without a player yet, deadline inf, is not: how
    much audio its first chunk brings is not known here)."""
    return (_deadline_batching(lim) and not h.first and h.deadline != INF
            and h.deadline - now > lim.deadline_lead_s)


def must_start(h: ReadyHop, lim: Limits, now: float) -> bool:
    """Whether this hop alone starts a solve now, whatever its size: its deadline is imminent,
    or it has waited its bound (a first hop ``first_wait_s``, a patient one until its deadline
    is ``deadline_lead_s`` away, any other ``max_wait_s``)."""
    if h.deadline - now <= lim.urgent_s:
        return True
    if patient(h, lim, now):
        return False
    return now - h.ready_at >= (lim.first_wait_s if h.first and lim.streaming else lim.max_wait_s)


def large_solves(now: float, lim: Limits, ar_deadline: float) -> bool:
    """Whether deadline batching may size solves beyond the usual target now. A large solve's
    Euler steps run between two AR steps whatever the budget, so they slow every decoding
    row's tokens; that is harmless while those rows' players have audio to spare, not once a
    decoding row's player is within ``deadline_lead_s`` of running dry (``ar_deadline``: the
    earliest deadline among the rows the AR engine still decodes; inf when none plays)."""
    return _deadline_batching(lim) and ar_deadline - now > lim.deadline_lead_s


def worth_starting(now: float, lim: Limits, costs: Costs, ar_active: bool, hops: list[ReadyHop],
                   large: bool = True) -> bool:
    """Whether the ready hops should start a solve now rather than wait for more."""
    if not hops:
        return False
    if not ar_active:
        return True
    per_segment = {}
    for h in hops:
        per_segment.setdefault(h.segment_id, h)
    if sum(h.tokens for h in per_segment.values()) >= _target(lim, costs, large):
        return True
    return any(must_start(h, lim, now) for h in hops)


def first_hops_apart(now: float, lim: Limits, costs: Costs, solve: Solve | None, hops: list[ReadyHop],
                     ar_deadline: float = INF) -> list[ReadyHop]:
    """First hops to solve now, whole and apart (``first_apart``, design.md D39): a listener
    waits for each, and in the usual order it would wait for the solve in progress to end and
    then for its own, which deadline batching makes large and spreads over many iterations. Not
    while a player of the solve in progress is about to run dry (that solve finishes first), nor
    while a row the AR engine decodes has less than the lead (``deadline_lead_s``, else
    ``urgent_s``) of audio left: its next chunk still needs AR steps, which a solve apart delays
    (``ar_deadline``: the earliest deadline among those rows)."""
    if not (lim.streaming and lim.first_apart) or (solve is not None and solve.deadline - now <= lim.urgent_s):
        return []
    if ar_deadline - now <= (lim.deadline_lead_s if lim.deadline_lead_s is not None else lim.urgent_s):
        return []
    firsts = [h for h in hops if h.first]
    return pick_jobs(firsts, lim, costs, True, now, large=False) if firsts else []


def plan(now: float, lim: Limits, costs: Costs, ar_active: bool, solve: Solve | None,
         hops: list[ReadyHop], mels: list[Mel], ar_rows: int = 0, ar_deadline: float = INF) -> SlicePlan:
    """The codec slices of one iteration, in the order to queue them (``ar_rows``: rows the
    AR step in flight serves, for ``iteration_budget``; ``ar_deadline``: see ``large_solves``)."""
    budget = iteration_budget(lim, ar_rows) if ar_active else INF
    urgent = lambda d: d - now <= lim.urgent_s  # noqa: E731
    spent = 0.0
    # HiFT first when its output is what someone waits for (streaming: a first chunk, a
    # deadline; full responses: a mel that waited max_wait_s), when a batch is full, or when
    # nothing else competes; else it accumulates a bigger batch.
    hift: tuple[str, ...] = ()
    if mels:
        queue = sorted(mels, key=_key(lim, now))[: lim.max_hift]
        flow_waiting = solve is not None or bool(hops)
        if lim.streaming:
            someone_waits = any(m.first or urgent(m.deadline) for m in queue)
        else:
            someone_waits = any(now - m.ready_at >= lim.max_wait_s for m in queue)
        if not ar_active or not flow_waiting or len(mels) >= lim.max_hift or someone_waits:
            hift = tuple(m.segment_id for m in queue)
            spent += costs.hift(sum(m.frames for m in queue))
    # first hops solved whole and apart, queued first; what is left of the budget goes on
    firsts = first_hops_apart(now, lim, costs, solve, hops, ar_deadline)
    if firsts:
        spent += costs.flow_step(sum(h.tokens for h in firsts)) * lim.n_steps
        taken = {h.segment_id for h in firsts}
        hops = [h for h in hops if h.segment_id not in taken]
    apart = tuple(h.segment_id for h in firsts)
    steps = 0
    if solve is not None:
        step = costs.flow_step(solve.tokens)
        room = budget - spent
        if urgent(solve.deadline):  # a player is about to run dry: finish its chunk now
            room = max(room, step * solve.steps_left)
        steps = max(1, _fit(room, step, solve.steps_left))
        spent += step * steps
        if steps < solve.steps_left:
            return SlicePlan(hift, steps, apart=apart)
    start, start_steps = (), 0
    large = large_solves(now, lim, ar_deadline)
    if worth_starting(now, lim, costs, ar_active, hops, large):
        jobs = pick_jobs(hops, lim, costs, ar_active, now, large)
        start = tuple(h.segment_id for h in jobs)
        step = costs.flow_step(sum(h.tokens for h in jobs))
        room = budget - spent
        if any(urgent(h.deadline) for h in jobs):
            room = max(room, step * lim.n_steps)
        start_steps = _fit(room, step, lim.n_steps)
    return SlicePlan(hift, steps, start, start_steps, apart)


def codec_turn(queued: int, ar_in_flight: bool, most: int) -> bool:
    """With the AR step on its own stream: whether the host queues codec slices this iteration,
    given ``queued`` iterations' codec work not yet finished on the GPU. Below ``most``, yes; at
    ``most``, only when no AR step is in flight (then nothing else is left to do and the caller
    waits for the oldest to finish); otherwise the AR step goes on and the codec is fed later."""
    return queued < most or not ar_in_flight


def _fit(room: float, step: float, most: int) -> int:
    """Steps of ``step`` ms that fit in ``room`` ms, at most ``most``."""
    if room == INF:
        return most
    return min(most, max(0, int(room // step)))
