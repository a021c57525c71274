"""`cosybatch synth` through the fast path (default profile) writes the official waveforms."""

import json
import re

import numpy as np
import pytest
import soundfile as sf
from click.testing import CliRunner

from conftest import ROWS, load_ref
from parity import assert_wave_close

pytestmark = pytest.mark.numeric


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_synth_default_profile_matches_official(fixtures_dir, reference_dir, tmp_path, stream):
    from cosybatch.cli import cli

    out = tmp_path / "out"
    args = ["synth", str(fixtures_dir / "prompts" / "meta.lst"), "--model", str(fixtures_dir / "model"),
            "--out", str(out), "--device", "cpu", "--wav-subtype", "FLOAT", "--quiet",
            "--profile", "default", "--set", "optimizations.prefix_reuse=" + ("true" if stream else "false"),
            "--set", "text.normalizer=none"]  # the fixtures were made with no text normaliser installed
    if stream:
        args.append("--stream")
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    # each row's ledger line names the pieces synthesized, in order: the official split
    recs = {r["utt_id"]: r for r in map(json.loads, (out / "ledger.jsonl").read_text().splitlines())
            if r.get("status") == "ok"}
    for row in ROWS:
        assert recs[row]["segments"] == json.loads((reference_dir / f"{row}.json").read_text())["segments"], row
    for row in ROWS:
        ref = load_ref(reference_dir, row)
        mode = "stream" if stream else "nonstream"
        # numeric order of (segment, chunk): "chunk10" must come after "chunk2"
        names = sorted((k for k in ref if k.startswith(f"{mode}.seg") and k.endswith(".wav")),
                       key=lambda k: [int(t) for t in re.findall(r"\d+", k)])
        want = np.concatenate([ref[k][0].numpy() for k in names])
        got, sr = sf.read(out / f"{row}.wav", dtype="float32")
        assert sr == 24000, row
        assert_wave_close(got, want, row)  # exact length, SNR, phase-tolerant max (tests/parity.py)


def test_synth_force_length_and_ledger_tokens(fixtures_dir, tmp_path):
    """--force-length gives every row the token count `profile --force-length` derives from its
    text, and the ledger's `tokens` counts the LM's speech tokens (the audio is 2 x 480 samples
    per token of a whole response)."""
    import json

    from cosybatch.cli import cli
    from cosybatch.manifest import read_manifest
    from cosybatch.scheduler.protocol import force_tokens

    out = tmp_path / "out"
    manifest = fixtures_dir / "prompts" / "meta.lst"
    args = ["synth", str(manifest), "--model", str(fixtures_dir / "model"), "--out", str(out), "--device", "cpu",
            "--quiet", "--force-length"]
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rows = {r.utt_id: r for r in read_manifest(manifest).rows}
    recs = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    ok = {r["utt_id"]: r for r in recs if r.get("status") == "ok"}
    assert set(ok) == set(rows)
    for utt, rec in ok.items():
        if utt == "utt5_paragraph":
            continue  # split over segments: each rounds its share (serving._forced)
        assert rec["tokens"] == force_tokens(rows[utt].target_text, 25.0), utt
    # a resumed run with the same flag redoes nothing; without it, the settings changed (exit 2)
    again = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert again.exit_code == 0
    changed = CliRunner().invoke(cli, args[:-1], catch_exceptions=False)
    assert changed.exit_code == 2


def test_bfloat16_prompt_features_are_part_of_the_resume_fingerprint(fixtures_dir):
    """bfloat16 GPU frontends change ~8 % of prompt codes, so resuming a run across that switch
    must be refused; every float32 path gives the reference's codes and shares the fingerprint."""
    import torch

    from cosybatch.synthesizers import build_synthesizer

    synth = build_synthesizer(str(fixtures_dir / "model"), "cpu", None, ["frontend.precision=bfloat16"])
    try:
        fe = synth.pipeline.frontend
        assert fe.backend == "onnxruntime" and not fe.bfloat16  # no GPU: the precision has no effect
        assert "prompt_features" not in synth.fingerprint()

        class Bf16Impl:  # what the GPU path would hold
            dtype = torch.bfloat16
        fe.backend, fe._impl, impl = "torch", Bf16Impl(), fe._impl
        try:
            assert synth.fingerprint()["prompt_features"] == "bfloat16"
        finally:
            fe.backend, fe._impl = "onnxruntime", impl
    finally:
        synth.close()


