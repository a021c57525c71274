"""The fast pipeline: frontend -> continuous-batching AR engine -> packed codec, in one process.

Three stages run at once. Prompt features are computed by a small thread pool ahead of
admission; the main thread steps the AR engine (CUDA graphs, default stream); the codec
(packed flow + batched HiFT) runs on its own thread and CUDA stream when ``codec.overlap`` is
on, taking every hop that became ready while its previous call ran, so batches form by
themselves. Only the main thread touches the engine and only the codec thread touches the flow
and HiFT runners; they exchange plain Python lists under one lock.

Rows are independent: an exception while preparing or running one row becomes that row's
``error`` event and the others go on.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import deque
from contextlib import nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields

import torch

from cosybatch.codec.flow_runner import FlowRunner
from cosybatch.config import resolve_dtype
from cosybatch.codec.hift_runner import HiftRunner
from cosybatch.codec.stage import CodecJob, CodecStage, take_batch
from cosybatch.codec.hops import Chunk, HopSchedule, SegmentPlanner
from cosybatch.engine.config import EngineConfig
from cosybatch.engine.llm_engine import LLMEngine
from cosybatch.engine.request import SamplingParams
from cosybatch.reference.token2wav import PromptTensors
from cosybatch.requests import Event, SynthRequest

log = logging.getLogger(__name__)

@dataclass
class _Row:
    req: SynthRequest
    prompt: PromptTensors  # on the CPU; the codec thread keeps its own device copy
    prompt_text_ids: torch.Tensor
    segments: list[torch.Tensor]
    schedule: HopSchedule
    seg: int = 0
    tokens: list[int] = field(default_factory=list)  # flow tokens of the current segment
    llm_done: bool = False
    planner: SegmentPlanner | None = None


class FastPipeline:
    """Implements ``cosybatch.requests.StreamingPipeline`` over the AR engine and packed codec."""

    def __init__(self, models, frontend, profile, device: torch.device):
        from cosybatch.profiles import effective_hops, effective_sampling

        self.cfg = models.cfg
        self.frontend = frontend
        self.device = device
        self.sample_rate = self.cfg.sample_rate
        self.token_frame_rate = self.cfg.token_frame_rate
        self.sampling = effective_sampling(profile.sampling, self.cfg.llm.sampling)
        self.hops = effective_hops(profile.hops, self.cfg.chunk_size)
        self.lookahead = self.cfg.flow.pre_lookahead_len
        self.streaming = profile.mode == "streaming"
        self.max_codec = profile.codec.max_num_seqs
        ar = {f.name: getattr(profile.ar, f.name) for f in fields(profile.ar)}
        if device.type != "cuda":
            ar["cuda_graphs"] = False
        # The AR step is short and on the critical path of every row; a high-priority stream
        # lets its blocks in between the codec's long GEMMs instead of queueing behind them.
        self._ar_stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        if device.type == "cuda" and profile.codec.frontend_workers > 1:
            # Parallelism comes from the frontend workers; intra-op threads on top of them
            # oversubscribe the CPU that the engine and codec threads need for launches.
            log.info("torch intra-op threads: %d -> 1 (codec.frontend_workers=%d)", torch.get_num_threads(),
                     profile.codec.frontend_workers)
            torch.set_num_threads(1)
        with self._on_ar_stream():
            self.engine = LLMEngine(models.llm, EngineConfig.from_mapping(ar))
        opt = profile.optimizations
        if opt.flow_graphs:
            raise ValueError("optimizations.flow_graphs is not implemented by the packed flow yet")
        if not opt.cached_istft:
            log.warning("optimizations.cached_istft=false: the packed HiFT runner always uses the cached "
                        "ISTFT (bit-equal to torch.istft)")
        flow = FlowRunner(
            models.flow,
            dtype=resolve_dtype(profile.codec.flow_dtype, device),
            attention=profile.codec.attention,
            prefix_budget_bytes=int(opt.prefix_budget_gb * (1 << 30)) if opt.prefix_reuse else 0,
            chunk_causal_final=opt.chunk_causal_final,
            compile=opt.flow_compile,
        )
        graphs = False
        if opt.hift_graphs and device.type == "cuda":
            graphs = {"capacity": opt.hift_graph_capacity, "max_counters": opt.hift_graph_counters,
                      "capture_after": opt.hift_graph_capture_after}
        if device.type == "cuda":
            # Process-wide, but HiFT's are the only float32 cuDNN convolutions here (flow: bf16,
            # F0: float64, LM: Triton); the graph cache keys on this flag.
            torch.backends.cudnn.allow_tf32 = profile.codec.hift_tf32
            log.info("HiFT convolutions: %s", "TF32" if profile.codec.hift_tf32 else "strict float32")
        if profile.codec.hift_dtype not in ("float32", "auto"):
            raise ValueError("codec.hift_dtype: HiFT runs in float32 (F0 in float64); "
                             f"{profile.codec.hift_dtype} is not implemented")
        hift = HiftRunner(models.hift, graphs=graphs, max_batch=self.max_codec)
        if graphs and opt.hift_graph_precapture:
            n = hift.precapture(opt.hift_graph_precapture)
            log.info("HiFT decode graphs captured at start-up: %d of %d shapes", n, len(opt.hift_graph_precapture))

        self.codec = CodecStage(flow, hift, device)
        self._lock = threading.Condition()
        self._pool = ThreadPoolExecutor(profile.codec.frontend_workers, thread_name_prefix="cosybatch-frontend")
        self._preparing: dict[str, Future] = {}
        self._rows: dict[str, _Row] = {}
        self._ready: list[CodecJob] = []  # hops whose tokens exist, waiting for the codec
        self._finished: deque = deque()  # (job, audio | Exception) back from the codec
        self._release: list[tuple[str, str | None]] = []  # (segment id, row id when the row ends)
        self._events: list[Event] = []
        self._busy = {"frontend": 0.0, "ar": 0.0}
        self._ar_steps_since_codec = 0
        self._codec_error: Exception | None = None
        self._busy_lock = threading.Lock()
        self._closed = False
        self._codec_thread = None
        if device.type == "cuda":
            # Set-up kernels (weights, schedules, graph capture) ran on other streams; the codec
            # and AR streams must not start before they are done.
            torch.cuda.synchronize(device)
        if profile.codec.overlap:
            self._codec_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            self._codec_thread = threading.Thread(target=self._codec_loop, name="cosybatch-codec", daemon=True)
            self._codec_thread.start()

    # ------------------------------------------------------------------ protocol

    def add_request(self, req: SynthRequest) -> None:
        if req.stream != self.streaming:  # the mode is the profile's; say so rather than ignore it
            mode = "streaming" if self.streaming else "full"
            self._events.append(Event(req.request_id, "error", error=f"stream={req.stream} asked of a pipeline "
                                      f"built for mode={mode} (set the profile's mode)"))
            return
        self._preparing[req.request_id] = self._pool.submit(self._prepare, req)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._preparing or self._rows or self._events or self._finished)

    def stage_busy(self) -> dict[str, float]:
        return {**self._busy, **self.codec.busy}

    def step(self) -> list[Event]:
        progressed = self._admit()
        progressed |= self._collect()
        if self._codec_error is not None:
            e, self._codec_error = self._codec_error, None
            for row in list(self._rows.values()):
                self._fail(row, e)
        if self.engine.has_unfinished():
            t0 = time.perf_counter()
            try:
                with self._on_ar_stream():
                    outs = self.engine.step()
            except Exception as e:  # e.g. out of memory in a prefill: fail the decoding rows, keep going
                log.error("AR engine step failed (%s: %s); failing the rows it was decoding", type(e).__name__, e)
                for row in [r for r in self._rows.values() if not r.llm_done]:
                    self._fail(row, e)
                outs = []
            self._busy["ar"] += time.perf_counter() - t0  # step() already waits for its tokens
            self._ar_steps_since_codec += 1
            with self._lock:
                for out in outs:
                    if out.finished:
                        self.engine.seqs.pop(out.request_id, None)  # the engine need not remember it
                    row = self._rows.get(_row_id(out.request_id))
                    if row is not None:
                        row.tokens.extend(out.new_tokens)
                        row.llm_done = row.llm_done or out.finished
                        self._plan(row)
                self._lock.notify_all()
            progressed = True
        if self._codec_thread is None and self._ready and self._codec_due():
            self._codec_once()
            progressed = True
        if not progressed:
            self._idle_wait()
        events, self._events = self._events, []
        return events

    def _on_ar_stream(self):
        return torch.cuda.stream(self._ar_stream) if self._ar_stream is not None else nullcontext()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._codec_thread is not None:
            self._codec_thread.join(timeout=30)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __del__(self) -> None:  # the codec thread is a daemon; this only stops it early
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ frontend and admission

    def _prepare(self, req: SynthRequest) -> _Row:
        t0 = time.perf_counter()
        try:
            feats = self.frontend.prompt(req.row.prompt_wav)
            text = self.frontend.prepare(req.row.prompt_text, req.row.target_text)
        finally:
            with self._busy_lock:  # several pool threads add to it
                self._busy["frontend"] += time.perf_counter() - t0
        prompt = PromptTensors(feats.speech_tokens[None].long(), feats.mel, feats.embedding)
        first, mx, scale = self.hops
        return _Row(req, prompt, text.prompt_text_ids, list(text.segments), HopSchedule(first, mx, scale))

    def _admit(self) -> bool:
        done = [rid for rid, f in self._preparing.items() if f.done()]
        for rid in done:
            fut = self._preparing.pop(rid)
            try:
                row = fut.result()
            except Exception as e:  # a bad row must not take the others down
                self._events.append(Event(rid, "error", error=f"{type(e).__name__}: {e}"))
                continue
            with self._lock:
                self._rows[rid] = row
            self._start_segment(row)
        return bool(done)

    def _params(self, req: SynthRequest, seg: int) -> SamplingParams:
        s = self.sampling
        # Each segment gets its own random stream, derived from the run seed and the row's id,
        # so tokens depend neither on what else is in flight nor on the row's place in the run.
        key = getattr(req.row, "utt_id", req.request_id)  # not the request id: resume/shard/order-proof
        seed = (s.seed * 1_000_003 + zlib.crc32(str(key).encode()) * 101 + seg) % (2**63)
        kw = dict(seed=seed, enforce_min_len=s.enforce_min_len, force_length=self._forced(req, seg),
                  max_tokens=s.max_tokens)
        if s.mode == "standard":
            return SamplingParams.standard(s.temperature, s.top_p, s.top_k, s.repetition_penalty, **kw)
        return SamplingParams.ras(s.ras_config(), **kw)

    def _forced(self, req: SynthRequest, seg: int) -> int | None:
        """A row's forced token count, split over its segments by their text length."""
        if req.force_tokens is None:
            return None
        lens = [len(t) for t in self._rows[req.request_id].segments]
        before = sum(lens[:seg])
        share = lambda n: round(req.force_tokens * n / sum(lens))  # noqa: E731
        return max(1, share(before + lens[seg]) - share(before))

    def _start_segment(self, row: _Row) -> None:
        with self._lock:
            row.tokens, row.llm_done = [], False
            P = row.prompt.speech_tokens.shape[1]
            row.planner = SegmentPlanner(row.schedule, P, self.lookahead) if self.streaming else None
        try:
            with self._on_ar_stream():
                self.engine.add_request(row.segments[row.seg], row.prompt_text_ids, row.prompt.speech_tokens[0],
                                        self._params(row.req, row.seg),
                                        request_id=_seg_id(row.req.request_id, row.seg))
        except Exception as e:
            self._fail(row, e)

    # ------------------------------------------------------------------ hand-off (under the lock)

    def _plan(self, row: _Row) -> None:
        if row.planner is not None:
            while (chunk := row.planner.next_chunk(len(row.tokens), row.llm_done)) is not None:
                self._ready.append(self._job(row, chunk, row.tokens[: chunk.end]))
        elif row.llm_done:
            self._ready.append(self._job(row, None, list(row.tokens)))

    @staticmethod
    def _job(row: _Row, chunk: Chunk | None, tokens: list[int]) -> CodecJob:
        rid = row.req.request_id
        return CodecJob(_seg_id(rid, row.seg), rid, row.prompt, chunk, tokens, row.seg)

    def _codec_due(self) -> bool:
        # Inline codec: batch hops, but never hold back a first hop (time to first audio) and
        # never leave the GPU idle while hops wait.
        if not self.engine.has_unfinished() or len(self._ready) >= self.max_codec:
            return True
        if any(j.first for j in self._ready):
            return True
        return self._ar_steps_since_codec >= 8

    def _collect(self) -> bool:
        """Turn finished codec work into events, next segments and done/error (main thread)."""
        with self._lock:
            finished, self._finished = list(self._finished), deque()
        for job, out in finished:
            rid = job.row_id
            row = self._rows.get(rid)
            if row is None:
                continue  # the row already failed
            if isinstance(out, Exception):
                self._fail(row, out)
                continue
            self._events.append(Event(rid, "chunk", audio=out))
            if job.chunk is None or job.chunk.finalize:
                row.seg += 1
                last = row.seg == len(row.segments)
                with self._lock:
                    self._release.append((job.seg_id, rid if last else None))
                if not last:
                    self._start_segment(row)
                else:
                    with self._lock:
                        self._rows.pop(rid, None)
                    self._events.append(Event(rid, "done"))
        return bool(finished)

    def _fail(self, row: _Row, e: Exception) -> None:
        rid = row.req.request_id
        try:
            self.engine.abort(_seg_id(rid, row.seg))
        except Exception:  # after an engine fault its bookkeeping may be gone; the row fails anyway
            log.debug("abort of %s failed", rid, exc_info=True)
        with self._lock:
            self._release.append((_seg_id(rid, row.seg), rid))
            self._ready = [j for j in self._ready if j.row_id != rid]
            self._rows.pop(rid, None)
        self._events.append(Event(rid, "error", error=f"{type(e).__name__}: {e}"))

    def _idle_wait(self) -> None:
        """Nothing to do on this thread: wait for the frontend pool or the codec thread."""
        with self._lock:
            if self._finished or self._closed:
                return
            self._lock.wait(timeout=0.002)

    # ------------------------------------------------------------------ codec (its own thread)

    def _codec_loop(self) -> None:
        ctx = torch.cuda.stream(self._codec_stream) if self._codec_stream is not None else nullcontext()
        with ctx:
            while True:
                with self._lock:
                    while not (self._ready or self._release or self._closed):  # releases free memory too
                        self._lock.wait(timeout=0.05)
                    if self._closed:
                        return
                try:
                    self._codec_once()
                except Exception as e:  # never die silently: the main thread fails the rows in flight
                    log.exception("codec thread error")
                    with self._lock:
                        self._codec_error = e
                        self._ready.clear()
                        self._lock.notify_all()

    def _codec_once(self) -> None:
        with self._lock:
            for sid, rid in self._release:
                self.codec.release(sid, rid)
            self._release.clear()
            batch, self._ready = take_batch(self._ready, self.max_codec)
        self._ar_steps_since_codec = 0
        results = self.codec.run(batch)
        with self._lock:
            self._finished.extend(results)
            self._lock.notify_all()


def _seg_id(request_id: str, seg: int) -> str:
    return f"{request_id}#{seg}"


def _row_id(seg_id: str) -> str:
    return seg_id.rsplit("#", 1)[0]
