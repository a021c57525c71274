"""The fast pipeline: frontend -> continuous-batching AR engine -> packed codec, in one process
whose one thread owns the GPU timeline (design.md D15).

Each ``step`` is one iteration: admit rows whose prompt features are ready, queue one AR step
(a prefill or a graphed decode step), queue the codec slices the policy picks for the budget
(``timeline/policy.py``: Euler steps of the packed flow, a batched HiFT call), then read the
AR step's tokens (the one sync of an iteration: it waits for the AR step, not for the codec
work queued after it) and turn them into hops. Audio comes back through pinned buffers read
once their copy has finished. One stream, one order: the AR step never competes with codec
kernels for the GPU. Prompt work (``timeline/prompt_work.py``): audio is read and resampled on
worker threads that never touch CUDA; when the frontend runs on the GPU, its batched models
run here as one more slice, read back an iteration later.

Rows are independent: an exception while preparing or running one row becomes that row's
``error`` event and the others go on.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from cosybatch.codec.flops import solve_flops
from cosybatch.codec.flow_runner import FlowJob, FlowRunner
from cosybatch.codec.hift_runner import HiftRunner
from cosybatch.hops import Hop, HopSchedule, SegmentPlanner
from cosybatch.engine.llm_engine import LLMEngine
from cosybatch.engine.request import RequestFailed, SamplingParams
from cosybatch.gpu.hostcopy import h2d
from cosybatch.gpu.streams import on_stream
from cosybatch.gpu.triton_cache import watching
from cosybatch.scheduler.settings import RunSettings
from cosybatch.prompt import PromptFeatures
from cosybatch.scheduler.protocol import Event, SynthRequest
from cosybatch.scheduler.startup import StartupClock
from cosybatch.scheduler import policy
from cosybatch.scheduler.accounting import Accounting
from cosybatch.scheduler.budget import gpu_budget
from cosybatch.scheduler.gpu_util import KernelActiveSampler
from cosybatch.scheduler.codec_work import CodecWork, QueuedHop
from cosybatch.scheduler.costs import CostModel
from cosybatch.scheduler.prompt_work import PromptWork

log = logging.getLogger(__name__)

# Codec iterations the host may queue ahead of the GPU: enough that the codec's stream never
# drains while the host plans the next one, few enough that a plan made now is still fresh.
QUEUED_ITERATIONS = 2
LIVES_KEPT = 20_000


@dataclass
class _Row:
    req: SynthRequest
    prompt: PromptFeatures  # tokens on the host; mel and embedding on the pipeline's device
    prompt_text_ids: torch.Tensor
    segments: list[torch.Tensor]
    schedule: HopSchedule
    texts: tuple[str, ...] = ()  # the normalized piece behind each segment (reported when done)
    seg: int = 0
    tokens: list[int] = field(default_factory=list)  # flow tokens of the current segment
    generated: int = 0  # raw speech tokens the LM produced for the row, all segments
    llm_done: bool = False
    planner: SegmentPlanner | None = None
    first_audio: float | None = None  # host time its first non-empty chunk came back
    audio_s: float = 0.0  # seconds of audio returned so far
    life: dict[str, float] = field(default_factory=dict)  # host times of its life (ROW_STAGES)

    @property
    def deadline(self) -> float:
        """When a player that started at the first chunk runs out of what it has."""
        return policy.INF if self.first_audio is None else self.first_audio + self.audio_s


class FastPipeline:
    """Implements ``cosybatch.scheduler.protocol.StreamingPipeline`` over the AR engine and packed codec."""

    def __init__(self, models, frontend, settings: RunSettings, device: torch.device,
                 startup: StartupClock | None = None, precapture_flow: bool = True):
        """``precapture_flow=False`` leaves the profile's start-up flow captures
        (``optimizations.flow_graph_precapture``) to ``precapture_flow_graphs``, for a caller that
        first learns whether its run is large enough to use them."""
        self.cfg = models.cfg
        self.settings = settings
        self.frontend = frontend
        self.device = device
        self.sample_rate = self.cfg.sample_rate
        self.token_frame_rate = self.cfg.token_frame_rate
        self.sampling = settings.sampling
        self.hops = settings.hops
        self.lookahead = self.cfg.flow.pre_lookahead_len
        self.streaming = settings.streaming
        codec_cfg = settings.codec
        self.startup = startup = startup or StartupClock(device)
        with startup.phase("AR engine"):
            self.engine = LLMEngine(models.llm, settings.engine)
        # ``scheduler.ar_stream=beside`` (design.md D22): the AR engine's work (prefill, decode,
        # sampling, row state, the tokens' copy and event) on a high-priority stream of its own,
        # so a decode step no longer queues behind the codec slices issued before it. Everything
        # the engine reads on the device is written by the engine itself on that stream (its
        # inputs come from the host), and the codec reads its tokens on the host, so no event is
        # needed between the two streams; the decode graphs were captured on a side stream and
        # replay on whichever stream is current, and they share a memory pool only with the
        # prefill graphs, which replay on the same stream.
        self._ar_stream = self._side_stream("scheduler.ar_stream", settings.ar_stream, self.engine.runner.graphed,
                                            "CUDA and a graphed AR decode", priority=-1)  # the highest PyTorch exposes
        # The host's side of beside: the AR steps go at their own pace, interleaved with the
        # codec's slices (the streams are the device's side).
        self._beside = self._ar_stream is not None
        self.acct = Accounting(device)
        self.util = KernelActiveSampler(device)  # what the slices cannot see: a GPU waiting inside them
        self._audio_samples = 0  # audio handed out, for the GPU budget per audio second
        sl = settings.slices
        limits = policy.Limits(streaming=self.streaming, budget_ms=sl.budget_ms, budget_max_ms=sl.budget_max_ms,
                               ar_capacity=settings.engine.max_num_seqs,
                               max_jobs=codec_cfg.max_num_seqs, max_hift=codec_cfg.max_num_seqs,
                               n_steps=self.cfg.flow.n_timesteps, solve_tokens=sl.solve_tokens,
                               first_wait_s=sl.first_wait_s, max_wait_s=sl.max_wait_s,
                               deadline_lead_s=sl.deadline_lead_s, deadline_tokens=sl.deadline_tokens,
                               first_apart=sl.first_apart)
        # ``scheduler.hift_stream=beside`` (design.md D36): HiFT's calls on a stream of their own,
        # each after the solves that made its mels
        hift_stream = self._side_stream("scheduler.hift_stream", settings.hift_stream)
        with startup.phase("codec"):
            hift = HiftRunner(models.hift, graphs=codec_cfg.hift_graph_options() or False,
                              max_batch=codec_cfg.max_num_seqs, frame_bucket=codec_cfg.hift_frame_bucket,
                              fused_snake=codec_cfg.triton_kernels, convs=codec_cfg.hift_convs)
            if codec_cfg.hift_graphs and codec_cfg.hift_graph_precapture:
                # on HiFT's stream when it has one, like every later call: the tensors it caches
                # (ISTFT envelopes) then belong to that stream when they are evicted
                with on_stream(hift_stream):
                    n = hift.precapture(codec_cfg.hift_graph_precapture)
                log.info("HiFT decode graphs captured at start-up: %d of %d shapes", n,
                         len(codec_cfg.hift_graph_precapture))
            flow = FlowRunner.from_config(models.flow, codec_cfg)
            self.codec = CodecWork(flow, hift, self.acct, CostModel(learn=device.type == "cuda"), limits, device,
                                   hift_stream=hift_stream)
        if precapture_flow:
            self._precapture_flow()
        self._token_frames = self.cfg.flow.token_mel_ratio
        self._chunk_frames = self.cfg.flow.dit.static_chunk_size
        # A GPU frontend's models run on this thread, batched; a CPU one (onnxruntime) in the workers.
        on_device = getattr(frontend, "backend", "") == "torch" and device.type == "cuda"
        # ``scheduler.frontend_stream=beside`` (design.md D34): each launch is self-contained on
        # the device (inputs from pinned host memory, results copied back to it and read once its
        # event has completed, its graphs in a pool of their own)
        self.prompts = PromptWork(frontend, settings.frontend_workers, on_device, self.acct, settings.frontend.batch,
                                  settings.frontend.gather_s,
                                  self._side_stream("scheduler.frontend_stream", settings.frontend_stream, on_device,
                                                    "CUDA and the GPU frontend"))
        self._rows: dict[str, _Row] = {}
        self._added: dict[str, float] = {}  # host time each request was added, until admitted
        # finished rows' lives since the window began (the latest ones: bounded for long runs)
        self._lives: deque = deque(maxlen=LIVES_KEPT)
        self._events: list[Event] = []
        self._order = 0
        self._marks: deque = deque()  # an event at the end of each recent iteration's work
        self._counter_base: dict[str, int] = {}
        # captures and kernel compiles made before the first request (start-up) are not the window's
        self._window_bases(self._graph_stats())
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # set-up work (weights, schedules, graphs) is done

    def _side_stream(self, key: str, mode: str, possible: bool = True, needs: str = "CUDA", priority: int = 0):
        """A stream of its own when the setting ``key`` says beside and the device has streams
        (``possible``: what else it ``needs``), else None: serial, logged. ``priority`` 0 is the
        codec's."""
        if mode != "beside":
            return None
        if self.device.type != "cuda" or not possible:
            log.info("%s=beside needs %s; it runs serial", key, needs)
            return None
        return torch.cuda.Stream(device=self.device, priority=priority)

    def _on_ar(self):
        """Where the AR engine's kernels go: its own stream (beside), else the current one."""
        return on_stream(self._ar_stream)

    # ------------------------------------------------------------------ protocol

    def add_request(self, req: SynthRequest) -> None:
        if req.stream != self.streaming:  # the mode is the profile's; say so rather than ignore it
            mode = "streaming" if self.streaming else "full"
            self._events.append(Event(req.request_id, "error", error=f"stream={req.stream} asked of a pipeline "
                                      f"built for mode={mode} (set the profile's mode)"))
            return
        self._added[req.request_id] = time.perf_counter()
        self.prompts.add(req)

    def has_work(self) -> bool:
        return bool(self.prompts.has_work() or self._rows or self._events or self.codec.has_work())

    def stage_busy(self) -> dict[str, float]:
        """Seconds each stage held the GPU (AR, flow, HiFT), and the frontend workers' busy time."""
        busy = self.acct.busy_s()
        return {"frontend": self.prompts.busy_s + busy.get("frontend", 0.0),
                "ar": busy.get("ar_decode", 0.0) + busy.get("ar_prefill", 0.0),
                "flow": sum(v for k, v in busy.items() if k.startswith("flow")),
                "hift": sum(v for k, v in busy.items() if k.startswith("hift"))}

    def timeline(self, reset: bool = False, wall_s: float | None = None, settle: bool = True) -> dict:
        """AR step times, slice durations, busy and idle shares, host time per iteration
        (since the start or the last reset; shares of ``wall_s`` if given); ``reset`` starts a
        new window; ``settle=False``: a snapshot of the finished slices, without a GPU sync."""
        out = self.acct.summary(wall_s, settle)
        now = self._counters()
        base = self._counter_base
        d = {k: v - base.get(k, 0) for k, v in now.items()}
        per = lambda a, b: round(d[a] / d[b], 2) if d[b] else None  # noqa: E731
        out["batches"] = {
            "flow_jobs_per_solve": per("flow_jobs", "flow_calls"),
            "flow_tokens_per_step": per("flow_tokens", "flow_calls"),
            "flow_padding_share": round(1 - d["flow_tokens"] / d["flow_padded"], 3) if d["flow_padded"] else None,
            "hift_jobs_per_batch": per("hift_jobs", "hift_batches"),
            "hift_frames_per_batch": per("hift_frames", "hift_batches"),
            "prefill_seqs_per_call": per("prefill_seqs", "prefill_calls"),
            "prefill_graph_share": per("prefill_graphed", "prefill_calls"),
            "prefill_mixed_share": per("prefill_mixed", "prefill_calls"),  # rode along a decode step
            **{k: d[k] for k in ("flow_calls", "hift_batches", "prefill_calls")},
        }
        graphs = self._graph_stats()
        for k, g in graphs.items():  # captures inside the window: what start-up did not capture
            if g and "captures" in g:
                g["captures_in_window"] = g["captures"] - self._capture_base.get(k, 0)
        out["graphs"] = graphs
        # Triton kernel variants the window's launches compiled or read from the disk cache: what
        # neither the shipped launch list nor start-up's preload covered (design.md D37)
        watch = watching()
        out["kernel_compiles"] = watch.since(self._compile_base) if watch else None
        # The flow's arithmetic rate inside the pipeline: its work (linear, conv and attention;
        # padding not counted) over the GPU time of its steps and captures (a capture also runs
        # its step once eagerly, so this errs low). What the flow costs decides most targets.
        flow_ms = sum(out.get("slice_ms", {}).get(k, {}).get("total", 0.0) for k in ("flow_step", "flow_capture"))
        work = solve_flops(self.cfg.flow, d["flow_tokens"], d["flow_attn_pairs"])
        out["flow_tflops"] = float(f"{work / flow_ms / 1e9:.4g}") if flow_ms else None
        util = self.util.summary()
        out["gpu_kernel"] = util
        out["row_stages_ms"] = row_stages(self._lives)
        out["gpu_budget"] = gpu_budget({k: v["total"] for k, v in out.get("slice_ms", {}).items()}, out["wall_s"],
                                       d["audio_samples"] / self.sample_rate, util["kernel_active_share"])
        if reset:
            self.util.reset()
            self.acct.reset()
            self._counter_base = now
            self._lives.clear()
            self._window_bases(graphs)
        return out

    def _window_bases(self, graphs: dict) -> None:
        """What the window's graph captures and kernel compiles are counted from: the counts now."""
        self._capture_base = {k: g["captures"] for k, g in graphs.items() if g and "captures" in g}
        watch = watching()
        self._compile_base = len(watch.log) if watch else 0

    def precapture_flow_graphs(self) -> None:
        """The start-up flow captures the constructor was told to leave (``precapture_flow``):
        before the first request, timed as a start-up phase, and not counted as the window's."""
        self._precapture_flow()
        self.timeline(reset=True)  # the window starts after them

    def _precapture_flow(self) -> None:
        """Capture every flow bucket this run's solves of ``flow_graph_precapture_from`` to
        ``flow_graph_precapture`` tokens per branch can use, before the first row (design.md D27):
        logged with the pool memory they hold."""
        cfg, flow = self.settings.codec, self.codec.flow
        if cfg.flow_graphs and cfg.flow_graph_precapture:
            with self.startup.phase("flow graphs"):
                self._precapture_flow_band(flow, cfg.flow_graph_precapture, cfg.flow_graph_precapture_from)

    def _precapture_flow_band(self, flow: FlowRunner, max_stride: int, min_stride: int) -> None:
        if not flow.geometry.coarse:
            log.info("flow graphs: no start-up capture with the %s attention (its buckets follow each solve's "
                     "rows, an unbounded set); each bucket is captured at first sight", flow.backend.name)
            return
        # a solve while the AR engine is idle (a run's last ones) stays inside the band: a larger
        # one would be captured inside the window or run eagerly (both CFG branches count)
        self.codec.limits = replace(self.codec.limits, max_solve_tokens=2 * max_stride)
        keys = flow.bucket_keys(self.streaming, max_stride, min_stride)
        if len(keys) > flow.graphs.capacity:
            log.warning("flow graphs: %d buckets up to %d tokens exceed the cache's %d; the first %d are "
                        "captured", len(keys), max_stride, flow.graphs.capacity, flow.graphs.capacity)
            keys = keys[: flow.graphs.capacity]
        n = flow.precapture(keys)
        st = flow.graphs.stats
        log.info("flow graphs captured at start-up: %d of %d buckets (solves of %d to %d tokens per branch); "
                 "pool %.0f MB, buffers %.0f MB", n, len(keys), min_stride, max_stride, st.pool_bytes / 2**20,
                 st.buffer_bytes / 2**20)

    def _graph_stats(self) -> dict:
        """Each CUDA-graph cache's counters since start-up: hit rate, captures, pool memory."""
        flow, hift = self.codec.flow.graphs, self.codec.hift.graphs
        pg, mg = self.engine.runner.prefill_graphs, self.engine.runner.mixed_graphs
        stats = getattr(self.frontend, "graph_stats", lambda: None)()
        return {"flow": flow.stats.as_dict() if flow is not None else None,
                "hift": hift.stats.as_dict() if hift is not None else None,
                "frontend": stats,
                "prefill": {"buckets": len(pg.buckets), "replays": pg.replays, "eager": pg.eager} if pg else None,
                "mixed": {"pairs": len(mg.pairs), "replays": mg.replays, "eager": mg.eager,
                          "capture_log": mg.capture_log, "met_once": [list(p) for p in mg.met_once]} if mg else None}

    def _counters(self) -> dict[str, int]:
        """Cumulative batch counters of the codec and the engine (summed into ``timeline``)."""
        fs = self.codec.flow.stats
        es = self.engine.stats
        graphed = sum(g.replays for g in (self.engine.runner.prefill_graphs, self.engine.runner.mixed_graphs) if g)
        return {"flow_calls": fs["calls"], "flow_jobs": fs["jobs"], "flow_tokens": fs["tokens"],
                "flow_padded": fs["padded_tokens"], "flow_attn_pairs": fs["attn_pairs"], **self.codec.counts,
                "prefill_calls": es.prefill_steps, "prefill_seqs": es.prefill_seqs, "prefill_mixed": es.mixed_steps,
                "prefill_graphed": graphed, "audio_samples": self._audio_samples}

    def step(self) -> list[Event]:
        t0 = time.perf_counter()
        progressed = self._admit()
        progressed |= self._take_audio(wait=False)
        progressed |= self._launch_ar()
        # An AR step is queued (launched now, or run ahead by the last collect): the codec's
        # slices then share the iteration with it and keep to the budget.
        ar = self.engine.in_flight
        if self._codec_turn():
            between = self._ar_turn if self._beside else None
            progressed |= self.codec.run(time.perf_counter(), ar, self._deadline, self.engine.decoding_rows,
                                         self._ar_deadline(), between)
            self._bound_queue()
        if self.engine.in_flight:
            self._collect_ar()  # waits for the AR step: the loop never spins, so no idle wait after it
            progressed = True
            if self._beside:
                # Beside, the next step goes now: it runs while the host hands over audio and
                # events and admits rows (a new row's prefill waits for it, one step at most).
                self._launch_ar()
        progressed |= self._take_audio(wait=False)
        self.acct.poll()
        self.acct.iteration((time.perf_counter() - t0) * 1e3)
        if not progressed and not self._events:
            self._idle()
        events, self._events = self._events, []
        return events

    def _bound_queue(self) -> None:
        """The host runs at most ``QUEUED_ITERATIONS`` iterations' codec work ahead of the GPU.
        Serial, with an AR step in flight, the tokens' sync already bounds it; without one (rows
        wait for the codec) nothing would."""
        if self.device.type != "cuda":
            return
        ev = torch.cuda.Event()
        ev.record()  # on the codec's stream (the current one)
        self._marks.append(ev)
        while len(self._marks) > QUEUED_ITERATIONS:
            with self.acct.waiting():
                self._marks.popleft().synchronize()

    def _ar_turn(self) -> None:
        """Beside, between the codec's slices: an AR step that has finished is collected and the
        next one launched (never waits), so the AR stream does not stand idle while the host
        queues codec work (starting a large solve takes it milliseconds)."""
        if self.engine.in_flight:
            if not self.engine.step_done():
                return
            self._collect_ar()
        self._launch_ar()

    def _codec_turn(self) -> bool:
        """Whether this iteration queues codec slices. Serial: always (the AR step and the codec
        share one stream, and the budget keeps the AR cadence). Beside: only while the codec's
        stream has fewer than ``QUEUED_ITERATIONS`` iterations' work queued, so the AR steps go
        at their own pace instead of one per codec slice: tied to the codec, an AR step waited
        for a whole flow step each iteration (deadline batching makes them 5-8 ms), and a row's
        first 28 tokens for 28 of them. With no AR step in flight, the host waits for the codec."""
        if not self._beside:
            return True
        while self._marks and self._marks[0].query():
            self._marks.popleft()
        return policy.codec_turn(len(self._marks), self.engine.in_flight, QUEUED_ITERATIONS)

    def warm_prompts(self, wav_paths) -> int:
        """Compute and cache the features of these prompts now, in batches, so that requests
        using them later pay no frontend model work (``profile --warm-prompts``: the same run
        with the frontend's work removed). Returns the number of distinct paths."""
        return self.prompts.warm(wav_paths)

    def close(self) -> None:
        """Stop the frontend workers and wait for them (no thread outlives the pipeline), and
        let the frontend finish its disk-cache writes."""
        self.prompts.close()
        self.util.close()

    # ------------------------------------------------------------------ admission

    def _admit(self, wait: bool = False) -> bool:
        """Rows whose prompt work is done start their first segment (``timeline/prompt_work``)."""
        ready, failed, progressed = self.prompts.take(wait, self.engine.waiting_rows)
        for rid, e in failed:
            self._error(rid, e)
        for req, feats, text in ready:
            rid = req.request_id
            # The copy the codec reads: mel and embedding on the device, tokens on the host (they index).
            prompt = PromptFeatures(feats.speech_tokens, h2d(feats.embedding, device=self.device),
                                    h2d(feats.mel, device=self.device))
            first, mx, scale = self.hops
            row = _Row(req, prompt, text.prompt_text_ids, list(text.segments), HopSchedule(first, mx, scale),
                       texts=tuple(text.segment_texts))
            row.life = {"added": self._added.pop(rid, time.perf_counter()), "admitted": time.perf_counter()}
            self._rows[rid] = row
            self._start_segment(row)
        return progressed

    def _params(self, req: SynthRequest, seg: int) -> SamplingParams:
        s = self.sampling
        # Each segment gets its own random stream, derived from the run seed and the row's id,
        # so tokens depend neither on what else is in flight nor on the row's place in the run.
        key = getattr(req.row, "utt_id", req.request_id)  # not the request id: resume/shard/order-proof
        seed = (s.seed * 1_000_003 + zlib.crc32(str(key).encode()) * 101 + seg) % (2**63)
        return replace(s, seed=seed, force_length=self._forced(req, seg))

    def _forced(self, req: SynthRequest, seg: int) -> int | None:
        """A row's forced token count, split over its segments by their text length."""
        if req.force_tokens is None:
            return None
        lens = [len(t) for t in self._rows[req.request_id].segments]
        before = sum(lens[:seg])
        share = lambda n: round(req.force_tokens * n / sum(lens))  # noqa: E731
        return max(1, share(before + lens[seg]) - share(before))

    def _start_segment(self, row: _Row) -> None:
        row.tokens, row.llm_done = [], False
        P = row.prompt.speech_tokens.shape[0]
        row.planner = SegmentPlanner(row.schedule, P, self.lookahead) if self.streaming else None
        try:
            with self._on_ar():
                self.engine.add_request(row.segments[row.seg], row.prompt_text_ids, row.prompt.speech_tokens,
                                        self._params(row.req, row.seg), request_id=_segment_id(row.req.request_id, row.seg))
        except Exception as e:
            self._fail(row, e)

    # ------------------------------------------------------------------ AR

    def _launch_ar(self) -> bool:
        if self.engine.in_flight or not self.engine.has_unfinished():
            return False
        sch = self.engine.scheduler
        # a prefill beside running rows rides along their decode step with ar.mixed_prefill
        kind = ("ar_mixed" if sch.mixed and sch.running else "ar_prefill") if sch.can_admit() else "ar_decode"
        # on the AR stream, the accounting's events too (an AR slice is timed on its stream);
        # a failure is handled after it, since failing rows releases codec state
        with self._on_ar():
            t = self.acct.start(kind)
            try:
                launched = self.engine.launch()
                err = None
            except Exception as e:
                launched, err = False, e
                if isinstance(e, RequestFailed):
                    self.acct.cancel(t)
                else:
                    self.acct.end(t)
            else:
                self.acct.end(t, size=self.engine.prefilling)
        if isinstance(err, RequestFailed):  # the engine dropped that one request and goes on
            self._fail_request(err)
            return True
        if err is not None:  # anything else leaves the engine's rows unknown: fail them
            self._engine_failed(err)
            return True
        return launched

    def _collect_ar(self) -> None:
        # collect() may queue the next decode step at once (nothing finished, nobody to admit):
        # that step is AR work on the timeline too, so it is accounted like a launched one. On
        # the AR stream (beside): that step, and finished rows' state (unbind, move), written
        # there in order before the next step reads it.
        with self._on_ar():
            t = self.acct.start("ar_decode")
            try:
                with self.acct.waiting():  # the tokens' read (the engine's bookkeeping after it is small)
                    outs, err = self.engine.collect(), None
            except Exception as e:
                outs, err = [], e
            if err is None and self.engine.in_flight:
                self.acct.end(t)
            else:
                self.acct.cancel(t)
        if err is not None:  # failing rows releases codec state: not on the AR stream
            self._engine_failed(err)
            return
        for out in outs:
            if out.finished:
                self.engine.seqs.pop(out.request_id, None)  # the engine need not remember it
            row = self._rows.get(_row_id(out.request_id))
            if row is None:
                continue
            row.tokens.extend(out.new_tokens)
            row.generated += len(out.new_raw_tokens)
            row.llm_done = row.llm_done or out.finished
            row.life.setdefault("first_token", time.perf_counter())
            if out.finished and row.seg == len(row.segments) - 1:
                row.life["last_token"] = time.perf_counter()
            self._plan_hops(row)

    def _fail_request(self, e: RequestFailed) -> None:
        log.error("%s", e)
        row = self._rows.get(_row_id(e.request_id))
        if row is not None:
            self._fail(row, e)

    def _engine_failed(self, e: Exception) -> None:
        log.error("AR engine step failed (%s: %s); failing the rows it was decoding", type(e).__name__, e)
        for row in [r for r in self._rows.values() if not r.llm_done]:
            self._fail(row, e)

    # ------------------------------------------------------------------ hand-off to the codec

    def _plan_hops(self, row: _Row) -> None:
        if row.planner is not None:
            while (chunk := row.planner.next_chunk(len(row.tokens), row.llm_done)) is not None:
                self._hop(row, chunk, row.tokens[: chunk.end])
        elif row.llm_done:
            self._hop(row, None, list(row.tokens))

    def _hop(self, row: _Row, chunk: Hop | None, tokens: list[int]) -> None:
        rid = row.req.request_id
        job = FlowJob(_segment_id(rid, row.seg), torch.tensor(tokens, dtype=torch.long), row.prompt, chunk)
        self._order += 1
        first = row.first_audio is None and row.seg == 0 and (chunk is None or chunk.index == 0)
        if first:
            row.life.setdefault("first_hop", time.perf_counter())
        self.codec.add(QueuedHop(job, rid, self._order, first, chunk is None or chunk.finalize, self._tokens(row, chunk, tokens),
                           time.perf_counter()))

    def _tokens(self, row: _Row, chunk: Hop | None, tokens: list[int]) -> int:
        """Transformer tokens the hop adds to a solve (both CFG rows): the whole row unless the
        prefix cache holds its complete chunks."""
        frames = self._token_frames * (row.prompt.speech_tokens.shape[0] + len(tokens))
        if chunk is None or chunk.index == 0 or chunk.finalize or not self.settings.codec.prefix_budget_bytes:
            return 2 * frames
        new = self._token_frames * (chunk.end - chunk.offset) + self._chunk_frames
        return 2 * min(frames, new)

    def _ar_deadline(self) -> float:
        """The earliest player deadline among rows the AR engine still decodes (policy.large_solves)."""
        return min((r.deadline for r in self._rows.values() if not r.llm_done), default=policy.INF)

    def _deadline(self, row_id: str) -> float:
        row = self._rows.get(row_id)
        return row.deadline if row is not None else policy.INF

    def _take_audio(self, wait: bool) -> bool:
        outcomes = self.codec.take_audio(wait)
        for o in outcomes:
            row = self._rows.get(o.row_id)
            if row is None:
                continue  # the row already failed
            if o.error is not None:
                self._fail(row, o.error)
                continue
            self._events.append(Event(o.row_id, "chunk", audio=o.audio))
            if len(o.audio):
                self._audio_samples += len(o.audio)
                if row.first_audio is None:
                    row.first_audio = row.life["first_audio"] = time.perf_counter()
                row.audio_s += len(o.audio) / self.sample_rate
            if o.finalize:
                self.codec.release(o.segment_id)
                row.seg += 1
                if row.seg < len(row.segments):
                    self._start_segment(row)
                else:
                    del self._rows[o.row_id]
                    row.life["done"] = time.perf_counter()
                    self._lives.append(row.life)
                    life = row.life
                    queue = life["first_token"] - life["added"] if "first_token" in life else None
                    self._events.append(Event(o.row_id, "done", tokens=row.generated, segments=row.texts,
                                              queue_s=queue))
        return bool(outcomes)

    def _fail(self, row: _Row, e: Exception) -> None:
        rid = row.req.request_id
        seg_id = _segment_id(rid, row.seg)
        try:
            with self._on_ar():  # an abort frees the row's state with kernels: the AR stream's order
                self.engine.abort(seg_id)
        except Exception:  # after an engine fault its bookkeeping may be gone; the row fails anyway
            log.debug("abort of %s failed", rid, exc_info=True)
        self.codec.drop_row(rid, seg_id)
        self._rows.pop(rid, None)
        self._error(rid, e)

    def _error(self, request_id: str, e: Exception) -> None:
        self._added.pop(request_id, None)
        self._events.append(Event(request_id, "error", error=f"{type(e).__name__}: {e}"))

    def _idle(self) -> None:
        """Nothing was queued: wait for the GPU's oldest chunk or frontend batch, or briefly for
        the frontend's workers."""
        if self.prompts.launched:
            self._admit(wait=True)
            return
        if self.codec.outbox:
            with self.acct.waiting():
                self._take_audio(wait=True)
            return
        self.prompts.idle()


