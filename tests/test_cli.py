"""The cosybatch command through click's CliRunner, plus real-process kill/interrupt tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from click.testing import CliRunner

from cosybatch import cli as cli_mod
from cosybatch.cli import cli
from fake_synth import expected_audio, make_manifest

REPO = Path(__file__).resolve().parents[1]
FAKE = ["--synthesizer", "fake_synth:build"]


def _invoke(*args, env=None):
    return CliRunner().invoke(cli, [str(a) for a in args], env=env, catch_exceptions=False)


def _ledger(out: Path, name: str = "ledger.jsonl") -> list[dict]:
    return [json.loads(x) for x in (out / name).read_text().splitlines()]


def _ok_ids(out: Path) -> list[str]:
    return [r["utt_id"] for r in _ledger(out) if r.get("event") == "row" and r["status"] == "ok"]


@pytest.mark.parametrize("code,rc,err", [(None, 0, ""), (3, 3, ""), ("stopped: why", 1, "stopped: why")])
def test_the_process_leaves_without_finalizing_yet_keeps_what_finalizing_would_do(code, rc, err):
    """``cli._leave``: ``sys.exit(code)``'s status and message, after waiting for non-daemon
    threads (an idle thread pool's too, which must be told to stop first) and running the
    atexit hooks (other libraries' shutdowns), then ``os._exit``."""
    script = ("import atexit, concurrent.futures, sys, threading, time; from cosybatch import cli\n"
              "atexit.register(lambda: print('hook ran', flush=True))\n"
              "pool = concurrent.futures.ThreadPoolExecutor(1); pool.submit(time.sleep, 0).result()  # left idle\n"
              "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', flush=True))).start()\n"
              f"cli._leave({code!r})\n"
              "print('not reached')\n")
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == rc and res.stdout.split() == ["thread", "done", "hook", "ran"]
    assert res.stderr.strip() == err


def test_under_a_profiler_the_process_exits_the_ordinary_way_so_the_profile_is_written(tmp_path):
    script = tmp_path / "leave.py"
    script.write_text("from cosybatch import cli\ncli._leave(3)\nprint('not reached')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(tmp_path / "p.pstats"), str(script)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    # (cProfile's runner swallows the SystemExit: its own status is 0)
    assert "not reached" not in res.stdout and (tmp_path / "p.pstats").stat().st_size > 0, res.stderr


def test_help_is_fast_and_hides_the_test_hook():
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", "import sys; from cosybatch.cli import main; main(['synth', '--help'])"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and time.perf_counter() - t0 < 10
    for opt in ("--model", "--out", "--stream / --no-stream", "--device", "--wav-subtype", "--profile", "--set",
                "--strict", "--overwrite", "--shard", "--quiet", "--verbose", "--format", "--sample-rate",
                "--loudness"):
        assert opt in res.stdout
    assert "--synthesizer" not in res.stdout
    assert "FunAudioLLM/Fun-CosyVoice3-0.5B-2512" in res.stdout
    assert "torch" not in subprocess.run(
        [sys.executable, "-c", "import sys, cosybatch.cli; print(' '.join(sys.modules))"],
        cwd=REPO, capture_output=True, text=True, timeout=60).stdout.split()


def test_synth_writes_outputs_and_exit_0(tmp_path):
    man = make_manifest(tmp_path, 3)
    out = tmp_path / "out"
    res = _invoke("synth", man, "--out", out, *FAKE, "--wav-subtype", "float", "--stream")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.glob("*.wav")) == ["u0.wav", "u1.wav", "u2.wav"]
    audio, _ = sf.read(str(out / "u1.wav"), dtype="float32")
    np.testing.assert_array_equal(audio, expected_audio("u1", "Hello there, this is row 1."))
    t = json.loads((out / "timing.json").read_text())
    assert t["settings"]["stream"] is True and t["rows"][0]["chunks"] == 3
    assert "rows ok" in res.stderr  # summary table


def test_one_failing_row_gives_exit_1_and_names_it(tmp_path):
    man = make_manifest(tmp_path, 4)
    out = tmp_path / "out"
    res = _invoke("synth", man, "--out", out, *FAKE, "--set", "fail=u2", "-q")
    assert res.exit_code == 1
    assert "u2 (line 3) failed: RuntimeError: synthetic failure for u2" in res.stderr
    assert sorted(_ok_ids(out)) == ["u0", "u1", "u3"]


def test_bad_rows_reported_with_file_and_line_then_good_rows_run(tmp_path):
    man = make_manifest(tmp_path, 2)
    with open(man, "a") as f:
        f.write("u9|P.|prompts/nope.wav|T.\nonly|three|fields\n")
    out = tmp_path / "out"
    res = _invoke("synth", man, "--out", out, *FAKE)
    assert res.exit_code == 1
    assert f"{man}:3: prompt wav not found" in res.stderr
    assert f"{man}:4: expected 4 or 5 '|'-separated fields" in res.stderr
    assert sorted(_ok_ids(out)) == ["u0", "u1"]

    res = _invoke("synth", man, "--out", tmp_path / "strict", *FAKE, "--strict")
    assert res.exit_code == 2 and "--strict: 2 problem(s)" in res.stderr
    assert not (tmp_path / "strict").exists()


def test_every_bad_case_in_one_manifest_good_rows_still_finish(tmp_path):
    from fake_synth import write_prompt

    man = make_manifest(tmp_path, 2)
    p = tmp_path / "prompts"
    (p / "empty.wav").write_bytes(b"")
    (p / "junk.wav").write_bytes(b"not audio" * 10)
    write_prompt(p / "low.wav", 1.0, 8000)
    write_prompt(p / "long.wav", 30.5, 16000)
    bad = {
        3: ("x3|P.|prompts/a.wav", "expected 4 or 5"),
        4: ("x4||prompts/a.wav|T.", "empty field: prompt_text"),
        5: ("x5|P.|prompts/none.wav|T.", "prompt wav not found"),
        6: ("x6|P.|prompts/junk.wav|T.", "prompt wav unreadable"),
        7: ("x7|P.|prompts/empty.wav|T.", "prompt wav is empty"),
        8: ("x8|P.|prompts/low.wav|T.", "below 16000 Hz"),
        9: ("x9|P.|prompts/long.wav|T.", "over the 30 s limit"),
        10: ("u0|P.|prompts/a.wav|T.", "duplicate utt_id 'u0'"),
        11: ("../x11|P.|prompts/a.wav|T.", "not a safe file name"),
        12: ("x\x0112|P.|prompts/a.wav|T.", "control character U+0001"),
    }
    with open(man, "a") as f:
        f.write("".join(line + "\n" for line, _ in bad.values()) + "u2|P.|prompts/b.wav|Last good row.\n")
    out = tmp_path / "out"
    res = _invoke("synth", man, "--out", out, *FAKE)
    assert res.exit_code == 1
    for n, (_, why) in bad.items():
        assert any(ln.split(" ", 2)[-1].startswith(f"{man}:{n}: ") and why in ln
                   for ln in res.stderr.splitlines()), (n, why)
    assert sorted(_ok_ids(out)) == ["u0", "u1", "u2"]
    inv = {r["line"]: r["reason"] for r in _ledger(out) if r["event"] == "invalid"}
    assert sorted(inv) == sorted(bad) and all(bad[n][1] in inv[n] for n in bad)


@pytest.mark.parametrize("args,msg", [
    (["--set", "novalue"], "expected KEY=VALUE"),
    (["--shard", "3/3"], "need 0 <= i < n"),
    (["--device", "tpu"], "expected cpu, cuda, cuda:N or auto"),
    (["--wav-subtype", "PCM_24"], "PCM_24"),
    (["--set", "boom=no weights"], "cannot set up the synthesizer"),
    (["--synthesizer", "no_such_module:build"], "no_such_module"),
])
def test_usage_and_configuration_errors_exit_2(tmp_path, args, msg):
    man = make_manifest(tmp_path, 1)
    res = _invoke("synth", man, "--out", tmp_path / "out", *FAKE, *args)
    assert res.exit_code == 2 and msg in res.output + res.stderr


def test_missing_manifest_exits_2(tmp_path):
    res = _invoke("synth", tmp_path / "none.lst", "--out", tmp_path / "out", *FAKE)
    assert res.exit_code == 2 and "manifest not found" in res.stderr


def test_changed_setting_exits_2_until_overwrite(tmp_path):
    man = make_manifest(tmp_path, 2)
    out = tmp_path / "out"
    assert _invoke("synth", man, "--out", out, *FAKE, "-q").exit_code == 0
    res = _invoke("synth", man, "--out", out, *FAKE, "--set", "freq=300")
    assert res.exit_code == 2 and "freq: 220.0 before, 300.0 now" in res.stderr
    calls = tmp_path / "calls.txt"
    res = _invoke("synth", man, "--out", out, *FAKE, "--set", "freq=300", "--overwrite", "--set", f"calls={calls}")
    assert res.exit_code == 0 and calls.read_text().split() == ["u0", "u1"]


def test_shard_from_torchrun_environment(tmp_path):
    man = make_manifest(tmp_path, 4)
    out = tmp_path / "out"
    for rank in (0, 1):
        res = _invoke("synth", man, "--out", out, *FAKE, "-q", env={"RANK": str(rank), "WORLD_SIZE": "2"})
        assert res.exit_code == 0
    assert sorted(p.name for p in out.glob("ledger*")) == ["ledger.shard-0-of-2.jsonl", "ledger.shard-1-of-2.jsonl"]
    assert len(list(out.glob("*.wav"))) == 4
    res = _invoke("merge", out)
    assert res.exit_code == 0 and str(out / "timing.json") in res.stdout
    assert json.loads((out / "timing.json").read_text())["totals"]["ok"] == 4


def test_check_with_a_model_reads_its_config(tmp_path, model_dir):
    man = make_manifest(tmp_path, 3)
    res = _invoke("check", man, "--model", model_dir)
    assert res.exit_code == 0, res.output
    # check reports the resolved model path; the fixtures may be reached through a symbolic link
    shown = [ln.removeprefix("model: ") for ln in res.stdout.splitlines() if ln.startswith("model: ")]
    assert len(shown) == 1 and Path(shown[0]).resolve() == Path(model_dir).resolve(), res.stdout
    assert "output WAVs at 24000 Hz" in res.stdout
    assert "synth would synthesize 3 row(s)" in res.stdout


def test_check_reports_without_synthesizing(tmp_path):
    man = make_manifest(tmp_path, 3)
    res = _invoke("check", man)
    assert res.exit_code == 0, res.output
    assert "3 valid row(s), 0 line(s) with problems" in res.stdout
    assert "synth would synthesize 3 row(s)" in res.stdout and "model: not checked" in res.stdout
    out = tmp_path / "out"
    _invoke("synth", man, "--out", out, *FAKE, "-q")
    res = _invoke("check", man, "--out", out, "--shard", "0/1")
    assert "3 row(s) already done" in res.stdout and "synth would synthesize 0 row(s)" in res.stdout
    with open(man, "a") as f:
        f.write("bad/id|P.|prompts/a.wav|T.\n")
    res = _invoke("check", man)
    assert res.exit_code == 1 and f"{man}:4: utt_id 'bad/id' is not a safe file name" in res.stderr
    assert "skip 1 invalid line(s)" in res.stdout
    res = _invoke("check", man, "--model", tmp_path / "no_model_here")
    assert res.exit_code == 2 and "no_model_here" in res.stderr


def test_make_checkpoint_wiring(tmp_path, monkeypatch):
    import cosybatch.checkpoint.generate as gen

    seen = {}
    monkeypatch.setattr(gen, "generate_checkpoint", lambda out, **kw: seen.update(out=out, **kw) or out)
    res = _invoke("make-checkpoint", tmp_path / "ck", "--size", "small", "--seed", "7")
    assert res.exit_code == 0 and seen == {"out": tmp_path / "ck", "size": "small", "seed": 7, "chunk_size": None}
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "llm.pt").write_bytes(b"x")
    res = _invoke("make-checkpoint", tmp_path / "ck")
    assert res.exit_code == 2 and "--force" in res.stderr


def test_main_is_the_console_entry_point():
    text = (REPO / "pyproject.toml").read_text()
    assert 'cosybatch = "cosybatch.cli:main"' in text and callable(cli_mod.main)


# ---- real processes: kill -9 and Ctrl-C -------------------------------------------------

def _spawn(man: Path, out: Path, calls: Path, sleep: float = 0.12) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    cmd = [sys.executable, "-m", "cosybatch.cli", "synth", str(man), "--out", str(out), *FAKE,
           "--set", f"sleep={sleep}", "--set", f"calls={calls}", "--wav-subtype", "FLOAT", "-q"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_ok_rows(out: Path, n: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if (out / "ledger.jsonl").exists() and len(_ok_ids(out)) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    raise AssertionError("rows did not finish in time")


def _assert_every_wav_complete(out: Path, man: Path) -> None:
    texts = {line.split("|")[0]: line.split("|")[3] for line in man.read_text().splitlines()}
    for wav in out.glob("*.wav"):
        audio, _ = sf.read(str(wav), dtype="float32")
        np.testing.assert_array_equal(audio, expected_audio(wav.stem, texts[wav.stem]))


@pytest.mark.parametrize("after_rows,extra_delay", [(1, 0.0), (3, 0.05)])
def test_sigkill_mid_run_then_resume_redoes_only_unfinished(tmp_path, after_rows, extra_delay):
    man = make_manifest(tmp_path, 8)
    out, calls = tmp_path / "out", tmp_path / "calls.txt"
    proc = _spawn(man, out, calls)
    _wait_for_ok_rows(out, after_rows, proc)
    time.sleep(extra_delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    done_before = set(_ok_ids(out))
    assert len(done_before) >= after_rows and len(done_before) < 8
    _assert_every_wav_complete(out, man)
    assert json.loads((out / "timing.json").read_text())["complete"] is False  # still valid JSON

    calls.write_text("")
    res = _invoke("synth", man, "--out", out, *FAKE, "--set", f"calls={calls}", "--wav-subtype", "FLOAT", "-q")
    assert res.exit_code == 0
    redone = calls.read_text().split()
    assert set(redone) == {f"u{i}" for i in range(8)} - done_before
    oks = _ok_ids(out)
    assert sorted(oks) == [f"u{i}" for i in range(8)] and len(oks) == len(set(oks))  # none done twice
    _assert_every_wav_complete(out, man)
    assert not [p.name for p in out.iterdir() if ".cbtmp" in p.name]
    assert json.loads((out / "timing.json").read_text())["complete"] is True


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_signal_gives_130_or_143_and_a_consistent_ledger(tmp_path, sig, code):
    man = make_manifest(tmp_path, 8)
    out, calls = tmp_path / "out", tmp_path / "calls.txt"
    proc = _spawn(man, out, calls)
    _wait_for_ok_rows(out, 2, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err.decode()
    assert "Traceback" not in err.decode()
    recs = _ledger(out)  # every line parses
    assert recs[-1]["event"] == "run_end" and recs[-1]["interrupted"] is True
    oks = _ok_ids(out)
    assert sorted(p.stem for p in out.glob("*.wav")) == sorted(oks)
    assert recs[-1]["ok"] == len(oks) and recs[-1]["pending"] == 8 - len(oks)
    _assert_every_wav_complete(out, man)
    assert json.loads((out / "timing.json").read_text())["interrupted"] is True
    assert not [p.name for p in out.iterdir() if ".cbtmp" in p.name]


def _rows_that_can_only_fail(tmp_path):
    """Two good rows around every kind of row that cannot work (issue #30), by line."""
    man = make_manifest(tmp_path, 2)
    sf.write(str(tmp_path / "prompts" / "tiny.wav"), np.full(24000 // 25, 0.1, np.float32), 24000)  # 40 ms
    bad = {
        3: ("x3|P.|prompts/a.wav|Pick A|B, then go.", "the target text contains '|' ('Pick A|B, then go.')"),
        4: ("x4|P.|prompts/a.wav|...!?", "target text has nothing to synthesize after normalization (wetext)"),
        5: ("x5|P.|prompts/a.wav|\U0001F600\U0001F44D", "target text has nothing to synthesize"),
        6: ("x6|P.|prompts/tiny.wav|Fine text.", "a prompt must be longer than 40 ms"),
    }
    with open(man, "a") as f:
        f.write("".join(line + "\n" for line, _ in bad.values()) + "u2|P.|prompts/b.wav|It costs $3.50.|gt/u2.wav\n")
    return man, bad


def test_check_reports_every_row_that_can_only_fail_and_synth_skips_them(tmp_path):
    man, bad = _rows_that_can_only_fail(tmp_path)
    res = _invoke("check", man)
    assert res.exit_code == 1
    for n, (_, why) in bad.items():
        assert any(f"{man}:{n}: " in ln and why in ln for ln in res.stderr.splitlines()), (n, why)
    assert "3 valid row(s), 4 line(s) with problems" in res.stdout

    out = tmp_path / "out"
    res = _invoke("synth", man, "--out", out, *FAKE, "--wav-subtype", "FLOAT", "-q")
    assert res.exit_code == 1
    assert sorted(_ok_ids(out)) == ["u0", "u1", "u2"]  # the good rows, untouched
    audio, _ = sf.read(str(out / "u2.wav"), dtype="float32")
    np.testing.assert_array_equal(audio, expected_audio("u2", "It costs $3.50."))
    inv = {r["line"]: r["reason"] for r in _ledger(out) if r["event"] == "invalid"}
    assert sorted(inv) == sorted(bad) and all(bad[n][1] in inv[n] for n in bad)

    res = _invoke("synth", man, "--out", tmp_path / "strict", *FAKE, "--strict")
    assert res.exit_code == 2 and "--strict: 4 problem(s)" in res.stderr
    assert not (tmp_path / "strict").exists()


def test_the_profile_normalizer_decides_what_is_left_to_synthesize(tmp_path):
    man = make_manifest(tmp_path, 1)
    with open(man, "a") as f:
        f.write("x2|P.|prompts/a.wav|$\n")  # wetext reads "dollar"; without it, only a symbol
    assert _invoke("check", man).exit_code == 0
    res = _invoke("check", man, "--set", "text.normalizer=none")
    assert res.exit_code == 1 and f"{man}:2: target text has nothing to synthesize after normalization (none)" in res.stderr
    res = _invoke("synth", man, "--out", tmp_path / "out", *FAKE, "--set", "text.normalizer=none", "-q")
    assert res.exit_code == 1 and _ok_ids(tmp_path / "out") == ["u0"]
    res = _invoke("check", man, "--set", "text.normalizer=ttsfrd")
    assert res.exit_code == 2 and "text.normalizer: expected one of 'wetext', 'none'" in res.stderr


@pytest.mark.parametrize("content", ["", "# only a comment\n\n   \n"])
def test_an_empty_manifest_is_refused_before_any_model_work(tmp_path, content):
    man = tmp_path / "empty.lst"
    man.write_text(content)
    res = _invoke("check", man, "--model", tmp_path / "no_model_here")
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.strip().count("\n") == 0 and f"{man}: the manifest has no rows" in res.stderr
    # a factory that fails when called shows that synth stopped before building anything
    res = _invoke("synth", man, "--out", tmp_path / "out", *FAKE, "--set", "boom=no weights")
    assert res.exit_code == 2 and "no rows" in res.stderr and "cannot set up" not in res.stderr
    assert not (tmp_path / "out").exists()


def test_check_show_text_prints_each_rows_pieces(tmp_path, model_dir):
    man = make_manifest(tmp_path, 1, text="It costs $3.50 on 12/03/2025.")
    res = _invoke("check", man, "--model", model_dir, "--show-text")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    i = lines.index(f"{man}:1: u0: 1 segment(s)")
    assert lines[i + 1] == "  1. It costs three point five dollars on the third of december twenty twenty five."
    res = _invoke("check", man, "--model", model_dir, "--show-text", "--set", "text.normalizer=none")
    assert "  1. It costs $three.fifty on twelve/three/two thousand and twenty-five." in res.stdout.splitlines()
    res = _invoke("check", man, "--show-text")
    assert res.exit_code == 2 and "--show-text needs --model" in res.output


def test_synth_starts_the_fast_engine_s_encoder_before_the_synthesizer(tmp_path, monkeypatch):
    """The default (fast) engine's file encoder is a helper process started before the
    synthesizer's start-up, so that its imports are done by the first row; the reference engine
    encodes in-process and starts none."""
    import cosybatch.helper_process as hp
    from cosybatch.run.options import SynthOptions

    order = []

    class Helper:
        def __init__(self, name, warm=None, local_until_warm=False):
            order.append(name)

        def close(self):
            order.append("closed")

    def build(self, device, factory):
        order.append("build")
        raise RuntimeError("no model here")

    monkeypatch.setattr(hp, "HelperProcess", Helper)
    monkeypatch.setattr(SynthOptions, "build", build)
    man = make_manifest(tmp_path, 1)
    for profile, want in (("default", ["encoder", "build"]), ("reference", ["build"])):
        order.clear()
        res = CliRunner().invoke(cli, ["synth", str(man), "--model", str(tmp_path), "--out", str(tmp_path / "o"),
                                       "--profile", profile])
        assert res.exit_code == 2 and order == want, (profile, order, res.output)
