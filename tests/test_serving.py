"""The fast pipeline (AR engine + packed codec) gives the official outputs on the fixtures."""

import numpy as np
import pytest
import torch

from helpers import FP32, assert_official_chunks, drain, fixture_rows, official
from parity import assert_wave_close

pytestmark = pytest.mark.numeric


BESIDE = ["codec.deadline_lead_ms=500", "scheduler.ar_stream=beside"]
# five rows for three AR rows: a backlog, so freed rows are held for a batched prefill (design.md D29)
PREFILL_BATCHING = ["ar.prefill_min_rows=2", "ar.prefill_wait_ms=20"]
# rows' first hops solved apart, beside a solve in progress (design.md D39)
FIRST_APART = BESIDE + ["codec.first_hops_apart=true"]


# The last cases: deadline batching and the AR step beside the codec (design.md D22) are
# accepted on a CPU, where the AR step stays serial, and change no result; and the host's side
# of beside forced on (AR steps collected and launched between the codec's slices, at their own
# pace), which a CPU can run without streams; and prefill batching under a backlog.
@pytest.mark.parametrize("mode,timeline,host_beside", [("full", [], False), ("streaming", [], False),
                                                       ("streaming", BESIDE, False), ("streaming", BESIDE, True),
                                                       ("full", BESIDE, True), ("full", PREFILL_BATCHING, False),
                                                       ("streaming", FIRST_APART, False)])
def test_fast_pipeline_matches_official(parts, fixtures_dir, reference_dir, mode, timeline, host_beside):
    from cosybatch.profiles import load_profile
    from cosybatch.synthesizers import fast_pipeline

    models, frontend = parts
    extra = ["optimizations.prefix_reuse=true"] if mode == "streaming" else []
    profile = load_profile("default", FP32 + [f"mode={mode}", "ar.max_num_seqs=3", "codec.max_num_seqs=2"] + extra
                           + timeline)
    pipe = fast_pipeline(models, frontend, profile, torch.device("cpu"))
    assert pipe._ar_stream is None  # serial on a CPU, whatever the profile asks
    if host_beside:
        pipe._beside = True
        turns = []
        ar_turn = pipe._ar_turn
        pipe._ar_turn = lambda: (turns.append(pipe.engine.in_flight), ar_turn())
    assert pipe.codec.limits.deadline_lead_s == (0.5 if timeline in (BESIDE, FIRST_APART) else None)
    sch = pipe.engine.scheduler
    assert sch.prefill_min_rows == (2 if timeline == PREFILL_BATCHING else 1)
    held, clock = [], sch.clock
    sch.clock = lambda: held.append(1) or clock()  # the scheduler reads its clock only to hold a row
    rows = fixture_rows(fixtures_dir)
    stream = mode == "streaming"
    chunks, ends = drain(pipe, [(r.utt_id, r, stream) for r in rows])
    tl = pipe.timeline()
    stages = tl["row_stages_ms"]
    # every row's first hop solved apart, and only those (a row's later hops follow it)
    assert pipe.codec.counts["first_jobs"] == (len(rows) if timeline == FIRST_APART else 0), pipe.codec.counts
    prefilled = pipe.engine.stats.prefill_seqs  # a row's segments prefill one after another
    pipe.close()
    assert all(e.kind == "done" for e in ends.values())
    # by tenth: every row's prompt loaded once, every segment prefilled once
    tenths = tl["by_tenth"]
    assert sum(tenths["marks"]["prompts_loaded"]) == len(rows), tenths["marks"]
    assert sum(tenths["size"]["ar_prefill"]) == prefilled >= len(rows), tenths["size"]
    assert sum(tenths["count"]["ar_prefill"]) == tl["batches"]["prefill_calls"], tenths["count"]
    if host_beside:  # AR steps were collected between codec slices
        assert True in turns, turns
    assert bool(held) == (timeline == PREFILL_BATCHING)
    # every row's life is accounted, stage by stage (times run forward)
    assert set(stages) == {"prompt", "first_tokens", "prefill", "first_decode", "first_audio", "after_tokens",
                           "decoding"}, stages
    assert all(v["p50"] >= 0 and v["mean"] >= 0 for v in stages.values()), stages
    assert_official_chunks(chunks, official(reference_dir, stream)[1])



