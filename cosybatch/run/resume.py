"""Deciding which rows a re-run may skip, and explaining a change of settings.

A row is done when its audio file is intact (size recorded in the ledger) and its latest
ledger record is 'ok' for the same inputs (texts, prompt path, size, mtime) and the same
settings fingerprint (``cosybatch.output.rows`` decides the first two, for every way of
running). Same inputs under different settings is the dangerous case: silently redoing some
rows would mix two models' (or two formats') outputs in one folder.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosybatch.manifest import ManifestRow
from cosybatch.output.audio_files import AudioFormat
from cosybatch.output.ledger import latest_rows, read_ledgers
from cosybatch.output.rows import finished_with_inputs

__all__ = ["fingerprint_sha", "run_fingerprint", "explain_change", "ResumePlan", "finished_with_inputs",
           "finished_rows", "plan_resume", "changed_message"]


def fingerprint_sha(fp: dict[str, Any]) -> str:
    blob = json.dumps(fp, sort_keys=True, ensure_ascii=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_fingerprint(synth_fp: dict[str, Any], stream: bool, audio: AudioFormat,
                    native_rate: int | None) -> dict[str, Any]:
    """Everything that changes a run's files: the synthesizer's own fingerprint, the mode, and the
    output format, rate and loudness. ``synth`` and the Ray stage both use this, so either resumes
    the other's OUT."""
    return {**synth_fp, "stream": bool(stream), **audio.fingerprint(native_rate)}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix or "value": d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(_flatten(v, key) if isinstance(v, dict) else {key: v})
    return out


def explain_change(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    if old is None:
        return ["(the earlier run's settings are not recorded in the ledger)"]
    a, b = _flatten(old), _flatten(new)
    return [f"{k}: {a.get(k, '<unset>')!r} before, {b.get(k, '<unset>')!r} now"
            for k in sorted(set(a) | set(b)) if a.get(k, "<unset>") != b.get(k, "<unset>")]


@dataclass
class ResumePlan:
    todo: list[ManifestRow]
    done: dict[str, dict[str, Any]]  # utt_id -> its earlier ok ledger record
    changed: dict[str, str]  # utt_id -> fingerprint sha its file was made with


def finished_rows(rows: list[ManifestRow], out_dir: Path,
                  records: list[dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """utt_id -> latest record of the rows an earlier run finished with these inputs
    (settings not compared); ``records``: the ledgers of ``out_dir``, if already read."""
    latest = latest_rows(read_ledgers(out_dir) if records is None else records)
    return {r.utt_id: latest[r.utt_id] for r in rows
            if r.utt_id in latest and finished_with_inputs(r, latest[r.utt_id], out_dir)}


def plan_resume(rows: list[ManifestRow], out_dir: Path, fp_sha: str, overwrite: bool,
                records: list[dict[str, Any]]) -> ResumePlan:
    latest = latest_rows(records)
    plan = ResumePlan([], {}, {})
    for row in rows:
        rec = latest.get(row.utt_id)
        if overwrite or rec is None or rec.get("status") != "ok":
            plan.todo.append(row)
            continue
        if not finished_with_inputs(row, rec, out_dir):
            plan.todo.append(row)  # new inputs (or a missing file): redoing mixes nothing
        elif rec.get("fp") != fp_sha:
            plan.changed[row.utt_id] = str(rec.get("fp"))
            plan.todo.append(row)
        else:
            plan.done[row.utt_id] = rec
    return plan


def changed_message(plan: ResumePlan, records: list[dict[str, Any]], fp: dict[str, Any], out_dir: Path) -> str:
    known = {r.get("fp"): r.get("fingerprint") for r in records if r.get("event") == "run_start"}
    fp = json.loads(json.dumps(fp, default=str))  # compare like with like: the ledger holds JSON
    lines = [f"{out_dir} already holds {len(plan.changed)} row(s) made with different settings;"
             " refusing to mix outputs."]
    for old_sha in sorted(set(plan.changed.values())):
        n = sum(1 for v in plan.changed.values() if v == old_sha)
        lines.append(f"  {n} row(s) from settings {old_sha}:")
        lines.extend(f"    {d}" for d in explain_change(known.get(old_sha), fp))
    lines.append("Re-run with --overwrite to redo every row, or choose another --out.")
    return "\n".join(lines)
