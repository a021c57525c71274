"""The helper process that runs a row's GIL-holding CPU work (wetext, the file's encoding with its
loudness measurement) outside the process driving the GPU: its results are the in-process ones, bit
for bit, and whatever goes wrong there the call runs here with the outcome it always had."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from cosybatch.bench.workload import speechlike, target_texts
from cosybatch.helper_process import HelperPool, HelperProcess
from cosybatch.manifest import read_manifest
from cosybatch.output.audio_files import AudioFormat
from cosybatch.run.synth import run_synth
from cosybatch.text.normalize import prepare_normalizer, split_target_text
from cosybatch.text.tokenizer import CosyVoice3Tokenizer
from fake_synth import FakeResult, FakeSynth, make_manifest

# Texts wetext reads in every way it can: plain workload sentences, numbers, money, dates,
# Chinese, markup, and the two it fails on (read without it, with a warning).
TEXTS = [*target_texts(24, seed=3), "It costs $3.50 on 2024-05-01, about 1,234 units.", "The 1990s were loud.",
         "今天 天气（很）好.我们去公园3次，", "Item #1 is ready.", "100+ people.", "  spaced  out  ", "$"]


@pytest.fixture(scope="module")
def tok(model_dir):
    return CosyVoice3Tokenizer.from_dir(model_dir / "CosyVoice-BlankEN")


@pytest.fixture(scope="module")
def text_helper():
    with HelperProcess("text normalizer", warm=(prepare_normalizer, "wetext")) as h:
        yield h


@pytest.fixture(scope="module")
def encoder():
    with HelperProcess("encoder", warm=(AudioFormat().prepare,)) as h:
        yield h


def _boom(x):
    raise ValueError(f"no {x}")


def test_text_through_the_helper_reads_exactly_as_here(tok, text_helper, caplog):
    for text in TEXTS:
        with caplog.at_level(logging.WARNING, logger="cosybatch.text"):
            caplog.clear()
            here = split_target_text(text, tok, normalizer="wetext")
            warned_here = "wetext cannot normalize" in caplog.text
            caplog.clear()
            there = split_target_text(text, tok, normalizer="wetext", helper=text_helper)
            warned_there = "wetext cannot normalize" in caplog.text
        assert there == here, text
        assert warned_there == warned_here, text  # the texts wetext fails on still say so
    assert text_helper.alive


def _signals() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [speechlike(5.0, 24000, seed=1) * np.float32(0.5),
            speechlike(2.3, 24000, seed=2) * np.float32(0.05),
            (0.9 * rng.standard_normal(24000 * 3)).astype(np.float32),  # past full scale: clipped
            speechlike(0.25, 24000, seed=3),  # shorter than a gating block
            np.zeros(12000, np.float32),
            (1e-5 * rng.standard_normal(24000)).astype(np.float32)]  # below the absolute gate


@pytest.mark.parametrize("fmt", [AudioFormat(), AudioFormat(wav_subtype="FLOAT"),
                                 AudioFormat(loudness=-23.0), AudioFormat("flac", sample_rate=16000, loudness=-16.0)],
                         ids=["wav", "float", "wav-23", "flac16k-16"])
def test_a_file_encoded_in_the_helper_is_the_one_encoded_here(encoder, fmt):
    for x in _signals():
        here, there = fmt.encode(x, 24000), encoder.run(fmt.encode, x, 24000)
        assert there.info == here.info
        if fmt.wav_subtype == "FLOAT" and fmt.format == "wav":  # the PEAK chunk stamps the time
            assert there.chunks[1] == here.chunks[1] and len(there.chunks[0]) == len(here.chunks[0])
        else:
            assert b"".join(there.chunks) == b"".join(here.chunks)
    assert encoder.fallbacks == 0


def test_a_call_that_raises_there_raises_the_same_here():
    with HelperProcess("t") as h:
        with pytest.raises(ValueError, match="no 3"):
            h.run(_boom, 3)
        assert h.fallbacks == 1 and h.alive  # the child goes on
        assert h.run(sorted, [3, 1, 2]) == [1, 2, 3]


def test_what_cannot_be_sent_runs_here():
    with HelperProcess("t") as h:
        assert h.run(lambda x: x + 1, 1) == 2
        assert h.fallbacks == 1 and h.alive


def test_a_dead_helper_hands_its_work_to_this_process(caplog):
    h = HelperProcess("t")
    assert h.run(os.getpid) != os.getpid()
    os.kill(h._proc.pid, signal.SIGKILL)
    h._proc.wait()
    with caplog.at_level(logging.WARNING, logger="cosybatch.helper_process"):
        assert h.run(os.getpid) == os.getpid()
    assert "gone" in caplog.text and not h.alive
    assert h.run(os.getpid) == os.getpid()  # and goes on here, quietly
    h.close()
    h.close()


@pytest.mark.parametrize("local_until_warm", [True, False])
def test_calls_before_the_warm_up_answers_run_here_only_when_asked(local_until_warm):
    """A writer's first rows must not wait for the child's start-up; a text reader must wait for
    the normalizer its warm-up builds (it would be built twice)."""
    import time

    with HelperProcess("t", warm=(time.sleep, 1.0), local_until_warm=local_until_warm) as h:
        assert (h.run(os.getpid) == os.getpid()) == local_until_warm
        t_end = time.monotonic() + 60  # once the warm-up has answered, every call goes to the child
        while h.run(os.getpid) == os.getpid() and time.monotonic() < t_end:
            time.sleep(0.05)
        assert h.run(os.getpid) != os.getpid() and h.fallbacks == 0


def test_a_closed_helper_runs_calls_here():
    h = HelperProcess("t")
    h.close()
    assert h.run(os.getpid) == os.getpid()


def _pid_after(seconds):
    import time

    time.sleep(seconds)
    return os.getpid()


def test_a_pool_runs_calls_from_several_threads_side_by_side():
    """Two threads' calls go to two children at once (neither queues behind the other's), and a
    closed pool runs them here."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    pool = HelperPool("t", 2)
    try:
        assert pool.run(_pid_after, 0) != pool.run(_pid_after, 0)  # one after the other: each child imports this module
        with ThreadPoolExecutor(2) as ex:
            t0 = time.monotonic()
            pids = list(ex.map(lambda s: pool.run(_pid_after, s), [1.0, 1.0]))
            took = time.monotonic() - t0
        assert len(set(pids)) == 2 and os.getpid() not in pids and pool.fallbacks == 0
        assert took < 1.9, took  # side by side, not one after the other
    finally:
        pool.close()
    assert not pool.alive and pool.run(os.getpid) == os.getpid()


