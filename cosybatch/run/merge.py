"""``cosybatch merge``: one summary from the ledgers and timings of many shard runs.

The ledgers are the authority on row status (latest record per utt_id wins across all
of them); the timing files contribute per-row timings and the windows in which the shards
ran. The merged wall time is the union of those windows: shards run side by side count
their overlap once, shards run one after the other add up (the gap between them does not).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosybatch.run.exits import EXIT_FAILED, EXIT_OK
from cosybatch.atomic import OutputFault, atomic_write_bytes
from cosybatch.output.ledger import ledger_files, read_ledger
from cosybatch.output.timing import TIMING_SCHEMA, build_totals, doc_windows, read_timing_docs, unique_windows

log = logging.getLogger(__name__)


class MergeError(Exception):
    pass


@dataclass
class MergeResult:
    path: Path
    totals: dict[str, Any]
    exit_code: int


def _load_timings(outs: list[Path], level: int) -> list[tuple[Path, dict[str, Any]]]:
    def unreadable(p: Path, e: Exception) -> None:
        log.log(level, "%s: unreadable timing file skipped (%s)", p, e)

    return [pd for out in outs for pd in read_timing_docs(out, unreadable)]


def _ledger_state(outs: list[Path]) -> tuple[dict[str, dict[str, Any]], dict[tuple[Any, Any], dict[str, Any]]]:
    recs: list[dict[str, Any]] = []
    for out in outs:
        for p in ledger_files(out):
            recs.extend(read_ledger(p))
    recs.sort(key=lambda r: r.get("time", 0.0) if isinstance(r.get("time"), (int, float)) else 0.0)
    rows: dict[str, dict[str, Any]] = {}
    invalid: dict[tuple[Any, Any], dict[str, Any]] = {}
    for r in recs:
        if r.get("event") == "row" and isinstance(r.get("utt_id"), str):
            rows[r["utt_id"]] = r
        elif r.get("event") == "invalid":
            invalid[(r.get("line"), r.get("utt_id"))] = r
    return rows, invalid


def _shard_gaps(docs: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    seen: dict[int, set[int]] = {}
    for _, doc in docs:
        sh = doc.get("shard") or {}
        if isinstance(sh.get("count"), int) and isinstance(sh.get("index"), int):
            seen.setdefault(sh["count"], set()).add(sh["index"])
    return [f"{i}/{n}" for n, got in sorted(seen.items()) for i in range(n) if i not in got]


def merge_outputs(outs: list[Path], into: Path, quiet: bool = False) -> MergeResult:
    """``quiet``: the caller reports each part's fate itself; the merge's warnings go to debug."""
    level = logging.DEBUG if quiet else logging.WARNING
    docs = _load_timings(outs, level)
    rows_state, invalid = _ledger_state(outs)
    if not docs and not rows_state:
        raise MergeError(f"no timing*.json or ledger*.jsonl found in {', '.join(map(str, outs))}")
    missing = _shard_gaps(docs)
    for s in missing:
        log.log(level, "shard %s has no timing file: it never ran or wrote elsewhere", s)
    incomplete = [str(p) for p, d in docs if not d.get("complete")]
    for p in incomplete:
        log.log(level, "%s: that shard did not finish (killed or interrupted)", p)

    rows: dict[str, dict[str, Any]] = {}
    for _, doc in sorted(docs, key=lambda pd: str(pd[1].get("updated", ""))):
        for r in doc.get("rows") or []:
            if isinstance(r, dict) and isinstance(r.get("utt_id"), str):
                rows[r["utt_id"]] = r
    status = [r.get("status") for r in rows_state.values()]
    # Every document carries the windows of the runs behind its rows; the same window may be in
    # several (a resumed shard's file repeats its earlier run's): each counts once.
    windows = unique_windows(w for _, d in docs for w in doc_windows(d))
    audio_all = sum(float(r.get("audio_s") or 0.0) for r in rows_state.values() if r.get("status") == "ok")
    totals = build_totals(
        # rows and pending: unknown here (a merge has no manifest; missing_shards says what is missing)
        rows=None, ok=status.count("ok"), failed=status.count("failed"), skipped=0,
        invalid=len(invalid), pending=None, audio_s_run=0.0, this_run=None, audio_s_all=audio_all, windows=windows,
        # wall_s_sum: the windows added up, overlap and all (how busy the shards were together)
        extra={"wall_s_sum": round(sum(float(w["end"]) - float(w["start"]) for w in windows), 4),
               "shards": len(docs), "missing_shards": missing, "incomplete": incomplete})
    first = docs[0][1] if docs else {}
    merged = {"schema": TIMING_SCHEMA, "merged": True, "complete": not missing and not incomplete,
              "model": first.get("model"), "device": first.get("device"), "versions": first.get("versions"),
              "sources": [{"file": str(p), "shard": d.get("shard"), "complete": d.get("complete"),
                           "totals": d.get("totals")} for p, d in docs],
              "totals": totals, "runs": windows,
              "failed": {u: r.get("reason") for u, r in rows_state.items() if r.get("status") == "failed"},
              "rows": list(rows.values())}
    try:
        into.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MergeError(f"cannot create {into}: {e}") from None
    path = into / "timing.json"
    if any(p.resolve() == path.resolve() for p, _ in docs):
        path = into / "timing.merged.json"  # never overwrite one of the sources
    try:
        atomic_write_bytes(path, json.dumps(merged, indent=1, ensure_ascii=False, default=str).encode() + b"\n")
    except OutputFault as e:  # a full disk: one line, not a traceback
        raise MergeError(str(e)) from None
    bad = totals["failed"] or totals["invalid"] or missing or incomplete
    return MergeResult(path, totals, EXIT_FAILED if bad else EXIT_OK)
