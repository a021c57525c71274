"""End to end: the reference pipeline from WAV + text to waveform equals the official outputs.

Tolerances: token ids exact; mels 1e-4; waveforms 2.5e-3. The waveform bound is looser than
the HiFT module's own parity (exact, see test_hift.py) because our onnxruntime gives CAM++
embeddings ~1e-6 away from the fixture's, and the sine source's phase (a float32 cumsum of
~1e4 rad) turns a 1e-6 mel change into ~1e-3 of waveform; with the fixture's own frontend
tensors the same path is bit-exact (test_exact_with_fixture_frontend).
"""

import json

import numpy as np
import pytest
import torch

from conftest import ROWS, load_ref

MEL_TOL = 1e-4
WAV_TOL = 2.5e-3


@pytest.fixture(scope="module")
def synth(model_dir):
    from cosybatch.pipeline import ReferenceSynthesizer

    return ReferenceSynthesizer(model_dir, torch.device("cpu"))  # profile: reference


def _rows(fixtures_dir):
    out = {}
    for line in (fixtures_dir / "prompts" / "meta.lst").read_text().strip().splitlines():
        utt, pt, wav, tt = line.split("|")
        out[utt] = (fixtures_dir / "prompts" / wav, pt, tt)
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("row", ROWS)
def test_reference_row_matches_official(synth, fixtures_dir, reference_dir, row, stream):
    wav_path, prompt_text, target = _rows(fixtures_dir)[row]
    ref = load_ref(reference_dir, row)
    meta = json.loads((reference_dir / f"{row}.json").read_text())
    trace = synth.pipeline.run(wav_path, prompt_text, target, stream)
    mode = "stream" if stream else "nonstream"
    assert len(trace.segments) == len(meta["segments"])
    pieces = []
    for s, seg in enumerate(trace.segments):
        assert seg.llm_tokens == ref[f"{mode}.seg{s}.llm_tokens_raw"].tolist()
        assert seg.flow_tokens == ref[f"{mode}.seg{s}.speech_token"].tolist()
        if stream:
            want = [c for c in meta["stream_chunks"] if c["segment"] == s]
            assert len(seg.chunk_wavs) == len(want)
            names = [f"stream.seg{s}.chunk{c['chunk']}" for c in want]
        else:
            names = [f"nonstream.seg{s}"]
        for name, mel, wav in zip(names, seg.chunk_mels, seg.chunk_wavs):
            rmel, rwav = ref[f"{name}.mel"], ref[f"{name}.wav"][0].numpy()
            assert mel.shape == rmel.shape and wav.shape == rwav.shape, name
            assert (mel - rmel).abs().max().item() <= MEL_TOL, name
            assert np.abs(wav - rwav).max() <= WAV_TOL, name
            pieces.append(rwav)
    np.testing.assert_allclose(trace.audio, np.concatenate(pieces), atol=WAV_TOL, rtol=0)


def test_exact_with_fixture_frontend(synth, reference_dir):
    from cosybatch.reference.token2wav import PromptTensors, flow_full

    ref = load_ref(reference_dir, "utt1")
    prompt = PromptTensors(ref["frontend.prompt_speech_token"].long(), ref["frontend.prompt_speech_feat"],
                           ref["frontend.embedding"])
    mel = flow_full(synth.models.flow, ref["nonstream.seg0.speech_token"].long(), prompt)
    wav, _ = synth.models.hift.inference(mel, True)
    assert (mel - ref["nonstream.seg0.mel"]).abs().max().item() <= 1e-5
    assert (wav - ref["nonstream.seg0.wav"]).abs().max().item() <= 1e-4
