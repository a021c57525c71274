"""The fast path equals the reference path on a checkpoint whose attention chunk does not line
up with the official 25 -> 50 -> 100 hops (chunk_size 15), streaming with exact prefix reuse."""

import numpy as np
import pytest
import torch

from parity import assert_wave_close
from helpers import FP32, drain, fixture_rows

pytestmark = pytest.mark.numeric


@pytest.fixture(scope="module")
def chunk15(tmp_path_factory, model_dir):
    """The fixture checkpoint with chunk_size 15: same weights and tokens, a 30-frame DiT chunk."""
    import re
    import shutil

    out = tmp_path_factory.mktemp("ckpt") / "c15"
    shutil.copytree(model_dir, out)
    yaml = (out / "cosyvoice3.yaml")
    yaml.chmod(0o644)
    text, n = re.subn(r"(?m)^chunk_size: \d+", "chunk_size: 15", yaml.read_text())
    assert n == 1
    yaml.write_text(text)
    return out


@pytest.mark.parametrize("extra", [[], ["codec.budget_max_ms=40"]], ids=["fixed-budget", "growing-budget"])
def test_fast_streaming_equals_reference_with_misaligned_chunks(chunk15, fixtures_dir, extra):
    """(The budget only reorders work: with it growing while few rows decode, the same audio.)"""
    from cosybatch.synthesizers import ReferenceSynthesizer
    from cosybatch.profiles import load_profile
    from cosybatch.synthesizers import fast_pipeline

    ref = ReferenceSynthesizer(chunk15, torch.device("cpu"))
    assert ref.models.cfg.flow.dit.static_chunk_size == 30
    rows = [r for r in fixture_rows(fixtures_dir) if r.utt_id in ("utt1", "utt4", "utt5_paragraph")]
    profile = load_profile("packed_streaming", FP32 + ["codec.max_num_seqs=3"] + extra)
    pipe = fast_pipeline(ref.models, ref.frontend, profile, torch.device("cpu"))
    chunks, ends = drain(pipe, [(r.utt_id, r, True) for r in rows])
    assert all(e.kind == "done" for e in ends.values())
    assert pipe.codec.flow.stats["cached_tokens"] > 0  # the prefix really was reused
    for r in rows:
        trace = ref.pipeline.run(r.prompt_wav, r.prompt_text, r.target_text, stream=True)
        want = [w for s in trace.segments for w in s.chunk_wavs]
        assert len(want) > 1, "needs several hops to mean anything"
        assert [len(c) for c in chunks[r.utt_id]] == [len(w) for w in want], r.utt_id
        assert_wave_close(np.concatenate(chunks[r.utt_id]), trace.audio, r.utt_id)
