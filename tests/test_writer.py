"""Atomic WAV/JSON writes, the append-only ledger and timing.json rewrites."""

from __future__ import annotations

import errno
import io
import json
import os
import struct

import numpy as np
import pytest
import soundfile as sf

from cosybatch.atomic import OutputFault, remove_stale_tmp
from cosybatch.output.audio_files import encode_wav, wav_size, write_wav_atomic
from cosybatch.output.ledger import Ledger, latest_rows, read_ledger, read_ledgers
from cosybatch.output.timing import TimingWriter
from fake_disk import FullDisk, install as install_disk


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


def _soundfile_bytes(audio, sr, subtype):
    buf = io.BytesIO()
    sf.write(buf, audio, sr, subtype=subtype, format="WAV")
    return buf.getvalue()


def _edge_samples():
    # Every quarter step of the 16-bit grid and the float32 neighbours of each: rounding and
    # saturation at +-1 are where a hand-written conversion would differ.
    k = np.arange(-32768 * 4 - 8, 32768 * 4 + 8) / (4 * 32768.0)
    return np.clip(np.concatenate([k, np.nextafter(k, 2), np.nextafter(k, -2)]), -1, 1).astype(np.float32)


@pytest.mark.parametrize("subtype", ["PCM_16", "FLOAT"])
@pytest.mark.parametrize("case", ["tone", "noise", "edges", "one", "silence", "odd"])
def test_wav_bytes_equal_what_soundfile_writes(subtype, case):
    rng = np.random.default_rng(7)
    audio = {"tone": _tone(24000), "noise": rng.uniform(-1, 1, 4801).astype(np.float32), "edges": _edge_samples(),
             "one": np.array([-0.25], np.float32), "silence": np.zeros(100, np.float32),
             "odd": np.array([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1e-30, -0.5], np.float32)}[case]
    ref = _soundfile_bytes(audio, 24000, subtype)
    # FLOAT's PEAK chunk carries the time of writing (bytes 60..64); take soundfile's.
    stamp = struct.unpack_from("<I", ref, 60)[0] if subtype == "FLOAT" else None
    header, data = encode_wav(audio, 24000, subtype, timestamp=stamp)
    assert header + data == ref
    assert len(ref) == wav_size(len(audio), subtype)


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

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OutputFault) as ei:
        write_wav_atomic(final, _tone(n=9999), 24000)
    assert str(ei.value) == f"cannot write {final}: no space left on device"
    assert final.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["u1.wav"]


@pytest.mark.parametrize("nth,partial", [(1, 0), (2, 1000)])  # in the header; part-way through the samples
@pytest.mark.parametrize("err,reason", [(errno.ENOSPC, "no space left on device"),
                                        (errno.EDQUOT, "disk quota exceeded"), (errno.EIO, "input/output error")])
def test_wav_on_a_full_disk_is_one_output_fault_and_no_temp(tmp_path, monkeypatch, nth, partial, err, reason):
    disk = FullDisk("u1.wav", nth=nth, partial=partial, err=err)
    install_disk(monkeypatch, disk)
    with pytest.raises(OutputFault) as ei:
        write_wav_atomic(tmp_path / "u1.wav", _tone(n=24000), 24000)
    assert (ei.value.path, ei.value.errno, ei.value.reason) == (tmp_path / "u1.wav", err, reason)
    assert disk.failed_writes == 1 and os.listdir(tmp_path) == []


def test_a_file_problem_that_is_not_the_disk_stays_an_oserror(tmp_path):
    (tmp_path / "u1.wav").mkdir()  # something in the way of this one name
    with pytest.raises(OSError) as ei:
        write_wav_atomic(tmp_path / "u1.wav", _tone(), 24000)
    assert not isinstance(ei.value, OutputFault) and ei.value.errno == errno.EISDIR
    assert os.listdir(tmp_path) == ["u1.wav"]  # the temp file is gone


def test_interrupt_mid_write_never_exposes_a_partial_final_name(tmp_path, monkeypatch):
    real_replace = os.replace
    seen = {}

    def spy_replace(src, dst):
        # At rename time the temp file must already be complete and readable.
        seen["frames"] = sf.info(str(src)).frames
        seen["hidden"] = os.path.basename(src).startswith(".")
        assert not os.path.exists(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy_replace)
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
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
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


@pytest.mark.parametrize("partial", [0, 7])
def test_ledger_append_on_a_full_disk_leaves_whole_lines_only(tmp_path, monkeypatch, partial):
    path = tmp_path / "ledger.jsonl"
    with Ledger(path) as led:
        led.append({"event": "row", "utt_id": "a", "status": "ok"})
    before = path.read_bytes()
    disk = FullDisk("ledger.jsonl", nth=1, partial=partial)
    install_disk(monkeypatch, disk)
    with Ledger(path) as led:
        with pytest.raises(OutputFault, match=f"cannot write {path}: no space left on device"):
            led.append({"event": "row", "utt_id": "b", "status": "ok"})
        assert path.read_bytes() == before  # the part that got written was cut off again
        disk.free()
        led.append({"event": "row", "utt_id": "c", "status": "ok"})
    assert [r["utt_id"] for r in read_ledger(path)] == ["a", "c"]
    assert path.read_bytes().count(b"\n") == 2


def test_ledger_that_cannot_be_opened_is_an_output_fault(tmp_path):
    (tmp_path / "ledger.jsonl").mkdir()
    with pytest.raises(OutputFault, match="ledger.jsonl"):
        Ledger(tmp_path / "ledger.jsonl")


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


def test_timing_rewrite_on_a_full_disk_keeps_the_previous_file(tmp_path, monkeypatch):
    tw = TimingWriter(tmp_path / "timing.json", min_interval_s=0)
    tw.write({"v": 1})
    install_disk(monkeypatch, FullDisk("timing.json", nth=1, partial=3))
    with pytest.raises(OutputFault, match="timing.json: no space left on device"):
        tw.write({"v": 2, "rows": list(range(1000))})
    assert json.loads((tmp_path / "timing.json").read_text()) == {"v": 1}
    assert os.listdir(tmp_path) == ["timing.json"]
