"""synth --ray and cosybatch.run.ray.api.synthesize on a local two-CPU Ray cluster.

Skipped when Ray is not installed, except in CI (COSYBATCH_REQUIRE_FIXTURES), which installs
the `ray` extra through `.[test]` and must not pass by skipping. The cluster is started once
for the module and shut down after it; the last check is that no Ray process is left.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from fake_synth import expected_audio, make_manifest
from out_dirs import invoke, ok_counts, records

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
FAKE = ["--synthesizer", "fake_synth:build"]

try:
    import ray
    import ray.data
except ImportError:
    ray = None


@pytest.fixture(scope="module")
def local_ray():
    if ray is None:
        if os.environ.get("COSYBATCH_REQUIRE_FIXTURES"):
            pytest.fail("ray is not installed: CI installs it with the `ray` extra (`.[test]`)")
        pytest.skip("ray is not installed (pip install 'cosybatch[ray]')")
    from conftest import requested_threads

    before = _ray_processes()
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "MULTI_TEST_THREADS")}
    # Actors are started by the raylet with this environment: they must find the test factories,
    # and run at the thread count of the process their output is compared with (one_thread).
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(REPO), *filter(None, [saved["PYTHONPATH"]])])
    os.environ["MULTI_TEST_THREADS"] = str(requested_threads() or 1)
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        yield ray
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    t_end = time.monotonic() + 20
    while (left := _ray_processes() - before) and time.monotonic() < t_end:
        time.sleep(0.2)
    assert not left, f"Ray processes left running: {left}"


def _ray_processes() -> set[tuple[int, str]]:
    """Live (not zombie) processes that are Ray's: raylet, gcs_server, workers, helpers."""
    found = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state = stat.rsplit(")", 1)[-1].split()[0]
        if state != "Z" and ("ray::" in cmd or "raylet" in cmd or "gcs_server" in cmd or "/ray/" in cmd):
            found.add((int(d.name), cmd[:80]))
    return found


def _short_rows(fixtures_dir: Path, folder: Path) -> Path:
    lines = [line.replace("|p", f"|{fixtures_dir / 'prompts'}/p", 1)
             for line in (fixtures_dir / "prompts" / "meta.lst").read_text().splitlines() if "paragraph" not in line]
    (folder / "meta.lst").write_text("\n".join(lines) + "\n")
    return folder / "meta.lst"


def test_ray_on_the_tiny_checkpoint_writes_what_one_process_writes(local_ray, tmp_path, fixtures_dir, model_dir,
                                                                  one_thread):
    man = _short_rows(fixtures_dir, tmp_path)
    args = ["--model", model_dir, "--profile", "reference", "--wav-subtype", "FLOAT", "--device", "cpu", "-q"]
    assert invoke("synth", man, "--out", tmp_path / "one", *args).exit_code == 0
    out = tmp_path / "ray"
    res = invoke("synth", man, "--out", out, *args, "--ray", "--synthesizer", "multi_synth:real")
    assert res.exit_code == 0, res.stderr
    for wav in sorted((tmp_path / "one").glob("*.wav")):
        np.testing.assert_array_equal(sf.read(str(wav))[0], sf.read(str(out / wav.name))[0], err_msg=wav.name)
    tokens = lambda o: {r["utt_id"]: r["tokens"] for r in records(o) if r.get("event") == "row"}  # noqa: E731
    assert tokens(tmp_path / "one") == tokens(out) and len(tokens(out)) == 4
    assert ok_counts(out) == {u: 1 for u in ("utt1", "utt2", "utt3", "utt4")}
    assert list(out.glob("ledger.ray-*.jsonl")) and (out / "ledger.ray.jsonl").exists()
    merged = json.loads((out / "timing.json").read_text())
    assert merged["merged"] is True and merged["totals"]["ok"] == 4 and merged["complete"] is True
    # The same OUT, resumed: by --ray (nothing is scheduled) and by plain synth (same layout).
    res = invoke("synth", man, "--out", out, *args, "--ray")
    assert res.exit_code == 0
    assert invoke("synth", man, "--out", out, *args).exit_code == 0
    assert ok_counts(out) == {u: 1 for u in ("utt1", "utt2", "utt3", "utt4")}


