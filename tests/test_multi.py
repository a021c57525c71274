"""synth --devices/--workers: one worker process per device, one bar, one merged summary.

Fake-synthesizer tests cover the launcher's behaviour (split, environment, a killed worker,
signals, resume); two tests on the tiny checkpoint show the workers produce what one
process produces.
"""

from __future__ import annotations

import dataclasses
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

from cosybatch.manifest import read_manifest
from cosybatch.run.multi.launcher import DevicesError, plan_slots, run_workers
from cosybatch.run.sharding import Shard, balance, estimated_cost, select
from cosybatch.run.options import SynthOptions
from fake_synth import expected_audio, make_manifest
from out_dirs import invoke, ok_counts, records

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
FAKE = ["--synthesizer", "fake_synth:build"]
CPU2 = ["--device", "cpu", "--workers", "2"]


# ---- where workers run ------------------------------------------------------------------

def test_device_specs_map_to_one_gpu_per_worker():
    three = lambda: 3  # noqa: E731
    assert [s.label for s in plan_slots("all", None, "auto", three, env={})] == ["cuda:0", "cuda:1", "cuda:2"]
    assert [(s.label, s.device, s.visible) for s in plan_slots("2", None, "cuda", three, env={})] == [
        ("cuda:0", "cuda:0", "0"), ("cuda:1", "cuda:0", "1")]
    # cuda:K is torch's K-th GPU in the parent: the K-th entry of an inherited CUDA_VISIBLE_DEVICES.
    env = {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c"}
    assert [s.visible for s in plan_slots("cuda:2,0", None, "auto", three, env=env)] == ["GPU-c", "GPU-a"]
    assert [(s.label, s.device, s.visible) for s in plan_slots(None, 3, "cpu", three)] == [
        ("cpu#0", "cpu", None), ("cpu#1", "cpu", None), ("cpu#2", "cpu", None)]
    for args, msg in [(("all", None, "auto", lambda: 0), "no CUDA GPU"),
                      (("4", None, "auto", three), "between 1 and 3"),
                      (("cuda:3", None, "auto", three), "cuda:0..cuda:2"), (("0,cuda:0", None, "auto", three), "twice"),
                      ((None, 2, "auto", three), "needs --device cpu"), (("all", 2, "cpu", three), "pick one"),
                      (("all", None, "cpu", three), "cannot be combined")]:
        with pytest.raises(DevicesError, match=msg):
            plan_slots(*args)


def test_rows_left_are_balanced_and_every_worker_owns_its_own(tmp_path):
    man = read_manifest(make_manifest(tmp_path, 40))
    rows = [dataclasses.replace(r, target_text="y" * (5 + (i * 37) % 200)) for i, r in enumerate(man.rows)]
    done = {r.utt_id for r in rows[::3]}
    parts = balance(rows, 4, done)
    ids = [r.utt_id for p in parts for r in p]
    assert sorted(ids) == sorted(r.utt_id for r in rows if r.utt_id not in done) and len(ids) == len(set(ids))
    loads = [sum(estimated_cost(r) for r in p) for p in parts]
    assert max(loads) - min(loads) <= max(estimated_cost(r) for r in rows)
    assert [[r.utt_id for r in p] for p in balance(list(reversed(rows)), 4, done)] == \
        [[r.utt_id for r in reversed(p)] for p in parts]  # depends on the rows, not their order
    mine = Shard(1, 4, members=frozenset(r.utt_id for r in parts[1]))
    assert select(rows, mine) == parts[1] and mine.tag == ".shard-1-of-4" and mine == Shard(1, 4)


# ---- the launcher around a fake synthesizer ----------------------------------------------

def test_two_workers_write_what_one_process_writes_and_merge(tmp_path):
    man = make_manifest(tmp_path, 8)
    one, two = tmp_path / "one", tmp_path / "two"
    assert invoke("synth", man, "--out", one, *FAKE, "--wav-subtype", "FLOAT").exit_code == 0
    res = invoke("synth", man, "--out", two, *FAKE, *CPU2, "--wav-subtype", "FLOAT")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in two.glob("ledger*")) == ["ledger.shard-0-of-2.jsonl", "ledger.shard-1-of-2.jsonl"]
    wavs = sorted(p.name for p in one.glob("*.wav"))
    assert wavs == sorted(p.name for p in two.glob("*.wav")) and len(wavs) == 8
    for name in wavs:
        np.testing.assert_array_equal(sf.read(str(one / name))[0], sf.read(str(two / name))[0])
    assert ok_counts(two) == {f"u{i}": 1 for i in range(8)}
    rows_of = [{r["utt_id"] for r in _records_of(p) if r.get("event") == "row"} for p in sorted(two.glob("ledger*"))]
    assert all(len(ids) >= 2 for ids in rows_of) and not rows_of[0] & rows_of[1]  # both worked, apart
    merged = json.loads((two / "timing.json").read_text())
    assert merged["merged"] is True and merged["complete"] is True
    assert (merged["totals"]["ok"], merged["totals"]["failed"], merged["totals"]["shards"]) == (8, 0, 2)
    assert "rows ok" in res.stderr and "(2 workers)" in res.stderr
    # Re-running the same command redoes nothing: one worker only checks the settings.
    res = invoke("synth", man, "--out", two, *FAKE, *CPU2, "--wav-subtype", "FLOAT")
    assert res.exit_code == 0 and "8 row(s) already done, 0 to go" in res.stderr
    assert res.stderr.count("row(s) to do") == 1 and ok_counts(two) == {f"u{i}": 1 for i in range(8)}


