"""timing.json: the run's per-row and total timings, rewritten atomically as the run goes.

One module builds every summary cosybatch writes or prints, so a plain run, a run over worker
processes, a Ray run and ``cosybatch merge`` cannot drift apart: :func:`row_timing` (one row's
entry), :func:`build_totals` (the ``totals`` block) and :func:`timing_document` (the file).

Throughput is measured over *windows*: a run's window opens when its first row is handed to
the synthesizer (start-up is reported beside it, not in it) and closes when its last row is
committed. Each document keeps the windows of every run that made the rows it lists
(``runs``), in absolute epoch seconds, so a resumed job, shards run one after the other and
shards run side by side are all measured over the time something was actually running: the
union of the windows, never their sum and never only the longest.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from cosybatch.atomic import atomic_write_bytes


# /2: absolute run windows (``runs``), per-row queue and synthesis time, totals over every
# finished row. Readers (merge, resume) accept /1 documents too.
TIMING_SCHEMA = "cosybatch.timing/2"
READABLE_SCHEMAS = ("cosybatch.timing/1", TIMING_SCHEMA)

# Per-stage seconds a synthesizer may report for a row. Only the sequential reference engine
# knows them (the fast engine's rows share batches: its stage times are per run, in
# ``totals.stage_busy_s``), so a row carries only the stages its synthesizer reported.
STAGE_KEYS = ("frontend_s", "llm_s", "flow_s", "hift_s")


def timing_files(out_dir: Path) -> list[Path]:
    return sorted(p for p in out_dir.glob("timing*.json") if p.is_file())


def rates(audio_s: float, wall_s: float) -> dict[str, float | None]:
    """The timing document's throughput figures: audio seconds per wall second, and its inverse.
    None, not 0, when there is nothing to divide: no audio is not "infinitely slow"."""
    return {"audio_s_per_s": audio_s / wall_s if wall_s > 0 and audio_s > 0 else None,
            "rtf": wall_s / audio_s if audio_s > 0 else None}


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


# --- windows ---------------------------------------------------------------------------------


def window(start: float, end: float, **extra: Any) -> dict[str, Any]:
    """One run's window: absolute start and end (epoch seconds), plus what it made."""
    return {"start": round(start, 3), "end": round(max(start, end), 3), **extra}


