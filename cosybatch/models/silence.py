"""The official silent-token rule: runs of silence/breath tokens longer than MAX_SILENT_RUN never reach the flow."""

from __future__ import annotations

from typing import Iterable


# FSQ ids of silence/breath that the official llm_job caps at a run of MAX_SILENT_RUN.
SILENT_TOKENS: frozenset[int] = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})


MAX_SILENT_RUN = 5


class SilentFilter:
    """Streaming form of ``silent_filter``: ``push(tok)`` says whether tok goes on to the flow.

    Only a non-silent token resets the run, so every silent token after the first ``max_run``
    of a run is dropped (the LLM itself still conditions on all of them)."""

    def __init__(self, max_run: int = MAX_SILENT_RUN, silent: Iterable[int] = SILENT_TOKENS):
        self.max_run = max_run
        self.silent = frozenset(silent)
        self.run = 0

    def push(self, token: int) -> bool:
        if token in self.silent:
            self.run += 1
            return self.run <= self.max_run
        self.run = 0
        return True


def silent_filter(tokens: Iterable[int], max_run: int = MAX_SILENT_RUN) -> list[int]:
    f = SilentFilter(max_run)
    return [int(t) for t in tokens if f.push(int(t))]
