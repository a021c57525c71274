"""Closed-loop benchmark of a streaming pipeline, measured the way serving benchmarks are.

At most ``concurrency`` requests are in flight; a new one is admitted as soon as one finishes.
Warm-up requests run first through the same loop and are drained before the clock starts.
The driver stamps every event itself (``perf_counter`` when ``step`` returns), so a pipeline
cannot flatter its own numbers. ``cosybatch profile`` (in ``cli.py``) drives it.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from cosybatch.bench.metrics import Timeline, aggregate, request_metrics
from cosybatch.scheduler.budget import budget_rows
from cosybatch.scheduler.protocol import StreamingPipeline, SynthRequest, drive

log = logging.getLogger("cosybatch.bench.closed_loop")


@dataclass
class RequestRecord:
    request_id: str
    utt_id: str
    admitted: float  # seconds since the measured run started
    finished: float | None
    error: str | None
    chunks: list[tuple[float, int]]  # (seconds since run start, samples)
    ttfp_s: float | None = None
    e2el_s: float | None = None
    audio_duration_s: float = 0.0
    rtf: float | None = None
    underrun_s: float = 0.0


@dataclass
class BenchResult:
    concurrency: int
    num_warmups: int
    wall_s: float
    metrics: dict[str, Any]
    records: list[RequestRecord]
    max_in_flight: int
    stage_busy_s: dict[str, float] = field(default_factory=dict)
    gpu_memory: dict[str, Any] | None = None
    warmup_failed: int = 0
    timeline: dict[str, Any] | None = None  # the pipeline's own GPU-timeline accounting, if it keeps one

    def to_json(self, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """vLLM-bench-like layout: run facts, aggregate metrics, then per-request lists."""
        ok = [r for r in self.records if r.error is None and r.finished is not None]
        doc: dict[str, Any] = {"backend": "cosybatch", **(meta or {}),
                               "max_concurrency": self.concurrency, "num_prompts": len(self.records),
                               "num_warmups": self.num_warmups, "warmup_failed": self.warmup_failed,
                               "max_in_flight": self.max_in_flight, **self.metrics,
                               "stage_busy_s": self.stage_busy_s,
                               "stage_busy_frac": {k: v / self.wall_s for k, v in self.stage_busy_s.items()},
                               "gpu_memory": self.gpu_memory, "timeline": self.timeline}
        doc.update(ttfps=[r.ttfp_s for r in ok], e2els=[r.e2el_s for r in ok],
                   audio_durations=[r.audio_duration_s for r in ok], rtfs=[r.rtf for r in ok],
                   underruns=[r.underrun_s for r in ok],
                   errors=[f"{r.request_id}: {r.error}" for r in self.records if r.error is not None],
                   records=[asdict(r) for r in self.records])
        return doc


class _GpuMemory:
    """Peak allocator and device-level memory over the measured run (None off CUDA)."""

    MIN_INTERVAL_S = 0.2  # cudaMemGetInfo is cheap, but not free inside a tight step loop

    def __init__(self, device: Any = None) -> None:
        self.torch: Any = None
        self.device: Any = None
        try:
            import torch

            dev = torch.device(device) if device is not None else None
            if torch.cuda.is_available() and (dev is None or dev.type == "cuda"):
                self.torch = torch
                self.device = dev if dev is not None and dev.index is not None else torch.cuda.current_device()
        except (ImportError, RuntimeError, TypeError):
            pass
        self.peak_used = 0
        self.total = 0
        self.last = -1e9

    def start(self) -> None:
        if self.torch is not None:
            self.torch.cuda.reset_peak_memory_stats(self.device)
            self.sample(force=True)

    def sample(self, force: bool = False) -> None:
        if self.torch is None:
            return
        now = time.perf_counter()
        if force or now - self.last >= self.MIN_INTERVAL_S:
            free, self.total = self.torch.cuda.mem_get_info(self.device)
            self.peak_used = max(self.peak_used, self.total - free)
            self.last = now

    def result(self) -> dict[str, Any] | None:
        if self.torch is None:
            return None
        self.sample(force=True)
        cuda, d = self.torch.cuda, self.device
        gib = 1024**3
        return {"device": cuda.get_device_name(d), "max_allocated_gib": cuda.max_memory_allocated(d) / gib,
                "max_reserved_gib": cuda.max_memory_reserved(d) / gib,
                "device_max_used_gib": self.peak_used / gib, "device_total_gib": self.total / gib}


@dataclass
class _Loop:
    timelines: dict[str, Timeline]
    t_start: float
    t_end: float
    max_in_flight: int


def _drive(pipeline: StreamingPipeline, reqs: Sequence[SynthRequest], concurrency: int,
           clock: Callable[[], float], on_step: Callable[[], None] = lambda: None) -> _Loop:
    """The shared driver loop, keeping only what the metrics need (chunk sizes, not PCM)."""
    sr = int(pipeline.sample_rate)
    done: dict[str, Timeline] = {}
    t_start = clock()
    peak = 0
    for f in drive(pipeline, reqs, concurrency, clock, on_step):
        peak = max(peak, f.in_flight)
        done[f.request.request_id] = Timeline(f.admitted, tuple((t, len(a)) for t, a in f.chunks), sr,
                                              finished=f.finished, error=f.error)
    t_end = max((tl.finished for tl in done.values()), default=t_start)
    return _Loop(done, t_start, t_end, peak)


def _warmup_requests(requests: Sequence[SynthRequest], n: int) -> list[SynthRequest]:
    return [SynthRequest(f"warmup-{i}", r.row, r.stream, r.force_tokens)
            for i, r in zip(range(n), (requests[i % len(requests)] for i in range(n)))]


def run_closed_loop(pipeline: StreamingPipeline, requests: Sequence[SynthRequest], concurrency: int,
                    num_warmups: int = 0, *, clock: Callable[[], float] = time.perf_counter,
                    host_profile: str | Path | None = None) -> BenchResult:
    """Run ``num_warmups`` warm-ups (copies of the first requests, cycled), drain them, then
    measure ``requests`` at ``concurrency``; wall time runs from the first admission to the
    last completion. ``host_profile``: cProfile the measured run's driving thread (the one
    that issues all GPU work) into this pstats file: which Python code the host time goes to
    (cProfile slows that thread, so the run's own figures are not comparable)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if not requests:
        raise ValueError("no requests to run")
    warm_failed = 0
    if num_warmups > 0:
        warm = _drive(pipeline, _warmup_requests(requests, num_warmups), concurrency, clock)
        warm_failed = sum(1 for tl in warm.timelines.values() if not tl.ok)
        if warm_failed:
            log.warning("%d of %d warm-up request(s) failed", warm_failed, num_warmups)
    gpu = _GpuMemory(getattr(pipeline, "device", None))  # the pipeline's device, if it says
    gpu.start()
    busy0 = dict(pipeline.stage_busy())
    timeline = getattr(pipeline, "timeline", None)
    if timeline is not None:
        timeline(reset=True)  # the measured run's window starts here
    prof = None
    if host_profile is not None:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        loop = _drive(pipeline, requests, concurrency, clock, on_step=gpu.sample)
    finally:
        if prof is not None:
            prof.disable()
            _write_host_profile(prof, Path(host_profile))
    busy1 = pipeline.stage_busy()
    wall = max(loop.t_end - loop.t_start, 1e-9)
    records = []
    for req in requests:
        tl = loop.timelines[req.request_id]
        m = request_metrics(tl)
        records.append(RequestRecord(
            request_id=req.request_id, utt_id=str(getattr(req.row, "utt_id", "")),
            admitted=tl.admitted - loop.t_start,
            finished=None if tl.finished is None else tl.finished - loop.t_start, error=tl.error,
            chunks=[(t - loop.t_start, n) for t, n in tl.chunks], ttfp_s=m["ttfp_s"], e2el_s=m["e2el_s"],
            audio_duration_s=m["audio_duration_s"], rtf=m["rtf"], underrun_s=m["underrun_s"]))
    return BenchResult(
        concurrency=concurrency, num_warmups=num_warmups, wall_s=wall,
        metrics=aggregate([loop.timelines[r.request_id] for r in requests], wall), records=records,
        max_in_flight=loop.max_in_flight,
        stage_busy_s={k: float(busy1.get(k, 0.0)) - float(busy0.get(k, 0.0)) for k in busy1},
        gpu_memory=gpu.result(), warmup_failed=warm_failed,
        timeline=timeline(wall_s=wall) if timeline is not None else None)


def _write_host_profile(prof: Any, path: Path, top: int = 25) -> None:
    import io
    import pstats

    path.parent.mkdir(parents=True, exist_ok=True)
    prof.dump_stats(str(path))
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    log.info("host profile of the measured run written to %s; top %d by own time:\n%s", path, top, text.getvalue())


def write_result(result: BenchResult, result_dir: str | Path, meta: dict[str, Any], tag: str) -> Path:
    out = Path(result_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out / f"cosybatch-{tag}-c{result.concurrency}-{stamp}.json"
    doc = result.to_json({"date": stamp, **meta})
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def _num(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def result_table(result: BenchResult, title: str):
    from rich.table import Table

    m = result.metrics
    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("concurrency (max in flight seen)", f"{result.concurrency} ({result.max_in_flight})"),
        ("completed / failed", f"{m['completed']} / {m['failed']}"),
        ("wall time (s)", _num(m["duration"])),
        ("audio produced (s)", _num(m["total_audio_duration_s"])),
        ("audio throughput (audio-s/s)", _num(m["audio_throughput"])),
        ("request throughput (req/s)", _num(m["request_throughput"])),
    ]
    for name, label in (("ttfp_ms", "first PCM (ms)"), ("e2el_ms", "end-to-end (ms)"), ("rtf", "RTF"),
                        ("underrun_ms", "underrun (ms)"), ("audio_duration_s", "audio per request (s)")):
        fmt = "{:.3f}" if name == "rtf" else "{:.1f}"
        rows.append((f"{label} mean / p50 / p90 / p99", " / ".join(
            _num(m[f"{k}_{name}"], fmt) for k in ("mean", "median", "p90", "p99"))))
    rows.append(("requests with an underrun", str(m["underrun_requests"])))
    for k, v in result.stage_busy_s.items():
        rows.append((f"busy: {k} (s, share of wall)", f"{v:.2f} ({v / result.wall_s:.0%})"))
    tl = result.timeline or {}
    if "ar_step_ms" in tl:
        a = tl["ar_step_ms"]
        rows.append(("AR decode step in the pipeline p50 / p90 (ms)", f"{a['p50']:.2f} / {a['p90']:.2f}"))
    for k, v in (tl.get("row_stages_ms") or {}).items():
        rows.append((f"row stage p50 / mean (ms): {k.replace('_', ' ')}", f"{v['p50']:.1f} / {v['mean']:.1f}"))
    if tl.get("gpu_idle_share") is not None:
        rows.append(("GPU idle share of wall (outside slices)", f"{tl['gpu_idle_share']:.0%}"))
    kernel = tl.get("gpu_kernel") or {}
    if kernel:
        share = kernel.get("kernel_active_share")
        rows.append(("GPU kernel-active share of wall (NVML, in the process)",
                     f"{share:.1%}" if share is not None else f"unavailable: {kernel.get('unavailable')}"))
        if kernel.get("by_tenth"):
            rows.append(("GPU kernel-active share by tenth of the run (%)",
                         " ".join(f"{100 * v:.0f}" for v in kernel["by_tenth"])))
    if tl.get("gpu_budget"):
        rows += budget_rows(tl["gpu_budget"])
    if tl.get("flow_tflops") is not None:
        rows.append(("flow TFLOP/s over its GPU time (steps and captures)", f"{tl['flow_tflops']:.4g}"))
    queue = tl.get("slice_queue_ms") or {}
    for k, v in (tl.get("busy_share") or {}).items():
        q = f", host queueing it {queue[k] / 1e3 / result.wall_s:.0%}" if k in queue and result.wall_s else ""
        rows.append((f"GPU busy: {k} (share of wall)", f"{v:.0%}{q}"))
    if "host_ms_per_iteration" in tl:
        rows.append(("host ms per iteration p50 / mean", "{p50:.2f} / {mean:.2f}".format(**tl["host_ms_per_iteration"])))
    if "host_busy_ms_per_iteration" in tl:
        rows.append(("host ms per iteration not waiting for the GPU p50 / mean",
                     "{p50:.2f} / {mean:.2f}".format(**tl["host_busy_ms_per_iteration"])))
    for k, v in (tl.get("batches") or {}).items():
        if v is not None:
            rows.append((f"batches: {k}", f"{v:g}"))
    for k, g in (tl.get("graphs") or {}).items():
        if g and "hit_rate" in g:
            mb = (g.get("pool_bytes") or g.get("pool_reserved_bytes") or 0) / 2**20
            rows.append((f"graphs: {k} hit rate / pool MB (since start-up) / captures in the run",
                         f"{g['hit_rate']:.2f} / {mb:,.0f} / {g.get('captures_in_window', '-')}"))
        elif g and "replays" in g:  # the AR engine's prefill and mixed steps: replayed / eager calls
            rows.append((f"graphs: {k} steps replayed / eager", f"{g['replays']} / {g['eager']}"))
    if result.gpu_memory:
        g = result.gpu_memory
        rows.append(("GPU memory peak: allocated / reserved / device (GiB)",
                     f"{g['max_allocated_gib']:.1f} / {g['max_reserved_gib']:.1f} / {g['device_max_used_gib']:.1f}"))
    for label, value in rows:
        t.add_row(label, value)
    return t


def select_rows(rows: list, num_prompts: int | None, seed: int) -> list:
    """All rows in order; fewer: a seeded sample; more: the rows cycled."""
    import random

    if num_prompts is None or num_prompts == len(rows):
        return list(rows)
    if num_prompts < len(rows):
        return random.Random(seed).sample(rows, num_prompts)
    return [rows[i % len(rows)] for i in range(num_prompts)]


def environment() -> dict[str, Any]:
    import platform
    import subprocess

    import cosybatch

    env: dict[str, Any] = {"cosybatch": cosybatch.__version__, "python": platform.python_version()}
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                       cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env
