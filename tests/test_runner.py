"""run_synth around a fake synthesizer: outputs, isolation, resume, interrupts, sharding, merge."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosybatch.output import rows as rows_mod
from cosybatch.output.timing import TimingWriter
from cosybatch.run import disk_estimate
from cosybatch.manifest import ManifestRow, read_manifest
from cosybatch.run.merge import merge_outputs
from cosybatch.run.disk_estimate import estimated_audio_s, estimated_output_bytes
from cosybatch.run.synth import RunError, SettingsChanged, run_synth
from cosybatch.run.sharding import Shard, ShardError, assign, estimated_cost, parse_shard, select, shard_from_env
from fake_disk import FullDisk, install as install_disk
from fake_synth import FakeSynth, expected_audio, guard_signals, make_manifest


def _ledger(out: Path, name="ledger.jsonl") -> list[dict]:
    return [json.loads(x) for x in (out / name).read_text().splitlines()]


def _ok_ids(out: Path, name="ledger.jsonl") -> list[str]:
    return [r["utt_id"] for r in _ledger(out, name) if r.get("event") == "row" and r["status"] == "ok"]


def _run(man_path, synth, out, **kw):
    kw.setdefault("quiet", True)
    return run_synth(read_manifest(man_path), synth, out, **kw)


@pytest.fixture
def logs(caplog):
    """Records of the ``cosybatch`` loggers (the CLI's setup_logging stops their propagation)."""
    lg = logging.getLogger("cosybatch")
    level, propagate = lg.level, lg.propagate
    lg.addHandler(caplog.handler)
    lg.setLevel(logging.DEBUG)
    lg.propagate = False  # each record once
    yield caplog
    lg.removeHandler(caplog.handler)
    lg.setLevel(level)
    lg.propagate = propagate


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_all_rows_written_as_utt_id_wav_with_ledger_and_timing(tmp_path):
    man = make_manifest(tmp_path, 4)
    out = tmp_path / "out"
    rep = _run(man, FakeSynth(), out, wav_subtype="FLOAT")
    assert rep.exit_code == 0
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "ledger.jsonl", "timing.json", "u0.wav", "u1.wav", "u2.wav", "u3.wav"]
    for row in read_manifest(man).rows:
        audio, sr = sf.read(str(out / f"{row.utt_id}.wav"), dtype="float32")
        assert sr == 24000
        np.testing.assert_array_equal(audio, expected_audio(row.utt_id, row.target_text))
    assert _ok_ids(out) == ["u0", "u1", "u2", "u3"]
    events = [r["event"] for r in _ledger(out)]
    assert events[0] == "run_start" and events[-1] == "run_end"
    t = json.loads((out / "timing.json").read_text())
    assert t["complete"] is True and t["model"] == "fake" and t["device"] == "cpu"
    assert t["versions"]["fake"] == "1" and "numpy" in t["versions"]
    assert t["settings"] == {"stream": False, "wav_subtype": "FLOAT", "sample_rate": 24000, "format": "wav",
                             "output_sample_rate": 24000, "loudness_lufs": None}
    r0 = t["rows"][0]
    assert r0["utt_id"] == "u0" and r0["prompt_s"] == 1.0 and r0["tokens"] == len("Hello there, this is row 0.")
    assert r0["audio_s"] == pytest.approx(len(expected_audio("u0", "Hello there, this is row 0.")) / 24000)
    for k in ("frontend_s", "llm_s", "flow_s", "hift_s", "first_chunk_s", "total_s", "rtf"):
        assert isinstance(r0[k], float)
    tot = t["totals"]
    assert (tot["rows"], tot["ok"], tot["failed"], tot["skipped"], tot["invalid"]) == (4, 4, 0, 0, 0)
    assert tot["audio_s"] == pytest.approx(sum(r["audio_s"] for r in t["rows"]), abs=1e-3)
    assert tot["audio_s_per_s"] > 0 and tot["rtf"] > 0


def test_one_bad_row_among_good_ones(tmp_path):
    man = make_manifest(tmp_path, 5)
    out = tmp_path / "out"
    rep = _run(man, FakeSynth(fail={"u1"}, nan={"u3"}), out)
    assert rep.exit_code == 1 and rep.failed == ["u1", "u3"]
    assert sorted(p.name for p in out.glob("*.wav")) == ["u0.wav", "u2.wav", "u4.wav"]
    rows = {r["utt_id"]: r for r in _ledger(out) if r.get("event") == "row"}
    assert rows["u1"]["status"] == "failed" and "synthetic failure for u1" in rows["u1"]["reason"]
    assert rows["u3"]["status"] == "failed" and "non-finite audio (1 NaN/inf samples)" in rows["u3"]["reason"]
    assert not (out / "u3.wav").exists()
    t = json.loads((out / "timing.json").read_text())
    assert (t["totals"]["ok"], t["totals"]["failed"]) == (3, 2)
    # A re-run retries only the failed rows.
    synth = FakeSynth()
    assert _run(man, synth, out).exit_code == 0
    assert synth.calls == ["u1", "u3"]