def test_ray_run_interrupted_then_resumed_redoes_only_what_was_left(local_ray, tmp_path, monkeypatch, request):
    from cosybatch.run.ray import driver as ray_cli
    man = make_manifest(tmp_path, 10)
    out, calls = tmp_path / "out", tmp_path / "calls.txt"
    seen = []
    real = ray_cli.RayRun._result

    def ctrl_c_after_two(self, res, bar):  # the driver gets Ctrl-C after two rows came back
        real(self, res, bar)
        seen.append(res["utt_id"])
        if len(seen) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ray_cli.RayRun, "_result", ctrl_c_after_two)
    # A shell starts background jobs with SIGINT ignored, and Python keeps that: Ctrl-C must
    # reach this run however pytest was started.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    args = ["synth", man, "--out", out, *FAKE, "--device", "cpu", "--wav-subtype", "FLOAT", "-q", "--ray",
            "--set", f"calls={calls}"]
    # every actor's rows after its first two are slow: the interrupt always lands with rows left,
    # however late a loaded machine's driver sees the first results
    res = invoke(*args, "--set", "sleep=0.1", "--set", "slow=4")
    assert res.exit_code == 130, res.stderr
    done_before = set(ok_counts(out))
    assert 2 <= len(done_before) < 10
    time.sleep(1.0)
    assert set(ok_counts(out)) == done_before  # the interrupted run's actors were stopped, not left writing
    end = [r for r in records(out) if r.get("event") == "run_end"]
    assert end[-1]["interrupted"] is True and end[-1]["pending"] == 10 - end[-1]["ok"]

    monkeypatch.setattr(ray_cli.RayRun, "_result", real)
    calls.write_text("")
    res = invoke(*args)
    assert res.exit_code == 0, res.stderr
    assert set(calls.read_text().split()) == {f"u{i}" for i in range(10)} - done_before
    assert ok_counts(out) == {f"u{i}": 1 for i in range(10)}  # none done twice
    texts = {line.split("|")[0]: line.split("|")[3] for line in man.read_text().splitlines()}
    for wav in out.glob("*.wav"):
        np.testing.assert_array_equal(sf.read(str(wav), dtype="float32")[0], expected_audio(wav.stem, texts[wav.stem]))
    assert not [p.name for p in out.iterdir() if ".cbtmp" in p.name]
    # Nothing is left to do, yet other settings are refused, not met with "all done".
    res = invoke(*args, "--set", "freq=300")
    assert res.exit_code == 2 and "refusing to mix outputs" in res.stderr


def test_an_actor_killed_mid_run_is_restarted_by_ray_and_keeps_what_it_wrote(local_ray, tmp_path):
    man = make_manifest(tmp_path, 12)
    out, calls = tmp_path / "out", tmp_path / "calls.txt"
    killed = []

    def kill_an_actor_after_its_first_row():
        t_end = time.monotonic() + 60
        while not killed and time.monotonic() < t_end:
            for part in out.glob("ledger.ray-*.jsonl") if out.exists() else ():
                recs = [json.loads(x) for x in part.read_text().splitlines() if x.strip()]
                if any(r.get("event") == "row" for r in recs):
                    pid = [r for r in recs if r.get("event") == "run_start"][-1]["pid"]
                    os.kill(pid, signal.SIGKILL)
                    killed.append(part)
                    return
            time.sleep(0.02)

    import threading

    watcher = threading.Thread(target=kill_an_actor_after_its_first_row, daemon=True)
    watcher.start()
    res = invoke("synth", man, "--out", out, *FAKE, "--device", "cpu", "-q", "--ray", "--set", "sleep=0.3",
                  "--set", f"calls={calls}")
    watcher.join(5)
    assert killed and res.exit_code == 0, res.stderr
    # Ray restarted the actor (same id, same ledger part) and retried its batch; the new
    # incarnation returned the rows its predecessor had committed instead of redoing them.
    starts = [json.loads(x) for x in killed[0].read_text().splitlines() if '"run_start"' in x]
    assert [s["restarted"] for s in starts] == [False, True] and starts[0]["pid"] != starts[1]["pid"]
    assert ok_counts(out) == {f"u{i}": 1 for i in range(12)}
    assert len(calls.read_text().split()) <= 12 + 2  # at most the rows in flight at the kill were redone


