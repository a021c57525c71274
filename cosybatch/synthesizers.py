"""Wires frontend -> LM -> codec for the CLI: objects that turn manifest rows into audio.

``ReferenceSynthesizer`` runs the slow exact path one row at a time; ``FastSynthesizer`` keeps
many rows in flight through ``scheduler.pipeline.FastPipeline``. ``build_synthesizer`` (``synth``) and
``build_streaming_pipeline`` (``profile``) pick one from a profile.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import cosybatch

log = logging.getLogger(__name__)

# A ``synth`` run captures the profile's start-up flow buckets only with at least this many
# codec admissions' worth of rows (256 at the default 64): on the H200 they cost ~1.2 s of
# start-up (11 buckets, the first paying the process's first capture) and saved ~2.4 s of a
# 1,088-row window (5-7 captures of ~230 ms each there, where the pipeline stalls behind them),
# while a 16-row job used none of them and took ~1.8 s longer (design.md D27).
PRECAPTURE_MIN_JOBS = 4


@dataclass
class RowResult:
    audio: np.ndarray  # float32 mono at sample_rate
    sample_rate: int
    tokens: int  # speech tokens behind the audio
    # total_s, first_chunk_s, queue_s (the part of total_s before its first speech tokens: the
    # wait for the frontend and an AR slot, and the prefill) and, from
    # the sequential reference engine, frontend_s, llm_s, flow_s, hift_s: what is known
    timings: dict[str, float]
    chunks: int
    # The normalized target pieces in the order they were synthesized (the ledger's
    # ``segments``); None from a synthesizer that does not know them.
    segments: list[str] | None = None


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA GPU")
    return torch.device(device)


def _describe(model_dir, device, engine: str, **extra) -> dict:
    return {"model": str(model_dir), "device": str(device), "engine": engine, **extra,
            "cosybatch": cosybatch.__version__, "torch": torch.__version__, "python": platform.python_version()}


class ReferenceSynthesizer:
    """The exact, sequential path (profile ``reference``)."""

    def __init__(self, model_dir, device: torch.device, profile=None, prompt_cache=None):
        from cosybatch.checkpoint import load_models
        from cosybatch.frontend.frontend import Frontend
        from cosybatch.profiles import load_profile
        from cosybatch.profiles.resolve import resolve_sampling, resolve_text
        from cosybatch.reference.pipeline import ReferencePipeline
        from cosybatch.gpu.runtime import ProcessSettings, apply_process_settings

        profile = profile or load_profile("reference")
        s = profile.sampling
        # Refuse what the one-request path does not implement instead of ignoring it.
        if s.mode == "standard" or s.max_tokens is not None or (profile.hops.first, profile.hops.max) != (None, None):
            raise ValueError("the reference engine implements RAS sampling with the official 25 -> 100 hops only "
                             "(no sampling.mode=standard, sampling.max_tokens or hops.*)")
        self.model_dir, self.device = model_dir, device
        if device.type == "cuda":  # the exact path: no TF32 anywhere (cuDNN enables it by default)
            apply_process_settings(ProcessSettings(cudnn_tf32=False, matmul_tf32=False))
        self.text = resolve_text(profile.text)
        self.models = load_models(model_dir, device=str(device))
        # onnxruntime on the CPU: the exact path's frontend, whatever the device
        self.frontend = Frontend(model_dir, self.models.cfg, backend="onnxruntime", disk_cache=prompt_cache,
                                 text_normalizer=self.text.normalizer)
        self.sample_rate = self.models.cfg.sample_rate
        self.streaming = profile.mode == "streaming"
        self.sampling = resolve_sampling(s, self.models.cfg.llm.sampling)
        self.pipeline = ReferencePipeline(self.models, self.frontend, device, sampling=self.sampling.ras_config(),
                                          enforce_min_len=s.enforce_min_len, seed=s.seed)

    def fingerprint(self) -> dict:
        return {"model": str(self.model_dir), "engine": "reference", "sampling": vars(self.sampling),
                "text_normalizer": self.text.normalizer}

    def describe(self) -> dict:
        return _describe(self.model_dir, self.device, "reference")

    def close(self) -> None:
        """Nothing runs beside the caller's thread."""

    def synthesize(self, row, stream: bool) -> RowResult:
        trace = self.pipeline.run(row.prompt_wav, row.prompt_text, row.target_text, stream)
        return RowResult(
            audio=trace.audio,
            sample_rate=self.sample_rate,
            tokens=sum(len(s.llm_tokens) for s in trace.segments),
            timings=trace.timings,
            chunks=sum(len(s.chunk_wavs) for s in trace.segments),
            segments=list(trace.segment_texts),
        )


