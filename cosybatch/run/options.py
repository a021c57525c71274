"""The ``synth`` options a worker process or a Ray actor needs to build the same engine."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from cosybatch.output.audio_files import AudioFormat

DEFAULT_FACTORY = "cosybatch.synthesizers:build_synthesizer"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SynthOptions:
    model: str
    profile: str | None = None
    overrides: tuple[str, ...] = ()
    stream: bool | None = None  # None: the profile's mode
    wav_subtype: str = "PCM_16"
    overwrite: bool = False
    # MODULE:FACTORY called like cosybatch.synthesizers.build_synthesizer(model, device, profile,
    # overrides, stream=...); it is imported where the engine runs, so it must be importable there.
    factory: str = DEFAULT_FACTORY
    argv: tuple[str, ...] = field(default=(), compare=False)
    force_length: bool = False
    prompt_cache: str | None = None
    # the files: format (wav_subtype applies to wav only), rate (None: the synthesizer's), LUFS target
    out_format: str = "wav"
    sample_rate: int | None = None
    loudness: float | None = None

    def audio_format(self) -> AudioFormat:
        """The output settings every way of running writes with (and fingerprints)."""
        return AudioFormat(self.out_format, self.wav_subtype, self.sample_rate, self.loudness)

    def load_factory(self):
        import importlib

        mod, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(mod), attr or "build_synthesizer")

    def build(self, device: str, factory=None):
        """The synthesizer on ``device``, from ``factory`` (default: ``load_factory()``). Only
        the options the user set are passed, so a factory that predates them keeps working."""
        kw: dict = {}
        if self.force_length:
            kw["force_length"] = True
        if self.prompt_cache:
            kw["prompt_cache"] = self.prompt_cache
        build = factory if factory is not None else self.load_factory()
        return build(self.model, device, self.profile, list(self.overrides), stream=self.stream, **kw)

    def stream_for(self, synth) -> bool:
        """The mode rows are synthesized in: as asked, else the synthesizer's (its profile's)."""
        return self.stream if self.stream is not None else bool(getattr(synth, "streaming", False))


def close_synthesizer(synth: Any) -> None:
    """``close()`` a synthesizer that has one (joining its threads); a failure there is only
    logged: the rows are recorded by then."""
    close = getattr(synth, "close", None)
    if not callable(close):
        return
    try:
        close()
    except Exception as e:
        log.warning("shutting the synthesizer down failed: %s: %s", type(e).__name__, e)
        log.debug("close() failed", exc_info=True)
