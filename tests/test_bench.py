import json
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from cosybatch.bench import workload
from cosybatch.bench.closed_loop import run_closed_loop
from cosybatch.cli import profile_command
from cosybatch.scheduler.protocol import Event, PipelineContractError, StreamingPipeline, SynthRequest

SR = 8000
STEP_S = 0.125  # exact in binary: timelines compare exactly


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@dataclass
class _Active:
    req: SynthRequest
    steps: int = 0
    sent: int = 0


class FakePipeline:
    """Each step advances the clock by STEP_S. A request's first chunk comes on its ``delay``-th
    step, then one chunk of ``chunk_s`` seconds per step; ``done`` rides with the last chunk.
    Row attributes override the defaults per request (delay, n_chunks, chunk_s, fail)."""

    sample_rate = SR
    token_frame_rate = 25

    def __init__(self, clock=None, delay=2, n_chunks=3, chunk_s=STEP_S):
        self.clock = clock
        self.defaults = dict(delay=delay, n_chunks=n_chunks, chunk_s=chunk_s, fail=False)
        self.active: dict[str, _Active] = {}
        self.added: list[str] = []
        self.peak = 0
        self.busy = {"frontend": 0.0, "ar": 0.0, "flow": 0.0, "hift": 0.0}
        self.forced: dict[str, int | None] = {}

    def _opt(self, req, name):
        return getattr(req.row, name, None) if getattr(req.row, name, None) is not None else self.defaults[name]

    def add_request(self, req):
        assert req.request_id not in self.active
        self.active[req.request_id] = _Active(req)
        self.added.append(req.request_id)
        self.forced[req.request_id] = req.force_tokens
        self.peak = max(self.peak, len(self.active))
        self.busy["frontend"] += 0.01

    def has_work(self):
        return bool(self.active)

    def stage_busy(self):
        return dict(self.busy)

    def step(self):
        if self.clock is not None:
            self.clock.t += STEP_S
        self.busy["ar"] += 0.1
        self.busy["flow"] += 0.02
        events = []
        for rid, a in list(self.active.items()):
            a.steps += 1
            if a.steps < self._opt(a.req, "delay"):
                continue
            if self._opt(a.req, "fail"):
                events.append(Event(rid, "error", error="synthetic failure"))
                del self.active[rid]
                continue
            n = int(self._opt(a.req, "chunk_s") * SR)
            events.append(Event(rid, "chunk", audio=np.zeros(n, np.float32)))
            a.sent += 1
            if a.sent == self._opt(a.req, "n_chunks"):
                events.append(Event(rid, "done"))
                del self.active[rid]
        return events


def row(i, **kw):
    return SimpleNamespace(utt_id=f"u{i}", prompt_text="p", prompt_wav="p.wav", target_text="t", **kw)


def reqs(n, **kw):
    return [SynthRequest(f"r{i}", row(i, **kw)) for i in range(n)]


def test_fake_satisfies_the_protocol():
    assert isinstance(FakePipeline(), StreamingPipeline)


def test_closed_loop_numbers_by_hand():
    clock = FakeClock()
    pipe = FakePipeline(clock)
    res = run_closed_loop(pipe, reqs(4), concurrency=2, num_warmups=0, clock=clock)
    # two waves of two: each request takes 4 steps (first chunk on step 2, done on step 4)
    assert pipe.peak == 2 and res.max_in_flight == 2
    assert res.wall_s == 8 * STEP_S
    m = res.metrics
    assert (m["completed"], m["failed"]) == (4, 0)
    assert m["total_audio_duration_s"] == 4 * 3 * STEP_S
    assert m["audio_throughput"] == pytest.approx(1.5)
    assert m["request_throughput"] == pytest.approx(4.0)
    assert m["mean_ttfp_ms"] == pytest.approx(250.0) and m["p99_ttfp_ms"] == pytest.approx(250.0)
    assert m["mean_e2el_ms"] == pytest.approx(500.0)
    assert m["mean_rtf"] == pytest.approx(0.5 / 0.375)
    assert m["mean_underrun_ms"] == 0.0
    admitted = sorted(r.admitted for r in res.records)
    assert admitted == [0.0, 0.0, 0.5, 0.5]  # the second wave enters as the first finishes
    assert res.stage_busy_s["ar"] == pytest.approx(0.8) and res.stage_busy_s["frontend"] == pytest.approx(0.04)


