"""What a person watching a run sees on stderr: logging, a progress bar, a summary table."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task,
                           TextColumn, TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table
from rich.text import Text

_HANDLER_MARK = "_cosybatch_handler"


def stderr_console() -> Console:
    # No file bound: rich then writes to whatever sys.stderr is at call time (CliRunner swaps it).
    return Console(stderr=True)


def setup_logging(verbose: bool = False, quiet: bool = False, console: Console | None = None) -> None:
    """Route the ``cosybatch`` loggers to stderr (idempotent).

    A terminal gets rich's handler; a file or pipe (Slurm logs, CI) gets plain unwrapped
    lines, so a ``file:line: reason`` message stays one greppable line.
    """
    root = logging.getLogger("cosybatch")
    for h in list(root.handlers):
        if getattr(h, _HANDLER_MARK, False):
            root.removeHandler(h)
    console = console or stderr_console()
    handler: logging.Handler
    if console.is_terminal:
        handler = RichHandler(console=console, show_path=verbose, rich_tracebacks=verbose,
                              markup=False, log_time_format="[%X]")
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    setattr(handler, _HANDLER_MARK, True)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    root.propagate = False


def warn_failed_rows(log: logging.Logger, failed: list[str], reasons_in: Any) -> None:
    """After a run: one line naming the first failed rows and where their reasons are."""
    if failed:
        shown = ", ".join(failed[:10]) + (" ..." if len(failed) > 10 else "")
        log.warning("%d row(s) failed: %s (reasons in %s)", len(failed), shown, reasons_in)


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler that follows sys.stderr when it is swapped (as click's CliRunner does)."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


class _AudioColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        audio = task.fields.get("audio_s", 0.0)
        start = task.fields.get("t0")
        rate = audio / max(time.monotonic() - start, 1e-9) if start is not None else 0.0
        return Text(f"{audio:.1f} s audio, {rate:.2f} audio-s/s", style="cyan")


class RunProgress:
    """Rows done/total, audio seconds, live audio-s/s, ETA; a no-op when not on a TTY."""

    def __init__(self, total: int, enabled: bool, console: Console | None = None):
        console = console or stderr_console()
        self.enabled = enabled and console.is_terminal
        self.audio_s = 0.0
        self._progress = Progress(
            TextColumn("[bold]synth"), BarColumn(bar_width=24), MofNCompleteColumn(), TextColumn("rows"),
            _AudioColumn(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=console, disable=not self.enabled, transient=False)
        self._task = self._progress.add_task("synth", total=total, audio_s=0.0, t0=time.monotonic())

    def __enter__(self) -> "RunProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def advance(self, audio_s: float = 0.0) -> None:
        self.audio_s += audio_s
        self._progress.update(self._task, advance=1, audio_s=self.audio_s)


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def summary_table(totals: dict[str, Any], title: str = "cosybatch synth") -> Table:
    """The counts of this run, then the throughput of every finished row (over the windows of
    the runs that made them), then this run's alone when that differs (a resumed run)."""
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    for key, label in (("ok", "rows ok"), ("failed", "rows failed"),
                       ("skipped", "rows skipped (already done)"), ("invalid", "rows invalid")):
        t.add_row(label, f"{totals.get(key, 0):,}")
    _rate_rows(t, totals, "")
    startup = (totals.get("startup") or {}).get("total_s")
    if startup is not None:
        t.add_row("start-up before the first row (s)", _fmt_s(startup))
    cache = (totals.get("startup") or {}).get("kernel_cache")
    if cache in ("cold", "partial"):
        t.add_row("GPU kernels", "compiled during this run (a first run on this machine: slower)" if cache == "cold"
                  else "the rest compiled beside this run (an earlier one ended first): may be slower")
    if (totals.get("startup") or {}).get("bytecode") == "missing":
        t.add_row("Python imports", "compiled from source, as every run will (see the log)")
    this = totals.get("this_run")
    if this and (this.get("audio_s"), this.get("wall_s")) != (totals.get("audio_s"), totals.get("wall_s")):
        _rate_rows(t, this, "this run: ")
    return t


def _rate_rows(t: Table, figures: dict[str, Any], prefix: str) -> None:
    t.add_row(f"{prefix}audio seconds", _fmt_s(figures.get("audio_s")))
    t.add_row(f"{prefix}wall time (s)", _fmt_s(figures.get("wall_s")))
    rate = figures.get("audio_s_per_s")
    t.add_row(f"{prefix}audio-s/s", "-" if rate is None else f"{rate:,.2f}")
    rtf = figures.get("rtf")
    t.add_row(f"{prefix}RTF", "-" if rtf is None else f"{rtf:.4f}")


def print_summary(totals: dict[str, Any], console: Console | None = None, title: str = "cosybatch synth") -> None:
    (console or stderr_console()).print(summary_table(totals, title))


def is_tty() -> bool:
    return sys.stderr.isatty()
