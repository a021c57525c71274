"""The fast pipeline: frontend -> continuous-batching AR engine -> packed codec, in one process.

Each ``step`` advances every stage once: admit new rows through the frontend, run one AR step
over all decoding segments, then (when the batching policy says so) one packed codec call over
every hop that is ready. Rows are independent: an exception while preparing or running one row
becomes that row's ``error`` event and the others go on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from cosybatch.codec.flow_runner import FlowJob, FlowRunner
from cosybatch.codec.hift_runner import HiftJob, HiftRunner
from cosybatch.codec.hops import Chunk, HopSchedule, SegmentPlanner
from cosybatch.engine.config import EngineConfig
from cosybatch.engine.llm_engine import LLMEngine
from cosybatch.engine.request import SamplingParams
from cosybatch.reference.token2wav import PromptTensors
from cosybatch.requests import Event, SynthRequest

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class _Row:
    req: SynthRequest
    prompt: PromptTensors
    prompt_text_ids: torch.Tensor
    segments: list[torch.Tensor]
    schedule: HopSchedule
    seg: int = 0
    tokens: list[int] = field(default_factory=list)  # flow tokens of the current segment
    llm_done: bool = False
    planner: SegmentPlanner | None = None
    in_codec: bool = False  # a full-response job is queued or running


class FastPipeline:
    """Implements ``cosybatch.requests.StreamingPipeline`` over the AR engine and packed codec."""

    def __init__(self, models, frontend, profile, device: torch.device):
        from cosybatch.profiles import effective_hops, effective_sampling

        self.models = models
        self.cfg = models.cfg
        self.frontend = frontend
        self.profile = profile
        self.device = device
        self.sample_rate = self.cfg.sample_rate
        self.token_frame_rate = self.cfg.token_frame_rate
        self.sampling = effective_sampling(profile.sampling, self.cfg.llm.sampling)
        self.hops = effective_hops(profile.hops, self.cfg.chunk_size)
        self.lookahead = self.cfg.flow.pre_lookahead_len
        ar = _asdict(profile.ar)
        if device.type != "cuda":
            ar["cuda_graphs"] = False
        self.engine = LLMEngine(models.llm, EngineConfig.from_mapping(ar))
        opt = profile.optimizations
        self.flow = FlowRunner(
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
        hift = models.hift if profile.codec.hift_dtype in ("float32", "auto") else models.hift.to(_DTYPES[profile.codec.hift_dtype])
        self.hift = HiftRunner(hift, graphs=graphs, max_batch=profile.codec.max_num_seqs)
        self.max_codec = profile.codec.max_num_seqs
        self.streaming = profile.mode == "streaming"
        self._pending: deque[SynthRequest] = deque()
        self._rows: dict[str, _Row] = {}
        self._ready: list[tuple[str, Chunk | None]] = []  # codec jobs waiting: (row id, chunk)
        self._events: list[Event] = []
        self._busy = {"frontend": 0.0, "ar": 0.0, "flow": 0.0, "hift": 0.0}
        self._ar_steps_since_codec = 0

    # ------------------------------------------------------------------ protocol

    def add_request(self, req: SynthRequest) -> None:
        self._pending.append(req)

    def has_work(self) -> bool:
        return bool(self._pending or self._rows or self._events)

    def stage_busy(self) -> dict[str, float]:
        return dict(self._busy)

    def step(self) -> list[Event]:
        self._admit()
        if self.engine.has_unfinished():
            t0 = time.perf_counter()
            outs = self.engine.step()
            self._busy["ar"] += self._sync_elapsed(t0)
            self._ar_steps_since_codec += 1
            for out in outs:
                row = self._rows.get(_row_id(out.request_id))
                if row is None:
                    continue
                row.tokens.extend(out.new_tokens)
                if out.finished:
                    row.llm_done = True
                self._plan(row)
        if self._ready and self._codec_due():
            self._run_codec()
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ admission

    def _admit(self) -> None:
        while self._pending:
            req = self._pending.popleft()
            t0 = time.perf_counter()
            try:
                row = self._prepare(req)
            except Exception as e:  # a bad row must not take the others down
                log.debug("row %s failed in the frontend", req.request_id, exc_info=True)
                self._events.append(Event(req.request_id, "error", error=f"{type(e).__name__}: {e}"))
                continue
            finally:
                self._busy["frontend"] += time.perf_counter() - t0
            self._rows[req.request_id] = row
            self._start_segment(row)

    def _prepare(self, req: SynthRequest) -> _Row:
        feats = self.frontend.prompt(req.row.prompt_wav)
        text = self.frontend.prepare(req.row.prompt_text, req.row.target_text)
        dev = self.device
        prompt = PromptTensors(feats.speech_tokens.to(dev)[None].long(), feats.mel.to(dev), feats.embedding.to(dev))
        first, mx, scale = self.hops
        return _Row(req, prompt, text.prompt_text_ids, list(text.segments), HopSchedule(first, mx, scale))

    def _params(self, req: SynthRequest, seg: int) -> SamplingParams:
        s = self.sampling
        # Each segment gets its own stream of random numbers, derived from the row's seed.
        seed = (s.seed * 1_000_003 + _stable_hash(req.request_id) * 101 + seg) % (2**63)
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
        row.tokens, row.llm_done, row.in_codec = [], False, False
        P = row.prompt.speech_tokens.shape[1]
        row.planner = SegmentPlanner(row.schedule, P, self.lookahead) if self.streaming else None
        rid = _seg_id(row.req.request_id, row.seg)
        try:
            self.engine.add_request(row.segments[row.seg], row.prompt_text_ids, row.prompt.speech_tokens[0].cpu(),
                                    self._params(row.req, row.seg), request_id=rid)
        except Exception as e:
            self._fail(row, e)

    # ------------------------------------------------------------------ codec

    def _plan(self, row: _Row) -> None:
        if row.planner is not None:
            while (chunk := row.planner.next_chunk(len(row.tokens), row.llm_done)) is not None:
                self._ready.append((row.req.request_id, chunk))
        elif row.llm_done and not row.in_codec:
            row.in_codec = True
            self._ready.append((row.req.request_id, None))

    def _codec_due(self) -> bool:
        # Batch hops for efficiency, but never hold back a first hop (time to first audio),
        # and never let the AR engine idle the GPU while hops wait.
        if not self.engine.has_unfinished() or len(self._ready) >= self.max_codec:
            return True
        if any(c is not None and c.index == 0 and c.offset == 0 for _, c in self._ready):
            return True
        return self._ar_steps_since_codec >= 8

    def _run_codec(self) -> None:
        self._ar_steps_since_codec = 0
        # First hops first, then the oldest; at most codec.max_num_seqs rows per packed call,
        # one hop per row per call (a row's hops depend on each other through HiFT state).
        order = sorted(range(len(self._ready)), key=lambda i: (not _is_first(self._ready[i][1]), i))
        take, seen = [], set()
        for i in order:
            rid = self._ready[i][0]
            if rid in seen or len(take) >= self.max_codec:
                continue
            seen.add(rid)
            take.append(i)
        batch = [self._ready[i] for i in sorted(take)]
        taken = set(take)
        self._ready = [j for i, j in enumerate(self._ready) if i not in taken]
        self._run_batch(batch)

    def _run_batch(self, batch: list[tuple[str, Chunk | None]]) -> None:
        jobs, rows = [], []
        for rid, chunk in batch:
            row = self._rows[rid]
            toks = torch.tensor(row.tokens, dtype=torch.long, device=self.device)
            jobs.append(FlowJob(_seg_id(rid, row.seg), toks, row.prompt, chunk))
            rows.append((row, chunk))
        try:
            t0 = time.perf_counter()
            mels = self.flow.run(jobs)
            self._busy["flow"] += self._sync_elapsed(t0)
            t0 = time.perf_counter()
            hjobs = [HiftJob(j.request_id, m.float(), c is None or c.finalize) for j, (_, c), m in zip(jobs, rows, mels)]
            wavs = self.hift.run(hjobs)
            self._busy["hift"] += self._sync_elapsed(t0)
        except Exception as e:
            if len(batch) == 1:
                self._fail(rows[0][0], e)
            else:  # find the row that broke the packed call; the others still finish
                log.warning("packed codec call failed (%s: %s); running its rows one by one", type(e).__name__, e)
                for item in batch:
                    if item[0] in self._rows:
                        self._run_batch([item])
            return
        for (row, chunk), wav in zip(rows, wavs):
            audio = wav[0].float().cpu().numpy()
            if not np.isfinite(audio).all():
                self._fail(row, ValueError("non-finite audio"))
                continue
            self._events.append(Event(row.req.request_id, "chunk", audio=audio))
            if chunk is None or chunk.finalize:
                self._end_segment(row)

    def _end_segment(self, row: _Row) -> None:
        sid = _seg_id(row.req.request_id, row.seg)
        self.flow.release(sid)
        self.hift.release(sid)
        row.seg += 1
        if row.seg < len(row.segments):
            self._start_segment(row)
        else:
            self._rows.pop(row.req.request_id, None)
            self._events.append(Event(row.req.request_id, "done"))

    def _fail(self, row: _Row, e: Exception) -> None:
        rid = row.req.request_id
        sid = _seg_id(rid, row.seg)
        self.flow.release(sid)
        self.hift.release(sid)
        self._ready = [j for j in self._ready if j[0] != rid]
        self._rows.pop(rid, None)
        self._events.append(Event(rid, "error", error=f"{type(e).__name__}: {e}"))

    def _sync_elapsed(self, t0: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0


def _asdict(dc) -> dict:
    import dataclasses

    return {f.name: getattr(dc, f.name) for f in dataclasses.fields(dc)}


def _seg_id(request_id: str, seg: int) -> str:
    return f"{request_id}#{seg}"


def _row_id(seg_id: str) -> str:
    return seg_id.rsplit("#", 1)[0]


def _is_first(chunk: Chunk | None) -> bool:
    return chunk is not None and chunk.index == 0


def _stable_hash(s: str) -> int:
    import zlib

    return zlib.crc32(s.encode())
