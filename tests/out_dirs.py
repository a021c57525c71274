"""Reading an OUT folder in tests: every ledger part's records, and how often each row is ok."""

import json
from pathlib import Path

from click.testing import CliRunner

from cosybatch.cli import cli


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def records(out: Path) -> list[dict]:
    recs = []
    for p in sorted(out.glob("ledger*.jsonl")):
        recs += [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    return recs


def ok_counts(out: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records(out):
        if r.get("event") == "row" and r["status"] == "ok":
            counts[r["utt_id"]] = counts.get(r["utt_id"], 0) + 1
    return counts