def union_s(windows: Iterable[Mapping[str, Any]]) -> float:
    """Seconds covered by at least one window: overlapping shards count once, the gap between
    two sequential ones not at all."""
    spans = sorted((s, e) for w in windows
                   if (s := _num(w.get("start"))) is not None and (e := _num(w.get("end"))) is not None and e >= s)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _iso_epoch(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return time.mktime(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def doc_windows(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The windows a timing document records. A /1 document has none: its one window is
    rebuilt from ``started`` (to the second) and ``totals.wall_s``."""
    runs = doc.get("runs")
    if isinstance(runs, list):
        return [w for w in runs if isinstance(w, dict)]
    start, wall = _iso_epoch(doc.get("started")), _num((doc.get("totals") or {}).get("wall_s"))
    return [window(start, start + wall)] if start is not None and wall is not None else []


def unique_windows(windows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each window once (documents carry their predecessors' windows forward), oldest first."""
    seen: dict[tuple[Any, Any], dict[str, Any]] = {}
    for w in windows:
        seen.setdefault((w.get("start"), w.get("end")), dict(w))
    return sorted(seen.values(), key=lambda w: (w.get("start") or 0.0, w.get("end") or 0.0))


def read_timing_docs(out_dir: Path, on_error: Any = None) -> list[tuple[Path, dict[str, Any]]]:
    """Every readable per-run timing document in ``out_dir`` (merged summaries left out)."""
    docs = []
    for p in timing_files(out_dir):
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            if on_error is not None:
                on_error(p, e)
            continue
        if isinstance(doc, dict) and doc.get("schema") in READABLE_SCHEMAS and not doc.get("merged"):
            docs.append((p, doc))
    return docs


def windows_for(out_dir: Path, utt_ids: set[str]) -> list[dict[str, Any]]:
    """The windows of the earlier runs in ``out_dir`` that made any of these rows: a resumed
    run measures its finished rows over the time that made them, not over its own (empty)
    window, and not over the windows of other shards' runs sharing OUT."""
    if not utt_ids:
        return []
    found: list[dict[str, Any]] = []
    for _, doc in read_timing_docs(out_dir):
        rows = doc.get("rows") or []
        if any(isinstance(r, dict) and r.get("utt_id") in utt_ids for r in rows):
            found.extend(doc_windows(doc))
    return unique_windows(found)


# --- rows ------------------------------------------------------------------------------------


def row_timing(*, utt_id: str, line: int | None, manifest: str | None, status: Any, audio_s: Any = None,
               tokens: Any = None, chunks: Any = None, prompt_s: Any = None,
               timings: Mapping[str, Any] | None = None, resumed: bool = False,
               reason: str | None = None) -> dict[str, Any]:
    """One row's timing entry.

    ``total_s`` is from the moment the synthesizer took the row until its audio was complete;
    ``queue_s`` (when the synthesizer knows it) the part of that the row waited before its own
    work began (a batch engine's free slot); ``synth_s`` the rest. ``rtf`` is ``synth_s`` over
    the row's audio: a row that waited behind others is not reported as slow synthesis.
    """
    t = dict(timings or {})
    audio, total, queue = _num(audio_s), _num(t.get("total_s")), _num(t.get("queue_s"))
    synth = None if total is None else max(0.0, total - (queue or 0.0))
    return {"utt_id": utt_id, "manifest": manifest, "line": line, "status": status,
            "prompt_s": _r(_num(prompt_s)), "audio_s": audio, "tokens": tokens, "chunks": chunks,
            "total_s": _r(total), "queue_s": _r(queue), "synth_s": _r(synth),
            "rtf": _r(synth / audio) if synth is not None and audio else None,
            "first_chunk_s": _r(_num(t.get("first_chunk_s"))),
            **{k: _r(_num(t[k])) for k in STAGE_KEYS if _num(t.get(k)) is not None},
            "resumed": resumed, **({"reason": reason} if reason else {})}


# --- totals ----------------------------------------------------------------------------------


def build_totals(*, rows: int | None, ok: int, failed: int, skipped: int, invalid: int, pending: int | None,
                 audio_s_run: float, this_run: Iterable[Mapping[str, Any]] | None, audio_s_all: float,
                 windows: Iterable[Mapping[str, Any]], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``totals`` block every summary uses (a run's timing.json, the workers' and Ray's
    summaries, ``merge``).

    The counts say what this run did with each row (``skipped``: done before). ``audio_s``,
    ``wall_s``, ``audio_s_per_s`` and ``rtf`` describe every finished row: their audio over the
    union of the windows of the runs that made them, so a re-run with nothing left to do still
    reports the job's throughput. ``rows``/``pending`` None: not known (a merge has no manifest). ``this_run`` (the windows of this run: one, or one per
    worker) gives the figures of this run alone; a merge has none.
    """
    wall_all = union_s(windows)
    counts = {"rows": rows, "ok": ok, "failed": failed, "skipped": skipped, "invalid": invalid, "pending": pending}
    totals: dict[str, Any] = {
        **{k: v for k, v in counts.items() if v is not None},  # None: not known to this summary
        "audio_s": round(audio_s_all, 4), "wall_s": round(wall_all, 4), **rates(audio_s_all, wall_all)}
    if this_run is not None:
        wall = union_s(this_run)
        totals["this_run"] = {"audio_s": round(audio_s_run, 4), "wall_s": round(wall, 4), **rates(audio_s_run, wall)}
    totals.update(extra or {})
    return totals


# --- the document ----------------------------------------------------------------------------


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def timing_document(*, complete: bool, interrupted: bool, stopped: str | None, manifest: str | None,
                    out: Path | str, system: Mapping[str, Any], shard: Mapping[str, Any],
                    settings: Mapping[str, Any], started: float, totals: Mapping[str, Any],
                    runs: list[dict[str, Any]], rows: list[dict[str, Any]],
                    fingerprint: Mapping[str, Any] | None = None, fingerprint_sha: str | None = None) -> dict[str, Any]:
    """A run's timing.json. ``system`` is the synthesizer's description: its ``model``,
    ``device`` and ``versions`` get their own keys, the rest goes under ``system``."""
    sys_info = dict(system)
    return {"schema": TIMING_SCHEMA, "complete": complete, "interrupted": interrupted, "stopped": stopped,
            "manifest": manifest, "out": str(out),
            "model": sys_info.pop("model", None), "device": sys_info.pop("device", None),
            "versions": sys_info.pop("versions", None), "system": sys_info,
            "shard": dict(shard), "settings": dict(settings),
            **({"fingerprint": dict(fingerprint), "fingerprint_sha": fingerprint_sha} if fingerprint is not None else {}),
            "started": _iso(started), "updated": _iso(time.time()),
            "totals": dict(totals), "runs": runs, "rows": rows}


class TimingWriter:
    """Rewrites timing.json atomically now and then, so even a killed run leaves a valid one.

    The interval grows with the cost of a rewrite, keeping it a small share of wall time
    on very large manifests.
    """

    def __init__(self, path: Path, min_interval_s: float = 10.0, tag: str = ""):
        self.path = path
        self.min_interval_s = min_interval_s
        self.tag = tag
        self._last: float | None = None
        self._cost = 0.0

    def write(self, doc: dict[str, Any]) -> None:
        """Rewrite the file; raises OutputFault (the previous version stays) when it cannot."""
        t0 = time.monotonic()
        data = json.dumps(doc, indent=1, ensure_ascii=False, allow_nan=False, default=str).encode("utf-8")
        atomic_write_bytes(self.path, data + b"\n", tag=self.tag)
        self._last = time.monotonic()
        self._cost = self._last - t0

    def due(self) -> bool:
        if self._last is None:
            return True
        return time.monotonic() - self._last >= max(self.min_interval_s, 20 * self._cost)