def fast_pipeline(models, frontend, profile, device: torch.device):
    """A ``FastPipeline`` for loaded models under ``profile`` (tests and tools; the builders below
    also apply the process-wide settings and time the start-up)."""
    from cosybatch.profiles.resolve import resolve
    from cosybatch.scheduler.pipeline import FastPipeline

    return FastPipeline(models, frontend, resolve(profile, models.cfg, device), device)


def _fast_pipeline(model_dir, device: torch.device, profile, prompt_cache=None, precapture_flow: bool = True):
    from cosybatch.checkpoint import load_config, load_models
    from cosybatch.frontend.frontend import Frontend
    from cosybatch.profiles.resolve import resolve
    from cosybatch.gpu.runtime import apply_process_settings
    from cosybatch.gpu.triton_cache import preload, start_ahead_compile
    from cosybatch.scheduler.pipeline import FastPipeline
    from cosybatch.scheduler.startup import StartupClock
    # This package's modules the loads below need are imported now, before their threads start:
    # each thread then imports only third-party packages of its own (onnx; inflect, wetext), so
    # no two threads wait on each other's imports (a cycle there hands one a half-done module).
    for name in ("checkpoint.onnx_file", "checkpoint.onnx_weights", "frontend.ort_backend", "text.tokenizer",
                 "helper_process", "text.normalize", "models.flow", "models.hift", "models.speech_lm"):
        importlib.import_module(f"cosybatch.{name}")

    # Resolve (and so validate) the profile before loading any weights, and set the
    # process-wide switches before any model work.
    cfg = load_config(model_dir)
    settings = resolve(profile, cfg, device)
    apply_process_settings(settings.process)
    clock = StartupClock(device)
    launches = _kernel_cache(clock, device)
    f = settings.frontend

    stop_preload = threading.Event()  # set once the weights are in: the loading phase does not wait longer

    def preload_kernels() -> int:
        with _on(device):
            loaded, stale = preload(launches, stop_preload)
        if stale:  # another version's kernels in the cache: compile this one's beside the run
            log.info("Triton's cache lacks kernels of this version: compiling them ahead")
            start_ahead_compile("cold")
        return loaded

    def build_frontend() -> Frontend:
        # Benchmark workloads cycle through hundreds of prompts: room for thousands of them.
        with _on(device):
            fe = Frontend(model_dir, cfg, backend=f.backend, device=device, dtype=f.dtype, split_tf32=f.split_tf32,
                          row_bucket=f.row_bucket, batch_bucket_s=f.batch_bucket_s, graph_rows=f.graph_rows, cache_size=4096,
                          cache_bytes=2 << 30, disk_cache=prompt_cache, warmup=False,
                          text_normalizer=settings.text.normalizer)
            if f.prime and not f.warmup:  # (the warm-up, later, does this and more)
                fe.prime()
        _ahead_of_rows(lambda: fe.tokenizer)
        return fe

    # The three loads share nothing but the GPU's copy engine and the host (design.md D25):
    # the LM, flow and HiFT weights here, the frontend's models on one thread, the text
    # normalizer (what the first row would otherwise build; for wetext, the helper process that
    # builds it and normalises the rows' texts) on another. The prompt-audio helpers (design.md
    # D32) start first: their imports run on other CPUs while the rest loads.
    helpers = {}  # helper processes, ended here if the start-up fails
    if f.audio_processes:
        from cosybatch.frontend.prompt_audio import warm_helper
        from cosybatch.helper_process import HelperPool

        helpers["audio"] = HelperPool("prompt audio", settings.frontend_workers,
                                      warm=(warm_helper, torch.get_num_threads()), local_until_warm=True)

    def text_normalizer() -> None:
        helpers["text"] = _text_normalizer(settings.text.normalizer)

    try:
        with clock.parallel("loading (parallel)") as par:
            par.start("text normalizer", text_normalizer)
            fe = par.start("frontend", build_frontend)
            if launches:
                par.start("GPU kernels", preload_kernels)
            with par.part("models"):
                models = load_models(model_dir, device=str(device))
            stop_preload.set()
        frontend = fe.result()
    except BaseException:
        for h in helpers.values():
            if h is not None:
                h.close()
        raise
    frontend.text_helper = helpers.get("text")
    frontend.audio_helpers = helpers.get("audio")
    if f.warmup:
        with clock.phase("frontend warm-up"):
            frontend.warmup()
    pipeline = FastPipeline(models, frontend, settings, device, startup=clock, precapture_flow=precapture_flow)
    clock.log()
    return pipeline


