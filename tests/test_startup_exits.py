"""How `cosybatch synth` ends before its first row: Ctrl-C while the synthesizer is being
built, and the configuration errors that must be found before any model work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import fake_synth
from cosybatch.cli import cli
from cosybatch.profiles.schema import LEAVES
from fake_synth import make_manifest
from helpers import signal_when_ready

REPO = Path(__file__).resolve().parents[1]
PROFILED = ["--synthesizer", "fake_synth:build_profiled"]


def _spawn(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    return subprocess.Popen([sys.executable, "-m", "cosybatch", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    t_end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"exited before the build started: {proc.communicate()[1][-2000:]}")
        if time.monotonic() > t_end:
            raise AssertionError("the build never started")
        time.sleep(0.01)


@pytest.mark.parametrize("sig,code,word", [(signal.SIGINT, 130, "interrupted"),
                                           (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_a_signal_while_the_synthesizer_is_built_exits_cleanly(tmp_path, sig, code, word):
    """The build sits in a step that turns any exception into ImportError, as a native
    extension's initialization does (onnxruntime's); the signal still decides the exit."""
    man = make_manifest(tmp_path, 2)
    out, ready = tmp_path / "out", tmp_path / "building"
    proc = _spawn("synth", str(man), "--out", str(out), "--synthesizer", "fake_synth:build",
                  "--set", f"setup_ready={ready}", "--set", "setup_sleep=60")
    err = signal_when_ready(proc, lambda: _wait_for(ready, proc), sig, 30)
    assert proc.returncode == code, err
    assert word in err and "Traceback" not in err
    assert "cannot set up" not in err and "initialization failed" not in err
    assert not out.exists()  # nothing was started


def _invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def built():
    fake_synth.BUILT.clear()
    yield fake_synth.BUILT
    fake_synth.BUILT.clear()


def _one_error(stderr: str) -> str:
    errors = [ln for ln in stderr.splitlines() if "ERROR" in ln]
    assert len(errors) == 1, stderr
    return errors[0]


def test_the_profiled_factory_is_built_when_all_is_well(tmp_path, built):
    """The factory the tests below rely on records its calls (else they would prove nothing)."""
    man = make_manifest(tmp_path, 1)
    res = _invoke("synth", man, "--out", tmp_path / "out", *PROFILED, "--set", "ar.max_num_seqs=4", "-q")
    assert res.exit_code == 0, res.stderr
    assert len(built) == 1


@pytest.mark.parametrize("case", ["a file", "under a file"])
def test_an_unwritable_output_folder_exits_2_before_the_synthesizer_is_built(tmp_path, built, case):
    man = make_manifest(tmp_path, 1)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder\n")
    out = blocker if case == "a file" else blocker / "out"
    res = _invoke("synth", man, "--out", out, *PROFILED)
    assert res.exit_code == 2
    assert str(out) in res.stderr and "Traceback" not in res.stderr
    assert built == []


@pytest.mark.parametrize("args,words", [
    (["--set", "ar.max_num_seqs=lots"], "ar.max_num_seqs: expected an integer"),
    (["--set", "ar.max_num_seq=4"], "unknown key 'ar.max_num_seq'"),
    (["--profile", "no-such-profile"], "unknown profile 'no-such-profile'"),
])
def test_profile_and_set_errors_exit_2_before_the_synthesizer_is_built(tmp_path, built, args, words):
    man = make_manifest(tmp_path, 1)
    out = tmp_path / "out"
    res = _invoke("synth", man, "--out", out, *PROFILED, *args)
    assert res.exit_code == 2
    assert words in _one_error(res.stderr) and "Traceback" not in res.stderr
    assert built == [] and not out.exists()


def test_an_unknown_set_key_lists_the_valid_keys(tmp_path, built):
    man = make_manifest(tmp_path, 1)
    res = _invoke("synth", man, "--out", tmp_path / "out", *PROFILED, "--set", "sampling.temprature=0.5")
    err = _one_error(res.stderr)
    assert res.exit_code == 2 and "did you mean 'sampling.temperature'" in err
    assert all(k in err for k in LEAVES if k.startswith("sampling."))
    res = _invoke("synth", man, "--out", tmp_path / "out", *PROFILED, "--set", "turbo=1")
    err = _one_error(res.stderr)
    assert res.exit_code == 2 and all(k in err for k in LEAVES)  # no group to go by: every key


def test_ctrl_c_while_the_workers_build_their_synthesizers_exits_130(tmp_path):
    """--workers: the parent forwards Ctrl-C to workers still inside set-up; each stops as
    interrupted, none reports a broken synthesizer."""
    man = make_manifest(tmp_path, 4)
    out, ready = tmp_path / "out", tmp_path / "building"
    proc = _spawn("synth", str(man), "--out", str(out), "--synthesizer", "fake_synth:build", "--device", "cpu",
                  "--workers", "2", "--set", f"setup_ready={ready}", "--set", "setup_sleep=60")
    err = signal_when_ready(proc, lambda: _wait_for(ready, proc), signal.SIGINT, 60)
    assert proc.returncode == 130, err
    assert "cannot set up" not in err and "initialization failed" not in err and "Traceback" not in err
