"""Serving metrics over per-request timelines, defined as the peers define them (design.md, "Measuring").

All functions are pure: a :class:`Timeline` holds when a request was admitted and when each of
its PCM chunks arrived (the driver's clock, seconds); nothing here reads a clock.

- time to first PCM: admission -> first non-empty chunk
- end-to-end latency: admission -> last non-empty chunk
- RTF: end-to-end latency / audio duration
- underrun: the worst stall of a real-time player that starts at the first chunk, pauses when
  its buffer runs dry and resumes when the next chunk arrives
- audio-s/s: sum of completed audio / measured wall time; QPS: completed / wall time
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class Timeline:
    admitted: float
    chunks: tuple[tuple[float, int], ...]  # (arrival time, samples), in arrival order
    sample_rate: int
    finished: float | None = None  # time of the done/error event
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished is not None


def _audible(tl: Timeline) -> list[tuple[float, int]]:
    return [(t, n) for t, n in tl.chunks if n > 0]


def time_to_first_pcm(tl: Timeline) -> float | None:
    a = _audible(tl)
    return a[0][0] - tl.admitted if a else None


def e2e_latency(tl: Timeline) -> float | None:
    a = _audible(tl)
    if a:
        return a[-1][0] - tl.admitted
    return None if tl.finished is None else tl.finished - tl.admitted


def audio_duration(tl: Timeline) -> float:
    return sum(n for _, n in tl.chunks) / tl.sample_rate


def rtf(tl: Timeline) -> float | None:
    e2e, dur = e2e_latency(tl), audio_duration(tl)
    return e2e / dur if e2e is not None and dur > 0 else None


def underrun(tl: Timeline) -> float:
    """Worst single stall in seconds (0 when playback never ran dry or there is no audio)."""
    a = _audible(tl)
    if not a:
        return 0.0
    play_end = a[0][0]  # the player starts when the first chunk lands
    worst = 0.0
    for t, n in a:
        if t > play_end:
            worst = max(worst, t - play_end)
            play_end = t
        play_end += n / tl.sample_rate
    return worst


def request_metrics(tl: Timeline) -> dict[str, float | None]:
    return {
        "ttfp_s": time_to_first_pcm(tl),
        "e2el_s": e2e_latency(tl),
        "audio_duration_s": audio_duration(tl),
        "rtf": rtf(tl),
        "underrun_s": underrun(tl),
    }


def distribution(values: Iterable[float | None], name: str, scale: float = 1.0) -> dict[str, float | None]:
    """``mean_/median_/std_/p90_/p99_<name>`` (numpy's linear percentiles), None when empty."""
    v = np.array([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64) * scale
    keys = ("mean", "median", "std", "p90", "p99")
    if v.size == 0:
        return {f"{k}_{name}": None for k in keys}
    stats = (v.mean(), np.median(v), v.std(), np.percentile(v, 90), np.percentile(v, 99))
    return {f"{k}_{name}": float(s) for k, s in zip(keys, stats)}


# (per-request key, aggregate name, scale): latencies in ms as vLLM's bench reports them.
_DISTRIBUTIONS = (
    ("ttfp_s", "ttfp_ms", 1000.0),
    ("e2el_s", "e2el_ms", 1000.0),
    ("rtf", "rtf", 1.0),
    ("underrun_s", "underrun_ms", 1000.0),
    ("audio_duration_s", "audio_duration_s", 1.0),
)


def aggregate(timelines: Sequence[Timeline], wall_s: float) -> dict[str, float | int | None]:
    """vLLM-bench-style summary of one measured run (failed requests count only as failed)."""
    if wall_s <= 0:
        raise ValueError(f"wall time must be > 0, got {wall_s}")
    done = [tl for tl in timelines if tl.ok]
    per = [request_metrics(tl) for tl in done]
    total_audio = float(sum(m["audio_duration_s"] for m in per))
    out: dict[str, float | int | None] = {
        "completed": len(done),
        "failed": len(timelines) - len(done),
        "duration": wall_s,
        "total_audio_duration_s": total_audio,
        "request_throughput": len(done) / wall_s,
        "audio_throughput": total_audio / wall_s,
        "underrun_requests": sum(1 for m in per if m["underrun_s"] > 0),
    }
    for key, name, scale in _DISTRIBUTIONS:
        out.update(distribution((m[key] for m in per), name, scale))
    return out