def _text_normalizer(normalizer):
    """What the rows' text normalisation needs, built ahead of them: for wetext, a helper process
    that builds it and then normalises every row's text (returned; with the same result as here,
    without holding this process's GIL -- the GPU thread's -- for ~2.5 ms a row); else (or if no
    helper process starts) the normaliser in this process."""
    from cosybatch.helper_process import HelperProcess
    from cosybatch.text.normalize import prepare_normalizer

    if normalizer == "wetext":
        helper = HelperProcess("text normalizer", warm=(prepare_normalizer, normalizer))
        if helper.alive:
            return helper
    _ahead_of_rows(lambda: prepare_normalizer(normalizer))
    return None


def _ahead_of_rows(load) -> None:
    """Build now what the first row would build; if that fails, the rows still fail as they
    did before (each builds it again and reports why), not the start-up."""
    try:
        load()
    except Exception:  # noqa: BLE001
        log.debug("built ahead of the rows: failed; the rows will say why", exc_info=True)


def _kernel_cache(clock, device: torch.device) -> list[dict]:
    """Triton's kernel cache at start-up (design.md D37): on CUDA, whether it is cold, partial or
    warm (recorded in ``clock`` and said in the log; unless warm, the recorded launches not yet
    compiled are compiled ahead in helper processes) and, when ``COSYBATCH_RECORD_LAUNCHES`` is
    set, this run's launches recorded. Returns the recorded launches to preload beside the
    weights (a warm cache), their modules imported on this thread; else []."""
    from cosybatch.gpu.runtime import triton_available
    from cosybatch.gpu.triton_cache import (install_recorder, kernel_cache_state, kernel_modules, load_launches,
                                            start_ahead_compile, triton_cache_dir, watch_compiles)

    if device.type != "cuda" or not triton_available():
        return []
    watch_compiles()
    clock.kernel_cache = kernel_cache_state()
    if clock.kernel_cache == "cold":
        log.warning("Triton's cache (%s) holds no GPU kernel of this package: helper processes compile them while "
                    "this run starts, which compiles the rest itself as it first needs each one and is slower (on "
                    "an H200 a first 16-row job ~24 s against ~8); later runs read them from the cache",
                    triton_cache_dir())
    elif clock.kernel_cache == "partial":
        log.info("Triton's cache holds part of this version's GPU kernels (an earlier run ended before its helpers "
                 "had compiled them all, or another version's): helper processes compile the rest while this run starts")
    start_ahead_compile(clock.kernel_cache)
    if os.environ.get("COSYBATCH_RECORD_LAUNCHES"):  # a developer's switch: list this run's launches
        install_recorder(Path(os.environ["COSYBATCH_RECORD_LAUNCHES"]))
    if clock.kernel_cache != "warm":
        return []
    launches = load_launches()
    for name in kernel_modules(launches):
        importlib.import_module(name)
    return launches


