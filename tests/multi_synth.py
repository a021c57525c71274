"""Synthesizer factories for the launcher and Ray tests (``--synthesizer multi_synth:NAME``).

``env``: the fake synthesizer, which also writes its process's environment and device to
``$MULTI_TEST_ENV_DIR/<pid>.json``. ``real``: the real pipeline at ``$MULTI_TEST_THREADS``
intra-op threads (the count of the process it is compared with) and, when
``$MULTI_TEST_VICTIM`` is set, killed with SIGKILL once that row's audio is ready, the first
time only (``$MULTI_TEST_MARKER`` records that it happened).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import fake_synth


def env(model, device, profile, overrides, stream=None):
    folder = Path(os.environ["MULTI_TEST_ENV_DIR"])
    (folder / f"{os.getpid()}.json").write_text(json.dumps({"device": device, "env": dict(os.environ)}))
    return fake_synth.build(model, device, profile, overrides, stream)


env.free_settings = True  # --set holds fake_synth's settings, not profile keys


class _Dying:
    def __init__(self, inner, victim: str, marker: Path):
        self.inner, self.victim, self.marker = inner, victim, marker

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _check(self, row):
        if row.utt_id == self.victim and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)

    def synthesize_batch(self, rows, stream):
        batch = getattr(self.inner, "synthesize_batch", None)
        if batch is None:
            for row in rows:
                try:
                    outcome = self.inner.synthesize(row, stream)
                except Exception as e:
                    outcome = e
                self._check(row)
                yield row, outcome
            return
        for row, outcome in batch(rows, stream):
            self._check(row)
            yield row, outcome


def real(model, device, profile, overrides, stream=None):
    import torch

    from cosybatch.synthesizers import build_synthesizer

    inner = build_synthesizer(model, device, profile, overrides, stream=stream)
    if os.environ.get("MULTI_TEST_THREADS"):
        torch.set_num_threads(int(os.environ["MULTI_TEST_THREADS"]))
    if not os.environ.get("MULTI_TEST_VICTIM"):
        return inner
    return _Dying(inner, os.environ["MULTI_TEST_VICTIM"], Path(os.environ["MULTI_TEST_MARKER"]))
