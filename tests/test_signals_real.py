"""SIGTERM and Ctrl-C to a real `cosybatch synth` on the tiny checkpoint, and the resume after.

Real processes on the real fast path, because the fault lives there: torch and onnxruntime
threads still inside a native call at interpreter exit abort the process (C++ ``terminate``,
exit 134). Rows are admitted one at a time so the run is long enough to be interrupted
part-way on any machine; the ledger is polled, never a fixed sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import signal_when_ready

REPO = Path(__file__).resolve().parents[1]
ROWS = 8  # the signal comes right after the first row and one row is in flight at a time, so 8 leave ample margin
pytestmark = pytest.mark.slow


def _manifest(tmp_path: Path, fixtures_dir: Path) -> Path:
    """ROWS rows cycling through the fixture's four short rows (absolute prompt paths)."""
    prompts = fixtures_dir / "prompts"
    src = [ln.split("|") for ln in (prompts / "meta.lst").read_text(encoding="utf-8").splitlines() if ln.strip()][:4]
    lines = [f"{u}_{i}|{pt}|{prompts / wav}|{tt}" for i in range(ROWS // 4) for u, pt, wav, tt in src]
    path = tmp_path / "meta.lst"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _cmd(man: Path, out: Path, model_dir: Path) -> list[str]:
    return [sys.executable, "-m", "cosybatch.cli", "synth", str(man), "--model", str(model_dir), "--out", str(out),
            "--device", "cpu", "--set", "ar.max_num_seqs=1", "--set", "codec.max_num_seqs=1"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "ledger.jsonl").read_text(encoding="utf-8").splitlines()]


def _ok_rows(recs: list[dict]) -> list[str]:
    return [r["utt_id"] for r in recs if r.get("event") == "row" and r.get("status") == "ok"]


def _wait_for_first_row(out: Path, proc: subprocess.Popen, timeout: float = 150.0) -> None:
    t_end = time.monotonic() + timeout  # model loading included, on a busy 2-core machine
    while time.monotonic() < t_end:
        if (out / "ledger.jsonl").exists() and '"event": "row"' in (out / "ledger.jsonl").read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(f"synth ended before its first row: {proc.communicate()[1].decode()[-3000:]}")
        time.sleep(0.02)
    raise AssertionError("no row finished in time")


@pytest.mark.parametrize("sig,code,word", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                           (signal.SIGINT, 130, "interrupted")])
def test_signal_mid_run_exits_cleanly_and_the_rerun_redoes_only_the_rest(tmp_path, fixtures_dir, model_dir,
                                                                        sig, code, word):
    man, out = _manifest(tmp_path, fixtures_dir), tmp_path / "out"
    proc = subprocess.Popen(_cmd(man, out, model_dir), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = signal_when_ready(proc, lambda: _wait_for_first_row(out, proc), sig, 90).decode(errors="replace")
    assert proc.returncode == code, err[-3000:]
    for bad in ("terminate called", "Traceback", "Aborted", "core dumped"):
        assert bad not in err, err[-3000:]
    assert f"{word}: finished rows are kept; re-run the same command to resume" in err
    assert "rows ok" in err  # the summary is printed

    recs = _records(out)  # every line parses
    done = _ok_rows(recs)
    assert recs[-1]["event"] == "run_end" and recs[-1]["interrupted"] is True
    assert 1 <= len(done) < ROWS and recs[-1]["ok"] == len(done) and recs[-1]["pending"] == ROWS - len(done)
    assert sorted(p.stem for p in out.glob("*.wav")) == sorted(done)
    assert not [p.name for p in out.iterdir() if ".cbtmp" in p.name]
    timing = json.loads((out / "timing.json").read_text())
    assert timing["interrupted"] is True and timing["complete"] is False and len(timing["rows"]) == len(done)
    kept = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("*.wav")}

    res = subprocess.run([*_cmd(man, out, model_dir), "-q"], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "terminate called" not in res.stderr
    rerun = _records(out)[len(recs):]
    assert rerun[0]["event"] == "run_start" and rerun[0]["skipped"] == len(done)
    redone = [r["utt_id"] for r in rerun if r.get("event") == "row"]
    all_ids = {f"{u}_{i}" for i in range(ROWS // 4) for u in ("utt1", "utt2", "utt3", "utt4")}
    assert sorted(redone) == sorted(all_ids - set(done))  # nothing finished is redone, nothing is done twice
    assert {p.stem for p in out.glob("*.wav")} == all_ids
    assert {n: (p.stat().st_mtime_ns, p.read_bytes()) for n, p in ((n, out / n) for n in kept)} == kept


def test_close_joins_every_thread_the_fast_synthesizer_started(tmp_path, fixtures_dir, model_dir):
    """What the CLI relies on: after ``close()``, even with rows still in flight, none of the
    synthesizer's threads is alive (a daemon thread in a native call would abort the exit)."""
    from cosybatch.manifest import read_manifest
    from cosybatch.synthesizers import build_synthesizer

    before = set(threading.enumerate())
    synth = build_synthesizer(str(model_dir), "cpu", None, ["ar.max_num_seqs=1", "codec.max_num_seqs=1"])
    if not callable(getattr(synth, "close", None)):
        pytest.xfail("FastSynthesizer.close() is not implemented yet (pipeline/serving)")
    rows = read_manifest(_manifest(tmp_path, fixtures_dir)).rows[:6]
    outcomes = synth.synthesize_batch(rows, synth.streaming)
    next(outcomes)  # one row back, the others in flight
    outcomes.close()  # what an interrupt or a full disk does to the generator
    synth.close()
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []
