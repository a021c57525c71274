"""`cosybatch synth` through the fast path (default profile) writes the official waveforms."""

import re

import numpy as np
import pytest
import soundfile as sf
from click.testing import CliRunner

from conftest import ROWS, load_ref

WAV_TOL = 2.5e-3  # see test_reference_e2e.py


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_synth_default_profile_matches_official(fixtures_dir, reference_dir, tmp_path, stream):
    from cosybatch.cli import cli

    out = tmp_path / "out"
    args = ["synth", str(fixtures_dir / "prompts" / "meta.lst"), "--model", str(fixtures_dir / "model"),
            "--out", str(out), "--device", "cpu", "--wav-subtype", "FLOAT", "--quiet",
            "--profile", "default", "--set", "optimizations.prefix_reuse=" + ("true" if stream else "false")]
    if stream:
        args.append("--stream")
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    for row in ROWS:
        ref = load_ref(reference_dir, row)
        mode = "stream" if stream else "nonstream"
        # numeric order of (segment, chunk): "chunk10" must come after "chunk2"
        names = sorted((k for k in ref if k.startswith(f"{mode}.seg") and k.endswith(".wav")),
                       key=lambda k: [int(t) for t in re.findall(r"\d+", k)])
        want = np.concatenate([ref[k][0].numpy() for k in names])
        got, sr = sf.read(out / f"{row}.wav", dtype="float32")
        assert sr == 24000 and got.shape == want.shape, row
        assert np.abs(got - want).max() <= WAV_TOL, row
