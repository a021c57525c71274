"""Atomic WAV/JSON writes, the append-only ledger and timing.json rewrites."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import soundfile as sf

from cosybatch import writer
from cosybatch.writer import (Ledger, TimingWriter, latest_rows, read_ledger, read_ledgers,
                              remove_stale_tmp, write_wav_atomic)


def _tone(n=2400, amp=0.5):
    return (amp * np.sin(np.arange(n) * 0.05)).astype(np.float32)


@pytest.mark.parametrize("subtype,sf_subtype,tol", [("PCM_16", "PCM_16", 1 / 32767 + 1e-6), ("FLOAT", "FLOAT", 0.0)])
def test_wav_roundtrip_and_subtype(tmp_path, subtype, sf_subtype, tol):
    audio = _tone()
    size = write_wav_atomic(tmp_path / "u1.wav", audio, 24000, subtype)
    info = sf.info(str(tmp_path / "u1.wav"))
    assert (info.samplerate, info.channels, info.frames, info.subtype) == (24000, 1, len(audio), sf_subtype)
    assert size == os.path.getsize(tmp_path / "u1.wav")
    back, _ = sf.read(str(tmp_path / "u1.wav"), dtype="float32")
    assert np.max(np.abs(back - audio)) <= tol
    assert sorted(os.listdir(tmp_path)) == ["u1.wav"]  # no temp file left


def test_pcm16_clips_instead_of_wrapping(tmp_path):
    write_wav_atomic(tmp_path / "loud.wav", np.array([2.0, -3.0, 0.5], np.float32), 16000, "PCM_16")
    back, _ = sf.read(str(tmp_path / "loud.wav"), dtype="float32")
    assert back[0] > 0.99 and back[1] < -0.99 and abs(back[2] - 0.5) < 1e-4


def test_bad_subtype_rejected(tmp_path):
    with pytest.raises(ValueError, match="PCM_16"):
        write_wav_atomic(tmp_path / "x.wav", _tone(), 24000, "PCM_24")


def test_failure_mid_write_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    final = tmp_path / "u1.wav"
    write_wav_atomic(final, _tone(amp=0.1), 24000)
    before = final.read_bytes()

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer.os, "fsync", boom)
    with pytest.raises(OSError, match="No space"):
        write_wav_atomic(final, _tone(n=9999), 24000)
    assert final.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["u1.wav"]


def test_interrupt_mid_write_never_exposes_a_partial_final_name(tmp_path, monkeypatch):
    real_replace = os.replace
    seen = {}

    def spy_replace(src, dst):
        # At rename time the temp file must already be complete and readable.
        seen["frames"] = sf.info(str(src)).frames
        seen["hidden"] = os.path.basename(src).startswith(".")
        assert not os.path.exists(dst)
        real_replace(src, dst)

    monkeypatch.setattr(writer.os, "replace", spy_replace)
    write_wav_atomic(tmp_path / "u2.wav", _tone(n=4800), 24000)
    assert seen == {"frames": 4800, "hidden": True}


def test_stale_temp_files_are_removed_only_for_own_tag(tmp_path):
    (tmp_path / ".u1.wav.cbtmp").write_bytes(b"partial")
    (tmp_path / ".u2.wav.cbtmp.shard-1-of-2").write_bytes(b"partial")
    (tmp_path / "u3.wav").write_bytes(b"keep")
    assert remove_stale_tmp(tmp_path, "") == 1
    assert sorted(os.listdir(tmp_path)) == [".u2.wav.cbtmp.shard-1-of-2", "u3.wav"]
    assert remove_stale_tmp(tmp_path, ".shard-1-of-2") == 1


def test_ledger_appends_fsynced_lines_and_survives_a_torn_tail(tmp_path, monkeypatch):
    path = tmp_path / "ledger.jsonl"
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(writer.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    with Ledger(path) as led:
        led.append({"event": "row", "utt_id": "a", "status": "ok"})
        led.append({"event": "row", "utt_id": "b", "status": "failed", "reason": "x"})
    assert len(synced) == 2
    with open(path, "ab") as f:  # what kill -9 in the middle of a write leaves
        f.write(b'{"event": "row", "utt_id": "c", "sta')
    with Ledger(path) as led:
        led.append({"event": "row", "utt_id": "a", "status": "failed", "reason": "redo"})
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 5
    recs = list(read_ledger(path))
    assert [r["utt_id"] for r in recs] == ["a", "b", "a"]
    assert all(isinstance(r["time"], float) for r in recs)
    latest = latest_rows(read_ledgers(tmp_path))
    assert latest["a"]["status"] == "failed" and latest["b"]["reason"] == "x"


def test_ledger_rejects_nan_rather_than_writing_invalid_json(tmp_path):
    with Ledger(tmp_path / "ledger.jsonl") as led, pytest.raises(ValueError):
        led.append({"x": float("nan")})
    assert (tmp_path / "ledger.jsonl").read_bytes() == b""


def test_read_ledgers_merges_shard_files_by_time(tmp_path):
    (tmp_path / "ledger.shard-0-of-2.jsonl").write_text(
        json.dumps({"time": 2.0, "event": "row", "utt_id": "a", "status": "ok"}) + "\n")
    (tmp_path / "ledger.jsonl").write_text(
        json.dumps({"time": 1.0, "event": "row", "utt_id": "a", "status": "failed"}) + "\n"
        + json.dumps({"time": 3.0, "event": "row", "utt_id": "b", "status": "ok"}) + "\n")
    latest = latest_rows(read_ledgers(tmp_path))
    assert latest["a"]["status"] == "ok" and latest["b"]["status"] == "ok"


def test_timing_writer_is_atomic_and_rate_limited(tmp_path):
    tw = TimingWriter(tmp_path / "timing.json", min_interval_s=3600)
    assert tw.due()
    tw.write({"rows": [1, 2], "v": 1})
    assert not tw.due()
    tw.write({"rows": [], "v": 2})
    assert json.loads((tmp_path / "timing.json").read_text()) == {"rows": [], "v": 2}
    assert os.listdir(tmp_path) == ["timing.json"]