def test_new_request_admitted_as_soon_as_one_finishes():
    clock = FakeClock()
    # r0 finishes after 2 steps, r1 after 6: r2 must enter at step 2, not wait for r1
    rs = [SynthRequest("r0", row(0, delay=1, n_chunks=2)), SynthRequest("r1", row(1, delay=1, n_chunks=6)),
          SynthRequest("r2", row(2, delay=1, n_chunks=1))]
    res = run_closed_loop(FakePipeline(clock), rs, concurrency=2, clock=clock)
    by = {r.request_id: r for r in res.records}
    assert by["r2"].admitted == 2 * STEP_S
    assert by["r2"].finished == 3 * STEP_S
    assert res.wall_s == 6 * STEP_S


@pytest.mark.parametrize("c", [1, 3, 7, 20])
def test_concurrency_never_exceeded(c):
    pipe = FakePipeline(FakeClock())
    rs = [SynthRequest(f"r{i}", row(i, delay=1 + i % 4, n_chunks=1 + i % 3)) for i in range(17)]
    res = run_closed_loop(pipe, rs, concurrency=c, num_warmups=5, clock=pipe.clock)
    assert pipe.peak == min(c, 17) and res.max_in_flight == min(c, 17)
    assert res.metrics["completed"] == 17
    assert [r.request_id for r in res.records] == [f"r{i}" for i in range(17)]


def test_warmups_run_first_and_are_excluded():
    clock = FakeClock()
    pipe = FakePipeline(clock)
    res = run_closed_loop(pipe, reqs(3), concurrency=2, num_warmups=5, clock=clock)
    assert pipe.added[:5] == [f"warmup-{i}" for i in range(5)]
    assert pipe.added[5:] == ["r0", "r1", "r2"]
    assert res.num_warmups == 5 and res.metrics["completed"] == 3
    assert {r.request_id for r in res.records} == {"r0", "r1", "r2"}
    # the measured clock starts after the warm-ups drained: r0 is admitted at t=0 of the run
    assert min(r.admitted for r in res.records) == 0.0
    assert res.wall_s == 8 * STEP_S  # 2 + 1 requests -> two waves of 4 steps
    assert res.stage_busy_s["ar"] == pytest.approx(0.8)  # warm-up busy time is not counted


def test_failures_and_underruns_are_recorded():
    clock = FakeClock()
    # slow: 3 chunks of 1/16 s every step of 1/8 s -> dry for 1/16 s before each later chunk
    rs = [SynthRequest("ok", row(0)), SynthRequest("bad", row(1, fail=True)),
          SynthRequest("slow", row(2, chunk_s=STEP_S / 2))]
    res = run_closed_loop(FakePipeline(clock), rs, concurrency=3, clock=clock)
    by = {r.request_id: r for r in res.records}
    assert by["bad"].error == "synthetic failure" and res.metrics["failed"] == 1
    assert by["slow"].underrun_s == STEP_S / 2
    assert res.metrics["underrun_requests"] == 1
    doc = res.to_json({"model_id": "fake"})
    assert doc["errors"] == ["bad: synthetic failure"] and len(doc["ttfps"]) == 2
    json.dumps(doc)


def test_contract_violations_raise():
    class Idle(FakePipeline):
        def has_work(self):
            return False

    with pytest.raises(PipelineContractError, match="no work while 1 request"):
        run_closed_loop(Idle(FakeClock()), reqs(1), 1)

    class Stray(FakePipeline):
        def step(self):
            return [Event("ghost", "chunk", audio=np.zeros(4, np.float32))]

    with pytest.raises(PipelineContractError, match="'ghost', which is not in flight"):
        run_closed_loop(Stray(FakeClock()), reqs(1), 1)
    with pytest.raises(PipelineContractError, match="duplicate request id"):
        run_closed_loop(FakePipeline(FakeClock()), [SynthRequest("x", row(0))] * 2, 1)


