"""One worker process of ``synth --devices/--workers``: its own engine, its own ledger part.

The parent (``cosybatch.run.multi.launcher``) starts it with the ``spawn`` method and hands it a ``Job``.
The worker runs ``run_synth`` on its rows exactly as a one-process ``synth --shard`` would;
the parent learns about finished rows by following the worker's ledger part, and about
everything else from the worker's log records (sent over a pipe) and its exit code.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

from cosybatch.run.multi.devices import Slot
from cosybatch.run.exits import EXIT_USAGE, Interrupted, interrupt_exit_code
from cosybatch.run.interrupts import signals_decide_setup
from cosybatch.manifest import Manifest
from cosybatch.run.sharding import Shard
from cosybatch.run.options import SynthOptions, close_synthesizer

log = logging.getLogger("cosybatch.run.multi.worker")

EXIT_SETUP = EXIT_USAGE  # the worker could not start its engine or its run (none of its rows ran)


@dataclass
class Job:
    index: int  # 0 .. workers-1
    workers: int
    slot: Slot
    shard: Shard  # names the ledger part; members = this worker's rows
    manifest: Manifest  # only this worker's rows (the parent already parsed and validated)
    out: str
    options: SynthOptions
    log_level: int  # what the parent shows; lower records are not even sent
    parent_pid: int


class PipeHandler(logging.Handler):
    """Sends (level, logger name, text) to the parent, which shows it above its progress bar.

    Plain tuples, not LogRecords: a record's args may not pickle. ``emit`` runs under the
    handler's lock, so the engine's threads never interleave two messages on the pipe.
    """

    def __init__(self, conn: Any):
        super().__init__()
        self.conn = conn

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.conn.send((record.levelno, record.name, self.format(record)))
        except Exception:  # the parent is gone: nobody to tell
            pass


def _set_stop_signals() -> None:
    # The parent is the one place a Ctrl-C lands: leaving the terminal's process group means
    # a Ctrl-C reaches this worker once (forwarded by the parent), not twice. The parent
    # started us with SIGINT ignored so that the window before this line is covered too.
    try:
        os.setpgrp()
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Before run_synth installs its own handlers (e.g. while the model loads), SIGTERM
    # stops the worker the same orderly way as SIGINT.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    _die_with_parent()


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def _die_with_parent() -> None:
    """A parent killed with SIGKILL cannot forward anything: have the kernel send SIGTERM."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except Exception:
        pass


def _route_logging(conn: Any, level: int) -> None:
    root = logging.getLogger("cosybatch")
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = PipeHandler(conn)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False


def _limit_threads(workers: int) -> None:
    """Share the CPU cores between the workers unless the user chose (OMP_NUM_THREADS)."""
    if "OMP_NUM_THREADS" in os.environ or "torch" not in sys.modules:
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    import torch

    torch.set_num_threads(max(1, cores // workers))


def run(job: Job) -> int:
    """Build the engine and run this worker's rows; returns the exit code."""
    from cosybatch.run.synth import RunError, run_synth

    opts = job.options
    try:
        with signals_decide_setup():  # a stop signal while the engine loads is a stop, not a broken set-up
            synth = opts.build(job.slot.device)
    except KeyboardInterrupt as e:
        return interrupt_exit_code(e)
    except Exception as e:
        log.debug("synthesizer setup failed", exc_info=True)
        log.error("cannot set up the synthesizer for %r on %s: %s", opts.model, job.slot.label, e)
        return EXIT_SETUP
    _limit_threads(job.workers)
    try:
        report = run_synth(job.manifest, synth, job.out, stream=opts.stream_for(synth),
                           audio_format=opts.audio_format(), overwrite=opts.overwrite, shard=job.shard,
                           quiet=True, argv=list(opts.argv))
        return report.exit_code
    except RunError as e:
        log.error("%s", e)
        return EXIT_SETUP
    except KeyboardInterrupt as e:  # a second signal during the runner's own cleanup
        return interrupt_exit_code(e)
    finally:
        close_synthesizer(synth)


def main(job: Job, conn: Any, stopped: Any = None) -> None:
    """The spawned process's target; the exit code is the worker's answer to the parent.
    ``stopped``: a shared int the parent sets to the signal it forwards (0 while running)."""
    _set_stop_signals()
    if stopped is not None and stopped.value:
        # The parent's signal came while SIGINT was still ignored here (before the line above)
        # and was lost: stop as that signal would have stopped us.
        sys.exit(128 + stopped.value)
    if os.getppid() != job.parent_pid:  # the parent died before PDEATHSIG was armed
        sys.exit(EXIT_SETUP)
    if job.slot.visible is not None:
        # Before anything imports torch: the worker then sees exactly one GPU, as cuda:0.
        os.environ["CUDA_VISIBLE_DEVICES"] = job.slot.visible
    _route_logging(conn, job.log_level)
    try:
        code = run(job)
    except KeyboardInterrupt as e:
        code = interrupt_exit_code(e)
    logging.getLogger("cosybatch").handlers.clear()
    conn.close()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    # Not sys.exit: interpreter finalization with an engine thread still inside native code
    # aborts the process (exit 134), which the parent would have to report as a crash.
    os._exit(code)
