"""``synth --devices all|N|LIST`` and ``--device cpu --workers N``: one worker process per device.

The parent never loads a model. It decides which rows are still to do (the same test
resume uses), splits them by estimated cost over the workers, and starts each worker with
the ``spawn`` method (CUDA is not fork-safe) in an unchanged copy of its own environment
plus that worker's CUDA_VISIBLE_DEVICES. Each worker writes its own ledger part
(``ledger.shard-I-of-N.jsonl``); the parent follows those parts for the one progress bar,
so it counts exactly the rows a re-run would skip. A worker that dies costs only its own
rows: the parent records them as failed, with the reason, and the others go on.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

from cosybatch.run.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_TERMINATED, signal_name
from cosybatch.manifest import Manifest, ManifestRow
from cosybatch.run.resume import finished_rows
from cosybatch.output.records import base_record
from cosybatch.run.multi.devices import DevicesError, Slot, cuda_device_count, plan_slots
from cosybatch.run.sharding import ALL, Shard, balance, select
from cosybatch.run.options import SynthOptions
from cosybatch.run.multi.worker import EXIT_SETUP, Job, main as worker_main
from cosybatch.atomic import OutputFault
from cosybatch.output.ledger import Ledger
from cosybatch.output.timing import build_totals, doc_windows, read_timing_docs, unique_windows

log = logging.getLogger("cosybatch.run.multi.launcher")

POLL_S = 0.25  # how often the ledgers are read for the progress bar
RESEND_S = 2.0  # a stop signal forwarded again to workers still setting up (_resend_to_setups)
# A worker stopped by SIGINT/SIGTERM: by its own handler (130/143) or before it had one.
_INTERRUPTED = (EXIT_INTERRUPTED, EXIT_TERMINATED, -signal.SIGINT, -signal.SIGTERM)


@dataclass
class _Worker:
    job: Job
    todo: set[str]
    proc: Any = None
    conn: Any = None
    tail: "_Tail | None" = None
    seen: set[str] = field(default_factory=set)  # rows this worker finished (ok or failed) in this run
    fp: str | None = None  # from its run_start record, for the rows the parent records for it
    exitcode: int | None = None
    outcome: str = ""

    @property
    def name(self) -> str:
        return f"worker {self.job.index} ({self.job.slot.label})"


class _Tail:
    """New complete lines of one append-only ledger part since the last call."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.pos = path.stat().st_size  # earlier runs' lines are not this run's progress
        except OSError:
            self.pos = 0
        self.rest = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return []
        self.pos += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        out = []
        for raw in lines:
            try:
                rec = json.loads(raw)
            except ValueError:
                continue  # blank, or the torn line a killed run left
            if isinstance(rec, dict):
                out.append(rec)
        return out


def split_rows(man: Manifest, outer: Shard, out: Path, overwrite: bool,
               workers: int) -> tuple[list[list[ManifestRow]], dict[str, dict[str, Any]]]:
    """(rows still to do, per worker; utt_id -> ledger record of the rows already done)."""
    rows = select(man.rows, outer)
    done = finished_rows(rows, out) if not overwrite and out.is_dir() else {}
    return balance(rows, workers, set(done)), done


def _worker_shard(outer: Shard, i: int, n: int, members: set[str]) -> Shard:
    # Worker i of node-shard k/N is shard k*n+i of N*n: the file names stay unique when several
    # launchers (one per node) share OUT, and `cosybatch merge` can name a missing part.
    return Shard(outer.index * n + i, outer.count * n, members=frozenset(members))