@pytest.mark.parametrize("step_ms", [0.05, 20.0, 300.0])
def test_streaming_output_is_the_official_one_whatever_the_clock_says(parts, fixtures_dir, reference_dir,
                                                                      monkeypatch, step_ms):
    """The codec's policy plans from the host clock (deadlines, waits, a player about to run dry),
    so which of its branches run depends on how fast the host is. A seeded clock that moves 0 to
    ``step_ms`` at every read stands for hosts far slower and faster than this one (at 300 ms
    every deadline is urgent, at 0.05 ms none comes before the AR engine idles; the HiFT batches
    differ), with first hops solved apart: the output stays the official one."""
    import random
    import time

    from cosybatch.profiles import load_profile
    from cosybatch.synthesizers import fast_pipeline

    models, frontend = parts
    profile = load_profile("default", FP32 + ["mode=streaming", "ar.max_num_seqs=3", "codec.max_num_seqs=2",
                                              "optimizations.prefix_reuse=true"] + FIRST_APART)
    pipe = fast_pipeline(models, frontend, profile, torch.device("cpu"))
    rng, now = random.Random(7), [1000.0]

    def clock():
        now[0] += rng.uniform(0.0, step_ms) / 1e3
        return now[0]

    monkeypatch.setattr(time, "perf_counter", clock)
    rows = fixture_rows(fixtures_dir)
    chunks, ends = drain(pipe, [(r.utt_id, r, True) for r in rows])
    pipe.close()
    monkeypatch.undo()
    assert all(e.kind == "done" for e in ends.values())
    assert_official_chunks(chunks, official(reference_dir, True)[1])


def test_bad_row_fails_alone(parts, fixtures_dir, tmp_path):
    from cosybatch.manifest import ManifestRow
    from cosybatch.profiles import load_profile
    from cosybatch.synthesizers import fast_pipeline

    models, frontend = parts
    bad_wav = tmp_path / "bad.wav"
    bad_wav.write_bytes(b"not a wav")
    good = fixture_rows(fixtures_dir)[2]
    bad = ManifestRow("bad", good.prompt_text, bad_wav, good.target_text)
    pipe = fast_pipeline(models, frontend, load_profile("default", FP32), torch.device("cpu"))
    chunks, ends = drain(pipe, [("bad", bad, False), ("good", good, False)])
    assert ends["bad"].kind == "error" and "bad.wav" in ends["bad"].error
    assert ends["good"].kind == "done" and len(chunks["good"]) == 1


def test_warm_prompts_leave_the_run_only_cache_hits(model_dir, fixtures_dir):
    """``profile --warm-prompts``: every prompt's features are computed before the run, so
    the rows then read them from the cache and give the same audio."""
    from cosybatch.checkpoint import load_models
    from cosybatch.frontend.frontend import Frontend
    from cosybatch.profiles import load_profile
    from cosybatch.synthesizers import fast_pipeline

    models = load_models(model_dir)
    rows = fixture_rows(fixtures_dir)[:3]
    reqs = [(r.utt_id, r, False) for r in rows]
    profile = load_profile("default", FP32)
    cold, _ = drain(fast_pipeline(models, Frontend(model_dir, models.cfg), profile, torch.device("cpu")),
                     reqs, force_tokens=20)
    frontend = Frontend(model_dir, models.cfg)
    pipe = fast_pipeline(models, frontend, profile, torch.device("cpu"))
    assert pipe.warm_prompts([r.prompt_wav for r in rows] * 2) == 3
    misses = frontend._cache.stats["misses"]
    warm, ends = drain(pipe, reqs, force_tokens=20)
    assert frontend._cache.stats["misses"] == misses and all(e.kind == "done" for e in ends.values())
    for r in rows:
        assert_wave_close(np.concatenate(warm[r.utt_id]), np.concatenate(cold[r.utt_id]), r.utt_id)


def test_auto_dtype_is_bfloat16_on_cuda_float32_on_cpu():
    from cosybatch.models.config import resolve_dtype

    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32


