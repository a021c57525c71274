"""What the summaries say: merge's wall time over the shards' windows, the totals of a re-run
with nothing to do, and a row's queue time kept apart from its synthesis time."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from cosybatch.manifest import read_manifest
from cosybatch.output.timing import union_s
from cosybatch.run.merge import merge_outputs
from cosybatch.run.sharding import Shard
from cosybatch.run.synth import run_synth
from fake_synth import FakeSynth, make_manifest


def _run(man_path, synth, out, **kw):
    kw.setdefault("quiet", True)
    return run_synth(read_manifest(man_path), synth, out, **kw)


def _timing(out: Path, name: str = "timing.json") -> dict:
    return json.loads((out / name).read_text())


def _span(w: dict) -> float:
    return w["end"] - w["start"]


def _shard_windows(out: Path, n: int) -> list[dict]:
    found = []
    for i in range(n):
        (w,) = _timing(out, f"timing.shard-{i}-of-{n}.json")["runs"]  # one run each
        found.append(w)
    return found


def test_merge_of_shards_run_one_after_the_other_adds_their_windows_not_the_gap(tmp_path):
    man = make_manifest(tmp_path, 4)
    out = tmp_path / "out"
    _run(man, FakeSynth(sleep=0.05), out, shard=Shard(0, 2))
    time.sleep(0.3)  # nothing runs here: the merged wall must not count it
    _run(man, FakeSynth(sleep=0.1), out, shard=Shard(1, 2))
    w0, w1 = _shard_windows(out, 2)
    assert w1["start"] >= w0["end"]  # they did run one after the other
    res = merge_outputs([out], out)
    walls = [_span(w0), _span(w1)]
    assert res.totals["wall_s"] == pytest.approx(sum(walls), abs=1e-3)
    assert res.totals["wall_s"] > max(walls)  # not the slowest shard's window
    assert res.totals["wall_s"] < w1["end"] - w0["start"]  # not the idle gap between them
    assert res.totals["audio_s_per_s"] == pytest.approx(res.totals["audio_s"] / res.totals["wall_s"], rel=1e-3)
    assert res.totals["ok"] == 4 and res.totals["wall_s_sum"] == pytest.approx(sum(walls), abs=1e-3)


def test_merge_of_shards_run_side_by_side_counts_their_overlap_once(tmp_path):
    man = make_manifest(tmp_path, 6)
    out = tmp_path / "out"
    threads = [threading.Thread(target=_run, args=(man, FakeSynth(sleep=0.1), out), kwargs={"shard": Shard(i, 2)})
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w0, w1 = _shard_windows(out, 2)
    assert max(w0["start"], w1["start"]) < min(w0["end"], w1["end"])  # they did overlap
    res = merge_outputs([out], out)
    union = max(w0["end"], w1["end"]) - min(w0["start"], w1["start"])
    assert res.totals["wall_s"] == pytest.approx(union, abs=1e-3)
    assert res.totals["wall_s"] < _span(w0) + _span(w1)  # the overlap counts once
    assert res.totals["ok"] == 6


def test_union_of_windows():
    # [0, 2] and [1, 3] overlap into [0, 3]; [5, 6] is apart; a window inside another adds nothing
    ws = [{"start": 1.0, "end": 3.0}, {"start": 5.0, "end": 6.0}, {"start": 0.0, "end": 2.0},
          {"start": 1.5, "end": 2.5}]
    assert union_s(ws) == pytest.approx((3.0 - 0.0) + (6.0 - 5.0))
    assert union_s([]) == 0.0


def test_a_rerun_with_nothing_to_do_keeps_the_totals_of_every_finished_row(tmp_path):
    man = make_manifest(tmp_path, 3)
    out = tmp_path / "out"
    first = _run(man, FakeSynth(sleep=0.02), out)
    before = _timing(out)["totals"]
    assert first.totals["audio_s_per_s"] == before["audio_s_per_s"]  # the summary and the file agree
    assert before["audio_s_per_s"] > 0 and before["wall_s"] > 0
    for _ in range(2):  # twice: the second no-op reads what the first one wrote
        again = _run(man, FakeSynth(), out)
        assert (again.totals["ok"], again.totals["skipped"]) == (0, 3)
        after = _timing(out)["totals"]
        for key in ("audio_s", "wall_s", "audio_s_per_s", "rtf"):
            assert after[key] == before[key] and again.totals[key] == before[key], key
        assert after["this_run"]["audio_s"] == 0 and after["this_run"]["audio_s_per_s"] is None


def test_a_resumed_run_measures_every_finished_row_over_both_windows(tmp_path):
    man = make_manifest(tmp_path, 4)
    out = tmp_path / "out"
    _run(man, FakeSynth(sleep=0.02, fail={"u1"}), out)
    time.sleep(0.2)  # idle between the runs
    _run(man, FakeSynth(sleep=0.02), out)
    doc = _timing(out)
    first, second = doc["runs"]
    tot = doc["totals"]
    assert tot["wall_s"] == pytest.approx(_span(first) + _span(second), abs=1e-3)
    assert tot["this_run"]["wall_s"] == pytest.approx(_span(second), abs=1e-3)
    assert tot["audio_s"] == pytest.approx(sum(r["audio_s"] for r in doc["rows"]), abs=1e-3)
    assert tot["this_run"]["audio_s"] == pytest.approx(
        sum(r["audio_s"] for r in doc["rows"] if not r["resumed"]), abs=1e-3)


class QueueingSynth(FakeSynth):
    """Takes every row at once and works on one at a time, as a batch engine's window does:
    a row waits for the ones before it, and says how long (``queue_s``)."""

    def synthesize_batch(self, rows, stream):
        taken = time.perf_counter()
        for row in rows:
            began = time.perf_counter()
            res = self.synthesize(row, stream)
            done = time.perf_counter()
            # a batch engine knows no per-row stage times: none are reported
            res.timings = {"total_s": done - taken, "queue_s": began - taken}
            yield row, res


def test_a_rows_rtf_leaves_out_the_time_it_waited_in_the_queue(tmp_path):
    man = make_manifest(tmp_path, 4)
    out = tmp_path / "out"
    pause = 0.05
    _run(man, QueueingSynth(sleep=pause), out)
    rows = {r["utt_id"]: r for r in _timing(out)["rows"]}
    manifest = read_manifest(man)
    for i, row in enumerate(manifest.rows):
        r = rows[row.utt_id]
        assert r["manifest"] == manifest.path and r["line"] == row.line
        assert r["queue_s"] >= pause * i  # it waited for the i rows before it
        assert r["synth_s"] == pytest.approx(r["total_s"] - r["queue_s"], abs=1e-3)
        assert r["synth_s"] >= pause
        assert r["rtf"] == pytest.approx(r["synth_s"] / r["audio_s"], rel=1e-2)
        assert not {"frontend_s", "llm_s", "flow_s", "hift_s"} & r.keys()  # never reported: not written
    last = rows[manifest.rows[-1].utt_id]
    assert last["rtf"] < last["total_s"] / last["audio_s"]  # the wait is not synthesis time


def test_a_row_run_alone_has_no_queue_and_keeps_the_stage_times_it_reported(tmp_path):
    man = make_manifest(tmp_path, 2)
    out = tmp_path / "out"
    _run(man, FakeSynth(sleep=0.01), out)  # FakeSynth reports per-stage seconds, as the reference engine does
    for r in _timing(out)["rows"]:
        assert r["queue_s"] is None and r["synth_s"] == r["total_s"]
        assert all(isinstance(r[k], float) for k in ("frontend_s", "llm_s", "flow_s", "hift_s"))


@pytest.mark.slow
def test_the_fast_engine_reports_each_rows_wait_for_an_ar_slot(fixtures_dir, tmp_path):
    """On the tiny checkpoint with one AR slot: the driver admits several rows at once, so all
    but the first wait for the slot. Their queue time is apart from their synthesis time."""
    from click.testing import CliRunner

    from cosybatch.cli import cli

    prompts = fixtures_dir / "prompts"
    src = [ln.split("|") for ln in (prompts / "meta.lst").read_text(encoding="utf-8").splitlines() if ln.strip()][:3]
    man = tmp_path / "meta.lst"
    man.write_text("".join(f"{u}|{pt}|{prompts / w}|{tt}\n" for u, pt, w, tt in src), encoding="utf-8")
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["synth", str(man), "--model", str(fixtures_dir / "model"), "--out", str(out),
                                   "--device", "cpu", "-q", "--set", "ar.max_num_seqs=1",
                                   "--set", "codec.max_num_seqs=1"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rows = _timing(out)["rows"]
    assert len(rows) == 3 and all(r["queue_s"] is not None for r in rows)
    for r in rows:
        assert r["synth_s"] == pytest.approx(r["total_s"] - r["queue_s"], abs=1e-3)
        assert r["rtf"] == pytest.approx(r["synth_s"] / r["audio_s"], rel=1e-2)
    waited = max(rows, key=lambda r: r["queue_s"])
    assert waited["queue_s"] > 0 and waited["rtf"] < waited["total_s"] / waited["audio_s"]


def test_workers_summary_is_over_their_windows_and_a_noop_rerun_keeps_it(tmp_path):
    """--workers: the merged wall is the union of the workers' own windows (their spawn and
    model loading are not row time), and a re-run with nothing to do reports the same."""
    from out_dirs import invoke

    man = make_manifest(tmp_path, 6)
    out = tmp_path / "out"
    args = ("synth", man, "--out", out, "--synthesizer", "fake_synth:build", "--set", "sleep=0.05",
            "--device", "cpu", "--workers", "2", "-q")
    assert invoke(*args).exit_code == 0
    windows = _shard_windows(out, 2)
    merged = _timing(out)["totals"]
    assert merged["wall_s"] == pytest.approx(union_s(windows), abs=1e-3) and merged["ok"] == 6
    assert merged["audio_s_per_s"] > 0
    assert invoke(*args).exit_code == 0  # nothing left to do
    again = _timing(out)["totals"]
    for key in ("audio_s", "wall_s", "audio_s_per_s", "rtf"):
        assert again[key] == merged[key], key
