"""``synth MANIFEST --out OUT --ray [ADDRESS]``: the manifest as a Ray dataset on a cluster.

The driver reads and validates the manifest as ``synth`` does, drops the rows OUT already
holds (so they are never scheduled: a re-run resumes), hands the rest to one actor per GPU
(``cosybatch.run.ray.api.stage``), and follows the results for the progress bar and the summary. Its
own ledger part, ``ledger.ray.jsonl``, holds the run's start and end and the manifest's
invalid rows; the actors' parts hold the rows; ``timing.ray.json`` is this run's timing
document, and ``timing.json`` the merge of every part in OUT.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from cosybatch.run.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from cosybatch.manifest import Manifest
from cosybatch.run.ray.stage import STOP_FILE
from cosybatch.run.resume import finished_rows
from cosybatch.run.sharding import Shard
from cosybatch.run.options import SynthOptions
from cosybatch.atomic import OutputFault
from cosybatch.output.ledger import Ledger, read_ledgers
from cosybatch.output.timing import TimingWriter, build_totals, row_timing, timing_document, window, windows_for

log = logging.getLogger("cosybatch.run.ray.api")

INSTALL_HINT = "pip install 'cosybatch[ray]'"


def ray_missing() -> str | None:
    """The one-line error for ``--ray`` without Ray Data installed (None when it is)."""
    try:
        importlib.import_module("ray.data")  # --ray needs it next anyway
    except ImportError:
        return f"--ray needs Ray Data, which is not installed: {INSTALL_HINT}"
    return None


def _refused_settings(e: BaseException) -> str | None:
    """The SettingsChanged message inside whatever Ray wrapped it in, if that is what stopped the run."""
    from cosybatch.run.synth import SettingsChanged

    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        cause = getattr(cur, "cause", None)  # a RayTaskError's original exception
        if isinstance(cause, SettingsChanged):
            return str(cause)
        if isinstance(cur, SettingsChanged) and cause is None:
            return str(cur)
        cur = cur.__cause__ or cause or cur.__context__
    text = str(e)
    if "refusing to mix outputs" in text:  # the actor's exception only reached us as text
        start = text.rfind("SettingsChanged: ")
        return text[start + len("SettingsChanged: "):] if start >= 0 else text
    return None


class _SetupError(Exception):
    """The cluster cannot host the run as asked (no GPU for --device cuda): exit 2."""


class RayRun:
    def __init__(self, man: Manifest, out: Path, options: SynthOptions, address: str | None, device: str,
                 quiet: bool, verbose: bool):
        self.man, self.out, self.options, self.address, self.device = man, out, options, address, device
        self.quiet, self.verbose = quiet, verbose
        self.counts = {"ok": 0, "failed": 0, "invalid": len(man.problems_by_line()), "skipped": 0}
        self.audio_s = 0.0
        self.rows: dict[str, dict[str, Any]] = {}  # this run's per-row timing entries
        # This run's window, from the rows themselves (a result's arrival less its own time):
        # the actors' start-up on the cluster is not row time.
        self.window_start: float | None = None
        self.window_end: float | None = None
        self.signum: int | None = None
        self.error: str | None = None
        self.code_for_error = EXIT_FAILED
        self.actors = 0

    def _plan(self) -> None:
        records = read_ledgers(self.out)
        self.done = {} if self.options.overwrite else finished_rows(self.man.rows, self.out, records)
        self.todo = [r for r in self.man.rows if r.utt_id not in self.done]
        from cosybatch.run.ray.api import fingerprints

        self.done_fps = fingerprints(records, self.done.values())
        self.counts["skipped"] = len(self.done)
        self.earlier = windows_for(self.out, set(self.done))  # the windows that made the done rows

    def _execute(self, bar: Any) -> None:
        import ray
        import ray.data

        from cosybatch.run.ray import api as cray
        place = self._place()
        self.actors = place.actors if isinstance(place.actors, int) else place.actors[1]
        log.info("Ray: %d row(s) on %d %s actor(s)", len(self.todo), self.actors, place.device)
        items = [{"utt_id": r.utt_id, "prompt_text": r.prompt_text, "prompt_wav": str(r.prompt_wav.absolute()),
                  "target_text": r.target_text, "line": r.line} for r in self.todo]
        results = cray.stage(ray.data.from_items(items), self.options, self.out, place, done_fps=self.done_fps,
                             batch_size=cray.cli_batch_size(len(self.todo), place))
        # closing(): on Ctrl-C the execution (and its actors) stops now, not when the iterator
        # is garbage collected; rows already committed stay committed.
        with contextlib.closing(iter(results.iter_batches(batch_size=None, batch_format="pyarrow"))) as batches:
            for batch in batches:
                for res in batch.to_pylist():
                    self._result(res, bar)

    def _place(self) -> Any:
        from cosybatch.run.ray import api as cray
        try:
            return cray.placement(self.device)
        except ValueError as e:
            raise _SetupError(str(e)) from None

    def _check_settings(self) -> None:
        """One engine, on the kind of device the actors would get, compares its settings with OUT's."""
        import ray

        from cosybatch.run.ray.stage import check_settings

        place = self._place()
        task = ray.remote(check_settings).options(num_gpus=place.num_gpus, **(
            {"num_cpus": place.num_cpus} if place.num_cpus else {}))
        ray.get(task.remote(self.options, place.device, self.done_fps, str(self.out)))

    def _result(self, res: dict[str, Any], bar: Any) -> None:
        status = res.get("status")
        if res.get("utt_id") in self.rows:
            return
        audio = float(res.get("audio_s") or 0.0) if status == "ok" else 0.0
        key = status if status in self.counts else "failed"
        self.counts[key] += 1
        self.audio_s += audio
        now, took = time.time(), res.get("total_s")
        began = now - took if isinstance(took, (int, float)) and took >= 0 else now
        self.window_start = began if self.window_start is None else min(self.window_start, began)
        self.window_end = now
        line = res.get("line")
        self.rows[res["utt_id"]] = row_timing(
            utt_id=res["utt_id"], line=int(line) if isinstance(line, (int, float)) else None, manifest=self.man.path,
            status=status, audio_s=res.get("audio_s"), tokens=res.get("tokens"), timings={"total_s": took},
            reason=res.get("reason") or None)
        bar.advance(audio)

    def _connect(self) -> bool:
        import ray

        if ray.is_initialized():  # a caller (a notebook, a test) brought its own Ray
            return False
        ray.init(address=self.address, logging_level=logging.DEBUG if self.verbose else logging.WARNING)
        return True

    def _quiet_ray_data(self, bar: Any) -> None:
        import ray.data

        if not self.verbose:  # its progress lines (stderr not a terminal) repeat what the summary says
            logging.getLogger("ray.data").setLevel(logging.WARNING)
        if bar.enabled:  # Ray Data's bars would fight ours for the terminal
            ray.data.DataContext.get_current().enable_progress_bars = False
            logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "bars disabled"

    def window(self) -> list[dict[str, Any]]:
        """This run's window, once a row came back (none before: a run that made no row adds no time)."""
        if self.window_start is None or self.window_end is None:
            return []
        return [window(self.window_start, self.window_end, ok=self.counts["ok"], failed=self.counts["failed"],
                       audio_s=round(self.audio_s, 4))]

    def totals(self) -> dict[str, Any]:
        late_invalid = self.counts["invalid"] - len(self.man.problems_by_line())  # found by an actor
        finished = self.counts["ok"] + self.counts["failed"] + late_invalid
        audio_done = sum(float(r.get("audio_s") or 0.0) for r in self.done.values())
        return build_totals(rows=len(self.man.rows), **self.counts, pending=max(0, len(self.todo) - finished),
                            audio_s_run=self.audio_s, this_run=self.window(), audio_s_all=self.audio_s + audio_done,
                            windows=[*self.earlier, *self.window()], extra={"actors": self.actors})

    def run(self) -> int:
        from cosybatch.run.progress import RunProgress, print_summary

        t0 = time.time()
        self._plan()
        if self.done:
            log.info("resuming: %d row(s) already done, %d to go", len(self.done), len(self.todo))
        started = False
        with Ledger(self.out / "ledger.ray.jsonl") as ledger:
            self._record(ledger, {"event": "run_start", "shard": "ray", "address": self.address, "pid": os.getpid(),
                                  "argv": list(self.options.argv), "rows": len(self.man.rows),
                                  "todo": len(self.todo), "skipped": len(self.done)})
            for line, probs in self.man.problems_by_line().items():
                self._record(ledger, {"event": "invalid", "utt_id": probs[0].utt_id, "line": line,
                                      "status": "invalid", "reason": "; ".join(p.reason for p in probs)})
            try:
                if self.todo:
                    from cosybatch.run.ray.api import remove_stale_actor_tmp

                    if remove_stale_actor_tmp(self.out):
                        log.info("removed temp file(s) left by the actors of an interrupted run")
                    started = self._connect()
                    with RunProgress(len(self.todo), enabled=not self.quiet) as bar:
                        self._quiet_ray_data(bar)
                        self._execute(bar)
                elif self.done and not self.options.overwrite:
                    started = self._connect()
                    self._check_settings()
                    log.info("nothing to do: every row is already done")
            except KeyboardInterrupt as e:
                self.signum = getattr(e, "signum", signal.SIGINT)
                if started:
                    self._stop_actors()
                log.warning("interrupted: finished rows are kept; re-run the same command to resume")
            except ConnectionError as e:
                self.error = f"cannot reach a Ray cluster at {self.address or '(default)'}: {e}"
                self.code_for_error = EXIT_USAGE
            except (_SetupError, OutputFault) as e:
                self.error = str(e)
                self.code_for_error = EXIT_USAGE if isinstance(e, _SetupError) else EXIT_FAILED
            except Exception as e:
                refused = _refused_settings(e)
                self.error = refused or f"the Ray run failed: {type(e).__name__}: {e}"
                self.code_for_error = EXIT_USAGE if refused else EXIT_FAILED
            finally:
                if started:
                    _shutdown()
            if self.error:
                log.error("%s", self.error)
            totals = self.totals()
            self._record(ledger, {"event": "run_end", "interrupted": self.signum is not None, "error": self.error,
                                  **{k: totals[k] for k in ("ok", "failed", "skipped", "invalid", "pending")}})
        self._write_timing(t0, totals)
        if not self.quiet:
            print_summary(totals, title=f"cosybatch synth (Ray, {self.actors} actors)" if self.actors
                          else "cosybatch synth (Ray)")
        if self.signum is not None:
            return 128 + self.signum  # 130 for Ctrl-C, 143 for SIGTERM
        if self.error:
            return self.code_for_error
        return EXIT_FAILED if totals["failed"] or totals["invalid"] or totals["pending"] else EXIT_OK

    def _stop_actors(self) -> None:
        """Tell the actors to commit nothing more, then give a commit already past that check
        (a WAV rename and a ledger line: milliseconds) time to land before the driver reports."""
        try:
            (self.out / STOP_FILE).touch()
        except OSError as e:
            log.warning("could not tell the actors to stop (%s); a row in flight may still be written", e)
            return
        time.sleep(STOP_GRACE_S)

    def _record(self, ledger: Ledger, rec: dict[str, Any]) -> None:
        try:
            ledger.append(rec)
        except OutputFault as e:  # the driver's own lines are a report; the rows are in the actors' parts
            log.warning("%s", e)

    def _write_timing(self, t0: float, totals: dict[str, Any]) -> None:
        from cosybatch import __version__

        resumed = [row_timing(utt_id=u, line=r.get("line"), manifest=self.man.path, status="ok",
                              audio_s=r.get("audio_s"), tokens=r.get("tokens"), chunks=r.get("chunks"),
                              prompt_s=r.get("prompt_s"), timings=r.get("timings"), resumed=True)
                   for u, r in self.done.items()]
        complete = self.signum is None and not self.error and not totals["pending"]
        doc = timing_document(
            complete=complete, interrupted=self.signum is not None, stopped=self.error, manifest=self.man.path,
            out=self.out, system={"model": self.options.model, "device": "ray",
                                  "versions": {"cosybatch": __version__, "ray": _ray_version()},
                                  "ray_address": self.address, "actors": self.actors},
            shard={"index": 0, "count": 1},
            settings={"stream": self.options.stream, **self.options.audio_format().settings(None)},
            started=t0, totals=totals, runs=[*self.earlier, *self.window()],
            rows=resumed + list(self.rows.values()))
        from cosybatch.run.merge import MergeError, merge_outputs

        try:
            TimingWriter(self.out / "timing.ray.json").write(doc)
            merge_outputs([self.out], self.out, quiet=True)  # this run's own summary says what is missing
        except (OSError, OutputFault, MergeError) as e:
            log.warning("could not write the run's summary into %s: %s", self.out, e)


