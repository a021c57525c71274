"""The ``synth`` options a worker process or a Ray actor needs to build the same engine."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_FACTORY = "cosybatch.pipeline:build_synthesizer"


@dataclass(frozen=True)
class SynthOptions:
    model: str
    profile: str | None = None
    overrides: tuple[str, ...] = ()
    stream: bool | None = None  # None: the profile's mode
    wav_subtype: str = "PCM_16"
    overwrite: bool = False
    # MODULE:FACTORY called like cosybatch.pipeline.build_synthesizer(model, device, profile,
    # overrides, stream=...); it is imported where the engine runs, so it must be importable there.
    factory: str = DEFAULT_FACTORY
    argv: tuple[str, ...] = field(default=(), compare=False)
    force_length: bool = False
    prompt_cache: str | None = None

    def build(self, device: str):
        import importlib

        mod, _, attr = self.factory.partition(":")
        build = getattr(importlib.import_module(mod), attr or "build_synthesizer")
        kw: dict = {}
        if self.force_length:
            kw["force_length"] = True
        if self.prompt_cache:
            kw["prompt_cache"] = self.prompt_cache
        return build(self.model, device, self.profile, list(self.overrides), stream=self.stream, **kw)
