"""scripts/flow_bound.py: the flow's work and the rate a target needs, from a run's counters."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cosybatch.codec.flops import dit_token_flops
from cosybatch.models.config import FlowConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
try:
    from flow_bound import bound, load  # noqa: E402
finally:
    sys.path.pop(0)


def _timing(path: Path) -> None:
    """A synth timing.json whose numbers make the answer easy to check by hand: 100 s of audio in
    1 s, 1,000 tokens per Euler step over 2 solves, flow steps 0.4 s + a 0.1 s capture, AR steps of
    2 ms, 0.1 s each of prefill, HiFT and frontend, 20 mixed steps of 7 ms (5 ms of prefill each)."""
    slices = {"flow_step": 400.0, "flow_capture": 100.0, "flow_start": 50.0, "hift_capture": 70.0,
              "ar_prefill": 100.0, "hift": 100.0, "frontend": 100.0, "ar_decode": 999.0}
    tl = {"batches": {"flow_tokens_per_step": 1000.0, "flow_calls": 2}, "ar_step_ms": {"p50": 2.0},
          "slice_ms": {**{k: {"total": v} for k, v in slices.items()}, "ar_mixed": {"total": 140.0, "count": 20}}}
    with gzip.open(path, "wt") as f:
        json.dump({"totals": {"audio_s": 100.0, "wall_s": 1.0, "timeline": tl}}, f)


def test_required_flow_rate_from_a_synth_timing(tmp_path):
    _timing(tmp_path / "timing.json.gz")
    cfg = FlowConfig()
    out = bound(load(tmp_path / "timing.json.gz"), target=50.0, ar_rows=10, cfg=cfg)
    work = 2000 * cfg.n_timesteps * dit_token_flops(cfg.dit)
    assert out["flow_work_pflop"] == pytest.approx(work / 1e15)
    assert out["flow_tflops_measured"] == pytest.approx(work / 0.5 / 1e12)  # steps + capture
    # window 2 s; decode 100 s x 25 tokens/s / 10 rows x 2 ms = 0.5 s; the mixed steps' prefill
    # 0.14 s - 20 x 2 ms = 0.1 s (their decode is in the full steps); 0.3 s for the others
    assert out["other_stages_s"]["ar_decode"] == pytest.approx(0.5)
    assert out["other_stages_s"]["ar_mixed_prefill"] == pytest.approx(0.1)
    assert out["flow_share_s"] == pytest.approx(2.0 - 0.9)
    assert out["flow_tflops_needed"] == pytest.approx(work / 1.1 / 1e12)


def test_an_ar_step_beside_the_codec_takes_none_of_the_window(tmp_path):
    _timing(tmp_path / "timing.json.gz")
    run = load(tmp_path / "timing.json.gz")
    run["ar_beside"] = True  # what a profile result with scheduler.ar_stream: beside loads as
    out = bound(run, target=50.0, ar_rows=10, cfg=FlowConfig())
    assert out["other_stages_s"]["ar_decode"] == out["other_stages_s"]["ar_mixed_prefill"] == 0
    assert out["other_stages_s"]["ar_prefill"] == 0  # the AR stream's too
    assert out["flow_share_s"] == pytest.approx(2.0 - 0.2)  # HiFT and the frontend


def test_a_synth_timing_needs_the_ar_admission(tmp_path):
    _timing(tmp_path / "timing.json.gz")
    r = subprocess.run([sys.executable, str(REPO / "scripts/flow_bound.py"), str(tmp_path / "timing.json.gz"),
                        "--target", "50"], capture_output=True, text=True)
    assert r.returncode == 2 and "--ar-rows" in r.stderr