def test_prompt_features_batched_on_the_scheduler_thread_give_the_same_audio(parts, fixtures_dir):
    """With a GPU frontend the workers only load audio and the scheduler launches the frontend's
    models for all newly loaded prompts at once, then reads the batch back at a later iteration,
    once it is ready (polled, never waited for while other work can go on); the rows' audio is
    what the worker path gives."""
    from cosybatch.profiles import load_profile
    from cosybatch.synthesizers import fast_pipeline

    models, frontend = parts
    rows = fixture_rows(fixtures_dir)[:3]
    reqs = [(r.utt_id, r, False) for r in rows]
    profile = load_profile("default", FP32)
    a, _ = drain(fast_pipeline(models, frontend, profile, torch.device("cpu")), reqs, force_tokens=30)
    batched = fast_pipeline(models, frontend, profile, torch.device("cpu"))
    batched.prompts.on_device = True  # what a torch frontend on CUDA selects
    calls, polls = [], []
    real = frontend.launch_features

    class Late:  # a batch whose copies land only at the third poll (or when the loop is idle)
        def __init__(self, pending):
            self.pending = pending

        def ready(self):
            polls.append(1)
            return len(polls) >= 3

        def result(self):
            return self.pending.result()

    frontend.launch_features = lambda prompts: calls.append(len(prompts)) or Late(real(prompts))
    try:
        b, ends = drain(batched, reqs, force_tokens=30, together=True)
    finally:
        frontend.launch_features = real
    assert calls == [3] and all(e.kind == "done" for e in ends.values())  # one batch of all three
    assert polls  # polled, not read at once
    for r in rows:
        assert_wave_close(np.concatenate(b[r.utt_id]), np.concatenate(a[r.utt_id]), r.utt_id)


def test_a_failed_frontend_batch_is_retried_prompt_by_prompt(parts, fixtures_dir):
    """A batch whose launch fails (out of memory for the batch) is redone one prompt at a time:
    only the prompt that fails alone fails its row, the others finish."""
    from cosybatch.profiles import load_profile
    from cosybatch.synthesizers import fast_pipeline

    models, frontend = parts
    rows = fixture_rows(fixtures_dir)[:3]
    bad = rows[1].prompt_wav
    pipe = fast_pipeline(models, frontend, load_profile("default", FP32), torch.device("cpu"))
    pipe.prompts.on_device = True
    real_launch = frontend.launch_features

    def launch(prompts):  # a batch runs out of memory; a bad prompt fails alone too
        if len(prompts) > 1:
            raise RuntimeError("CUDA out of memory (injected)")
        if prompts[0].source == str(bad):
            raise RuntimeError("bad prompt (injected)")
        return real_launch(prompts)

    frontend.launch_features = launch  # features() launches through it too
    try:
        _, ends = drain(pipe, [(r.utt_id, r, False) for r in rows], force_tokens=30, together=True)
    finally:
        frontend.launch_features = real_launch
    kinds = {k: e.kind for k, e in ends.items()}
    assert kinds == {rows[0].utt_id: "done", rows[1].utt_id: "error", rows[2].utt_id: "done"}, kinds
    assert "bad prompt" in ends[rows[1].utt_id].error


def test_the_hift_frame_bucket_pads_on_cuda_only(parts):
    from cosybatch.profiles import load_profile
    from cosybatch.profiles.resolve import resolve
    from cosybatch.synthesizers import fast_pipeline

    models, frontend = parts
    for kv, bucket in ((["optimizations.hift_graphs=true", "optimizations.hift_frame_bucket=128"], 128),
                       (["optimizations.hift_frame_bucket=64"], 64)):
        profile = load_profile("default", FP32 + kv)
        assert resolve(profile, models.cfg, torch.device("cuda")).codec.hift_frame_bucket == bucket
        pipe = fast_pipeline(models, frontend, profile, torch.device("cpu"))
        try:
            assert pipe.codec.hift.frame_bucket == 1  # exact windows on a CPU: padding only costs there
        finally:
            pipe.close()


def test_timeline_counts_graph_captures_inside_the_window(parts):
    """``timeline(reset=True)`` starts the measured window; each graph cache then reports how
    many captures fell inside it (what start-up and the warm-ups did not capture)."""
    from cosybatch.profiles import load_profile
    from cosybatch.synthesizers import fast_pipeline

    models, frontend = parts
    pipe = fast_pipeline(models, frontend, load_profile("default", FP32), torch.device("cpu"))
    captures = {"n": 5}
    pipe._graph_stats = lambda: {"flow": {"captures": captures["n"], "hit_rate": 1.0}, "hift": None,
                                 "prefill": {"buckets": 3}}
    try:
        assert pipe.timeline()["graphs"]["flow"]["captures_in_window"] == 5  # since start-up: no window yet
        pipe.timeline(reset=True)
        captures["n"] = 12
        g = pipe.timeline()["graphs"]
        assert g["flow"]["captures_in_window"] == 7 and g["hift"] is None and "captures_in_window" not in g["prefill"]
    finally:
        pipe.close()


