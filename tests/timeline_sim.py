"""A closed-loop streaming run on a simulated clock, driven by the real policy (``scheduler.policy``).

It mirrors what ``scheduler.pipeline.FastPipeline`` does with the policy's answers, with fixed
costs instead of a GPU: rows decode one token per AR step (``ar_ms`` of GPU time, serial with
the codec), their hops follow the official schedule (``hops.HopSchedule`` / ``SegmentPlanner``,
the same code the pipeline uses), a hop's transformer tokens are counted as
``FastPipeline._tokens`` counts them (prefix reuse on, full-attention final hop), one flow solve
is active at a time and advances by the steps the plan gives, HiFT costs its linear price, and a
row's player starts at its first chunk. When a row finishes, the next one is admitted (the
closed loop of ``cosybatch profile``). Nothing here is timed: the clock is the sum of the
modelled costs, so a run is a pure function of its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cosybatch.hops import HopSchedule, SegmentPlanner
from cosybatch.scheduler import policy

TOKEN_HZ = 25  # speech tokens per second of audio
MEL_PER_TOKEN = 2  # token_mel_ratio
CHUNK_FRAMES = 50  # the attention chunk a hop recomputes with prefix reuse
LOOKAHEAD = 3


@dataclass
class _Row:
    rid: str
    n_tokens: int
    prompt: int
    planner: SegmentPlanner
    generated: int = 0
    first_audio: float | None = None
    audio_s: float = 0.0
    hops: list = field(default_factory=list)  # (chunk, policy.ReadyHop) ready, in order
    underrun_s: float = 0.0
    first_ready: float | None = None  # when its first hop was ready

    @property
    def deadline(self) -> float:
        return policy.INF if self.first_audio is None else self.first_audio + self.audio_s


@dataclass
class SimResult:
    solves: list[int]  # transformer tokens per Euler step, one entry per solve
    first_wait_s: list[float]  # per row: first hop ready -> its solve started
    first_audio_s: list[float]  # per row: first hop ready -> its first audio at the player
    waits: list[tuple[float, float, float, bool]]  # per hop: (ready, started, deadline at start, patient bound)
    underrun_rows: int
    underrun_s: float
    wall_s: float
    audio_s: float

    @property
    def tokens_per_step(self) -> float:
        return sum(self.solves) / max(1, len(self.solves))


def hop_tokens(prompt: int, chunk, tokens_so_far: int) -> int:
    """Transformer tokens of a hop, both CFG twins (``FastPipeline._tokens`` with prefix reuse)."""
    frames = MEL_PER_TOKEN * (prompt + tokens_so_far)
    if chunk.index == 0 or chunk.finalize:
        return 2 * frames
    return 2 * min(frames, MEL_PER_TOKEN * (chunk.end - chunk.offset) + CHUNK_FRAMES)


def simulate(lim: policy.Limits, costs: policy.Costs, lengths: list[int], concurrency: int, ar_ms: float,
             prompt: int = 150, max_iterations: int = 200_000) -> SimResult:
    pending = list(enumerate(lengths))
    rows: dict[str, _Row] = {}
    now = 0.0
    order = 0
    solve = None  # (policy.Solve, [(row, chunk, hop)])
    mels: list = []  # (row, chunk, hop, ready_at)
    solves, first_wait, first_audio, waits = [], [], [], []
    audio_total = 0.0
    under_rows, under_s = 0, 0.0

    def admit():
        while pending and len(rows) < concurrency:
            i, n = pending.pop(0)
            rows[f"r{i}"] = _Row(f"r{i}", n, prompt, SegmentPlanner(HopSchedule(25, 100, 2), prompt, LOOKAHEAD))

    admit()
    for _ in range(max_iterations):
        if not rows:
            break
        decoding = [r for r in rows.values() if r.generated < r.n_tokens]
        ms = ar_ms if decoding else 0.0
        for r in decoding:
            r.generated += 1
        for r in rows.values():  # hops whose tokens are in
            done = r.generated >= r.n_tokens
            while (c := r.planner.next_chunk(r.generated, done)) is not None:
                order += 1
                first = c.index == 0
                if first:
                    r.first_ready = now
                r.hops.append((c, order, first, hop_tokens(r.prompt, c, c.end), now))
        ready = []
        for r in rows.values():
            if r.hops and not (solve and any(x[0] is r for x in solve[1])):
                c, o, first, tok, at = r.hops[0]
                ready.append((r, c, policy.ReadyHop(r.rid, o, first, r.deadline, tok, at)))
        p_mels = [policy.Mel(r.rid, h.order, h.first, r.deadline, MEL_PER_TOKEN * (c.end - c.offset), t)
                  for r, c, h, t in mels]
        p_solve = solve[0] if solve else None
        plan = policy.plan(now, lim, costs, bool(decoding), p_solve,
                           [h for _, _, h in ready], p_mels, len(decoding),
                           min((r.deadline for r in decoding), default=policy.INF))
        finished = []

        def take(jobs):  # hops leave their rows' queues as their solve starts
            for r, c, h in jobs:
                r.hops.pop(0)
                waits.append((h.ready_at, now, h.deadline, policy.patient(h, lim, h.ready_at)))
                if h.first:
                    first_wait.append(now - h.ready_at)

        if plan.apart:  # first hops solved whole before the active solve's steps, then decoded
            jobs = [(r, c, h) for r, c, h in ready if r.rid in plan.apart]
            tokens = sum(h.tokens for _, _, h in jobs)
            solves.append(tokens)
            take(jobs)
            ms += lim.n_steps * costs.flow_step(tokens)
            ms += costs.hift(sum(MEL_PER_TOKEN * (c.end - c.offset) for _, c, _ in jobs))
            finished += [(r, c, h, now) for r, c, h in jobs]
        if plan.hift:
            batch = [m for m in mels if m[0].rid in plan.hift]
            mels = [m for m in mels if m[0].rid not in plan.hift]
            ms += costs.hift(sum(MEL_PER_TOKEN * (c.end - c.offset) for _, c, _, _ in batch))
            finished += batch
        if plan.flow_steps:
            s, jobs = solve
            ms += plan.flow_steps * costs.flow_step(s.tokens)
            left = s.steps_left - plan.flow_steps
            if left:
                solve = (policy.Solve(s.tokens, left, s.deadline), jobs)
            else:
                mels += [(r, c, h, now) for r, c, h in jobs]
                solve = None
        if plan.start and solve is None:
            jobs = [(r, c, h) for r, c, h in ready if r.rid in plan.start]
            tokens = sum(h.tokens for _, _, h in jobs)
            solves.append(tokens)
            take(jobs)
            ms += plan.start_steps * costs.flow_step(tokens)
            s = policy.Solve(tokens, lim.n_steps - plan.start_steps, min(h.deadline for _, _, h in jobs))
            if s.steps_left:
                solve = (s, jobs)
            else:
                mels += [(r, c, h, now) for r, c, h in jobs]
        now += max(ms, 0.05) / 1e3
        for r, c, h, _ in finished:  # audio reaches the player at the end of the iteration
            if r.first_audio is None:
                r.first_audio = now
                first_audio.append(now - r.first_ready)
            elif now > r.deadline:
                r.underrun_s = max(r.underrun_s, now - r.deadline)
            sec = (c.end - c.offset) / TOKEN_HZ
            r.audio_s += sec
            audio_total += sec
            if c.finalize:
                under_rows += r.underrun_s > 0
                under_s = max(under_s, r.underrun_s)
                del rows[r.rid]
        admit()
    else:
        raise AssertionError("the simulated run did not finish")
    return SimResult(solves, first_wait, first_audio, waits, under_rows, under_s, now, audio_total)
