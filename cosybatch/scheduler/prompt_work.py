"""The prompt side of the GPU timeline: what a row needs before its first AR step.

Prompt audio is read and resampled on worker threads that never touch CUDA (with a CPU
frontend, onnxruntime computes the features there too). With a GPU frontend, the prompts the
workers have loaded are gathered here, on the pipeline's thread, and launched as one frontend
slice when ``policy.launch_prompts`` says (a full batch, or the AR engine is running short of
rows); prompts whose features were cached pass at once. A slice is launched in one iteration
and read back in a later one, once its copies have landed, so reading it never drains the
GPU's queue (design.md D15). A batch that fails is redone prompt by prompt, and only a prompt
that fails alone fails its row.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cosybatch.gpu.streams import on_stream
from cosybatch.scheduler.protocol import SynthRequest
from cosybatch.scheduler.accounting import Accounting
from cosybatch.scheduler.policy import launch_prompts


class PromptWork:
    def __init__(self, frontend, workers: int, on_device: bool, acct: Accounting, batch: int = 1,
                 gather_s: float = 0.0, stream=None):
        self.frontend = frontend
        # the CUDA stream every frontend launch goes on (``scheduler.frontend_stream=beside``),
        # or None: the current one. All of them, so its graphs replay on one stream only.
        self.stream = stream
        self.on_device = on_device  # the frontend's models run here, batched (else in the workers)
        self.acct = acct
        self.batch = batch  # prompts per launch while the engine has as many rows queued
        self.gather_s = gather_s  # with fewer queued, how long gathered prompts wait for more
        self._gathered: list[tuple] = []  # loaded, not launched: (request, LoadedPrompt, TextInputs)
        self._gathered_since = 0.0  # when the oldest of them was gathered
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="cosybatch-frontend")
        self._wake = threading.Condition()
        self.preparing: dict[str, tuple[SynthRequest, Future]] = {}
        self._launched: deque = deque()  # GPU batches on their way back: (their rows, PendingFeatures)
        self._busy_s = 0.0
        self._busy_lock = threading.Lock()  # several workers add to _busy_s
        self._closed = False

    @property
    def busy_s(self) -> float:
        """Seconds the workers spent on prompt work."""
        return self._busy_s

    def has_work(self) -> bool:
        return bool(self.preparing or self._gathered or self._launched)

    @property
    def launched(self) -> bool:
        """GPU batches are on their way back."""
        return bool(self._launched)

    def add(self, req: SynthRequest) -> None:
        fut = self._pool.submit(self._prepare, req)
        fut.add_done_callback(lambda _: self._notify())
        self.preparing[req.request_id] = (req, fut)

    def take(self, wait: bool = False, backlog: int = 0) -> tuple[list[tuple], list[tuple[str, Exception]], bool]:
        """(rows ready to start as (request, PromptFeatures, TextInputs), rows that failed as
        (request id, error), whether anything moved). ``backlog``: rows the AR engine has
        queued (admitted, not running). ``wait`` (the pipeline is idle): what has gathered
        launches as ``idle`` says, and the oldest launched batch is waited for rather than polled."""
        done = [rid for rid, (_, f) in self.preparing.items() if f.done()]
        if done:
            self.acct.mark("prompts_loaded", len(done))
        ready, failed = [], []
        for rid in done:
            req, fut = self.preparing.pop(rid)
            try:
                ready.append((req, *fut.result()))
            except Exception as e:  # a bad row must not take the others down
                failed.append((rid, e))
        if not self.on_device:
            return ready, failed, bool(done)
        now = time.perf_counter()
        if ready and not self._gathered:
            self._gathered_since = now
        self._gathered += ready
        on_the_way = sum(len(rows) for rows, _ in self._launched)
        if self._gathered and self._launch_now(0 if wait else backlog + on_the_way, now):
            self._launch(self._gathered)
            self._gathered = []
        else:
            hits = [r for r in self._gathered if r[1].cached is not None]  # no device work to wait for
            if hits:
                self._gathered = [r for r in self._gathered if r[1].cached is None]
                self._launch(hits)
        ready = []
        while self._launched and (wait or self._launched[0][1] is None or self._launched[0][1].ready()):
            ready += self._read(*self._launched.popleft(), failed)
            wait = False  # only the oldest is waited for
        return ready, failed, bool(done) or bool(ready)

    def _launch_now(self, backlog: int, now: float) -> bool:
        return launch_prompts(len(self._gathered), backlog, self.batch, now - self._gathered_since, self.gather_s,
                              more_coming=bool(self.preparing))

    def idle(self) -> None:
        """Nothing else to do: launch what has gathered as ``launch_prompts`` says with no
        backlog (the engine has nothing queued to run: without a gather time, at once), else
        wait briefly for a worker."""
        if self._gathered and self._launch_now(0, time.perf_counter()):
            self._launch(self._gathered)
            self._gathered = []
            return
        with self._wake:
            if not self._closed and not any(f.done() for _, f in self.preparing.values()):
                with self.acct.waiting():  # for the workers: not the host's own work
                    self._wake.wait(timeout=0.005)

    def warm(self, wav_paths) -> int:
        """Compute and cache the features of these prompts now, in batches (``profile
        --warm-prompts``); returns the number of distinct paths."""
        paths = list(dict.fromkeys(str(p) for p in wav_paths))
        with on_stream(self.stream):
            self.frontend.features(list(self._pool.map(self.frontend.load, paths)))  # batched by the frontend
        return len(paths)

    def close(self) -> None:
        """Stop the workers and wait for them (no thread outlives the pipeline), and let the
        frontend finish its disk-cache writes."""
        self._closed = True
        self._notify()
        self._pool.shutdown(wait=True, cancel_futures=True)
        close = getattr(self.frontend, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ internals

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _prepare(self, req: SynthRequest) -> tuple:
        """(PromptFeatures, or a LoadedPrompt for the GPU frontend; the text ids), on a worker."""
        t0 = time.perf_counter()
        try:
            loaded = self.frontend.load(req.row.prompt_wav)
            if not self.on_device:
                loaded = self.frontend.features([loaded])[0]
            text = self.frontend.prepare(req.row.prompt_text, req.row.target_text)
        finally:
            with self._busy_lock:
                self._busy_s += time.perf_counter() - t0
        return loaded, text

    def _launch(self, ready: list) -> None:
        """The frontend's models for every newly loaded prompt, as one batched slice (rows need
        their speech tokens on the host, so its results are copied back)."""
        with on_stream(self.stream):  # the slice's events too: it is timed on its stream
            t = self.acct.start("frontend")
            try:
                pending = self.frontend.launch_features([loaded for _, loaded, _ in ready])
            except Exception:
                pending = None  # _read redoes it prompt by prompt
            self.acct.end(t, size=len(ready))
        self._launched.append((ready, pending))

    def _read(self, ready: list, pending: Any, failed: list) -> list:
        if pending is not None:
            try:
                with self.acct.waiting():
                    feats = pending.result()
                return [(req, f, text) for (req, _, text), f in zip(ready, feats)]
            except Exception:
                pass  # redone prompt by prompt below
        out = []
        for req, loaded, text in ready:
            try:
                with on_stream(self.stream):
                    out.append((req, self.frontend.features([loaded])[0], text))
            except Exception as e:
                failed.append((req.request_id, e))
        return out
