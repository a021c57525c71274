"""What `cosybatch synth` answers when a long run meets a fault: a full disk, a signal, bad audio.

Around the fake synthesizer (``--synthesizer fake_synth:build``); the same faults on the
real tiny checkpoint are in test_signals_real.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from cosybatch.cli import cli
from fake_disk import FullDisk, install as install_disk
from fake_synth import guard_signals, make_manifest

REPO = Path(__file__).resolve().parents[1]
FAKE = ["--synthesizer", "fake_synth:build"]


def _invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _ledger(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]


def _ok_ids(out: Path) -> list[str]:
    return [r["utt_id"] for r in _ledger(out) if r.get("event") == "row" and r["status"] == "ok"]


@pytest.fixture
def signal_guard():
    with guard_signals():
        yield


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if " ERROR " in ln]


@pytest.mark.parametrize("case,args,code", [
    ("all ok", [], 0),
    ("a row fails", ["--set", "fail=u1"], 1),
    ("Ctrl-C", ["--set", "kill=u1:INT"], 130),
    ("SIGTERM", ["--set", "kill=u1:TERM"], 143),
    ("settings changed", ["--set", "freq=300"], 2),
])
def test_every_way_out_closes_the_synthesizer_once(tmp_path, signal_guard, case, args, code):
    man = make_manifest(tmp_path, 3)
    out, closed = tmp_path / "out", tmp_path / "closed.txt"
    if case == "settings changed":
        assert _invoke("synth", man, "--out", out, *FAKE, "-q").exit_code == 0
    res = _invoke("synth", man, "--out", out, *FAKE, "--set", f"closed={closed}", *args)
    assert res.exit_code == code, res.stderr
    assert closed.read_text() == "closed\n"
    assert "Traceback" not in res.stderr


def test_full_disk_is_one_line_exit_1_closed_and_resumable(tmp_path, monkeypatch):
    man = make_manifest(tmp_path, 4)
    out, closed, calls = tmp_path / "out", tmp_path / "closed.txt", tmp_path / "calls.txt"
    install_disk(monkeypatch, FullDisk("u2.wav", partial=100))
    res = _invoke("synth", man, "--out", out, *FAKE, "--set", f"closed={closed}")
    assert res.exit_code == 1
    errors = _error_lines(res.stderr)
    assert len(errors) == 1, res.stderr
    assert f"cannot write {out / 'u2.wav'}: no space left on device; run stopped, 2 finished row(s) kept" in errors[0]
    assert "Traceback" not in res.stderr and "rows ok" in res.stderr  # the summary, no traceback
    assert closed.read_text() == "closed\n"
    install_disk(monkeypatch, os)
    res = _invoke("synth", man, "--out", out, *FAKE, "--set", f"calls={calls}", "-q")
    assert res.exit_code == 0 and calls.read_text().split() == ["u2", "u3"]


def test_full_disk_traceback_only_with_verbose(tmp_path, monkeypatch):
    man = make_manifest(tmp_path, 2)
    install_disk(monkeypatch, FullDisk("u1.wav"))
    res = _invoke("synth", man, "--out", tmp_path / "out", *FAKE, "-v")
    assert res.exit_code == 1 and "Traceback" in res.stderr and "OSError: [Errno 28]" in res.stderr


def test_non_finite_and_empty_audio_fail_alone_with_the_reason(tmp_path):
    man = make_manifest(tmp_path, 5)
    out = tmp_path / "out"
    res = _invoke("synth", man, "--out", out, *FAKE, "--set", "nan=u1", "--set", "inf=u2", "--set", "empty=u3", "-q")
    assert res.exit_code == 1
    assert "u1 (line 2) failed: ValueError: non-finite audio (1 NaN/inf samples)" in res.stderr
    assert "u2 (line 3) failed: ValueError: non-finite audio (1 NaN/inf samples)" in res.stderr
    assert "u3 (line 4) failed: ValueError: empty audio" in res.stderr
    assert "3 row(s) failed: u1, u2, u3" in res.stderr
    assert sorted(_ok_ids(out)) == ["u0", "u4"] and sorted(p.stem for p in out.glob("*.wav")) == ["u0", "u4"]


def test_sigterm_while_the_model_loads_exits_143(tmp_path, signal_guard):
    man = make_manifest(tmp_path, 1)
    res = _invoke("synth", man, "--out", tmp_path / "out", *FAKE, "--set", "setup_kill=TERM")
    assert res.exit_code == 143 and "terminated (SIGTERM)" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()


def _run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    return subprocess.run([sys.executable, "-m", "cosybatch.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_thread_left_running_does_not_reach_interpreter_exit(tmp_path):
    # The last line of defence in main(): a daemon thread still alive (here one that close()
    # does not stop) means leaving without interpreter finalization, keeping the exit code.
    man = make_manifest(tmp_path, 2)
    res = _run_cli("synth", str(man), "--out", str(tmp_path / "out"), *FAKE, "--set", "straggler=1",
                   "--set", "fail=u1", "-v")
    assert res.returncode == 1, res.stderr
    assert "exiting without waiting for 1 thread(s) still running: cosybatch-fake-straggler" in res.stderr


# ---- a real full filesystem: a 192 KiB tmpfs --------------------------------------------------

@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 192 KiB tmpfs (needs root and a kernel that lets this process mount)."""
    where = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(where)],
                         capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip() or res.returncode}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def test_a_real_full_filesystem_then_resume_after_freeing_space(tmp_path, tiny_tmpfs):
    man = make_manifest(tmp_path, 8)  # ~35 KB per FLOAT WAV: the 192 KiB fill up after a few
    out, calls = tiny_tmpfs / "out", tmp_path / "calls.txt"
    res = _run_cli("synth", str(man), "--out", str(out), *FAKE, "--wav-subtype", "FLOAT", "--set", f"calls={calls}")
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr and "terminate called" not in res.stderr
    assert "cffi" not in res.stderr
    errors = _error_lines(res.stderr)
    assert len(errors) == 1 and "no space left on device; run stopped" in errors[0], res.stderr
    assert "estimated from text length" in res.stderr  # the warning before the first row
    done = _ok_ids(out)
    assert 0 < len(done) < 8 and sorted(p.stem for p in out.glob("*.wav")) == sorted(done)
    assert not [p.name for p in out.iterdir() if ".cbtmp" in p.name]

    # Free space (grow the filesystem) and run the same command again.
    subprocess.run(["mount", "-o", "remount,size=4m", str(tiny_tmpfs)], check=True, timeout=30)
    calls.write_text("")
    res = _run_cli("synth", str(man), "--out", str(out), *FAKE, "--wav-subtype", "FLOAT", "--set", f"calls={calls}",
                   "-q")
    assert res.returncode == 0, res.stderr
    assert sorted(calls.read_text().split()) == sorted({f"u{i}" for i in range(8)} - set(done))
    assert sorted(_ok_ids(out)) == [f"u{i}" for i in range(8)]
    assert sorted(p.stem for p in out.glob("*.wav")) == [f"u{i}" for i in range(8)]