def _records_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_one_launcher_per_node_shard_shares_an_out_folder(tmp_path):
    """Slurm, several nodes: --shard K/N picks the node's rows, --workers/--devices splits them."""
    man = make_manifest(tmp_path, 9)
    out = tmp_path / "out"
    for k in range(2):
        assert invoke("synth", man, "--out", out, *FAKE, *CPU2, "--shard", f"{k}/2", "-q").exit_code == 0
    assert sorted(p.name for p in out.glob("ledger*")) == [f"ledger.shard-{i}-of-4.jsonl" for i in range(4)]
    assert ok_counts(out) == {f"u{i}": 1 for i in range(9)}
    res = invoke("merge", out)
    assert res.exit_code == 0, res.stderr
    merged = json.loads((out / "timing.json").read_text())
    assert merged["complete"] is True and merged["totals"]["shards"] == 4 and merged["totals"]["ok"] == 9


def test_workers_keep_the_parents_environment(tmp_path, monkeypatch):
    man = make_manifest(tmp_path, 4)
    dumps = tmp_path / "env"
    dumps.mkdir()
    for k, v in {"NCCL_NVLS_ENABLE": "0", "NCCL_DEBUG": "INFO", "NVSHMEM_DISABLE_NCCL": "1",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c",
                 "MULTI_TEST_ENV_DIR": str(dumps)}.items():
        monkeypatch.setenv(k, v)
    # What any child of this process inherits (pytest's readline sets LINES/COLUMNS behind os.environ).
    parent = json.loads(subprocess.run([sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
                                       capture_output=True, text=True, check=True).stdout)
    assert parent["NCCL_NVLS_ENABLE"] == "0" and parent["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    opts = SynthOptions("fake", factory="multi_synth:env")
    # Two "GPUs" out of three: the fake synthesizer ignores the device, so this runs on CPU.
    code = run_workers(read_manifest(man), tmp_path / "out", opts, devices="cuda:0,cuda:2", workers=None,
                       device="auto", quiet=True, gpu_count=lambda: 3)
    assert code == 0
    seen = [json.loads(p.read_text()) for p in dumps.glob("*.json")]
    assert len(seen) == 2
    assert sorted(s["env"]["CUDA_VISIBLE_DEVICES"] for s in seen) == ["GPU-a", "GPU-c"]
    for s in seen:
        assert s["device"] == "cuda:0"
        assert {k: v for k, v in s["env"].items() if k != "CUDA_VISIBLE_DEVICES"} == \
            {k: v for k, v in parent.items() if k != "CUDA_VISIBLE_DEVICES"}
    # CPU workers: the environment as it is, CUDA_VISIBLE_DEVICES included.
    for p in dumps.glob("*.json"):
        p.unlink()
    assert run_workers(read_manifest(man), tmp_path / "cpu", opts, devices=None, workers=2, device="cpu",
                       quiet=True) == 0
    assert [json.loads(p.read_text())["env"] for p in dumps.glob("*.json")] == [parent, parent]


def _spawn(man: Path, out: Path, calls: Path, sleep: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    cmd = [sys.executable, "-m", "cosybatch.cli", "synth", str(man), "--out", str(out), *FAKE, *CPU2,
           "--set", f"sleep={sleep}", "--set", f"calls={calls}", "--wav-subtype", "FLOAT", "-q"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _worker_pids(out: Path) -> dict[str, int]:
    """Ledger part -> the pid in its run_start record (this run's, the latest)."""
    pids = {}
    for p in out.glob("ledger.shard-*.jsonl"):
        starts = [r for r in _records_of(p) if r.get("event") == "run_start"]
        if starts:
            pids[p.name] = starts[-1]["pid"]
    return pids


def _wait(cond, proc: subprocess.Popen, timeout: float = 30.0):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        got = cond()
        if got:
            return got
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("timed out")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_a_killed_worker_fails_only_its_rows_and_a_rerun_finishes_them(tmp_path):
    man = make_manifest(tmp_path, 10)
    out, calls = tmp_path / "out", tmp_path / "calls.txt"
    proc = _spawn(man, out, calls, sleep=0.25)
    victim = "ledger.shard-1-of-2.jsonl"
    _wait(lambda: any(r.get("event") == "row" for r in _records_of(out / victim)) if (out / victim).exists()
          else False, proc)
    os.kill(_worker_pids(out)[victim], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 1, err
    assert "worker 1 (cpu#1) was killed by SIGKILL" in err and "the other workers go on" in err
    rows = {r["utt_id"]: r for r in records(out) if r.get("event") == "row"}
    assert len(rows) == 10  # every row accounted for: ok, or failed with the reason
    failed = {u for u, r in rows.items() if r["status"] == "failed"}
    assert failed and all("killed by SIGKILL before finishing this row" in rows[u]["reason"] for u in failed)
    assert failed <= {r["utt_id"] for r in _records_of(out / victim) if r.get("event") == "row"}  # its own rows only

    calls.write_text("")
    res = subprocess.run(_spawn_cmd(man, out, calls), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert set(calls.read_text().split()) == failed  # nothing finished was redone
    assert ok_counts(out) == {f"u{i}": 1 for i in range(10)}
    texts = {line.split("|")[0]: line.split("|")[3] for line in man.read_text().splitlines()}
    for wav in out.glob("*.wav"):
        np.testing.assert_array_equal(sf.read(str(wav), dtype="float32")[0], expected_audio(wav.stem, texts[wav.stem]))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}


def _spawn_cmd(man: Path, out: Path, calls: Path) -> list[str]:
    return [sys.executable, "-m", "cosybatch.cli", "synth", str(man), "--out", str(out), *FAKE, *CPU2,
            "--set", f"calls={calls}", "--wav-subtype", "FLOAT", "-q"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_parent_stops_every_worker_cleanly(tmp_path, sig):
    man = make_manifest(tmp_path, 12)
    out, calls = tmp_path / "out", tmp_path / "calls.txt"
    proc = _spawn(man, out, calls, sleep=0.2)
    _wait(lambda: sum(ok_counts(out).values()) >= 2 if out.exists() else False, proc)
    pids = _worker_pids(out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err.decode()
    assert len(pids) == 2 and not any(_alive(p) for p in pids.values())
    for part in out.glob("ledger.shard-*.jsonl"):
        last = _records_of(part)[-1]  # each worker ended its own ledger (every line parses)
        assert last["event"] == "run_end" and last["interrupted"] is True
    done_before = set(ok_counts(out))
    assert 2 <= len(done_before) < 12 and "rows ok" not in err.decode()  # -q: no summary

    calls.write_text("")
    res = subprocess.run(_spawn_cmd(man, out, calls), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert set(calls.read_text().split()) == {f"u{i}" for i in range(12)} - done_before
    assert ok_counts(out) == {f"u{i}": 1 for i in range(12)}
    assert not [p.name for p in out.iterdir() if ".cbtmp" in p.name]


def test_a_setting_changed_since_the_first_run_stops_every_worker(tmp_path):
    man = make_manifest(tmp_path, 3)
    out = tmp_path / "out"
    assert invoke("synth", man, "--out", out, *FAKE).exit_code == 0
    res = invoke("synth", man, "--out", out, *FAKE, *CPU2, "--set", "freq=300")
    assert res.exit_code == 2 and "refusing to mix outputs" in res.stderr  # not "all done"
    (out / "u1.wav").unlink()
    res = invoke("synth", man, "--out", out, *FAKE, *CPU2, "--set", "freq=300")
    assert res.exit_code == 2 and "refusing to mix outputs" in res.stderr
    assert res.stderr.count("refusing to mix outputs") == 1  # reported once, not once per worker
    assert not (out / "u1.wav").exists()


# ---- the tiny checkpoint: workers produce what one process produces -----------------------

def _audio(out: Path) -> dict[str, np.ndarray]:
    return {p.stem: sf.read(str(p), dtype="float32")[0] for p in sorted(out.glob("*.wav"))}


def _tokens(out: Path) -> dict[str, int]:
    return {r["utt_id"]: r["tokens"] for r in records(out) if r.get("event") == "row" and r["status"] == "ok"}


def _short_rows(fixtures_dir: Path, folder: Path) -> Path:
    """The fixture's four sentences (its paragraph would be most of the test's time)."""
    lines = [line.replace("|p", f"|{fixtures_dir / 'prompts'}/p", 1)
             for line in (fixtures_dir / "prompts" / "meta.lst").read_text().splitlines() if "paragraph" not in line]
    (folder / "meta.lst").write_text("\n".join(lines) + "\n")
    return folder / "meta.lst"


def _same_threads_in_workers(monkeypatch) -> None:
    """Workers at this process's intra-op thread count (1, or COSYBATCH_TEST_THREADS): results
    are compared bit for bit, and float sums depend on how many threads split them."""
    import torch

    n = str(torch.get_num_threads())
    monkeypatch.setenv("OMP_NUM_THREADS", n)  # the launcher then leaves the count alone
    monkeypatch.setenv("MULTI_TEST_THREADS", n)  # and multi_synth:real sets it exactly (torch caps the env's)


def test_reference_workers_equal_one_process_exactly_even_after_a_worker_is_killed(
        tmp_path, fixtures_dir, model_dir, one_thread, monkeypatch):
    man = _short_rows(fixtures_dir, tmp_path)
    args = ["--model", model_dir, "--profile", "reference", "--wav-subtype", "FLOAT", "-q"]
    assert invoke("synth", man, "--out", tmp_path / "one", "--device", "cpu", *args).exit_code == 0
    out = tmp_path / "two"
    _same_threads_in_workers(monkeypatch)
    monkeypatch.setenv("MULTI_TEST_VICTIM", "utt3")  # SIGKILLed when its audio is ready, before it is written
    monkeypatch.setenv("MULTI_TEST_MARKER", str(tmp_path / "killed"))
    workers = [*CPU2, *args, "--synthesizer", "multi_synth:real"]
    res = invoke("synth", man, "--out", out, *workers)
    assert res.exit_code == 1 and (tmp_path / "killed").exists() and "was killed by SIGKILL" in res.stderr
    failed = {r["utt_id"] for r in records(out) if r.get("event") == "row" and r["status"] == "failed"}
    done_before = set(ok_counts(out))
    assert "utt3" in failed and done_before and not failed & done_before

    res = invoke("synth", man, "--out", out, *workers)  # the re-run resumes (and nobody dies this time)
    assert res.exit_code == 0, res.stderr
    assert ok_counts(out) == {u: 1 for u in ("utt1", "utt2", "utt3", "utt4")}  # nothing done twice
    one, two = _audio(tmp_path / "one"), _audio(out)
    assert list(one) == list(two)
    for utt in one:
        np.testing.assert_array_equal(one[utt], two[utt], err_msg=utt)
    assert _tokens(tmp_path / "one") == _tokens(out)
    assert len(list(out.glob("ledger.shard-*-of-2.jsonl"))) == 2
    merged = json.loads((out / "timing.json").read_text())
    assert (merged["totals"]["ok"], merged["totals"]["failed"], merged["complete"]) == (4, 0, True)


def test_default_profile_two_workers_match_one_process(tmp_path, fixtures_dir, model_dir, one_thread, monkeypatch):
    man = _short_rows(fixtures_dir, tmp_path)
    args = ["--model", model_dir, "--wav-subtype", "FLOAT", "-q"]
    assert invoke("synth", man, "--out", tmp_path / "one", "--device", "cpu", *args).exit_code == 0
    _same_threads_in_workers(monkeypatch)
    res = invoke("synth", man, "--out", tmp_path / "two", *CPU2, *args, "--synthesizer", "multi_synth:real")
    assert res.exit_code == 0, res.stderr
    one, two = _audio(tmp_path / "one"), _audio(tmp_path / "two")
    assert list(one) == list(two) and len(one) == 4
    assert _tokens(tmp_path / "one") == _tokens(tmp_path / "two")
    for utt in one:  # rows packed differently: the same length, samples equal up to float rounding
        assert one[utt].shape == two[utt].shape, utt
        np.testing.assert_allclose(one[utt], two[utt], atol=2e-3, err_msg=utt)