# A finished row's life in stages, each between two of its host times: what first PCM (the first
# three) and the end-to-end time (all but the last, which overlaps them) are made of.
ROW_STAGES = (("prompt", "added", "admitted"),  # queued for the frontend, prompt features
              ("first_tokens", "admitted", "first_hop"),  # prefill and the first hop's decode steps
              ("prefill", "admitted", "first_token"),  # of it: waiting for the prefill, and the prefill
              ("first_decode", "first_token", "first_hop"),  # of it: the decode steps to the first hop
              ("first_audio", "first_hop", "first_audio"),  # the first hop's flow solve and HiFT
              ("after_tokens", "last_token", "done"),  # the final hops after the last token
              ("decoding", "admitted", "last_token"))


def row_stages(rows) -> dict[str, dict[str, float]]:
    """p50 and mean milliseconds of each ``ROW_STAGES`` stage over finished rows' lives."""
    out = {}
    for name, a, b in ROW_STAGES:
        v = np.array([m[b] - m[a] for m in rows if a in m and b in m]) * 1e3
        if v.size:
            out[name] = {"p50": round(float(np.median(v)), 1), "mean": round(float(v.mean()), 1)}
    return out


def _segment_id(request_id: str, seg: int) -> str:
    return f"{request_id}#{seg}"


def _row_id(segment_id: str) -> str:
    return segment_id.rsplit("#", 1)[0]
