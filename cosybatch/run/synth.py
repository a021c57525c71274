"""``run_synth``: drive a Synthesizer over manifest rows so every row ends up done or explained.

The synthesizer is anything with ``sample_rate``, ``fingerprint() -> dict``,
``describe() -> dict`` and ``synthesize(row, stream) -> RowResult`` (see
``cosybatch.synthesizers``); this module only needs RowResult's ``audio``,
``sample_rate``, ``tokens``, ``timings`` and ``chunks`` attributes.

How a run ends, whatever happens: a row that fails (an exception, non-finite or empty
audio, an audio file that cannot be encoded or written) is recorded and the others go on;
SIGINT/SIGTERM drop the rows in flight and keep every finished one; a full disk (``writer.OutputFault``) stops
the run with one log line. Each way, the ledger's last line and timing.json are written
when the disk allows and the summary is printed. The synthesizer is not closed here: its
builder (the CLI) does that, on every path.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import platform
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from cosybatch import __version__
from cosybatch.run.disk_estimate import warn_if_short_of_space
from cosybatch.run.exits import EXIT_FAILED, EXIT_OK, Interrupted, interrupt_exit_code, signal_name
from cosybatch.run.interrupts import DeferredInterrupts
from cosybatch.manifest import Manifest, ManifestRow
from cosybatch.run.progress import RunProgress, print_summary, stderr_console
from cosybatch.run.resume import ResumePlan, changed_message, fingerprint_sha, plan_resume, run_fingerprint
from cosybatch.output.records import base_record, one_by_one
from cosybatch.output.rows import RowFailed, finish_row
from cosybatch.run.sharding import ALL, Shard, select
from cosybatch.output.write_behind import WriteBehind
from cosybatch.atomic import OutputFault, remove_stale_tmp
from cosybatch.output.audio_files import AudioFormat
from cosybatch.output.ledger import Ledger, read_ledgers
from cosybatch.output.timing import (STAGE_KEYS, TimingWriter, build_totals, row_timing, timing_document,
                                     window, windows_for)

log = logging.getLogger(__name__)

# Per-row seconds summed into the totals (``sum_<key>``) when some row reported them.
SUMMED_KEYS = ("total_s", "queue_s", *STAGE_KEYS)


class RunError(Exception):
    """A configuration problem that stops the run before any row (exit code 2)."""


class SettingsChanged(RunError):
    pass


class _SynthesizerFailed(Exception):
    """The synthesizer's batch generator raised: the run cannot go on (rows already done stay)."""


