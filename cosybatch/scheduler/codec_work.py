"""The codec side of the GPU timeline: queues of hops and mels, the flow solve in progress,
and the audio on its way to the host.

``run`` asks the policy what to queue between two AR steps and queues it; ``take_audio``
returns the chunks whose device-to-host copy has finished (it never waits). Failure isolation:
a slice that raises is retried on halves of its jobs (an out-of-memory slice shrinks instead of
failing, logged once), and only a job that fails alone fails its row. Both runners leave
their state untouched by a failed call, so the retries are exact.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np
import torch

from cosybatch.codec.flow_runner import FlowJob, FlowRunner, FlowSolve
from cosybatch.codec.hift_runner import HiftJob, HiftRunner
from cosybatch.scheduler import policy
from cosybatch.scheduler.accounting import Accounting
from cosybatch.scheduler.costs import CostModel

log = logging.getLogger(__name__)


@dataclass(eq=False)  # identity: a hop is one piece of work, and its job holds tensors
class QueuedHop:
    """A hop handed to the codec: its flow job, and what the policy needs to place it."""

    job: FlowJob
    row_id: str
    order: int
    first: bool  # the row's first chunk
    finalize: bool  # the segment's last chunk
    tokens: int  # estimated transformer tokens (CFG included)
    ready_at: float = 0.0  # host time it became ready


@dataclass
class _Mel:
    hop: QueuedHop
    mel: torch.Tensor  # [1, mel, F] on the device
    ready_at: float = 0.0  # host time its solve was queued
    done: object = None  # with HiFT on a stream of its own: a CUDA event after its solve's last kernel


@dataclass
class _Audio:
    hop: QueuedHop
    host: torch.Tensor  # pinned on CUDA
    ready: object  # a CUDA event, or None when already on the host


@dataclass
class Outcome:
    row_id: str
    segment_id: str
    finalize: bool
    audio: np.ndarray | None = None
    error: Exception | None = None


@dataclass
class _Active:
    solve: FlowSolve
    hops: list[QueuedHop]
    tokens: int


@dataclass
class CodecWork:
    flow: FlowRunner
    hift: HiftRunner
    acct: Accounting
    costs: CostModel
    limits: policy.Limits
    device: torch.device
    hops: dict[str, deque] = field(default_factory=dict)  # segment -> its ready hops, in order
    mels: list[_Mel] = field(default_factory=list)
    outbox: deque = field(default_factory=deque)
    active: _Active | None = None
    failed: list[tuple[QueuedHop, Exception]] = field(default_factory=list)
    _retry_flow: deque = field(default_factory=deque)  # halves of failed solves, run before anything new
    _retry_hift: deque = field(default_factory=deque)
    _dead: set = field(default_factory=set)  # segments of failed rows still inside the active solve
    _warned: set = field(default_factory=set)
    # batch sizes, for the timeline summary: hift_batches, hift_jobs, hift_frames; first hops
    # solved apart (``first_hops_apart``): first_solves, first_jobs
    counts: dict = field(default_factory=lambda: dict.fromkeys(("hift_batches", "hift_jobs", "hift_frames",
                                                                "first_solves", "first_jobs"), 0))
    # HiFT's calls on a stream of their own (``scheduler.hift_stream=beside``, design.md D36), or
    # None: on the current one, after the solves that made their mels
    hift_stream: Any = None

    # ------------------------------------------------------------------ queues

    def add(self, hop: QueuedHop) -> None:
        self.hops.setdefault(hop.job.segment_id, deque()).append(hop)

    def has_work(self) -> bool:
        return bool(self.active or self.mels or self.outbox or self._retry_flow or self._retry_hift
                    or any(self.hops.values()))

    def drop_row(self, row_id: str, segment_id: str) -> None:
        """Forget a failed row's queued work and state (after the active solve, if it is in it)."""
        self.hops.pop(segment_id, None)
        self.mels = [m for m in self.mels if m.hop.row_id != row_id]
        self.outbox = deque(a for a in self.outbox if a.hop.row_id != row_id)
        self._retry_flow = deque(g for g in ([h for h in g if h.row_id != row_id] for g in self._retry_flow) if g)
        self._retry_hift = deque(g for g in ([m for m in g if m.hop.row_id != row_id] for g in self._retry_hift) if g)
        if self.active and any(h.job.segment_id == segment_id for h in self.active.hops):
            self._dead.add(segment_id)
        else:
            self.release(segment_id)

    def release(self, segment_id: str) -> None:
        self.flow.release(segment_id)
        self.hift.release(segment_id)

    # ------------------------------------------------------------------ one iteration

    def run(self, now: float, ar_active: bool, deadline: Callable[[str], float], ar_rows: int = 0,
            ar_deadline: float = policy.INF, between: Callable[[], None] | None = None) -> bool:
        """Queue this iteration's codec slices; True if any was queued (``ar_rows``: rows the
        AR step in flight serves; ``ar_deadline``: the earliest deadline among them). The halves
        of a failed call run first, each alone, before the policy starts anything new.
        ``between`` is called between slices (the AR step's turn when it runs on its own stream:
        the host's codec work then does not hold a finished AR step's successor back); it may
        add hops and fail rows, so what is started after it is looked up again."""
        between = between or (lambda: None)
        did = False
        if self._retry_hift:
            self._hift_batch(self._retry_hift.popleft())
            did = True
        active = self.active
        solve = None
        if active is not None:
            solve = policy.Solve(active.tokens, active.solve.steps_left, min(deadline(h.row_id) for h in active.hops))
        retrying = {id(h) for g in self._retry_flow for h in g}
        ready = [q[0] for q in self.hops.values() if q and not self._in_active(q[0]) and id(q[0]) not in retrying]
        p_hops = [policy.ReadyHop(h.job.segment_id, h.order, h.first, deadline(h.row_id), h.tokens, h.ready_at) for h in ready]
        p_mels = [policy.Mel(m.hop.job.segment_id, m.hop.order, m.hop.first, deadline(m.hop.row_id), m.mel.shape[2],
                             m.ready_at) for m in self.mels]
        plan = policy.plan(now, self.limits, self.costs.costs(), ar_active, solve, p_hops, p_mels, ar_rows, ar_deadline)
        if plan.apart and self._solve_apart(plan.apart, ready, now):  # before anything else
            did = True
            between()
        if plan.hift:
            self._run_hift(set(plan.hift))
            did = True
            between()
        if plan.flow_steps:
            self._steps(plan.flow_steps, now)
            did = True
            between()
        if self.active is None and self._retry_flow:
            self._start(self._retry_flow.popleft(), 1, now)
            did = True
        elif plan.start and self.active is None:
            hops = self._heads(ready, plan.start)
            if hops:
                self._start(hops, plan.start_steps, now)
                did = True
        return did

    def _heads(self, ready: list[QueuedHop], segments: tuple) -> list[QueuedHop]:
        """The ready hops of these segments still at the head of their queues (``between`` may
        have dropped a failed row's hops, and a solve apart taken others), in the plan's order."""
        by_seg = {h.job.segment_id: h for h in ready}
        return [by_seg[s] for s in segments if s in by_seg and self._at_head(by_seg[s])]

    def _at_head(self, hop: QueuedHop) -> bool:
        q = self.hops.get(hop.job.segment_id)  # emptied (not removed) when its last hop was solved
        return bool(q) and q[0] is hop

    def _in_active(self, hop: QueuedHop) -> bool:
        return self.active is not None and any(h is hop for h in self.active.hops)

    def _start(self, hops: list[QueuedHop], steps: int, now: float) -> None:
        t = self.acct.start("flow_start")
        try:
            solve = self.flow.start([h.job for h in hops])
        except Exception as e:
            self.acct.end(t)
            self._split_or_fail(hops, e, "flow")
            return
        self.acct.end(t, size=len(hops))
        self.active = _Active(solve, hops, solve.buffers.stride * 2)
        if steps:
            self._steps(steps, now)

    def _solve_apart(self, segments: tuple, ready: list[QueuedHop], now: float) -> bool:
        """Solve these first hops whole now, apart, before the active solve's next steps if
        there is one (design.md D39), and decode their mels at once: someone waits for each.
        False if the flow cannot start them beside that solve now (they wait as before)."""
        hops = self._heads(ready, segments)
        if not hops:
            return False
        t = self.acct.start("flow_start")
        try:
            solve = self.flow.start([h.job for h in hops], beside=self.active.solve if self.active else None)
        except Exception as e:
            self.acct.end(t)
            self._split_or_fail(hops, e, "flow")
            return True
        self.acct.end(t, size=len(hops) if solve is not None else None)
        if solve is None:
            return False
        self.counts["first_solves"] += 1
        self.counts["first_jobs"] += len(hops)
        before = len(self.mels)
        self._steps(solve.steps_left, now, _Active(solve, hops, solve.buffers.stride * 2))
        done = {id(m) for m in self.mels[before:]}  # none if the solve failed (its halves are retried)
        if done:
            self._hift_batch([m for m in self.mels if id(m) in done])
            self.mels = [m for m in self.mels if id(m) not in done]
        return True

    def _steps(self, n: int, now: float, a: _Active | None = None) -> None:
        """``n`` Euler steps of the active solve (or of ``a``, a solve beside it), and its end."""
        a = a or self.active
        main = a is self.active
        tokens = a.tokens
        t = self.acct.start("flow_step", lambda ms: self.costs.observe_flow_step(tokens, ms / n))
        captures = self._captures()
        try:
            left = a.solve.step(n)
            self.acct.end(t, "flow_capture" if self._captures() > captures else None)
            if left:
                return
            t = self.acct.start("flow_finish")
            mels = a.solve.finish()
            self.acct.end(t)
        except Exception as e:
            self.acct.end(t)
            if main:
                self.active = None
                self._release_dead()
            self._split_or_fail(a.hops, e, "flow")
            return
        if main:
            self.active = None
        done = None
        if self.hift_stream is not None:  # what HiFT's stream waits for before it reads these mels
            done = torch.cuda.Event()
            done.record()
        for h, mel in zip(a.hops, mels):
            if self._at_head(h):
                self.hops[h.job.segment_id].popleft()
            if h.job.segment_id not in self._dead:
                self.mels.append(_Mel(h, mel, now, done))
        if main:
            self._release_dead()

    def _captures(self) -> int:
        """Graphs captured so far by the flow and HiFT: a slice that captured one is counted
        apart (``flow_capture``, ``hift_capture``), since its time is not a replay's."""
        graphs = (getattr(self.flow, "graphs", None), getattr(self.hift, "graphs", None))
        return sum(g.stats.captures for g in graphs if g is not None)

    def _release_dead(self) -> None:
        for seg in self._dead:
            self.release(seg)
        self._dead.clear()

    def _run_hift(self, segments: set) -> None:
        batch = [m for m in self.mels if m.hop.job.segment_id in segments][: self.limits.max_hift]
        chosen = {id(m) for m in batch}
        self.mels = [m for m in self.mels if id(m) not in chosen]
        self._hift_batch(batch)

    def _hift_batch(self, batch: list[_Mel]) -> None:
        if self.hift_stream is None:
            self._hift_call(batch)
            return
        # Beside: HiFT's stream waits for the solves that made these mels, and each mel's memory
        # (the flow's stream's) is not handed out again before HiFT's reads of it have run.
        for ev in {id(m.done): m.done for m in batch if m.done is not None}.values():
            self.hift_stream.wait_event(ev)
        for m in batch:
            m.mel.record_stream(self.hift_stream)
        with torch.cuda.stream(self.hift_stream):  # the slice's events, the call and the copies back
            self._hift_call(batch)

    def _hift_call(self, batch: list[_Mel]) -> None:
        frames = sum(m.mel.shape[2] for m in batch)
        c = self.counts
        c["hift_batches"] += 1
        c["hift_jobs"] += len(batch)
        c["hift_frames"] += frames
        t = self.acct.start("hift", lambda ms: self.costs.observe_hift(frames, ms))
        captures = self._captures()
        try:
            wavs = self.hift.run([HiftJob(m.hop.job.segment_id, m.mel.float(), m.hop.finalize) for m in batch])
        except Exception as e:
            self.acct.end(t)
            self._split_or_fail(batch, e, "HiFT")
            return
        self.acct.end(t, "hift_capture" if self._captures() > captures else None, size=len(batch))
        for m, w in zip(batch, wavs):
            self._to_host(m.hop, w[0])

    def _to_host(self, hop: QueuedHop, wav: torch.Tensor) -> None:
        if self.device.type != "cuda":
            self.outbox.append(_Audio(hop, wav.float(), None))
            return
        host = torch.empty(wav.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(wav, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.outbox.append(_Audio(hop, host, ev))

    # ------------------------------------------------------------------ results

    def take_audio(self, wait: bool = False) -> list[Outcome]:
        """Chunks whose copy to the host is complete, in queue order (``wait``: block for the first)."""
        failed, self.failed = self.failed, []
        out = [Outcome(h.row_id, h.job.segment_id, h.finalize, error=e) for h, e in failed]
        while self.outbox:
            a = self.outbox[0]
            if a.ready is not None and not a.ready.query():
                if not wait:
                    break
                a.ready.synchronize()
            wait = False
            self.outbox.popleft()
            audio = a.host.numpy().copy() if a.ready is not None else a.host.cpu().numpy()
            h = a.hop
            if not np.isfinite(audio).all():
                out.append(Outcome(h.row_id, h.job.segment_id, h.finalize, error=ValueError("non-finite audio")))
            else:
                out.append(Outcome(h.row_id, h.job.segment_id, h.finalize, audio=audio))
        return out

    # ------------------------------------------------------------------ failures

    def _split_or_fail(self, items: list[Any], e: Exception, stage: str) -> None:
        """Retry a failed flow solve (``items``: its hops) or HiFT batch (its mels) on halves,
        first half first, before anything new; fail a job that fails alone. Out of memory also
        lowers that stage's batch limit for the rest of the run."""
        hift = stage == "HiFT"
        if len(items) == 1:
            self._fail(items[0].hop if hift else items[0], e)
            return
        self._warn(stage, e, len(items))
        half = len(items) // 2
        (self._retry_hift if hift else self._retry_flow).extendleft([items[half:], items[:half]])
        if isinstance(e, torch.OutOfMemoryError):
            self.limits = replace(self.limits, **{"max_hift" if hift else "max_jobs": max(1, half)})

    def _fail(self, hop: QueuedHop, e: Exception) -> None:
        if self._at_head(hop):
            self.hops[hop.job.segment_id].popleft()
        self.failed.append((hop, e))

    def _warn(self, stage: str, e: Exception, n: int) -> None:
        key = (stage, type(e).__name__)
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        log.log(level, "packed %s call of %d jobs failed (%s: %s); retrying on halves", stage, n, type(e).__name__, e)