def _on(device: torch.device):
    """The run's device as the thread's current one (a new thread starts on device 0)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class FastSynthesizer:
    """``synth`` on the fast path: many rows in flight through ``scheduler.pipeline.FastPipeline``."""

    # The thread iterating synthesize_batch drives the GPU: run_synth encodes the rows' files in
    # a helper process, so that their loudness measurement does not hold that thread's GIL (the
    # rows' texts are normalised in another, see _text_normalizer).
    helper_processes = True

    def __init__(self, model_dir, device: torch.device, profile, force_length: bool = False, prompt_cache=None):
        """``force_length``: each row generates the token count ``workload.force_tokens`` derives
        from its text (what ``profile --force-length`` imposes; for random-weight benchmarks)."""
        self.model_dir, self.device, self.profile = model_dir, device, profile
        # the start-up flow captures wait for expect_rows: whether the run is large enough to use them
        self.pipeline = _fast_pipeline(model_dir, device, profile, prompt_cache, precapture_flow=False)
        cfg = self.pipeline.cfg
        self.sample_rate = cfg.sample_rate
        self.streaming = profile.mode == "streaming"
        self.force_length = force_length
        # Admit a bounded window of rows so the frontend never runs far ahead of the engine.
        self.window = max(profile.ar.max_num_seqs, profile.codec.max_num_seqs) * 2
        self.startup = self.pipeline.startup.as_dict()
        self._closed = False

    def expect_rows(self, n: int) -> None:
        """Told (before the run's window opens) how many rows the run will synthesize: a run of
        at least ``PRECAPTURE_MIN_JOBS`` admissions' worth captures the profile's band of flow
        buckets now (``optimizations.flow_graph_precapture``, design.md D27), part of start-up."""
        if n >= PRECAPTURE_MIN_JOBS * self.pipeline.settings.codec.max_num_seqs:
            self.pipeline.precapture_flow_graphs()
            self.startup = self.pipeline.startup.as_dict()

    def fingerprint(self) -> dict:
        """Only what changes the audio: admission sizes, workers and graphs may change on resume.
        Read from the resolved settings, so it names what runs, not what the profile asked for."""
        s = self.pipeline.settings
        return {"model": str(self.model_dir), "engine": "fast", "mode": self.profile.mode,
                "hops": list(s.hops), "sampling": vars(s.sampling),
                "ar_dtype": str(s.engine.torch_dtype(self.device)), "flow_dtype": str(s.codec.flow_dtype),
                # HiFT always runs in float32 (F0 in float64); the key keeps older OUT folders resumable
                "hift_dtype": "float32", "hift_tf32": bool(s.process.cudnn_tf32),
                "chunk_causal_final": s.codec.chunk_causal_final, "force_length": self.force_length,
                "text_normalizer": self.pipeline.frontend.text_normalizer,
                # only when it changes the tokens, so float32 runs resume across frontend paths
                **({"prompt_features": "bfloat16"} if self.pipeline.frontend.bfloat16 else {})}

    def stage_busy(self) -> dict[str, float]:
        """Seconds each stage has been busy; rows share batches, so stages are timed per run."""
        return self.pipeline.stage_busy()

    def timeline(self) -> dict:
        """The pipeline's GPU-timeline accounting since start-up (``serving.FastPipeline``).
        timing.json is rewritten every few seconds of a run: a snapshot, never a GPU sync."""
        return self.pipeline.timeline(settle=False)

    def close(self) -> None:
        """Stop and join every thread the pipeline started (safe to call twice)."""
        if not self._closed:
            self._closed = True
            self.pipeline.close()

    def describe(self) -> dict:
        return _describe(self.model_dir, self.device, "fast", profile=self.profile.name)

    def synthesize(self, row, stream: bool) -> RowResult:
        for _, outcome in self.synthesize_batch([row], stream):
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        raise RuntimeError("the pipeline returned nothing")

    def synthesize_batch(self, rows, stream: bool):
        """(row, RowResult | Exception) in completion order. ``stream`` is the profile's mode
        (``load_profile(stream=...)`` set it), so it needs no separate handling here."""
        from cosybatch.scheduler.protocol import SynthRequest, drive, force_tokens

        rate = float(self.pipeline.token_frame_rate)
        reqs = (SynthRequest(row.utt_id, row, stream, force_tokens(row.target_text, rate) if self.force_length else None)
                for row in rows)
        for f in drive(self.pipeline, reqs, self.window):
            row = f.request.row
            if f.error is not None:
                yield row, RuntimeError(f.error)
                continue
            pieces = [a for _, a in f.chunks]
            audio = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
            first = next((t - f.admitted for t, a in f.chunks if len(a)), float("nan"))
            timings = {"first_chunk_s": first, "total_s": f.finished - f.admitted}
            if f.queue_s is not None:
                timings["queue_s"] = f.queue_s
            yield row, RowResult(audio, self.sample_rate, f.tokens, timings, len(pieces), f.segments)


def build_synthesizer(model: str, device: str = "auto", profile: str | None = None,
                      overrides: list[str] | None = None, stream: bool | None = None, force_length: bool = False,
                      prompt_cache=None):
    """The CLI's ``synth`` factory: the profile's engine (default profile: ``default``)."""
    from cosybatch.checkpoint import resolve_model_dir
    from cosybatch.profiles import load_profile

    prof = load_profile(profile, list(overrides or ()), stream=stream)
    model_dir, dev = resolve_model_dir(model), pick_device(device)
    if prof.engine == "reference":
        if force_length:
            raise ValueError("--force-length needs the fast engine (the reference path runs the official loop)")
        return ReferenceSynthesizer(model_dir, dev, prof, prompt_cache=prompt_cache)
    return FastSynthesizer(model_dir, dev, prof, force_length=force_length, prompt_cache=prompt_cache)


def build_streaming_pipeline(model: str, device: str, profile, prompt_cache=None):
    """The ``profile`` command's factory: a ``requests.StreamingPipeline`` for the profile."""
    from cosybatch.checkpoint import resolve_model_dir

    if profile.engine == "reference":
        raise ValueError("profile measures the fast engine; the reference engine has no streaming pipeline")
    return _fast_pipeline(resolve_model_dir(model), pick_device(device), profile, prompt_cache)