@dataclass
class RunReport:
    exit_code: int
    totals: dict[str, Any]
    out_dir: Path
    ledger_path: Path
    timing_path: Path
    failed: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _out_lock(out_dir: Path, tag: str) -> Iterator[None]:
    """One writer per (OUT, shard): a second run would interleave the same ledger."""
    try:
        import fcntl
    except ImportError:  # not POSIX: run unguarded
        yield
        return
    try:
        fd = os.open(out_dir / f".cosybatch{tag or '.all'}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunError(f"cannot write to {out_dir}: {e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunError(f"{out_dir}: another cosybatch synth is writing here (same shard)") from None
        yield
    finally:
        os.close(fd)


def _system_info(synth: Any) -> dict[str, Any]:
    try:
        desc = dict(synth.describe())
    except Exception as e:  # a describe() bug must not cost the run
        desc = {"describe_error": f"{type(e).__name__}: {e}"}
    import soundfile

    versions = {"cosybatch": __version__, "python": platform.python_version(),
                "numpy": np.__version__, "soundfile": soundfile.__version__}
    versions.update(desc.get("versions") or {})
    for k in ("torch", "python", "cosybatch", "numpy", "onnxruntime", "cuda"):
        if isinstance(desc.get(k), str):
            versions[k] = desc.pop(k)
    desc["versions"] = versions
    desc.setdefault("model", None)
    desc.setdefault("device", None)
    desc["host"] = platform.node()
    return desc


def _row_timing(row: ManifestRow, rec: dict[str, Any], resumed: bool, manifest: str | None) -> dict[str, Any]:
    return row_timing(utt_id=row.utt_id, line=row.line, manifest=manifest, status=rec.get("status"),
                      audio_s=rec.get("audio_s"), tokens=rec.get("tokens"), chunks=rec.get("chunks"),
                      prompt_s=row.prompt_s, timings=rec.get("timings"), resumed=resumed, reason=rec.get("reason"))


def run_synth(manifest: Manifest, synth: Any, out_dir: str | os.PathLike, *, stream: bool = False,
              wav_subtype: str = "PCM_16", audio_format: AudioFormat | None = None, overwrite: bool = False,
              strict: bool = False, shard: Shard = ALL, quiet: bool = False, argv: list[str] | None = None,
              timing_interval_s: float = 10.0, console: Any = None, encoder: Any = None) -> RunReport:
    """Synthesize this shard's valid rows into ``out_dir``; returns the exit code to use.

    ``audio_format``: the files' format, rate and loudness (default: WAV of ``wav_subtype`` at the
    synthesizer's rate). ``encoder``: a ``HelperProcess`` warming ``audio_format.prepare`` that
    the caller started before the synthesizer's start-up (see ``_Run._begin``); the caller
    closes it. Raises RunError (exit code 2) for problems found before any row runs: a
    busy OUT, settings that differ from the files already there, an unusable format or rate.
    """
    out = Path(out_dir)
    audio = audio_format if audio_format is not None else AudioFormat(wav_subtype=wav_subtype)
    native_rate = getattr(synth, "sample_rate", None)
    problem = audio.problem() or audio.problem_at(native_rate if isinstance(native_rate, int) else None)
    if problem:
        raise RunError(problem)
    if strict and manifest.problems:
        raise RunError(f"--strict: {len(manifest.problems)} problem(s) in {manifest.path}; nothing was run")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(f"cannot create output folder {out}: {e}") from None
    ledger_path, timing_path = out / f"ledger{shard.tag}.jsonl", out / f"timing{shard.tag}.json"
    console = console or stderr_console()
    with _out_lock(out, shard.tag):
        stale = remove_stale_tmp(out, shard.tag)
        if stale:
            log.info("removed %d temp file(s) left by an interrupted run", stale)
        rows = select(manifest.rows, shard)
        fp = run_fingerprint(synth.fingerprint(), stream, audio, native_rate)
        fp_sha = fingerprint_sha(fp)
        records = read_ledgers(out)
        plan = plan_resume(rows, out, fp_sha, overwrite, records)
        if plan.changed:
            raise SettingsChanged(changed_message(plan, records, fp, out))
        invalid = manifest.problems_by_line() if shard.index == 0 else {}
        warn_if_short_of_space(out, plan.todo, native_rate, audio)
        # The windows of the runs that made the rows already done: the totals describe every
        # finished row, so a re-run with nothing to do still reports the job's throughput.
        earlier = windows_for(out, set(plan.done))
        return _Run(manifest, synth, out, rows, plan, fp, fp_sha, invalid, stream, audio,
                    shard, quiet, argv, ledger_path, timing_path, timing_interval_s, console, earlier, encoder).go()


def start_encoder(audio: AudioFormat) -> Any:
    """The helper process that encodes a fast engine's rows (``run_synth``'s ``encoder``): it
    imports what ``audio`` encodes with while the caller goes on, rows being encoded in the
    calling process until it has."""
    from cosybatch.helper_process import HelperProcess

    return HelperProcess("encoder", warm=(audio.prepare,), local_until_warm=True)


@dataclass
class _Run:
    manifest: Manifest
    synth: Any
    out: Path
    rows: list[ManifestRow]
    plan: ResumePlan
    fp: dict[str, Any]
    fp_sha: str
    invalid: dict[int, list[Any]]  # manifest line -> its problems (only the shard that reports them)
    stream: bool
    audio: AudioFormat
    shard: Shard
    quiet: bool
    argv: list[str] | None
    ledger_path: Path
    timing_path: Path
    interval: float
    console: Any
    earlier: list[dict[str, Any]] = field(default_factory=list)  # windows that made the done rows
    early_encoder: Any = None  # run_synth's ``encoder``

    def __post_init__(self) -> None:
        self.t_start = time.time()  # the window opens here: start-up is reported beside it
        self.t_end: float | None = None  # set when the run ends: the summary and the file agree
        self.timing_rows: dict[str, dict[str, Any]] = {
            r.utt_id: _row_timing(r, self.plan.done[r.utt_id], True, self.manifest.path)
            for r in self.rows if r.utt_id in self.plan.done}
        self.audio_s_done = sum(float(r.get("audio_s") or 0.0) for r in self.timing_rows.values())
        self.counts = {"ok": 0, "failed": 0, "skipped": len(self.plan.done), "invalid": len(self.invalid)}
        self.sums = {k: 0.0 for k in ("audio_s", "tokens", "first_chunk_s", *SUMMED_KEYS)}
        self.reported: set[str] = set()  # timing keys some row reported (batched paths lack per-row stages)
        self.failed: list[str] = []
        self.system = _system_info(self.synth)
        self.timing = TimingWriter(self.timing_path, self.interval, tag=self.shard.tag)
        self.signum: int | None = None  # the signal that interrupted the run
        self.stopped: str | None = None  # why the run stopped early (an output fault, a synthesizer crash)
        self.synth_stats: dict[str, Any] = {}  # the synthesizer's own figures, read on the thread driving it
        # what building the synthesizer cost before the run's window opened (wall_s excludes it)
        self.startup: dict[str, Any] | None = getattr(self.synth, "startup", None)
        self.encoder: Any = None  # the HelperProcess encoding the rows' files, if any (see _begin)

    @property
    def interrupted(self) -> bool:
        return self.signum is not None

    def window(self) -> dict[str, Any]:
        """This run's window so far (it closes with the last record written)."""
        return window(self.t_start, self.t_end or time.time(), ok=self.counts["ok"], failed=self.counts["failed"],
                      audio_s=round(self.sums["audio_s"], 4))

    def runs(self) -> list[dict[str, Any]]:
        """The windows behind this document's rows: the earlier ones, and this run's once it
        has made a row (a run that made none adds no time to the job)."""
        made = self.counts["ok"] + self.counts["failed"]
        return [*self.earlier, self.window()] if made else list(self.earlier)

    def totals(self) -> dict[str, Any]:
        audio = self.sums["audio_s"]
        done = self.counts["ok"] + self.counts["failed"] + self.counts["skipped"]
        return build_totals(
            rows=len(self.rows), **self.counts, pending=len(self.rows) - done,
            audio_s_run=audio, this_run=[self.window()], audio_s_all=audio + self.audio_s_done,
            windows=self.runs(),
            extra={"tokens": int(self.sums["tokens"]),
                   **{f"sum_{k}": round(self.sums[k], 4) for k in SUMMED_KEYS if k in self.reported},
                   **self.synth_stats,
                   **({"startup": self.startup} if self.startup else {}),
                   "mean_first_chunk_s": (self.sums["first_chunk_s"] / self.counts["ok"]) if self.counts["ok"] else None})

    def read_synth_stats(self) -> None:
        """Stage busy times and the timeline snapshot for timing.json. Only the thread that
        drives the synthesizer may call it: the pipeline's accounting is not thread-safe."""
        stats: dict[str, Any] = {}
        if hasattr(self.synth, "stage_busy"):
            stats["stage_busy_s"] = {k: round(v, 4) for k, v in self.synth.stage_busy().items()}
        if hasattr(self.synth, "timeline"):
            stats["timeline"] = self.synth.timeline()
        self.synth_stats = stats

    def timing_doc(self, complete: bool) -> dict[str, Any]:
        rate = getattr(self.synth, "sample_rate", None)
        return timing_document(
            complete=complete, interrupted=self.interrupted, stopped=self.stopped,
            manifest=self.manifest.path, out=self.out, system=self.system,
            shard={"index": self.shard.index, "count": self.shard.count},
            settings={"stream": self.stream, "sample_rate": rate, **self.audio.settings(rate)},
            fingerprint=self.fp, fingerprint_sha=self.fp_sha, started=self.t_start,
            totals=self.totals(), runs=self.runs(),
            rows=[self.timing_rows[r.utt_id] for r in self.rows if r.utt_id in self.timing_rows])

    def go(self) -> RunReport:
        if self.plan.done:
            log.info("resuming: %d row(s) already done, %d to go", len(self.plan.done), len(self.plan.todo))
        ledger: Ledger | None = None
        with DeferredInterrupts() as intr, contextlib.ExitStack() as stack:
            try:
                ledger = stack.enter_context(Ledger(self.ledger_path))
                stack.callback(self._close_encoder)
                self._begin(ledger, intr)
                self._rows_loop(ledger)
            except KeyboardInterrupt as e:
                self._note_interrupt(e)
            except OutputFault as e:
                self._note_fault(e)
            except _SynthesizerFailed as e:
                self._note_crash(e.__cause__ or e)
            totals = self._end(ledger, intr)
        if not self.quiet:
            print_summary(totals, self.console)
        return RunReport(self._exit_code(), totals, self.out, self.ledger_path, self.timing_path, self.failed)

    def _close_encoder(self) -> None:
        if self.encoder is not None:
            self.encoder.close()

    def _exit_code(self) -> int:
        if self.signum is not None:
            return interrupt_exit_code(Interrupted(self.signum))
        if self.stopped or self.counts["failed"] or self.counts["invalid"]:
            return EXIT_FAILED
        return EXIT_OK

    def _begin(self, ledger: Ledger, intr: DeferredInterrupts) -> None:
        self.read_synth_stats()
        with intr.commit():
            ledger.append({"event": "run_start", "fp": self.fp_sha, "fingerprint": self.fp,
                           "shard": str(self.shard), "argv": self.argv, "pid": os.getpid(),
                           "rows": len(self.rows), "todo": len(self.plan.todo), "skipped": len(self.plan.done)})
            for line, probs in self.invalid.items():
                ledger.append({"event": "invalid", "utt_id": probs[0].utt_id, "line": line,
                               "status": "invalid", "reason": "; ".join(p.reason for p in probs)})
        # The encoders' imports (about a second, scipy) happen here, not in the first row's commit
        # where they would hold back every row behind it; after run_start, so that the parent of
        # --devices workers sees each worker start as soon as it has; before the rows' window
        # opens, so throughput is not charged with them. A synthesizer that drives a GPU from
        # the thread iterating its rows (``helper_processes``) has them encoded in a helper
        # process, which imports them itself: a row's loudness measurement holds the GIL for
        # milliseconds (scipy's lfilter, pyloudnorm's gating loop), and the GPU thread needs it.
        # Until that process has imported them, rows are encoded here (importing them here, which
        # holds the GIL for seconds on a slow host): ``synth`` starts it before the synthesizer's
        # start-up (``early_encoder``), so that it is ready by the first row.
        if getattr(self.synth, "helper_processes", False):
            self.encoder = self.early_encoder or start_encoder(self.audio)
        if self.encoder is None or not self.encoder.alive:
            self.audio.prepare()
        # A synthesizer may prepare for the run's size (FastSynthesizer: start-up graph captures
        # that pay only on large runs), before its window opens and as part of its start-up.
        expect = getattr(self.synth, "expect_rows", None)
        if expect is not None and self.plan.todo:
            expect(len(self.plan.todo))
            self.startup = getattr(self.synth, "startup", None)
        self.t_start = time.time()
        with intr.commit():
            self.timing.write(self.timing_doc(False))

    def _rows_loop(self, ledger: Ledger) -> None:
        """Rows are committed (audio file, ledger line, timing.json now and then) on a writer thread,
        in the order they finish, so their fsyncs overlap the synthesizer's next steps. Any way
        out of here first commits every row already finished (``WriteBehind.__exit__``);
        closing() then finishes the synthesizer's generator, not garbage collection later."""
        todo = self.plan.todo
        wanted, seen = {r.utt_id for r in todo}, set()

        def commit(item: tuple[ManifestRow, Any, float | None]) -> None:
            self._commit(*item, ledger, bar)
            if self.timing.due():
                self.timing.write(self.timing_doc(False))

        with RunProgress(len(todo), enabled=not self.quiet, console=self.console) as bar, \
                contextlib.closing(self._outcomes(todo)) as outcomes, WriteBehind(commit) as behind:
            for row, outcome, elapsed in outcomes:
                if row.utt_id not in wanted or row.utt_id in seen:
                    log.error("synthesizer returned an unexpected or repeated row %r; ignored", row.utt_id)
                    continue
                seen.add(row.utt_id)
                if self.timing.due():  # the writer thread will rewrite timing.json after this row
                    self.read_synth_stats()
                behind.put((row, outcome, elapsed))
            for row in todo:  # a batch engine that lost a row must not lose it silently
                if row.utt_id not in seen:
                    behind.put((row, RuntimeError("the synthesizer returned no result"), None))
            behind.drain()

    def _end(self, ledger: Ledger | None, intr: DeferredInterrupts) -> dict[str, Any]:
        """Last ledger line and timing.json; after a fault each may fail again (quietly)."""
        self.read_synth_stats()
        self.t_end = time.time()
        totals = self.totals()
        try:
            with intr.commit():
                if ledger is not None:
                    self._try_record(lambda: ledger.append(
                        {"event": "run_end", "fp": self.fp_sha, "interrupted": self.interrupted,
                         **({"stopped": self.stopped} if self.stopped else {}),
                         **{k: totals[k] for k in ("ok", "failed", "skipped", "invalid", "pending")}}))
                complete = not self.interrupted and not self.stopped
                self._try_record(lambda: self.timing.write(self.timing_doc(complete)))
        except KeyboardInterrupt as e:  # arrived while the last records were written; they are written
            self._note_interrupt(e)
        return totals

    def _try_record(self, write: Any) -> None:
        try:
            write()
        except OutputFault as e:
            self._note_fault(e)

    def _note_interrupt(self, e: BaseException) -> None:
        if self.signum is not None:
            return
        self.signum = getattr(e, "signum", signal.SIGINT)
        what = "interrupted" if self.signum == signal.SIGINT else f"terminated ({signal_name(self.signum)})"
        log.warning("%s: finished rows are kept; re-run the same command to resume", what)

    def _note_fault(self, e: OutputFault) -> None:
        """The one line a full disk gets (the traceback only with --verbose)."""
        if not self.stopped:  # later writes failing too is expected: the first one is the news
            self.stopped = str(e)
            kept = self.counts["ok"] + self.counts["skipped"]
            full = e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", None))
            hint = "free space and" if full else "once the output folder is writable again,"
            log.error("%s; run stopped, %d finished row(s) kept: %s re-run the same command to resume",
                      e, kept, hint)
        log.debug("output fault", exc_info=(type(e), e, e.__traceback__))

    def _note_crash(self, e: BaseException) -> None:
        self.stopped = f"synthesizer failed: {type(e).__name__}: {e}"[:1000]
        log.error("%s; run stopped, finished rows are kept (--verbose for the traceback)", self.stopped)
        log.debug("synthesizer crash", exc_info=(type(e), e, e.__traceback__))

    def _outcomes(self, todo: list[ManifestRow]) -> Iterator[tuple[ManifestRow, Any, float | None]]:
        """(row, RowResult or the exception it raised, seconds) as rows finish.

        A synthesizer with ``synthesize_batch(rows, stream)`` yielding ``(row, RowResult |
        Exception)`` in completion order is driven through that; otherwise row by row.
        """
        batch = getattr(self.synth, "synthesize_batch", None)
        if batch is not None:
            try:
                for row, outcome in batch(todo, self.stream):
                    yield row, outcome, None  # what the caller raises is not thrown in here
            except Exception as e:  # the engine as a whole broke down (a row's error is an outcome)
                raise _SynthesizerFailed() from e
            return
        yield from one_by_one(self.synth, todo, self.stream)

    def _commit(self, row: ManifestRow, res: Any, elapsed: float | None, ledger: Ledger, bar: RunProgress) -> None:
        """On the writer thread, where no signal arrives: a row's file, its ledger line and its
        counts are never separated by an interrupt. A full disk (OutputFault) stops the run."""
        try:
            rec = finish_row(self.out, row, res, elapsed, self.fp_sha, self.audio, ledger, self.shard.tag,
                             helper=self.encoder)
        except RowFailed as e:
            self._failed(row, e.error, ledger, bar)
            return
        audio_s, timings = rec["audio_s"], rec["timings"]
        self.counts["ok"] += 1
        self.sums["audio_s"] += audio_s
        self.sums["tokens"] += rec["tokens"]
        for k in ("first_chunk_s", *SUMMED_KEYS):
            if timings.get(k) is not None:
                self.sums[k] += timings[k]
                self.reported.add(k)
        self.timing_rows[row.utt_id] = _row_timing(row, rec, False, self.manifest.path)
        log.debug("%s ok: %.2f s audio", row.utt_id, audio_s)
        bar.advance(audio_s)

    def _failed(self, row: ManifestRow, e: BaseException, ledger: Ledger, bar: RunProgress) -> None:
        reason = f"{type(e).__name__}: {e}"[:1000]
        log.error("%s (line %d) failed: %s", row.utt_id, row.line, reason)
        log.debug("%s", "".join(traceback.format_exception(type(e), e, e.__traceback__)))
        rec = {**base_record(row, self.fp_sha), "status": "failed", "reason": reason}
        ledger.append(rec)
        self.counts["failed"] += 1
        self.failed.append(row.utt_id)
        self.timing_rows[row.utt_id] = _row_timing(row, rec, False, self.manifest.path)
        bar.advance(0.0)