class Launcher:
    def __init__(self, man: Manifest, out: Path, slots: list[Slot], options: SynthOptions, outer: Shard = ALL,
                 quiet: bool = False, verbose: bool = False, console: Any = None):
        self.man, self.out, self.slots, self.options, self.outer = man, out, slots, options, outer
        self.quiet, self.verbose, self.console = quiet, verbose, console
        self.stop_signal: int | None = None
        self._stopped: Any = None  # shared with the workers once they start (_start)
        self._forwarded_at = 0.0  # when the stop signal was last forwarded
        self.workers: list[_Worker] = []
        self.done: set[str] = set()
        self.audio_done = 0.0  # seconds of audio of the rows done before this run
        self.todo_count = 0
        self.counts = {"ok": 0, "failed": 0}
        self.failed: list[str] = []
        self.audio_s = 0.0
        self.errors_seen: dict[str, int] = {}  # error text -> how many more workers sent it

    # -- setup ---------------------------------------------------------------------------

    def _jobs(self) -> None:
        n = len(self.slots)
        parts, done = split_rows(self.man, self.outer, self.out, self.options.overwrite, n)
        self.done = set(done)
        self.audio_done = sum(float(rec.get("audio_s") or 0.0) for rec in done.values())
        for i, (slot, part) in enumerate(zip(self.slots, parts)):
            # Every worker also gets every done row: run_synth then checks all of them against
            # its settings, so a changed setting stops every worker before any writes a WAV.
            members = {r.utt_id for r in part} | self.done
            rows = [r for r in self.man.rows if r.utt_id in members]
            job = Job(index=i, workers=n, slot=slot, shard=_worker_shard(self.outer, i, n, members),
                      manifest=Manifest(self.man.path, rows, self.man.problems), out=str(self.out),
                      options=self.options, log_level=logging.DEBUG if self.verbose else logging.WARNING,
                      parent_pid=os.getpid())
            self.workers.append(_Worker(job, {r.utt_id for r in part}))
        self.todo_count = sum(len(w.todo) for w in self.workers)
        if not self.todo_count:
            # Nothing to synthesize, but (as plain synth does) the settings are still checked
            # against the rows already there, so a changed setting is not met by "all done":
            # one worker does that, on one device.
            del self.workers[1:]

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        # What the workers read once their handlers are in place: a forwarded signal that reached
        # one while it still ignored SIGINT (see below) is not lost.
        self._stopped = ctx.Value("i", 0, lock=False)
        for w in self.workers:
            w.tail = _Tail(self.out / f"ledger{w.job.shard.tag}.jsonl")
            recv, send = ctx.Pipe(duplex=False)
            w.proc = ctx.Process(target=worker_main, args=(w.job, send, self._stopped), name=f"cosybatch-{w.name}",
                                 daemon=False)
            # Started with SIGINT ignored (inherited through exec) until the worker has left
            # the terminal's process group; see worker._set_stop_signals.
            old = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                w.proc.start()
            finally:
                signal.signal(signal.SIGINT, old)
            send.close()  # the parent keeps only the reading end: EOF then means the worker is gone
            w.conn = recv
            log.info("%s: pid %d, %d row(s) to do%s", w.name, w.proc.pid, len(w.todo),
                     f", CUDA_VISIBLE_DEVICES={w.job.slot.visible}" if w.job.slot.visible is not None else "")

    # -- signals -------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            if self._stopped is not None:
                self._stopped.value = signum
            self._forwarded_at = time.monotonic()
            what = "interrupted" if signum == signal.SIGINT else f"terminated ({signal_name(signum)})"
            log.warning("%s: stopping the workers (finished rows are kept)", what)
        for w in self.workers:
            if w.proc is not None and w.exitcode is None and w.proc.pid:
                try:
                    os.kill(w.proc.pid, signum)
                except ProcessLookupError:
                    pass

    # -- watching ------------------------------------------------------------------------

    def _show(self, w: _Worker, level: int, name: str, text: str) -> None:
        if level >= logging.ERROR:
            # A setup error (a bad profile key, a settings change) comes from every worker at once.
            if text in self.errors_seen:
                self.errors_seen[text] += 1
                return
            self.errors_seen[text] = 0
        logging.getLogger(name).log(level, "[%s] %s", w.job.slot.label, text)

    def _receive(self, w: _Worker, live: dict[Any, _Worker]) -> None:
        try:
            while w.conn.poll():
                self._show(w, *w.conn.recv())
        except (EOFError, OSError):  # the worker exited (or died mid-message: nothing more to read)
            live.pop(w.conn, None)
            w.conn.close()

    def _follow(self, bar: Any) -> None:
        for w in self.workers:
            for rec in w.tail.read() if w.tail else ():
                if rec.get("event") == "run_start":
                    w.fp = rec.get("fp")
                elif rec.get("event") == "row" and isinstance(rec.get("utt_id"), str) and rec["utt_id"] not in w.seen:
                    w.seen.add(rec["utt_id"])
                    ok = rec.get("status") == "ok"
                    audio = float(rec.get("audio_s") or 0.0) if ok else 0.0
                    self.counts["ok" if ok else "failed"] += 1
                    if not ok:
                        self.failed.append(rec["utt_id"])
                    self.audio_s += audio
                    bar.advance(audio)

    def _watch(self, bar: Any) -> None:
        live = {w.conn: w for w in self.workers}
        running = {w.proc.sentinel: w for w in self.workers}
        while running:
            for ready in wait(list(live) + list(running), timeout=POLL_S):
                if ready in live:
                    self._receive(live[ready], live)
                elif ready in running:
                    w = running.pop(ready)
                    w.proc.join()
                    if w.conn in live:
                        self._receive(w, live)
                    self._follow(bar)
                    self._ended(w, bar)
            self._follow(bar)
            self._resend_to_setups(running.values())

    def _resend_to_setups(self, running) -> None:
        """Forward the stop signal again, every RESEND_S, to workers still setting up (no run_start
        in their ledger yet). Python can drop a SIGINT that lands in an import's weakref callback
        (it prints "Exception ignored"), and a worker that lost it would build on for as long as
        that takes. Nothing is written before run_start, so a second signal there costs nothing;
        after it the runner's handlers take the first one reliably."""
        now = time.monotonic()
        if self.stop_signal is None or now - self._forwarded_at < RESEND_S:
            return
        self._forwarded_at = now
        for w in running:
            if w.fp is None and w.proc.pid:
                try:
                    os.kill(w.proc.pid, self.stop_signal)
                except ProcessLookupError:
                    pass

    def _ended(self, w: _Worker, bar: Any) -> None:
        code = w.exitcode = w.proc.exitcode
        left = [r for r in w.job.manifest.rows if r.utt_id in w.todo and r.utt_id not in w.seen]
        if code == EXIT_SETUP:  # it refused before its first row (a settings change, a bad option)
            w.outcome = "setup"
            log.error("%s could not run (its error is above): its %d row(s) were not run", w.name, len(left))
        elif not left:
            w.outcome = "done"
            log.info("%s finished (exit %s)", w.name, code)
        elif self.stop_signal is not None or code in _INTERRUPTED:
            w.outcome = "interrupted"
            log.warning("%s stopped: %d row(s) pending", w.name, len(left))
        elif code in (EXIT_OK, EXIT_FAILED):  # the runner stopped early (a full disk) and said why
            w.outcome = "stopped"
            log.error("%s stopped early (its error is above): %d row(s) pending", w.name, len(left))
        else:
            w.outcome = "died"
            why = (f"was killed by {signal_name(-code)}" if code is not None and code < 0
                   else f"exited with code {code}")
            log.error("%s %s: its %d unfinished row(s) are recorded as failed; the other workers go on",
                      w.name, why, len(left))
            self._record_failed(w, left, f"{w.name} {why} before finishing this row; re-run to retry it")
            for _ in left:
                bar.advance(0.0)

    def _record_failed(self, w: _Worker, rows: list[ManifestRow], reason: str) -> None:
        """The dead worker's rows, in its own ledger part (nothing else writes there now)."""
        try:
            with Ledger(self.out / f"ledger{w.job.shard.tag}.jsonl") as ledger:
                for row in rows:
                    w.seen.add(row.utt_id)
                    ledger.append({**base_record(row, w.fp), "status": "failed", "reason": reason})
                    self.counts["failed"] += 1
                    self.failed.append(row.utt_id)
        except (OSError, OutputFault) as e:
            log.error("cannot record %s's rows as failed in %s: %s (they count as pending)", w.name, self.out, e)

    # -- the run -------------------------------------------------------------------------

    def _totals(self, t0: float) -> dict[str, Any]:
        """The workers' own timing documents hold the windows: the parent's clock would count
        their spawn and model loading as row time. This run's windows are those opened after
        it started; the job's are every window behind a row of this selection."""
        seen = set().union(*(w.seen for w in self.workers)) if self.workers else set()
        rows = select(self.man.rows, self.outer)
        ids = {r.utt_id for r in rows}
        windows: list[dict[str, Any]] = []
        for _, doc in read_timing_docs(self.out):
            if any(isinstance(r, dict) and r.get("utt_id") in ids for r in doc.get("rows") or []):
                windows.extend(doc_windows(doc))
        windows = unique_windows(windows)
        invalid = len(self.man.problems_by_line()) if self.outer.index == 0 else 0
        finished = self.counts["ok"] + self.counts["failed"]
        return build_totals(
            rows=len(rows), **self.counts, skipped=len(self.done - seen), invalid=invalid,
            pending=max(0, self.todo_count - finished), audio_s_run=self.audio_s,
            # windows are stored to the millisecond; a worker's opens well after the parent's t0
            this_run=[w for w in windows if float(w["start"]) >= round(t0, 3)],
            audio_s_all=self.audio_s + self.audio_done, windows=windows, extra={"workers": len(self.workers)})

    def _exit_code(self, totals: dict[str, Any]) -> int:
        outcomes = [w.outcome for w in self.workers]
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        if "interrupted" in outcomes:  # a worker stopped by a signal sent to it, not to the parent
            return max(w.exitcode if w.exitcode in (EXIT_INTERRUPTED, EXIT_TERMINATED) else EXIT_INTERRUPTED
                       for w in self.workers if w.outcome == "interrupted")
        if "setup" in outcomes:
            return EXIT_SETUP
        bad = totals["failed"] or totals["invalid"] or "died" in outcomes or "stopped" in outcomes
        return EXIT_FAILED if bad else EXIT_OK

    def _merge(self) -> None:
        if len(self.slots) == 1:
            return  # one worker wrote timing.json / ledger.jsonl like a plain run
        from cosybatch.run.merge import MergeError, merge_outputs

        try:  # quiet: each worker's fate is reported above already
            result = merge_outputs([self.out], self.out, quiet=True)
        except (MergeError, OSError, OutputFault) as e:
            log.warning("could not merge the workers' summaries: %s", e)
            return
        log.info("merged summary of every ledger part: %s", result.path)

    def run(self) -> int:
        from cosybatch.run.progress import RunProgress, print_summary, warn_failed_rows

        t0 = time.time()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.error("cannot create output folder %s: %s", self.out, e)
            return EXIT_SETUP
        self._jobs()
        if self.done:
            log.info("resuming: %d row(s) already done, %d to go", len(self.done), self.todo_count)
        saved = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._start()
            if self.stop_signal is not None:  # a signal came while starting: the late ones too
                self._on_signal(self.stop_signal, None)
            with RunProgress(self.todo_count, enabled=not self.quiet, console=self.console) as bar:
                self._watch(bar)
        finally:
            for s, h in saved.items():
                signal.signal(s, h)
        for more in self.errors_seen.values():
            if more:
                log.warning("(%d more worker(s) reported the same error)", more)
        totals = self._totals(t0)
        self._merge()
        if totals["pending"] and self.stop_signal is not None:
            log.warning("interrupted: %d row(s) pending; re-run the same command to resume", totals["pending"])
        if not self.quiet:
            print_summary(totals, self.console, title=f"cosybatch synth ({len(self.workers)} workers)")
        warn_failed_rows(log, self.failed, f"{self.out}/ledger*.jsonl")
        return self._exit_code(totals)


def run_workers(man: Manifest, out: Path, options: SynthOptions, *, devices: str | None, workers: int | None,
                device: str, outer: Shard = ALL, quiet: bool = False, verbose: bool = False,
                gpu_count: Callable[[], int] = cuda_device_count) -> int:
    """``synth --devices/--workers`` after option parsing; returns the exit code."""
    try:
        slots = plan_slots(devices, workers, device, gpu_count)
    except DevicesError as e:
        log.error("%s", e)
        return EXIT_SETUP
    return Launcher(man, Path(out), slots, options, outer, quiet, verbose).run()