@pytest.mark.parametrize("profile,warmed", [("default", False), ("packed_streaming_optimized_standard", True)])
def test_frontend_warm_up_runs_only_where_the_profile_asks_and_start_up_is_timed(model_dir, monkeypatch, profile,
                                                                                 warmed):
    """Bulk runs (``default``: frontend.warmup false) skip the per-length-bucket warm-up that
    serves prompts trickling in; the streaming profiles keep it. Start-up's phases are timed."""
    import torch

    from cosybatch.frontend.frontend import Frontend
    from cosybatch.synthesizers import _fast_pipeline
    from cosybatch.profiles import load_profile

    calls = []
    monkeypatch.setattr(Frontend, "warmup", lambda self: calls.append(self))
    pipe = _fast_pipeline(model_dir, torch.device("cpu"), load_profile(profile))
    helper = pipe.frontend.text_helper
    try:
        assert len(calls) == (1 if warmed else 0)
        phases = pipe.startup.phases
        assert {"loading (parallel)", "AR engine", "codec"} <= set(phases)
        assert set(pipe.startup.parallel_parts["loading (parallel)"]) == {"models", "frontend", "text normalizer"}
        assert ("frontend warm-up" in phases) == warmed
        # wetext (the profiles' normaliser) runs in a helper process, which reads as this one does
        assert helper is not None and helper.alive
        assert pipe.frontend.prepare("Hi.", "It is 5 past 3.").segment_texts == ["It is five past three."]
        assert helper.fallbacks == 0
    finally:
        pipe.close()
    assert not helper.alive and pipe.frontend.text_helper is None  # the pipeline ends it


def test_prompt_audio_in_helper_processes_is_one_per_worker_and_ends_with_the_pipeline(model_dir, fixtures_dir):
    """``frontend.audio=process``: the start-up starts one helper process per frontend worker,
    a prompt loads through them with the bits it has here, and the pipeline ends them."""
    import os
    import time

    import torch

    from cosybatch.synthesizers import _fast_pipeline
    from cosybatch.profiles import load_profile

    pipe = _fast_pipeline(model_dir, torch.device("cpu"), load_profile("default", ["frontend.audio=process"]))
    pool = pipe.frontend.audio_helpers
    try:
        assert pool is not None and pool.alive and len(pool.helpers) == pipe.settings.frontend_workers
        for h in pool.helpers:  # calls made before a helper's warm-up answers run here: wait for it
            t_end = time.monotonic() + 60
            while h.run(os.getpid) == os.getpid() and time.monotonic() < t_end:
                time.sleep(0.05)
        wav = fixtures_dir / "prompts" / "p2_24k.wav"
        there = pipe.frontend.load(wav)
        assert pool.fallbacks == 0
        pipe.frontend.audio_helpers = None
        pipe.frontend.clear_cache()
        here = pipe.frontend.load(wav)
        pipe.frontend.audio_helpers = pool
        assert all(torch.equal(getattr(here, k), getattr(there, k)) for k in ("wav16", "wav_mel", "fbank"))
    finally:
        pipe.close()
    assert not pool.alive and pipe.frontend.audio_helpers is None


def test_what_is_built_ahead_of_the_rows_does_not_fail_the_start_up(model_dir, monkeypatch):
    """The text normaliser is built during start-up for the first row's sake; if that fails,
    the start-up does not (the rows build it again and report why, as before)."""
    import torch

    import cosybatch.text.normalize as normalize
    from cosybatch.profiles import load_profile
    from cosybatch.synthesizers import _fast_pipeline

    def broken(normalizer):
        raise ImportError("no normaliser here")

    monkeypatch.setattr(normalize, "prepare_normalizer", broken)
    pipe = _fast_pipeline(model_dir, torch.device("cpu"), load_profile("default"))
    try:
        assert "text normalizer" in pipe.startup.parallel_parts["loading (parallel)"]
    finally:
        pipe.close()