def test_real_clock_numbers_are_consistent():
    pipe = FakePipeline()  # no fake clock: perf_counter
    res = run_closed_loop(pipe, reqs(6), concurrency=4, num_warmups=2)
    m = res.metrics
    assert m["audio_throughput"] == pytest.approx(m["total_audio_duration_s"] / res.wall_s)
    for r in res.records:
        assert 0 <= r.admitted <= r.ttfp_s + r.admitted <= r.finished <= res.wall_s + 1e-9
        assert r.e2el_s >= r.ttfp_s


# --- the CLI command ---------------------------------------------------------------------------

CALLS: list = []


def build_fake(model, device, profile):
    CALLS.append((model, device, profile))
    return FakePipeline(delay=1, n_chunks=2)


@pytest.fixture(scope="module")
def small_manifest(tmp_path_factory):
    return workload.write(tmp_path_factory.mktemp("wl"), (), n_rows=6, n_prompts=3, seed=1)


def invoke(*args):
    return CliRunner().invoke(profile_command, [*args, "--pipeline", "test_bench:build_fake"])


def test_profile_command_writes_a_result(small_manifest, tmp_path):
    CALLS.clear()
    r = invoke(str(small_manifest), "--model", "m", "--device", "cpu", "-c", "2", "--num-warmups", "1",
               "--profile", "packed_streaming_optimized_standard", "--force-length", "--result-dir", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert len(CALLS) == 1 and CALLS[0][2].name == "packed_streaming_optimized_standard"
    assert "audio throughput" in r.output
    (path,) = tmp_path.glob("cosybatch-packed_streaming_optimized_standard-c2-*.json")
    doc = json.loads(path.read_text())
    assert doc["completed"] == 6 and doc["max_concurrency"] == 2 and doc["num_warmups"] == 1
    assert doc["profile"]["sampling"]["mode"] == "standard"
    assert doc["audio_throughput"] > 0 and len(doc["records"]) == 6
    assert doc["stage_busy_s"]["ar"] > 0


def test_profile_command_samples_and_cycles_rows(small_manifest):
    CALLS.clear()
    r = invoke(str(small_manifest), "--num-prompts", "9", "-c", "3")
    assert r.exit_code == 0, r.output
    r = invoke(str(small_manifest), "--num-prompts", "2", "-c", "3", "--seed", "5")
    assert r.exit_code == 0, r.output


def test_profile_command_bad_profile_exits_2_before_any_work(small_manifest):
    CALLS.clear()
    r = invoke(str(small_manifest), "--profile", "packed_streaming_optimized_standard",
               "--set", "sampling.mode=ras")
    assert r.exit_code == 2 and CALLS == []
    r = invoke(str(small_manifest), "--set", "ar.max_num_seqz=3")
    assert r.exit_code == 2 and CALLS == []
    r = invoke(str(small_manifest), "--profile", "nope")
    assert r.exit_code == 2 and CALLS == []


def test_force_length_reaches_the_requests(small_manifest, monkeypatch):
    made = []

    def build(model, device, profile):
        made.append(FakePipeline(delay=1, n_chunks=1))
        return made[-1]

    monkeypatch.setattr("test_bench.build_fake", build)
    assert invoke(str(small_manifest), "--force-length").exit_code == 0
    assert all(isinstance(v, int) and v > 0 for v in made[0].forced.values())
    assert invoke(str(small_manifest)).exit_code == 0
    assert all(v is None for v in made[1].forced.values())


def test_profile_smoke_on_the_tiny_fixture(model_dir, tmp_path):
    """CPU smoke run of `cosybatch profile` over the real fast pipeline."""
    m = workload.write(tmp_path / "w", n_rows=4, n_prompts=2)
    r = CliRunner().invoke(profile_command, [
        str(m), "--model", str(model_dir), "--device", "cpu", "-c", "2", "--num-warmups", "1", "--force-length",
        "--profile", "packed_streaming_optimized_standard", "--set", "ar.dtype=float32",
        "--set", "codec.flow_dtype=float32", "--set", "ar.cuda_graphs=false",
        "--set", "optimizations.hift_graphs=false", "--warm-prompts", "--result-dir", str(tmp_path / "res"),
        "--host-profile", str(tmp_path / "host.pstats")])
    assert r.exit_code == 0, r.output
    (path,) = (tmp_path / "res").glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["warm_prompts"] is True
    b = doc["timeline"]["batches"]
    assert b["flow_calls"] > 0 and b["flow_jobs_per_solve"] >= 1 and b["flow_tokens_per_step"] > 0
    assert b["hift_batches"] > 0 and b["hift_jobs_per_batch"] >= 1 and b["prefill_seqs_per_call"] >= 1
    assert b["prefill_graph_share"] == 0  # no CUDA: every prefill eager
    assert b["prefill_mixed_share"] == 0  # the CPU's torch executor never mixes
    assert set(doc["timeline"]["graphs"]) == {"flow", "hift", "frontend", "prefill", "mixed"}
    assert doc["timeline"]["graphs"]["mixed"] is None  # no mixed steps without ar.mixed_prefill
    import pstats

    names = {fn for (_, _, fn) in pstats.Stats(str(tmp_path / "host.pstats")).stats}
    assert "step" in names  # the pipeline's iterations ran under the profiler
    tl = doc["timeline"]
    # on the CPU the tokens' read waits for nothing, so the wait is a small part of an iteration
    assert 0 <= tl["host_wait_share"] < 1
    assert 0 < tl["host_busy_ms_per_iteration"]["mean"] <= tl["host_ms_per_iteration"]["mean"]
    assert tl["flow_tflops"] > 0  # the flow's work over its slices' time
    assert doc["completed"] == 4 and doc["failed"] == 0 and doc["audio_throughput"] > 0
    assert all(t is not None and t > 0 for t in doc["ttfps"])


@pytest.mark.gpu
def test_gpu_memory_is_recorded():
    import torch

    class CudaFake(FakePipeline):
        device = torch.device("cuda")

        def __init__(self):
            super().__init__(FakeClock())
            self.keep = []

        def step(self):
            self.keep.append(torch.empty(256 * 1024**2, dtype=torch.uint8, device="cuda"))  # 256 MiB a step
            return super().step()

    pipe = CudaFake()
    res = run_closed_loop(pipe, reqs(2), concurrency=2, clock=pipe.clock)
    g = res.gpu_memory
    assert g is not None and g["device"]
    assert g["max_allocated_gib"] >= 1.0  # 4 steps x 256 MiB
    assert g["device_max_used_gib"] >= g["max_allocated_gib"] * 0.9
    assert g["device_total_gib"] > g["device_max_used_gib"]


def test_the_table_shows_each_slice_kinds_gpu_share_beside_the_host_time_queueing_it():
    from rich.console import Console

    from cosybatch.bench.closed_loop import result_table

    clock = FakeClock()
    res = run_closed_loop(FakePipeline(clock), reqs(2), concurrency=2, num_warmups=0, clock=clock)
    res.timeline = {"busy_share": {"hift": 0.2, "flow_step": 0.5}, "flow_tflops": 187.25,
                    "slice_queue_ms": {"hift": res.wall_s * 0.18e3, "flow_step": res.wall_s * 0.02e3}}
    console = Console(width=200, record=True)
    console.print(result_table(res, "t"))
    text = console.export_text()
    assert "GPU busy: hift (share of wall)" in text and "20%, host queueing it 18%" in text
    assert "50%, host queueing it 2%" in text
    assert "flow TFLOP/s over its GPU time (steps and captures)" in text and "187.2" in text
