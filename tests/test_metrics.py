import math

import numpy as np
import pytest

from cosybatch.bench.metrics import (Timeline, aggregate, audio_duration, distribution, e2e_latency, request_metrics,
                               rtf, time_to_first_pcm, underrun)

SR = 1000  # 1 sample = 1 ms, so chunk sizes read as durations


def tl(admitted, chunks, finished=None, error=None, sr=SR):
    last = max((t for t, _ in chunks), default=admitted)
    return Timeline(admitted, tuple(chunks), sr, finished if finished is not None else last, error)


def test_single_request_by_hand():
    # admitted at 10 s; an empty chunk, then 0.5 s, 0.5 s, a 0.5 s gap too late, then 0.2 s
    t = tl(10.0, [(10.5, 0), (11.0, 500), (11.25, 500), (12.5, 1000), (12.6, 200)])
    assert time_to_first_pcm(t) == pytest.approx(1.0)  # the empty chunk does not count
    assert e2e_latency(t) == pytest.approx(2.6)
    assert audio_duration(t) == pytest.approx(2.2)
    assert rtf(t) == pytest.approx(2.6 / 2.2)
    # player: starts 11.0, has audio to 11.5, then to 12.0; the chunk at 12.5 finds it dry for 0.5 s
    assert underrun(t) == pytest.approx(0.5)


def test_underrun_is_the_worst_stall_after_rebuffering():
    # stalls of 0.3 s and 0.7 s; after the first the player resumes at the arrival, not on schedule
    t = tl(0.0, [(1.0, 100), (1.4, 100), (2.2, 500), (2.5, 100)])
    # 1.0-1.1 play, dry 1.1-1.4 (0.3), 1.4-1.5 play, dry 1.5-2.2 (0.7), 2.2-2.7 play; 2.5 arrives in time
    assert underrun(t) == pytest.approx(0.7)
    # a faster-than-real-time stream never starves
    assert underrun(tl(0.0, [(1.0, 300), (1.2, 300), (1.5, 300)])) == 0.0
    # exactly on time is not a stall
    assert underrun(tl(0.0, [(0.5, 250), (0.75, 250), (1.0, 250)])) == 0.0


def test_no_audio():
    t = tl(1.0, [(2.0, 0)], finished=3.0)
    assert time_to_first_pcm(t) is None and audio_duration(t) == 0.0 and rtf(t) is None
    assert e2e_latency(t) == pytest.approx(2.0)  # falls back to completion time
    assert underrun(t) == 0.0


def test_sample_rate_is_respected():
    t = tl(0.0, [(0.2, 24000), (0.3, 12000)], sr=24000)
    assert audio_duration(t) == pytest.approx(1.5)
    assert rtf(t) == pytest.approx(0.3 / 1.5)


def test_distribution_matches_numpy():
    vals = [0.1, 0.4, 0.2, None, 0.3, math.nan, 1.0]
    d = distribution(vals, "x_ms", 1000.0)
    v = np.array([100.0, 400.0, 200.0, 300.0, 1000.0])
    assert d["mean_x_ms"] == pytest.approx(400.0)
    assert d["median_x_ms"] == pytest.approx(300.0)
    assert d["std_x_ms"] == pytest.approx(v.std())
    assert d["p90_x_ms"] == pytest.approx(760.0)  # linear: 400 + 0.6 * (1000 - 400)
    assert d["p99_x_ms"] == pytest.approx(976.0)
    assert distribution([], "x")["mean_x"] is None


def test_aggregate_by_hand():
    a = tl(0.0, [(0.5, 1000), (1.0, 1000)])  # ttfp 0.5, e2e 1.0, 2 s audio, no stall
    b = tl(0.0, [(1.0, 500), (2.0, 500)])  # ttfp 1.0, e2e 2.0, 1 s audio, stall 0.5
    c = tl(1.0, [(2.0, 3000)])  # ttfp 1.0, e2e 1.0, 3 s audio
    failed = tl(0.5, [(1.5, 700)], finished=1.6, error="boom")
    m = aggregate([a, b, c, failed], wall_s=4.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["duration"] == 4.0
    assert m["total_audio_duration_s"] == pytest.approx(6.0)  # the failed request's audio is not counted
    assert m["audio_throughput"] == pytest.approx(1.5)
    assert m["request_throughput"] == pytest.approx(0.75)
    assert m["mean_ttfp_ms"] == pytest.approx(2500.0 / 3)
    assert m["median_ttfp_ms"] == pytest.approx(1000.0)
    assert m["p99_ttfp_ms"] == pytest.approx(1000.0)
    assert m["mean_e2el_ms"] == pytest.approx(4000.0 / 3)
    assert m["median_e2el_ms"] == pytest.approx(1000.0)
    assert m["mean_rtf"] == pytest.approx((0.5 + 2.0 + 1 / 3) / 3)
    assert m["mean_underrun_ms"] == pytest.approx(500.0 / 3)
    assert m["p90_underrun_ms"] == pytest.approx(400.0)
    assert m["underrun_requests"] == 1
    assert m["mean_audio_duration_s"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        aggregate([a], 0.0)


def test_request_metrics_keys():
    m = request_metrics(tl(0.0, [(0.25, 500)]))
    assert m == {"ttfp_s": 0.25, "e2el_s": 0.25, "audio_duration_s": 0.5, "rtf": 0.5, "underrun_s": 0.0}


def test_vllm_style_key_names():
    m = aggregate([tl(0.0, [(1.0, 1000)])], 1.0)
    for k in ("request_throughput", "audio_throughput", "mean_ttfp_ms", "median_ttfp_ms", "p99_ttfp_ms",
              "mean_e2el_ms", "p90_e2el_ms", "mean_rtf", "p99_underrun_ms", "std_ttfp_ms"):
        assert k in m