STOP_GRACE_S = 0.5  # after the stop file: far more than a commit takes, far less than a row


def _ray_version() -> str | None:
    try:
        import ray

        return ray.__version__
    except ImportError:
        return None


def _shutdown() -> None:
    import ray

    try:
        ray.shutdown()
    except Exception as e:  # the run's outcome is known; a shutdown hiccup must not change it
        log.debug("ray.shutdown failed: %s", e)


def run_on_ray(man: Manifest, out: Path, options: SynthOptions, *, address: str | None, device: str,
               shard: Shard, multi: bool, quiet: bool = False, verbose: bool = False) -> int:
    """``synth --ray`` after option parsing; returns the exit code."""
    missing = ray_missing()
    if missing:
        log.error("%s", missing)
        return EXIT_USAGE
    if multi:
        log.error("--ray places one actor on every GPU of the cluster itself; drop --devices/--workers")
        return EXIT_USAGE
    if shard.count > 1:
        log.error("--ray runs every row of the manifest; it does not combine with --shard (or RANK/WORLD_SIZE, "
                  "a Slurm array)")
        return EXIT_USAGE
    if device not in ("auto", "cuda", "cpu"):
        log.error("--ray with --device %s: use auto, cuda or cpu (Ray gives each actor its GPU)", device)
        return EXIT_USAGE
    out = Path(out).absolute()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.error("cannot create output folder %s: %s", out, e)
        return EXIT_USAGE
    return RayRun(man, out, options, address, device, quiet, verbose).run()
