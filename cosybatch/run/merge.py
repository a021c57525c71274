"""``cosybatch merge``: one summary from the ledgers and timings of many shard runs.

The ledgers are the authority on row status (latest record per utt_id wins across all
of them); the timing files contribute per-row timings and each shard's wall time.
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
from cosybatch.output.timing import TIMING_SCHEMA, rates, timing_files

log = logging.getLogger(__name__)


class MergeError(Exception):
    pass


@dataclass
class MergeResult:
    path: Path
    totals: dict[str, Any]
    exit_code: int


def _load_timings(outs: list[Path], level: int) -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for out in outs:
        for p in timing_files(out):
            try:
                doc = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                log.log(level, "%s: unreadable timing file skipped (%s)", p, e)
                continue
            if isinstance(doc, dict) and doc.get("schema") == TIMING_SCHEMA and not doc.get("merged"):
                docs.append((p, doc))
    return docs


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
    walls = [float(d["totals"]["wall_s"]) for _, d in docs if isinstance(d.get("totals"), dict)
             and isinstance(d["totals"].get("wall_s"), (int, float))]
    run_audio = sum(float(d["totals"].get("audio_s") or 0.0) for _, d in docs if isinstance(d.get("totals"), dict))
    wall = max(walls) if walls else 0.0
    audio_all = sum(float(r.get("audio_s") or 0.0) for r in rows_state.values() if r.get("status") == "ok")
    totals = {
        "ok": status.count("ok"), "failed": status.count("failed"), "skipped": 0, "invalid": len(invalid),
        "audio_s_all": round(audio_all, 4),
        # Shards are assumed to run side by side: throughput is their audio over the slowest one's wall.
        "audio_s": round(run_audio, 4), "wall_s": round(wall, 4), "wall_s_sum": round(sum(walls), 4),
        **rates(run_audio, wall),
        "shards": len(docs), "missing_shards": missing, "incomplete": incomplete,
    }
    first = docs[0][1] if docs else {}
    merged = {"schema": TIMING_SCHEMA, "merged": True, "complete": not missing and not incomplete,
              "model": first.get("model"), "device": first.get("device"), "versions": first.get("versions"),
              "sources": [{"file": str(p), "shard": d.get("shard"), "complete": d.get("complete"),
                           "totals": d.get("totals")} for p, d in docs],
              "totals": totals,
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