@pytest.mark.parametrize("batch", [False, True])
def test_inf_and_empty_audio_fail_alone_with_the_reason(tmp_path, batch):
    man = make_manifest(tmp_path, 4)
    out = tmp_path / "out"

    class Batch(FakeSynth):  # the fast path's shape: results come back through synthesize_batch
        def synthesize_batch(self, rows, stream):
            for row in rows:
                yield row, FakeSynth.synthesize(self, row, stream)

    rep = _run(man, (Batch if batch else FakeSynth)(inf={"u1"}, empty={"u2"}), out)
    assert rep.exit_code == 1 and rep.failed == ["u1", "u2"]
    rows = {r["utt_id"]: r for r in _ledger(out) if r.get("event") == "row"}
    assert rows["u1"]["reason"] == "ValueError: non-finite audio (1 NaN/inf samples)"
    assert rows["u2"]["reason"].startswith("ValueError: empty audio")
    assert sorted(p.name for p in out.glob("*.wav")) == ["u0.wav", "u3.wav"]


def test_a_row_whose_wav_cannot_be_written_fails_alone(tmp_path):
    man = make_manifest(tmp_path, 3)
    out = tmp_path / "out"
    (out / "u1.wav").mkdir(parents=True)  # this one name is taken; the disk is fine
    rep = _run(man, FakeSynth(), out)
    assert rep.exit_code == 1 and rep.failed == ["u1"]
    assert sorted(p.name for p in out.glob("*.wav") if p.is_file()) == ["u0.wav", "u2.wav"]
    assert "IsADirectoryError" in {r["utt_id"]: r for r in _ledger(out) if r.get("event") == "row"}["u1"]["reason"]


# ---- a full disk: one clear stop, a consistent OUT, a re-run that redoes only what is missing ----