class _HelperSynth(FakeSynth):
    """The fake synthesizer, asking run_synth for the encoder helper as the fast engine does,
    with speech-like rows (whose loudness is measured, gated)."""

    helper_processes = True

    def synthesize(self, row, stream):
        res = super().synthesize(row, stream)
        x = speechlike(1.0 + int(row.utt_id[1:]) % 4, 24000, seed=int(row.utt_id[1:])) * np.float32(0.4)
        return FakeResult(x, self.sample_rate, res.tokens, res.timings, 1)


class _HereSynth(_HelperSynth):
    helper_processes = False


def _rows(out: Path) -> dict[str, dict]:
    recs = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    return {r["utt_id"]: {k: v for k, v in r.items() if k not in ("time", "timings")}
            for r in recs if r.get("event") == "row"}


@pytest.mark.parametrize("fmt", [AudioFormat(), AudioFormat(loudness=-20.0)], ids=["wav", "wav-20"])
def test_run_synth_with_the_encoder_helper_writes_the_same_files_and_ledger(tmp_path, fmt):
    man = read_manifest(make_manifest(tmp_path, 6))
    outs = {}
    for name, synth in (("here", _HereSynth()), ("helper", _HelperSynth())):
        outs[name] = tmp_path / name
        assert run_synth(man, synth, outs[name], audio_format=fmt, quiet=True).exit_code == 0
    assert _rows(outs["helper"]) == _rows(outs["here"])
    files = sorted(p.name for p in outs["here"].glob("*.wav"))
    assert len(files) == 6 and files == sorted(p.name for p in outs["helper"].glob("*.wav"))
    for f in files:
        assert (outs["helper"] / f).read_bytes() == (outs["here"] / f).read_bytes()
