"""The codec stage: turns ready hops of many rows into one packed flow call and one batched
HiFT call, with per-row failure isolation. It owns the flow and HiFT runners; whoever calls
``run`` and ``release`` must do so from one thread."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from cosybatch.codec.flow_runner import FlowJob, FlowRunner
from cosybatch.codec.hift_runner import HiftJob, HiftRunner
from cosybatch.codec.hops import Chunk
from cosybatch.reference.token2wav import PromptTensors

log = logging.getLogger(__name__)


@dataclass
class CodecJob:
    seg_id: str  # one text segment of one row: the unit of flow/HiFT streaming state
    row_id: str
    prompt: PromptTensors  # on the CPU
    chunk: Chunk | None  # None: the whole response (mode full)
    tokens: list[int]
    seg: int = 0

    @property
    def first(self) -> bool:
        return self.chunk is not None and self.chunk.index == 0


def take_batch(ready: list[CodecJob], max_rows: int) -> tuple[list[CodecJob], list[CodecJob]]:
    """(batch, rest): first hops first (time to first audio), then the oldest; at most
    ``max_rows`` jobs and one per segment (a segment's hops depend on each other)."""
    order = sorted(range(len(ready)), key=lambda i: (not ready[i].first, i))
    take, seen = set(), set()
    for i in order:
        if ready[i].seg_id in seen or len(take) >= max_rows:
            continue
        seen.add(ready[i].seg_id)
        take.add(i)
    return [j for i, j in enumerate(ready) if i in take], [j for i, j in enumerate(ready) if i not in take]


class CodecStage:
    def __init__(self, flow: FlowRunner, hift: HiftRunner, device: torch.device):
        self.flow, self.hift, self.device = flow, hift, device
        self.busy = {"flow": 0.0, "hift": 0.0}
        self._prompts: dict[str, PromptTensors] = {}  # device copies, one per row

    def release(self, seg_id: str, row_id: str | None = None) -> None:
        """Forget a segment's streaming state (and the row's prompt when ``row_id`` is given)."""
        self.flow.release(seg_id)
        self.hift.release(seg_id)
        if row_id is not None:
            self._prompts.pop(row_id, None)

    def run(self, batch: list[CodecJob]) -> list[tuple[CodecJob, object]]:
        """(job, audio or the exception that failed it) per job. A failed packed call is retried
        job by job, so one bad row fails alone; both runners leave their state untouched by a
        failed call, which keeps the retry exact."""
        jobs = []
        for j in batch:
            prompt = self._prompts.get(j.row_id)
            if prompt is None:
                p = j.prompt
                prompt = PromptTensors(p.speech_tokens.to(self.device), p.mel.to(self.device), p.embedding.to(self.device))
                self._prompts[j.row_id] = prompt
            toks = torch.tensor(j.tokens, dtype=torch.long).to(self.device)
            jobs.append(FlowJob(j.seg_id, toks, prompt, j.chunk))
        t0 = time.perf_counter()
        mels = _each(self.flow.run, jobs, "flow")
        self.busy["flow"] += self._sync_elapsed(t0)
        ok = [i for i, m in enumerate(mels) if not isinstance(m, Exception)]
        hjobs = [HiftJob(jobs[i].request_id, mels[i].float(), batch[i].chunk is None or batch[i].chunk.finalize)
                 for i in ok]
        t0 = time.perf_counter()
        wavs = _each(self.hift.run, hjobs, "HiFT")
        self.busy["hift"] += self._sync_elapsed(t0)
        out: list[object] = list(mels)
        for i, w in zip(ok, wavs):
            if isinstance(w, Exception):
                out[i] = w
                continue
            audio = w[0].float().cpu().numpy()
            out[i] = audio if np.isfinite(audio).all() else ValueError("non-finite audio")
        return list(zip(batch, out))

    def _sync_elapsed(self, t0: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter() - t0


def _each(run, jobs: list, stage: str) -> list:
    """``run(jobs)``; if the packed call fails, each job alone, its exception in its place."""
    if not jobs:
        return []
    try:
        return run(jobs)
    except Exception as e:
        if len(jobs) == 1:
            return [e]
        log.warning("packed %s call failed (%s: %s); running its rows one by one", stage, type(e).__name__, e)
    out = []
    for j in jobs:
        try:
            out.extend(run([j]))
        except Exception as e:
            out.append(e)
    return out