def _assert_out_consistent(out: Path, man: Path) -> list[str]:
    """Every ledger line whole; the WAVs on disk are exactly the ok rows, each intact; no temp files."""
    lines = (out / "ledger.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b""
    recs = [json.loads(x) for x in lines[:-1]]
    oks = [r["utt_id"] for r in recs if r.get("event") == "row" and r["status"] == "ok"]
    assert sorted(p.stem for p in out.glob("*.wav")) == sorted(oks)
    texts = {r.utt_id: r.target_text for r in read_manifest(man).rows}
    for u in oks:
        audio, _ = sf.read(str(out / f"{u}.wav"), dtype="float32")
        np.testing.assert_array_equal(audio, expected_audio(u, texts[u]))
    assert not [p.name for p in out.iterdir() if ".cbtmp" in p.name]
    json.loads((out / "timing.json").read_text())  # still valid JSON
    return oks


# (file, which write of that file fails, bytes it gets first): the WAV of the third row, the
# ledger's ok line of the third row (run_start, u0, u1, u2), timing.json after the second row.
DISK_FULL_AT = {"wav": ("u2.wav", 1, 0), "wav_partial": ("u2.wav", 2, 5000),
                "ledger": ("ledger.jsonl", 4, 0), "ledger_partial": ("ledger.jsonl", 4, 40),
                "timing": ("timing.json", 3, 0)}


@pytest.mark.parametrize("stays_full", [True, False])
@pytest.mark.parametrize("where", list(DISK_FULL_AT))
def test_full_disk_stops_with_one_line_and_a_consistent_out(tmp_path, monkeypatch, logs, where, stays_full):
    man = make_manifest(tmp_path, 5)
    out = tmp_path / "out"
    name, nth, partial = DISK_FULL_AT[where]
    disk = FullDisk(name, nth=nth, partial=partial)
    install_disk(monkeypatch, disk)
    monkeypatch.setattr(TimingWriter, "due", lambda self: True)  # a rewrite after every row
    if not stays_full:  # space comes back right after the failed write (another job cleaned up)
        real_write = disk.write

        def write_then_free(fd, data):
            try:
                return real_write(fd, data)
            except OSError:
                disk.free()
                raise
        disk.write = write_then_free
    rep = _run(man, FakeSynth(), out, wav_subtype="FLOAT")
    assert rep.exit_code == 1 and rep.failed == []
    errors = _errors(logs)
    assert len(errors) == 1, errors
    assert errors[0] == (f"cannot write {out / name}: no space left on device; run stopped, "
                         "2 finished row(s) kept: free space and re-run the same command to resume")
    assert not any(r.exc_info for r in logs.records if r.levelno > logging.DEBUG)  # tracebacks only with -v
    install_disk(monkeypatch, os)
    assert _assert_out_consistent(out, man) == ["u0", "u1"]
    end = _ledger(out)[-1]
    if stays_full:
        assert end["event"] == "row"  # no run_end: the disk never took another byte
    else:
        assert end["event"] == "run_end" and end["stopped"] == errors[0].split(";")[0] and end["pending"] == 3
        t = json.loads((out / "timing.json").read_text())
        assert t["complete"] is False and t["stopped"] == end["stopped"]
    synth = FakeSynth()
    assert _run(man, synth, out, wav_subtype="FLOAT").exit_code == 0
    assert synth.calls == ["u2", "u3", "u4"]
    assert _assert_out_consistent(out, man) == ["u0", "u1", "u2", "u3", "u4"]


def test_disk_full_before_the_first_row(tmp_path, monkeypatch, logs):
    man = make_manifest(tmp_path, 3)
    out = tmp_path / "out"
    install_disk(monkeypatch, FullDisk("ledger.jsonl"))
    synth = FakeSynth()
    rep = _run(man, synth, out)
    assert rep.exit_code == 1 and synth.calls == []
    assert _errors(logs) == [f"cannot write {out / 'ledger.jsonl'}: no space left on device; run stopped, "
                             "0 finished row(s) kept: free space and re-run the same command to resume"]
    assert (out / "ledger.jsonl").read_bytes() == b"" and not list(out.glob("*.wav"))


def test_free_space_is_checked_before_starting(tmp_path, monkeypatch, logs):
    man = make_manifest(tmp_path, 4)
    rows = read_manifest(man).rows
    need, audio_s = estimated_output_bytes(rows, 24000, "PCM_16")
    assert audio_s == pytest.approx(sum(0.5 + len(r.target_text) / 14 for r in rows))
    assert need > audio_s * 24000 * 2  # samples plus headers and records
    monkeypatch.setattr(disk_estimate, "free_bytes", lambda p: need - 1)
    assert _run(man, FakeSynth(), tmp_path / "a").exit_code == 0  # a warning, not a refusal
    warned = [r.getMessage() for r in logs.records if "estimated from text length" in r.getMessage()]
    assert len(warned) == 1 and "4 row(s) need about" in warned[0] and "PCM_16 audio at 24000 Hz" in warned[0]
    logs.clear()
    monkeypatch.setattr(disk_estimate, "free_bytes", lambda p: need)
    _run(man, FakeSynth(), tmp_path / "b")
    assert not [r for r in logs.records if "estimated from text length" in r.getMessage()]


def test_audio_estimate_reads_cjk_slower_than_latin():
    assert estimated_audio_s("") == 0.5
    assert estimated_audio_s("a" * 140) == pytest.approx(10.5)
    assert estimated_audio_s("你好" * 20) == pytest.approx(10.5)


def test_a_synthesizer_that_breaks_down_stops_the_run_cleanly(tmp_path, logs):
    man = make_manifest(tmp_path, 4)
    out = tmp_path / "out"

    class Breaks(FakeSynth):
        def synthesize_batch(self, rows, stream):
            yield rows[0], FakeSynth.synthesize(self, rows[0], stream)
            raise RuntimeError("CUDA error: an illegal memory access")

    rep = _run(man, Breaks(), out)
    assert rep.exit_code == 1 and _ok_ids(out) == ["u0"]
    assert _errors(logs) == ["synthesizer failed: RuntimeError: CUDA error: an illegal memory access; "
                             "run stopped, finished rows are kept (--verbose for the traceback)"]
    end = _ledger(out)[-1]
    assert end["event"] == "run_end" and end["pending"] == 3 and "illegal memory access" in end["stopped"]


def test_invalid_rows_are_ledgered_and_strict_refuses(tmp_path):
    man = make_manifest(tmp_path, 2)
    with open(man, "a") as f:
        f.write("bad|P.|prompts/missing.wav|T.\nu0|dup.|prompts/a.wav|T.\n")
    out = tmp_path / "out"
    with pytest.raises(RunError, match="--strict"):
        _run(man, FakeSynth(), out, strict=True)
    assert not out.exists()
    rep = _run(man, FakeSynth(), out)
    assert rep.exit_code == 1 and rep.totals["invalid"] == 2 and rep.totals["ok"] == 2
    inv = [r for r in _ledger(out) if r["event"] == "invalid"]
    assert [(r["line"], r["utt_id"]) for r in inv] == [(3, "bad"), (4, "u0")]
    assert "not found" in inv[0]["reason"] and "duplicate" in inv[1]["reason"]
    assert _ok_ids(out) == ["u0", "u1"]  # the duplicate did not shadow the good u0


def test_resume_skips_done_rows_and_redoes_exactly_what_changed(tmp_path):
    man = make_manifest(tmp_path, 6)
    out = tmp_path / "out"
    assert _run(man, FakeSynth(), out).exit_code == 0
    synth = FakeSynth()
    rep = _run(man, synth, out)
    assert synth.calls == [] and rep.totals["skipped"] == 6 and rep.exit_code == 0
    t = json.loads((out / "timing.json").read_text())
    assert len(t["rows"]) == 6 and all(r["resumed"] for r in t["rows"]) and t["totals"]["audio_s"] > 0

    (out / "u0.wav").unlink()  # missing WAV
    with open(out / "u1.wav", "r+b") as f:  # WAV damaged behind our back
        f.truncate(100)
    text = man.read_text().replace("this is row 2.", "this is row two.")  # changed text
    man.write_text(text)
    later = time.time() + 5  # prompt b.wav replaced (rows u1, u3, u5 use it)
    os.utime(tmp_path / "prompts" / "b.wav", (later, later))
    synth = FakeSynth()
    assert _run(man, synth, out).exit_code == 0
    assert synth.calls == ["u0", "u1", "u2", "u3", "u5"]
    assert sorted(p.name for p in out.glob("*.wav")) == [f"u{i}.wav" for i in range(6)]

    synth = FakeSynth()
    assert _run(man, synth, out, overwrite=True).exit_code == 0
    assert synth.calls == [f"u{i}" for i in range(6)]


def test_change_explanation_is_not_fooled_by_json_types(tmp_path):
    man = make_manifest(tmp_path, 1)
    out = tmp_path / "out"

    class Tupled(FakeSynth):
        def fingerprint(self):
            return {**super().fingerprint(), "rates": (8, 5, 3)}

    assert _run(man, Tupled(), out).exit_code == 0
    assert _run(man, Tupled(), out).totals["skipped"] == 1
    with pytest.raises(SettingsChanged) as ei:
        _run(man, Tupled(freq=100.0), out)
    assert "freq" in str(ei.value) and "rates" not in str(ei.value)


@pytest.mark.parametrize("change", [{"synth": FakeSynth(freq=330.0)}, {"stream": True}])
def test_changed_setting_is_explained_not_mixed(tmp_path, change):
    man = make_manifest(tmp_path, 3)
    out = tmp_path / "out"
    assert _run(man, FakeSynth(), out).exit_code == 0
    before = (out / "ledger.jsonl").read_bytes()
    synth = change.get("synth", FakeSynth())
    with pytest.raises(SettingsChanged) as ei:
        _run(man, synth, out, stream=change.get("stream", False))
    msg = str(ei.value)
    assert "3 row(s) made with different settings" in msg and "--overwrite" in msg
    assert ("freq: 220.0 before, 330.0 now" in msg) if "synth" in change else ("stream: False before, True now" in msg)
    assert synth.calls == [] and (out / "ledger.jsonl").read_bytes() == before
    assert _run(man, synth, out, stream=change.get("stream", False), overwrite=True).exit_code == 0
    assert len(synth.calls) == 3


def test_interrupt_exits_130_with_consistent_ledger_then_resumes(tmp_path):
    man = make_manifest(tmp_path, 4)
    out = tmp_path / "out"
    rep = _run(man, FakeSynth(interrupt_at="u2"), out)
    assert rep.exit_code == 130
    assert _ok_ids(out) == ["u0", "u1"] and sorted(p.name for p in out.glob("*.wav")) == ["u0.wav", "u1.wav"]
    end = _ledger(out)[-1]
    assert end["event"] == "run_end" and end["interrupted"] is True and end["pending"] == 2
    t = json.loads((out / "timing.json").read_text())
    assert t["complete"] is False and t["interrupted"] is True and len(t["rows"]) == 2
    assert not [p for p in out.iterdir() if ".cbtmp" in p.name]
    synth = FakeSynth()
    assert _run(man, synth, out).exit_code == 0 and synth.calls == ["u2", "u3"]


@pytest.mark.parametrize("sig,code,word", [(signal.SIGINT, 130, "interrupted"),
                                           (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_a_real_signal_mid_run_keeps_finished_rows_and_sets_the_exit_code(tmp_path, logs, sig, code, word):
    man = make_manifest(tmp_path, 4)
    out = tmp_path / "out"
    with guard_signals() as guard:
        rep = _run(man, FakeSynth(kill=("u2", sig)), out)
        assert signal.getsignal(sig) is guard  # the runner put the handler back
    assert rep.exit_code == code
    assert _ok_ids(out) == ["u0", "u1"] and _ledger(out)[-1]["interrupted"] is True
    assert f"{word}: finished rows are kept; re-run the same command to resume" in logs.text


def test_second_writer_on_same_out_and_shard_is_refused(tmp_path):
    man = make_manifest(tmp_path, 2)
    out = tmp_path / "out"

    class Reentrant(FakeSynth):
        def synthesize(self, row, stream):
            with pytest.raises(RunError, match="another cosybatch synth"):
                _run(man, FakeSynth(), out)
            return super().synthesize(row, stream)

    assert _run(man, Reentrant(), out).exit_code == 0


def _rows(costs):
    return [ManifestRow(f"r{i:03d}", "p", Path("x.wav"), "t" * int(c * 15), line=i + 1, prompt_s=0.0)
            for i, c in enumerate(costs)]


def test_sharding_is_deterministic_disjoint_complete_and_balanced():
    rng = np.random.default_rng(0)
    rows = _rows(np.concatenate([rng.uniform(1, 5, 300), [200, 180, 150]]))
    a = assign(rows, 4)
    assert a == assign(list(rows), 4)
    parts = [select(rows, Shard(i, 4)) for i in range(4)]
    ids = [r.utt_id for p in parts for r in p]
    assert sorted(ids) == sorted(r.utt_id for r in rows)
    loads = [sum(estimated_cost(r) for r in p) for p in parts]
    assert max(loads) - min(loads) <= max(estimated_cost(r) for r in rows) * 0.05
    assert [r.line for r in parts[1]] == sorted(r.line for r in parts[1])  # manifest order kept
    assert select(rows, Shard(0, 1)) == rows


def test_shard_spec_and_environment():
    assert parse_shard("2/8") == Shard(2, 8)
    for bad in ("8/8", "-1/4", "1", "a/b", "0/0"):
        with pytest.raises(ShardError):
            parse_shard(bad)
    assert shard_from_env({}) == (Shard(0, 1), "default")
    assert shard_from_env({"RANK": "3", "WORLD_SIZE": "4"})[0] == Shard(3, 4)
    assert shard_from_env({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "4",
                           "SLURM_ARRAY_TASK_MIN": "2"})[0] == Shard(3, 4)
    assert shard_from_env({"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_COUNT": "4",
                           "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_STEP": "4"})[0] == Shard(2, 4)
    with pytest.raises(ShardError):
        shard_from_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_shards_share_an_out_folder_and_merge(tmp_path):
    man = make_manifest(tmp_path, 7)
    out = tmp_path / "out"
    codes = [_run(man, FakeSynth(fail={"u4"}), out, shard=Shard(i, 3)).exit_code for i in range(3)]
    assert sorted(p.name for p in out.glob("*.wav")) == [f"u{i}.wav" for i in range(7) if i != 4]
    assert sorted(p.name for p in out.glob("ledger*")) == [f"ledger.shard-{i}-of-3.jsonl" for i in range(3)]
    assert codes.count(1) == 1
    res = merge_outputs([out], out)
    assert res.path == out / "timing.json" and res.exit_code == 1
    assert (res.totals["ok"], res.totals["failed"], res.totals["shards"]) == (6, 1, 3)
    doc = json.loads(res.path.read_text())
    assert doc["merged"] is True and sorted(r["utt_id"] for r in doc["rows"]) == [f"u{i}" for i in range(7)]
    assert "u4" in doc["failed"]
    # An unsharded resume in the same folder sees every shard's work.
    synth = FakeSynth()
    assert _run(man, synth, out).exit_code == 0 and synth.calls == ["u4"]
    # Merging again does not double count the merged file, and never overwrites a source.
    res2 = merge_outputs([out], out)
    assert res2.path == out / "timing.merged.json" and res2.totals["ok"] == 7 and res2.totals["failed"] == 0


def test_merge_reports_missing_shards(tmp_path):
    man = make_manifest(tmp_path, 4)
    outs = [tmp_path / f"o{i}" for i in range(3)]
    for i in (0, 2):
        _run(man, FakeSynth(), outs[i], shard=Shard(i, 3))
    res = merge_outputs([outs[0], outs[2]], tmp_path / "merged")
    assert res.totals["missing_shards"] == ["1/3"] and res.exit_code == 1


def test_batch_synthesizer_results_in_completion_order(tmp_path):
    man = make_manifest(tmp_path, 5)

    class Batch(FakeSynth):
        def synthesize(self, row, stream):  # must not be used when synthesize_batch exists
            raise AssertionError("row-by-row path used")

        def synthesize_batch(self, rows, stream):
            for row in reversed(rows):
                if row.utt_id == "u3":
                    continue  # an engine bug: a row goes missing
                if row.utt_id == "u1":
                    yield row, RuntimeError("engine row error")
                    continue
                yield row, FakeSynth.synthesize(self, row, stream)
            yield rows[0], FakeSynth.synthesize(self, rows[0], stream)  # and one comes back twice

    out = tmp_path / "out"
    rep = _run(man, Batch(), out)
    assert rep.exit_code == 1 and sorted(rep.failed) == ["u1", "u3"]
    rows = {r["utt_id"]: r for r in _ledger(out) if r.get("event") == "row"}
    assert "no result" in rows["u3"]["reason"] and "engine row error" in rows["u1"]["reason"]
    assert _ok_ids(out) == ["u4", "u2", "u0"]
    t = json.loads((out / "timing.json").read_text())
    assert [r["utt_id"] for r in t["rows"]] == ["u0", "u1", "u2", "u3", "u4"]  # manifest order


def test_unwritable_out_is_a_run_error(tmp_path):
    man = make_manifest(tmp_path, 1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunError, match="cannot create output folder"):
        _run(man, FakeSynth(), tmp_path / "file" / "out")


def test_rows_are_committed_while_the_synthesizer_goes_on(tmp_path, monkeypatch):
    """A row's WAV is written beside the synthesizer's next step, not between two steps: the
    first write waits until the synthesizer has been asked for the next row. Committing on
    the synthesizer's thread would never get there (the wait times out and the test fails)."""
    man = make_manifest(tmp_path, 4)
    asked_again = threading.Event()
    waited = []
    real_write = rows_mod.write_audio_atomic

    def write_when_asked_again(*a, **kw):
        if not waited:
            waited.append(asked_again.wait(5))
        return real_write(*a, **kw)

    class Batch(FakeSynth):
        def synthesize_batch(self, rows, stream):
            for i, row in enumerate(rows):
                if i == 1:
                    asked_again.set()
                yield row, FakeSynth.synthesize(self, row, stream)

    monkeypatch.setattr(rows_mod, "write_audio_atomic", write_when_asked_again)
    out = tmp_path / "out"
    rep = _run(man, Batch(), out)
    assert waited == [True]
    assert rep.exit_code == 0 and _ok_ids(out) == ["u0", "u1", "u2", "u3"]
    assert _ledger(out)[-1]["event"] == "run_end" and _ledger(out)[-1]["ok"] == 4


def test_start_up_is_reported_beside_the_window_not_inside_it(tmp_path):
    """What building the synthesizer cost (its ``startup``) lands in timing.json's totals and the
    summary table, apart from wall_s, which times the rows alone."""
    from rich.console import Console

    from cosybatch.run.progress import summary_table

    man = make_manifest(tmp_path, 2)
    synth = FakeSynth()
    synth.startup = {"total_s": 41.5, "phases_s": {"models": 30.0, "AR engine": 11.5}}
    rep = run_synth(read_manifest(man), synth, tmp_path / "out", quiet=True)
    totals = json.loads((tmp_path / "out" / "timing.json").read_text())["totals"]
    assert totals["startup"] == synth.startup and totals["wall_s"] < 41.5
    console = Console(record=True, width=100)
    console.print(summary_table(totals))
    text = console.export_text()
    assert "start-up before the first row (s)" in text and "41.5" in text
    assert rep.exit_code == 0


def test_the_synthesizer_learns_the_run_size_before_the_window_and_its_start_up_follows(tmp_path):
    """A synthesizer with ``expect_rows`` is told how many rows are left before the window
    opens (FastSynthesizer captures flow graphs then, only for large runs): the start-up it
    reports afterwards is what timing.json carries; with nothing left to do it is not asked."""
    man = make_manifest(tmp_path, 3)
    told = []

    class Sized(FakeSynth):
        def expect_rows(self, n):
            told.append(n)
            self.startup = {"total_s": 2.5, "phases_s": {"models": 1.0, "flow graphs": 1.5}}

    synth = Sized()
    synth.startup = {"total_s": 1.0, "phases_s": {"models": 1.0}}
    out = tmp_path / "out"
    assert run_synth(read_manifest(man), synth, out, quiet=True).exit_code == 0
    assert told == [3]
    assert json.loads((out / "timing.json").read_text())["totals"]["startup"]["phases_s"]["flow graphs"] == 1.5
    assert run_synth(read_manifest(man), Sized(), out, quiet=True).exit_code == 0
    assert told == [3], "a run with every row done prepares nothing"


def test_fast_synth_captures_the_flow_band_only_for_runs_of_several_admissions():
    """``FastSynthesizer.expect_rows``: the profile's start-up flow captures happen for a run of
    at least ``PRECAPTURE_MIN_JOBS`` codec admissions' worth of rows, and then count as start-up."""
    from types import SimpleNamespace

    from cosybatch.scheduler.startup import StartupClock
    from cosybatch.synthesizers import PRECAPTURE_MIN_JOBS, FastSynthesizer

    class Pipe:
        settings = SimpleNamespace(codec=SimpleNamespace(max_num_seqs=8))
        startup = StartupClock()
        captured = 0

        def precapture_flow_graphs(self):
            self.captured += 1
            with self.startup.phase("flow graphs"):
                pass

    fs = FastSynthesizer.__new__(FastSynthesizer)
    fs.pipeline, fs.startup = Pipe(), {}
    fs.expect_rows(PRECAPTURE_MIN_JOBS * 8 - 1)
    assert fs.pipeline.captured == 0 and fs.startup == {}
    fs.expect_rows(PRECAPTURE_MIN_JOBS * 8)
    assert fs.pipeline.captured == 1 and "flow graphs" in fs.startup["phases_s"]


def test_startup_clock_times_phases_and_the_process_before_them():
    import torch

    from cosybatch.scheduler.startup import StartupClock, process_age_s

    age = process_age_s()
    assert age is None or 0 < age < 24 * 3600
    clock = StartupClock(torch.device("cpu"))
    with clock.phase("models"):
        time.sleep(0.02)
    with clock.phase("models"):  # a phase entered twice adds up
        time.sleep(0.01)
    assert 0.03 <= clock.phases["models"] < 0.5
    assert clock.total_s == pytest.approx(sum(clock.phases.values()), abs=1e-3)
    assert ("process start and imports" in clock.phases) == (age is not None)
    assert clock.as_dict()["phases_s"]["models"] == clock.phases["models"]


def test_a_first_run_on_a_machine_is_told_apart_by_triton_s_cache(tmp_path, monkeypatch):
    """``kernel_cache_state``: "cold" while Triton's cache holds none of the package's kernels
    (an empty, missing or foreign-only cache; ``TRITON_CACHE_DIR`` is followed); "partial" once
    one is there but the launch list's helpers did not all finish (no marker of every share of
    one split, for this list: another list's markers do not count); "warm" when they did. The
    summary says when a run compiled its kernels, all or some."""
    from rich.console import Console

    from cosybatch.gpu.triton_cache import done_marker, kernel_cache_state, list_digest, triton_cache_dir
    from cosybatch.run.progress import summary_table

    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    assert triton_cache_dir() == cache and kernel_cache_state() == "cold"
    (cache / "AAAA").mkdir(parents=True)
    (cache / "AAAA" / "some_other_kernel.json").write_text("{}")
    assert kernel_cache_state() == "cold"
    (cache / "BBBB").mkdir()
    (cache / "BBBB" / "_conv1d_kernel.json").write_text("{}")
    assert kernel_cache_state() == "partial"
    digest = list_digest()
    assert len(digest) == 20
    other = tmp_path / "other.json"
    other.write_text('[{"kernel": "cosybatch.codec.triton_conv:_conv1d_kernel", "args": [], "kwargs": {}}]')
    assert list_digest(other) not in ("", digest)
    for i in range(3):
        done_marker(cache, list_digest(other), i, 3).touch()  # another list compiled whole
    done_marker(cache, digest, 0, 3).touch()
    done_marker(cache, digest, 2, 3).touch()
    assert kernel_cache_state() == "partial"  # share 1 of 3 not done
    done_marker(cache, digest, 0, 2).touch()
    assert kernel_cache_state() == "partial"  # nor a split of 2's share 1
    done_marker(cache, digest, 1, 3).touch()
    assert kernel_cache_state() == "warm"
    assert kernel_cache_state(path=tmp_path / "none.json") == "warm"  # no list: nothing to compile
    for state, shown in (("cold", "compiled during this run"), ("partial", "the rest compiled beside this run"),
                         ("warm", None)):
        console = Console(record=True, width=120)
        console.print(summary_table({"ok": 1, "startup": {"total_s": 1.0, "kernel_cache": state}}))
        text = console.export_text()
        assert (shown in text) if shown else ("compiled during" not in text)


def test_an_encoder_started_before_the_synthesizer_encodes_the_rows_of_one_that_drives_a_gpu(tmp_path):
    """``run_synth(encoder=...)``: the helper the caller started early encodes every row of a
    synthesizer with ``helper_processes`` (none is started in its place), and none of one without."""
    class Encoder:
        alive = True

        def __init__(self):
            self.calls = 0

        def run(self, fn, *args):
            self.calls += 1
            return fn(*args)

        def close(self):
            pass

    class OnGpuThread(FakeSynth):
        helper_processes = True

    man = make_manifest(tmp_path, 3)
    enc = Encoder()
    assert run_synth(read_manifest(man), OnGpuThread(), tmp_path / "a", quiet=True, encoder=enc).exit_code == 0
    assert enc.calls == 3 and len(_ok_ids(tmp_path / "a")) == 3
    enc = Encoder()
    assert run_synth(read_manifest(man), FakeSynth(), tmp_path / "b", quiet=True, encoder=enc).exit_code == 0
    assert enc.calls == 0 and len(_ok_ids(tmp_path / "b")) == 3


def test_a_run_whose_imports_compile_source_every_time_is_told(tmp_path, monkeypatch, caplog):
    """``bytecode_state``: "missing" when an imported module left no bytecode where the next
    process looks for it (``PYTHONDONTWRITEBYTECODE``, or a folder it cannot write), "cached"
    once it is there (beside the source or under ``PYTHONPYCACHEPREFIX``); the start-up clock
    records it, says it once in the log, and the summary names it."""
    import importlib
    import logging
    import sys

    from rich.console import Console

    from cosybatch.run.progress import summary_table
    from cosybatch.scheduler import startup

    (tmp_path / "cb_bytecode_probe").mkdir()
    (tmp_path / "cb_bytecode_probe" / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    importlib.invalidate_caches()
    importlib.import_module("cb_bytecode_probe")
    monkeypatch.delitem(sys.modules, "cb_bytecode_probe")
    assert not (tmp_path / "cb_bytecode_probe" / "__pycache__").exists()
    assert startup.bytecode_state("cb_bytecode_probe") == "missing"
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "pyc"))  # PYTHONPYCACHEPREFIX
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert startup.bytecode_state("cb_bytecode_probe") == "missing"  # not there yet
    importlib.import_module("cb_bytecode_probe")  # writes it
    assert any((tmp_path / "pyc").rglob("*.pyc"))
    assert startup.bytecode_state("cb_bytecode_probe") == "cached"

    monkeypatch.setattr(startup, "bytecode_state", lambda module="torch": "missing")
    monkeypatch.setattr(startup, "_told_bytecode", False)
    with caplog.at_level(logging.WARNING, logger="cosybatch.scheduler.startup"):
        clocks = [startup.StartupClock(None) for _ in range(2)]
    assert caplog.text.count("every run compiles its source again") == 1
    assert all(c.as_dict()["bytecode"] == "missing" for c in clocks)
    for state, shown in (("missing", True), ("cached", False)):
        console = Console(record=True, width=120)
        console.print(summary_table({"ok": 1, "startup": {"total_s": 1.0, "bytecode": state}}))
        assert ("compiled from source" in console.export_text()) == shown


def test_the_command_keeps_bytecode_in_a_cache_folder_where_every_run_would_compile_torch_again(tmp_path, monkeypatch):
    """``run.bytecode.keep_bytecode``: where the probed package has no bytecode beside its source
    and this process would write none (``PYTHONDONTWRITEBYTECODE``, or a read-only folder), every
    later import keeps its bytecode under ``COSYBATCH_PYCACHE`` (else the user's cache folder),
    and so do child processes; nothing changes where bytecode is installed, where this process
    writes it beside the source, under a ``PYTHONPYCACHEPREFIX`` of the user's, or with
    ``COSYBATCH_PYCACHE=off``."""
    import importlib
    import py_compile
    import subprocess
    import sys

    from cosybatch.run.bytecode import default_folder, keep_bytecode

    pkg = tmp_path / "src" / "cb_keep_probe"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    importlib.invalidate_caches()
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    kept = tmp_path / "kept"

    assert keep_bytecode({"COSYBATCH_PYCACHE": "off"}, "cb_keep_probe") is None and sys.pycache_prefix is None
    (tmp_path / "a_file").write_text("")
    assert keep_bytecode({"COSYBATCH_PYCACHE": str(tmp_path / "a_file" / "sub")}, "cb_keep_probe") is None  # no folder
    def no_home(cls):
        raise RuntimeError("Could not determine home directory.")

    with monkeypatch.context() as m:
        m.setattr(Path, "home", classmethod(no_home))
        assert keep_bytecode({}, "cb_keep_probe") is None and sys.pycache_prefix is None  # nowhere to keep it
    assert default_folder({"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "cosybatch" / "pycache"
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # this run writes it beside the source
    assert keep_bytecode({"COSYBATCH_PYCACHE": str(kept)}, "cb_keep_probe") is None
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert keep_bytecode({"COSYBATCH_PYCACHE": str(kept)}, "cb_keep_probe") == kept
    assert sys.pycache_prefix == str(kept) and not sys.dont_write_bytecode
    assert os.environ["PYTHONPYCACHEPREFIX"] == str(kept) and "PYTHONDONTWRITEBYTECODE" not in os.environ
    importlib.import_module("cb_keep_probe")
    monkeypatch.delitem(sys.modules, "cb_keep_probe")
    assert list(kept.rglob("cb_keep_probe/__init__*.pyc")) and not (pkg / "__pycache__").exists()
    assert keep_bytecode({"COSYBATCH_PYCACHE": str(tmp_path / "other")}, "cb_keep_probe") is None  # a prefix is set
    # a child process of the command's reads and writes there too
    probe = "import sys, cb_keep_probe; print(sys.pycache_prefix, sys.flags.dont_write_bytecode)"
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(tmp_path / "src")})
    assert child.stdout.split() == [str(kept), "0"], child.stderr

    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    py_compile.compile(str(pkg / "__init__.py"), cfile=importlib.util.cache_from_source(str(pkg / "__init__.py")))
    assert keep_bytecode({"COSYBATCH_PYCACHE": str(tmp_path / "third")}, "cb_keep_probe") is None  # installed
    assert not (tmp_path / "third").exists()


def test_the_command_module_keeps_bytecode_before_its_heavy_imports():
    """``cosybatch.cli`` calls ``keep_bytecode`` at import, before click, numpy and the rest: a
    fresh interpreter that imports it with ``PYTHONDONTWRITEBYTECODE`` set and torch's bytecode
    missing would otherwise compile them all (checked here by the order of its statements)."""
    import ast
    import inspect

    import cosybatch.cli as cli

    body = ast.parse(inspect.getsource(cli)).body
    call = next(i for i, n in enumerate(body) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                and getattr(n.value.func, "id", None) == "keep_bytecode")
    first_heavy = next(i for i, n in enumerate(body) if isinstance(n, (ast.Import, ast.ImportFrom))
                       and any(a.name in ("click", "numpy", "torch") for a in n.names)
                       or isinstance(n, ast.ImportFrom) and (n.module or "").startswith(("cosybatch.manifest", "cosybatch.output")))
    assert call < first_heavy
