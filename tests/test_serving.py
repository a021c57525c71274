"""The fast pipeline (AR engine + packed codec) gives the official outputs on the fixtures."""

import json

import numpy as np
import pytest
import torch

from conftest import ROWS, load_ref

WAV_TOL = 2.5e-3  # see test_reference_e2e.py for why waveforms get this bound
FP32 = ["ar.dtype=float32", "codec.flow_dtype=float32", "ar.cuda_graphs=false"]


@pytest.fixture(scope="module")
def parts(model_dir):
    from cosybatch.checkpoint import load_models
    from cosybatch.frontend import Frontend

    models = load_models(model_dir)
    return models, Frontend(model_dir, models.cfg)


def _rows(fixtures_dir):
    from cosybatch.manifest import ManifestRow

    rows = []
    for line in (fixtures_dir / "prompts" / "meta.lst").read_text().strip().splitlines():
        utt, pt, wav, tt = line.split("|")
        rows.append(ManifestRow(utt, pt, fixtures_dir / "prompts" / wav, tt))
    return rows


def _drain(pipe, requests):
    from cosybatch.requests import SynthRequest

    for rid, row, stream in requests:
        pipe.add_request(SynthRequest(rid, row, stream))
    chunks, ends = {rid: [] for rid, _, _ in requests}, {}
    while pipe.has_work():
        for ev in pipe.step():
            if ev.kind == "chunk":
                assert ev.request_id not in ends
                chunks[ev.request_id].append(ev.audio)
            else:
                assert ev.request_id not in ends
                ends[ev.request_id] = ev
    return chunks, ends


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
@pytest.mark.parametrize("mode", ["full", "streaming"])
def test_fast_pipeline_matches_official(parts, fixtures_dir, reference_dir, mode, overlap):
    from cosybatch.profiles import load_profile
    from cosybatch.serving import FastPipeline

    models, frontend = parts
    extra = ["optimizations.prefix_reuse=true"] if mode == "streaming" else []
    profile = load_profile("default", FP32 + [f"mode={mode}", "ar.max_num_seqs=3", "codec.max_num_seqs=2",
                                            f"codec.overlap={str(overlap).lower()}"] + extra)
    pipe = FastPipeline(models, frontend, profile, torch.device("cpu"))
    rows = _rows(fixtures_dir)
    stream = mode == "streaming"
    chunks, ends = _drain(pipe, [(r.utt_id, r, stream) for r in rows])
    pipe.close()
    assert all(e.kind == "done" for e in ends.values())
    for row in ROWS:
        ref = load_ref(reference_dir, row)
        meta = json.loads((reference_dir / f"{row}.json").read_text())
        if stream:
            names = [f"stream.seg{c['segment']}.chunk{c['chunk']}" for c in meta["stream_chunks"]]
        else:
            names = [f"nonstream.seg{s}" for s in range(len(meta["segments"]))]
        want = [ref[f"{n}.wav"][0].numpy() for n in names]
        assert [len(c) for c in chunks[row]] == [len(w) for w in want], row
        for got, w in zip(chunks[row], want):
            assert np.abs(got - w).max() <= WAV_TOL, row


def test_bad_row_fails_alone(parts, fixtures_dir, tmp_path):
    from cosybatch.manifest import ManifestRow
    from cosybatch.profiles import load_profile
    from cosybatch.serving import FastPipeline

    models, frontend = parts
    bad_wav = tmp_path / "bad.wav"
    bad_wav.write_bytes(b"not a wav")
    good = _rows(fixtures_dir)[2]
    bad = ManifestRow("bad", good.prompt_text, bad_wav, good.target_text)
    pipe = FastPipeline(models, frontend, load_profile("default", FP32), torch.device("cpu"))
    chunks, ends = _drain(pipe, [("bad", bad, False), ("good", good, False)])
    assert ends["bad"].kind == "error" and "bad.wav" in ends["bad"].error
    assert ends["good"].kind == "done" and len(chunks["good"]) == 1


def test_auto_dtype_is_bfloat16_on_cuda_float32_on_cpu():
    from cosybatch.config import resolve_dtype

    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32