def test_synthesize_api_returns_one_result_row_per_input_row(local_ray, tmp_path):
    import cosybatch.run.ray.api as cray

    make_manifest(tmp_path, 3)
    rows = [{"utt_id": f"u{i}", "prompt_text": "Prompt words.", "prompt_wav": f"prompts/{'ab'[i % 2]}.wav",
             "target_text": f"Row number {i}.", "speaker": f"spk{i}"} for i in range(3)]
    rows.append({"utt_id": "bad", "prompt_text": "x", "prompt_wav": "prompts/missing.wav", "target_text": "y",
                 "speaker": "spk9"})
    out = tmp_path / "out"
    kw = dict(model="fake", out=out, device="cpu", factory="fake_synth:build", base_dir=tmp_path, concurrency=1)
    got = {r["utt_id"]: r for r in cray.synthesize(ray.data.from_items(rows), **kw).take_all()}
    assert sorted(got) == ["bad", "u0", "u1", "u2"]
    for i in range(3):
        r = got[f"u{i}"]
        assert (r["status"], r["speaker"], r["reason"]) == ("ok", f"spk{i}", None)  # input columns kept
        audio = expected_audio(f"u{i}", f"Row number {i}.")
        np.testing.assert_allclose(sf.read(r["wav"], dtype="float32")[0], audio, atol=1e-4)  # PCM_16
        assert r["audio_s"] == pytest.approx(len(audio) / 24000) and r["tokens"] == len(f"Row number {i}.")
    assert got["bad"]["status"] == "invalid" and "prompt wav not found" in got["bad"]["reason"]
    assert got["bad"]["wav"] is None and got["bad"]["audio_s"] is None
    # Again: what OUT holds is skipped, not redone.
    again = {r["utt_id"]: r["status"] for r in cray.synthesize(ray.data.from_items(rows), **kw).take_all()}
    assert again == {"u0": "skipped", "u1": "skipped", "u2": "skipped", "bad": "invalid"}
    assert ok_counts(out) == {"u0": 1, "u1": 1, "u2": 1}
    # Other settings on the same OUT: refused before anything is written.
    with pytest.raises(Exception, match="refusing to mix outputs"):
        cray.synthesize(ray.data.from_items(rows), overrides=["freq=300"], **kw).take_all()
    assert ok_counts(out) == {"u0": 1, "u1": 1, "u2": 1}


def test_without_ray_the_option_says_how_to_install_it(tmp_path):
    man = make_manifest(tmp_path, 1)
    code = ("import sys; sys.modules['ray'] = None; from cosybatch.cli import main; "
            f"main(['synth', {str(man)!r}, '--out', {str(tmp_path / 'out')!r}, '--ray'])")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "pip install 'cosybatch[ray]'" in lines[0], res.stderr
    assert not (tmp_path / "out").exists()


def test_importing_cosybatch_never_imports_ray():
    code = ("import sys, cosybatch, cosybatch.cli, cosybatch.run.multi.launcher, cosybatch.run.multi.worker, cosybatch.run.ray.driver, "
            "cosybatch.run.ray.stage; print('ray' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr


def test_an_actor_commits_nothing_after_the_stop_file(tmp_path):
    """The actor's side of an interrupt, without Ray: once the driver's stop file exists, a row
    that finishes is left to the resume (no WAV, no ledger line), and other rows were kept."""
    pa = pytest.importorskip("pyarrow")
    from cosybatch.run.ray.stage import STOP_FILE, SynthStage
    from cosybatch.run.options import SynthOptions

    man = make_manifest(tmp_path, 2)
    rows = [line.split("|") for line in Path(man).read_text().splitlines()]
    batch = lambda i: pa.table({"utt_id": [rows[i][0]], "prompt_text": [rows[i][1]], "prompt_wav": [rows[i][2]],  # noqa: E731
                                "target_text": [rows[i][3]], "line": [i + 1]})
    out = tmp_path / "out"
    out.mkdir()
    stage = SynthStage(SynthOptions("fake", factory="fake_synth:build", wav_subtype="FLOAT"), str(out), "cpu",
                       base_dir=str(Path(man).parent))
    assert stage(batch(0)).column("status").to_pylist() == ["ok"]
    (out / STOP_FILE).touch()
    got = stage(batch(1))
    assert got.column("status").to_pylist() == ["pending"]
    assert sorted(p.name for p in out.glob("*.wav")) == [f"{rows[0][0]}.wav"]
    assert set(ok_counts(out)) == {rows[0][0]}
    assert not [r for r in records(out) if r.get("utt_id") == rows[1][0]]  # not even a failed line
