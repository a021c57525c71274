"""Exit codes of every cosybatch command, and the exception that carries a signal to them.

A leaf module (nothing from cosybatch imported) so the runner, ``merge`` and the CLI share
one definition without importing each other.
"""

from __future__ import annotations

import signal

EXIT_OK = 0  # every row fine
EXIT_FAILED = 1  # some rows failed or were invalid, or the run stopped on an output fault (disk full)
EXIT_USAGE = 2  # usage or configuration error, found before any row ran
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: Ctrl-C
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: SIGTERM (kill, Slurm at the time limit, docker stop)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the main thread.

    A KeyboardInterrupt so that everything which already lets Ctrl-C through (``except
    Exception`` does not catch it) treats SIGTERM the same way; ``signum`` picks the exit code.
    """

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def interrupt_exit_code(exc: BaseException | None = None) -> int:
    """130 for Ctrl-C (a plain KeyboardInterrupt included), 143 for SIGTERM."""
    if getattr(exc, "signum", None) == signal.SIGTERM:
        return EXIT_TERMINATED
    return EXIT_INTERRUPTED


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