def test_slices_that_capture_a_graph_are_counted_apart_and_teach_the_cost_model_nothing(parts, fixtures_dir):
    """A HiFT batch or flow step that captured a CUDA graph paid for the capture (an eager
    warm-up, cold shapes): the timeline counts it as ``hift_capture`` / ``flow_capture``, the
    cost model learns only from the others, and the stage's busy time still includes it."""
    from types import SimpleNamespace

    from cosybatch.profiles import load_profile
    from cosybatch.synthesizers import fast_pipeline

    class Capturing:  # the real runner (or solve), seen through a graph cache that "captures" once
        def __init__(self, inner, graphs=None):
            self.inner = inner
            self.graphs = graphs or SimpleNamespace(stats=SimpleNamespace(captures=0))

        def _once(self):
            self.graphs.stats.captures = max(self.graphs.stats.captures, 1)

        def run(self, jobs):  # HiFT
            self._once()
            return self.inner.run(jobs)

        def start(self, jobs):  # the flow: its first Euler steps capture
            return Capturing(self.inner.start(jobs), self.graphs)

        def step(self, n=1):
            self._once()
            return self.inner.step(n)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    models, frontend = parts
    pipe = fast_pipeline(models, frontend, load_profile("default", FP32), torch.device("cpu"))
    learned = {"hift": [], "flow": []}
    costs = pipe.codec.costs
    hift_obs, flow_obs = costs.observe_hift, costs.observe_flow_step
    costs.observe_hift = lambda frames, ms: learned["hift"].append(ms) or hift_obs(frames, ms)
    costs.observe_flow_step = lambda tokens, ms: learned["flow"].append(ms) or flow_obs(tokens, ms)
    pipe.codec.hift, pipe.codec.flow = Capturing(pipe.codec.hift), Capturing(pipe.codec.flow)
    try:
        for row in fixture_rows(fixtures_dir)[:2]:  # one after the other: two HiFT batches, two solves
            _, ends = drain(pipe, [(row.utt_id, row, False)], force_tokens=20)
            assert ends[row.utt_id].kind == "done"
        ms = pipe.acct.ms
        for kind in ("hift", "flow"):
            replays = ms[kind if kind == "hift" else "flow_step"]
            assert len(ms[f"{kind}_capture"]) == 1 and len(replays) >= 1, kind
            assert len(learned[kind]) == len(replays), kind
        busy = pipe.stage_busy()
        assert busy["hift"] == pytest.approx((sum(ms["hift"]) + sum(ms["hift_capture"])) / 1e3)
        assert busy["flow"] >= (sum(ms["flow_step"]) + sum(ms["flow_capture"])) / 1e3 - 1e-9
    finally:
        pipe.close()


def test_float32_flow_on_cuda_gets_an_attention_that_runs_float32(parts):
    """FlashAttention's kernels take fp16/bf16 only: ``auto`` picks SDPA for a float32 flow (rows
    failed with "FlashAttention only support fp16 and bf16" before), and an explicit varlen or
    flash with a float32 flow is a profile error, before any model work."""
    from cosybatch.codec.attention import make_backend
    from cosybatch.profiles import ProfileError, load_profile
    from cosybatch.profiles.resolve import resolve

    assert make_backend("auto", "cuda", torch.float32).name == "sdpa"
    for name in ("varlen", "flash"):
        with pytest.raises(ValueError, match="fp16/bf16 only"):
            make_backend(name, "cuda", torch.float32)
        with pytest.raises(ProfileError, match="fp16/bf16 only"):
            resolve(load_profile("default", FP32 + [f"codec.attention={name}"]), parts[0].cfg, torch.device("cuda"))
    assert resolve(load_profile("default", FP32), parts[0].cfg, torch.device("cuda")).codec.attention == "auto"
