"""The ``cosybatch`` command: parse, build, run, report.

Heavy imports (torch, the models) happen inside commands so ``--help`` and ``check`` stay fast.
Exit codes (``cosybatch.run.exits``): 0 all rows fine, 1 some rows failed or were invalid or the
run stopped on an output fault (disk full), 2 usage or configuration error, 130 interrupted
(SIGINT), 143 terminated (SIGTERM). Every way out closes the synthesizer first, so no thread
of it is still running native code when the interpreter exits.

``synth`` has a hidden ``--synthesizer MODULE:FACTORY`` option: FACTORY is called exactly
like ``cosybatch.synthesizers.build_synthesizer(model, device, profile, overrides, stream=...)``;
``profile`` likewise has ``--pipeline`` for ``build_streaming_pipeline(model, device, profile)``.
Tests use them to run the whole commands around fakes.
"""

from __future__ import annotations

import os
import signal
import threading


def _exit_130_now(signum: int, frame: object) -> None:
    os._exit(128 + signum)


# Ctrl-C while this module's imports run (up to a second on a busy machine) ends the process
# at once with 130: nothing has been written yet, and a traceback from the middle of an import
# would say nothing. Only where Ctrl-C is not already handled or ignored (a background job).
_SIGINT_BEFORE = signal.getsignal(signal.SIGINT)
if threading.current_thread() is threading.main_thread() and _SIGINT_BEFORE is signal.default_int_handler:
    signal.signal(signal.SIGINT, _exit_130_now)

# Where an image has every run compile torch's source again, its bytecode is kept in a cache
# folder from here on (run/bytecode.py): before the imports below, which it speeds up
from cosybatch.run.bytecode import keep_bytecode  # noqa: E402

keep_bytecode()

import atexit  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import click  # noqa: E402

from cosybatch import __version__  # noqa: E402
from cosybatch.manifest import Manifest, ManifestError, read_manifest  # noqa: E402
from cosybatch.run.exits import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, Interrupted,  # noqa: E402
                                 interrupt_exit_code, signal_name)
from cosybatch.run.interrupts import signals_decide_setup  # noqa: E402
from cosybatch.run.sharding import Shard, ShardError, parse_shard, select, shard_from_env  # noqa: E402
from cosybatch.run.options import DEFAULT_FACTORY, SynthOptions, close_synthesizer  # noqa: E402
# the output formats' names and limits, for the options (this imports numpy: --help pays ~0.1 s)
from cosybatch.output.audio_files import FORMATS, MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, WAV_SUBTYPES, AudioFormat  # noqa: E402

# Imported where used: the runner and rich (logging, the progress
# bar) cost more than the rest of this module, and `--help`, `check` and `merge` need neither.

if signal.getsignal(signal.SIGINT) is _exit_130_now:
    signal.signal(signal.SIGINT, _SIGINT_BEFORE)

log = logging.getLogger("cosybatch.cli")

DEFAULT_MODEL = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
PIPELINE_FACTORY = "cosybatch.synthesizers:build_streaming_pipeline"


def _interruptible(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Ctrl-C anywhere in a command means exit 130 (click alone would say 'Aborted!' and 1),
    SIGTERM exit 143 after the same clean-up (by default it would end the process on the spot)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with _on_signals((signal.SIGTERM,), _raise_interrupted):
                return fn(*args, **kwargs)
        except KeyboardInterrupt as e:
            signum = getattr(e, "signum", signal.SIGINT)
            log.warning("%s", "interrupted" if signum == signal.SIGINT else f"terminated ({signal_name(signum)})")
            sys.exit(interrupt_exit_code(e))
    return wrapper


@contextlib.contextmanager
def _on_signals(signals: tuple[int, ...], action: Callable[[int], Any]) -> Any:
    """Run ``action(signum)`` (it raises or exits) on these signals for the duration (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, lambda signum, frame: action(signum)) for s in signals}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _raise_interrupted(signum: int) -> None:
    raise Interrupted(signum)


def _exit_for_signal(signum: int) -> None:
    _exit_now(interrupt_exit_code(Interrupted(signum)))


@contextlib.contextmanager
def _closing(synthesizer: Any) -> Any:
    """``close()`` the synthesizer on every way out (rows done, error, interrupt, full disk).

    Its threads run native code (torch, onnxruntime); a daemon thread still inside such a
    call at interpreter exit ends the process with C++ ``terminate`` (SIGABRT, exit 134).
    """
    try:
        yield synthesizer
    finally:
        # The ledger and timing.json are on disk by now: a second Ctrl-C or SIGTERM while
        # the threads are joined exits at once instead of breaking off the joins.
        with _on_signals((signal.SIGINT, signal.SIGTERM), _exit_for_signal):
            close_synthesizer(synthesizer)


def _exit_now(code: int) -> None:
    """End the process without interpreter finalization (where native threads abort it)."""
    for h in logging.getLogger("cosybatch").handlers:
        with contextlib.suppress(Exception):
            h.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _profiled() -> bool:
    """Whether a profiler watches this process (``python -m cProfile -m cosybatch ...``): it
    writes its output after the command returns, which leaving at once would skip."""
    mon = getattr(sys, "monitoring", None)  # Python 3.12+: cProfile registers as the profiler tool
    return sys.getprofile() is not None or (mon is not None and mon.get_tool(mon.PROFILER_ID) is not None)


def _leave(code: Any) -> None:
    """End the process once the command is done, with ``sys.exit(code)``'s status, without the
    interpreter's finalization: every output is closed and on disk by now, and tearing down
    torch's, onnxruntime's and CUDA's state took another ~0.7 s of a `make demo` on a CPU.
    Leaving this way also passes one of our engine's daemon threads (named ``cosybatch-*``)
    still inside native code, where finalization would abort the process (``close()`` should
    have joined them; debug level: nothing the user can act on). What finalization would do
    for others still happens: non-daemon threads are waited for (an idle thread pool's told to
    stop first), atexit hooks (Ray's shutdown, multiprocessing's children) run. Under a
    profiler, the ordinary exit, so that the profile is written."""
    if _profiled():
        sys.exit(code)
    left = [t.name for t in threading.enumerate()
            if t.daemon and t.is_alive() and t.name.startswith("cosybatch")]
    if left:
        log.debug("exiting without waiting for %d thread(s) still running: %s", len(left), ", ".join(left))
    # What finalization does first, in its order: threading's exit hooks (an idle thread pool's
    # workers told to stop), the non-daemon threads joined, then the atexit hooks.
    threading._shutdown()
    atexit._run_exitfuncs()
    if not (code is None or isinstance(code, int)):
        print(code, file=sys.stderr)  # sys.exit("message") semantics
        code = EXIT_FAILED
    _exit_now(code or 0)


def _fail(msg: str, code: int = EXIT_USAGE) -> None:
    log.error("%s", msg)
    sys.exit(code)


def _resolve_shard(spec: str | None) -> Shard:
    try:
        if spec is not None:
            return parse_shard(spec)
        shard, source = shard_from_env()
    except ShardError as e:
        raise click.UsageError(str(e)) from None
    if shard.count > 1:
        log.warning("running shard %s only (from %s)", shard, source)
    return shard


def setup_logging(verbose: bool, quiet: bool) -> None:
    from cosybatch.run.progress import setup_logging as setup

    setup(verbose, quiet)


def _text_normalizer(profile: str | None, overrides: list[str]) -> str:
    """The run's ``text.normalizer``, which decides whether a row has anything to synthesize.
    Only the profile's ``text.*`` overrides are applied here: the synthesizer validates the rest
    when it is built (a ``--synthesizer`` factory may take keys of its own)."""
    from cosybatch.profiles import ProfileError, load_profile

    try:
        prof = load_profile(profile, [o for o in overrides if o.strip().startswith("text.")])
    except ProfileError as e:
        _fail(f"profile: {e}")
    return prof.text.normalizer


def _load_manifest(path: Path, normalizer: str = "wetext") -> Manifest:
    try:
        man = read_manifest(path, normalizer)
    except ManifestError as e:
        _fail(str(e))
    if man.n_lines == 0:  # refused before any model is loaded: an empty run is a mistake, not a success
        _fail(f"{path}: the manifest has no rows (empty, or only blank and comment lines); nothing to do")
    for p in man.problems:
        log.warning("%s", p)
    if man.problems:
        log.warning("%d problem(s) on %d line(s) of %s; those rows are skipped",
                    len(man.problems), len(man.problems_by_line()), path)
    return man


def _check_out_dir(out: Path) -> str | None:
    """Why ``out`` cannot be written, or None; checked before any model work (and without
    creating anything: an interrupted start-up leaves no folder behind). The run itself still
    handles every write error, this only saves loading a model for nothing."""
    if out.exists():
        if not out.is_dir():
            return f"cannot write to output folder {out}: it exists and is not a folder"
        if not os.access(out, os.W_OK | os.X_OK):
            return f"cannot write to output folder {out}: permission denied"
        return None
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot create output folder {out}: {parent} is not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create output folder {out}: {parent} is not writable"
    return None


def _takes_profile(spec: str) -> bool:
    """Whether the factory reads --profile/--set as a profile (as ``build_synthesizer`` does).
    A factory with settings of its own (the test fakes) says so with ``free_settings = True``;
    the default one is not imported here (it imports torch)."""
    if spec == DEFAULT_FACTORY:
        return True
    return not getattr(_load_factory(spec), "free_settings", False)


def _check_profile(profile: str | None, overrides: list[str], stream: bool | None) -> Any:
    """Profile and --set errors (exit 2, one line) before any model is loaded; the factory
    loads the profile again itself, so this changes nothing else. Returns the profile."""
    from cosybatch.profiles import ProfileError, load_profile

    try:
        return load_profile(profile, overrides, stream=stream)
    except ProfileError as e:
        _fail(f"profile: {e}")


def _load_factory(spec: str, default_attr: str = "build_synthesizer") -> Callable[..., Any]:
    mod, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), attr or default_attr)
    except (ImportError, AttributeError) as e:
        raise click.UsageError(f"--synthesizer {spec!r}: {e}") from None


def _device_for(device: str) -> str:
    # Under torchrun every process would otherwise pile onto cuda:0.
    if device in ("cuda", "auto") and "LOCAL_RANK" in os.environ and _cuda_available():
        return f"cuda:{os.environ['LOCAL_RANK']}"
    return device


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_device(ctx: click.Context, param: click.Parameter, value: str) -> str:
    v = value.strip().lower()
    if v in ("cpu", "cuda", "auto") or (v.startswith("cuda:") and v[5:].isdigit()):
        return v
    raise click.BadParameter("expected cpu, cuda, cuda:N or auto")


def _check_subtype(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:  # not given: PCM_16 for wav; given with another format, refused
        return None
    v = value.strip().upper()
    if v in WAV_SUBTYPES:
        return v
    raise click.BadParameter(f"{value!r}: expected one of {', '.join(WAV_SUBTYPES)}")


def _audio_format(fmt: str, wav_subtype: str | None, sample_rate: str | None, loudness: str | None) -> AudioFormat:
    """The output settings, or one line and exit 2: checked here, before any model work (and
    libsndfile asked whether it can write that format at that rate)."""
    fmt = fmt.strip().lower()
    if fmt != "wav" and wav_subtype is not None:
        _fail(f"--wav-subtype {wav_subtype} applies to --format wav only ({fmt} has its own encoding); drop it")
    rate = None
    if sample_rate is not None:
        try:
            rate = int(sample_rate.strip())
        except ValueError:
            _fail(f"--sample-rate {sample_rate!r}: expected a whole number of Hz, "
                  f"{MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE}")
    lufs = None
    if loudness is not None:
        try:
            lufs = float(loudness.strip())
        except ValueError:
            _fail(f"--loudness {loudness!r}: expected a number of LUFS, e.g. -23")
    audio = AudioFormat(fmt, wav_subtype or "PCM_16", rate, lufs)
    problem = audio.problem()
    if problem:
        _fail(problem)
    return audio


def _check_overrides(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[str]:
    for item in value:
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE")
    return list(value)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cosybatch")
def cli() -> None:
    """Bulk zero-shot speech synthesis with CosyVoice3."""


@cli.command()
@click.argument("manifest", type=click.Path(path_type=Path))
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="Checkpoint directory or Hugging Face repo id (local cache only).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Output folder: <utt_id>.<format>, ledger.jsonl, timing.json.")
@click.option("--stream/--no-stream", default=None,
              help="Streaming (chunked) synthesis. Default: the profile's mode (full for `default`).")
@click.option("--device", default="auto", show_default=True, callback=_check_device, help="cpu, cuda, cuda:N or auto.")
@click.option("--format", "out_format", default="wav", show_default=True, metavar="|".join(FORMATS),
              help="Audio file format: WAV, FLAC (16-bit), Ogg Vorbis, Ogg Opus or MP3 (all but WAV "
                   "through libsndfile).")
@click.option("--wav-subtype", default=None, metavar="[PCM_16|FLOAT]", callback=_check_subtype,
              help="WAV samples: 16-bit integer (default) or 32-bit float; --format wav only.")
@click.option("--sample-rate", default=None, metavar="HZ",
              help="Resample every file to HZ (band-limited, soxr). Default: the model's rate (24000).")
@click.option("--loudness", default=None, metavar="LUFS",
              help="Normalize each file to this integrated loudness (ITU-R BS.1770), never past a "
                   "-1 dBFS sample peak. Default: as synthesized.")
@click.option("--profile", default=None, help="Profile name or YAML path.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", callback=_check_overrides,
              help="Override a profile setting (repeatable).")
@click.option("--strict", is_flag=True, help="Any manifest problem stops the run before it starts.")
@click.option("--overwrite", is_flag=True, help="Redo every row, even those already done.")
@click.option("--shard", "shard_spec", default=None, metavar="I/N",
              help="Run shard I of N (0-based). Default: from RANK/WORLD_SIZE or a Slurm array.")
@click.option("--devices", default=None, metavar="all|N|cuda:I,cuda:J",
              help="One worker process per GPU (every GPU, the first N, or these), one progress bar, "
                   "one merged summary.")
@click.option("--workers", type=click.IntRange(min=1), default=None, metavar="N",
              help="N worker processes with --device cpu (for GPUs use --devices).")
@click.option("--ray", "ray_address", default=None, is_flag=False, flag_value="", metavar="[ADDRESS]",
              help="Run on a Ray cluster: one actor per GPU, OUT on shared storage (needs "
                   "pip install 'cosybatch[ray]'). Alone: RAY_ADDRESS, or a local Ray.")
@click.option("--prompt-cache", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep prompt features here, keyed by the audio's content: a repeated or resumed run "
                   "does not compute them again.")
@click.option("--force-length", is_flag=True,
              help="Generate the token count profile --force-length uses for each row (benchmarks with "
                   "random weights).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar, summary or info logs.")
@click.option("--verbose", "-v", is_flag=True, help="Debug logging with tracebacks.")
@click.option("--synthesizer", "factory", default=DEFAULT_FACTORY, hidden=True)
@_interruptible
def synth(manifest: Path, model: str, out_dir: Path, stream: bool | None, device: str, out_format: str,
          wav_subtype: str | None, sample_rate: str | None, loudness: str | None,
          profile: str | None, overrides: list[str], strict: bool, overwrite: bool,
          shard_spec: str | None, devices: str | None, workers: int | None, ray_address: str | None,
          prompt_cache: Path | None, force_length: bool, quiet: bool, verbose: bool, factory: str) -> None:
    """Synthesize every row of MANIFEST (utt_id|prompt_text|prompt_wav|target_text) into OUT.

    Writes OUT/<utt_id>.wav (or .flac, .ogg, .opus, .mp3: --format), OUT/ledger.jsonl and
    OUT/timing.json. Re-running the same
    command resumes. Exit codes: 0 all rows fine, 1 some rows failed or were invalid, or
    the disk filled (one line names the file; the rows done are kept), 2 usage or
    configuration error, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM).
    """
    setup_logging(verbose, quiet)
    audio = _audio_format(out_format, wav_subtype, sample_rate, loudness)
    if ray_address is not None:
        from cosybatch.run.ray.driver import ray_missing

        missing = ray_missing()
        if missing:
            _fail(missing)
    shard = _resolve_shard(shard_spec)
    man = _load_manifest(manifest, _text_normalizer(profile, overrides))
    if strict and man.problems:
        _fail(f"--strict: {len(man.problems)} problem(s) in {manifest}; nothing was run")
    # Everything that can be checked without the model is checked before it loads (exit 2).
    problem = _check_out_dir(out_dir)
    if problem:
        _fail(problem)
    checked = _check_profile(profile, overrides, stream) if _takes_profile(factory) else None
    opts = SynthOptions(model, profile, tuple(overrides), stream, audio.wav_subtype, overwrite, factory,
                        tuple(sys.argv[1:]), force_length=force_length,
                        prompt_cache=str(prompt_cache) if prompt_cache else None,
                        out_format=audio.format, sample_rate=audio.sample_rate, loudness=audio.loudness)
    if ray_address is not None or devices is not None or workers is not None:
        if ray_address is not None:
            from cosybatch.run.ray.driver import run_on_ray

            sys.exit(run_on_ray(man, out_dir, opts, address=ray_address or None, device=device, shard=shard,
                                multi=devices is not None or workers is not None, quiet=quiet, verbose=verbose))
        from cosybatch.run.multi.launcher import run_workers

        sys.exit(run_workers(man, out_dir, opts, devices=devices, workers=workers, device=device, outer=shard,
                             quiet=quiet, verbose=verbose))
    # The fast engine's files are encoded in a helper process (run_synth's ``encoder``); it
    # starts now, so that its imports (scipy: 1-3 s) are done by the first row rather than made
    # in this process, on the GPU thread's GIL, while it warms up.
    encoder = None
    if factory == DEFAULT_FACTORY and checked is not None and checked.engine == "fast":
        from cosybatch.run.synth import start_encoder

        encoder = start_encoder(audio)
    try:
        with signals_decide_setup():
            synthesizer = opts.build(_device_for(device), _load_factory(factory))
    except click.UsageError:
        raise
    except Exception as e:
        log.debug("synthesizer setup failed", exc_info=True)
        _fail(f"cannot set up the synthesizer for {model!r}: {e}")
    from cosybatch.run.progress import warn_failed_rows
    from cosybatch.run.synth import RunError, run_synth

    with _closing(synthesizer), (contextlib.closing(encoder) if encoder else contextlib.nullcontext()):
        try:
            report = run_synth(man, synthesizer, out_dir, stream=opts.stream_for(synthesizer), audio_format=audio,
                               overwrite=overwrite, shard=shard, quiet=quiet, argv=sys.argv[1:], encoder=encoder)
        except RunError as e:
            _fail(str(e))
    warn_failed_rows(log, report.failed, report.ledger_path)
    sys.exit(report.exit_code)


@cli.command()
@click.argument("manifest", type=click.Path(path_type=Path))
@click.option("--model", default=None, help="Also check this checkpoint directory or repo id.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="Also count rows an earlier run already finished there.")
@click.option("--shard", "shard_spec", default=None, metavar="I/N")
@click.option("--profile", default=None, help="Profile name or YAML path (its text.normalizer decides what is read).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", callback=_check_overrides,
              help="Override a profile setting (repeatable), as for synth.")
@click.option("--show-text", is_flag=True,
              help="Print each valid row's normalized text pieces, in synthesis order (needs --model).")
@click.option("--verbose", "-v", is_flag=True)
@_interruptible
def check(manifest: Path, model: str | None, out_dir: Path | None, shard_spec: str | None, profile: str | None,
          overrides: list[str], show_text: bool, verbose: bool) -> None:
    """Validate MANIFEST (and --model) and say what synth would do, without synthesizing.

    Every row synth would skip is reported as FILE:LINE: REASON, including rows that can only
    fail: a target with nothing to synthesize once normalized, a prompt too short for a speech
    token, a '|' inside the target text."""
    from cosybatch.run.check import describe_model, describe_plan, describe_text

    setup_logging(verbose, quiet=False)
    if show_text and model is None:
        raise click.UsageError("--show-text needs --model: pieces are measured in its tokenizer's tokens")
    shard = _resolve_shard(shard_spec)
    normalizer = _text_normalizer(profile, overrides)
    man = _load_manifest(manifest, normalizer)
    code = EXIT_FAILED if man.problems else EXIT_OK
    if model is not None:
        try:
            lines = describe_model(model)
        except Exception as e:
            log.debug("model check failed", exc_info=True)
            _fail(f"model {model!r}: {e}")
        click.echo("\n".join(lines))
    else:
        click.echo("model: not checked (pass --model DIR_OR_REPO)")
    rows = select(man.rows, shard)
    if show_text:
        try:
            click.echo("\n".join(describe_text(model, man.path, rows, normalizer)))
        except Exception as e:
            log.debug("text check failed", exc_info=True)
            _fail(f"model {model!r}: {e}")
    click.echo("\n".join(describe_plan(man, rows, shard, out_dir)))
    sys.exit(code)


@cli.command()
@click.argument("outs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--into", "into", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="Where to write the merged timing.json (default: the first OUT).")
@click.option("--quiet", "-q", is_flag=True)
@_interruptible
def merge(outs: tuple[Path, ...], into: Path | None, quiet: bool) -> None:
    """Combine the ledgers and timings of shard runs (in one or several OUT folders) into one summary."""
    from cosybatch.run.merge import MergeError, merge_outputs

    setup_logging(False, quiet)
    try:
        result = merge_outputs(list(outs), into or outs[0])
    except MergeError as e:
        _fail(str(e))
    if not quiet:
        from cosybatch.run.progress import print_summary
        print_summary(result.totals, title="cosybatch merge")
    click.echo(str(result.path))
    sys.exit(result.exit_code)


@cli.command("make-checkpoint")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--size", type=click.Choice(["tiny", "small", "full"]), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--chunk-size", type=int, default=None, help="Tokens per attention chunk (default: the size's).")
@click.option("--force", is_flag=True, help="Write into OUT even if it already holds a checkpoint.")
@_interruptible
def make_checkpoint(out: Path, size: str, seed: int, chunk_size: int | None, force: bool) -> None:
    """Write a random-weight checkpoint in the official layout (produces noise, not speech)."""
    setup_logging(False, False)
    if (out / "llm.pt").exists() and not force:
        _fail(f"{out} already holds a checkpoint (llm.pt); pass --force to replace it")
    from cosybatch.checkpoint.generate import generate_checkpoint

    path = generate_checkpoint(out, size=size, seed=seed, chunk_size=chunk_size)
    click.echo(str(path))


@cli.command("profile")
@click.argument("manifest", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="Checkpoint directory or HF repo id.")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto.")
@click.option("--concurrency", "-c", type=click.IntRange(min=1), default=32, show_default=True,
              help="Requests in flight (closed loop).")
@click.option("--profile", "profile_spec", default="default", show_default=True, help="Profile name or YAML path.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a profile key (repeatable).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=None,
              help="Measured requests (default: every manifest row).")
@click.option("--num-warmups", type=click.IntRange(min=0), default=0, show_default=True,
              help="Warm-up requests run (and drained) before measuring.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Picks the rows when --num-prompts is smaller than the manifest (sampling.seed is a profile key).")
@click.option("--force-length", is_flag=True, help="Generate a fixed token count per row, derived from its text.")
@click.option("--result-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write a JSON result file here.")
@click.option("--prompt-cache", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep prompt features here, keyed by the audio's content.")
@click.option("--warm-prompts", is_flag=True,
              help="Compute every prompt's features before measuring: the run without the frontend's model work.")
@click.option("--workload-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the generated EN1088-shaped workload lives (when no MANIFEST is given).")
@click.option("--host-profile", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="cProfile the thread that drives the pipeline during the measured run into this file.")
@click.option("--verbose", "-v", is_flag=True)
@click.option("--pipeline", "factory", default=PIPELINE_FACTORY, hidden=True)
def profile_command(manifest: Path | None, model: str, device: str, concurrency: int, profile_spec: str,
                    overrides: tuple[str, ...], num_prompts: int | None, num_warmups: int, seed: int,
                    force_length: bool, result_dir: Path | None, prompt_cache: Path | None, warm_prompts: bool,
                    workload_dir: Path | None, host_profile: Path | None, verbose: bool, factory: str) -> None:
    """Measure a profile in a closed loop over MANIFEST (default: a generated EN1088-shaped workload)."""
    from rich.console import Console

    from cosybatch.bench import workload
    from cosybatch.bench.closed_loop import environment, result_table, run_closed_loop, select_rows, write_result
    from cosybatch.profiles import ProfileError, load_profile
    from cosybatch.scheduler.protocol import PipelineContractError, SynthRequest, force_tokens

    setup_logging(verbose, quiet=False)
    try:
        profile = load_profile(profile_spec, list(overrides))
    except ProfileError as e:
        _fail(f"profile: {e}")
    if manifest is None:
        where = workload_dir or Path.home() / ".cache" / "cosybatch" / "workload-en1088"
        manifest = workload.ensure(where)
    man = _load_manifest(manifest, profile.text.normalizer)
    if not man.rows:
        _fail(f"{manifest}: no usable rows")
    rows = select_rows(man.rows, num_prompts, seed)
    try:
        extra = {"prompt_cache": str(prompt_cache)} if prompt_cache is not None else {}
        pipeline = _load_factory(factory, "build_streaming_pipeline")(model, device, profile, **extra)
    except Exception as e:  # setup failures (missing checkpoint, unimplemented option) are usage errors
        log.debug("pipeline setup failed", exc_info=True)
        _fail(f"cannot set up the pipeline for {model!r} with profile {profile.name!r}: {e}")
    stream = profile.mode == "streaming"
    rate = float(pipeline.token_frame_rate)
    requests = [SynthRequest(f"{i}-{row.utt_id}", row, stream,
                             force_tokens(row.target_text, rate) if force_length else None)
                for i, row in enumerate(rows)]
    log.info("profile %s, %d request(s) at concurrency %d, %d warm-up(s)", profile.name, len(requests),
             concurrency, num_warmups)
    try:
        if warm_prompts:
            log.info("prompt features of %d prompt(s) computed before measuring",
                     pipeline.warm_prompts(r.row.prompt_wav for r in requests))
        result = run_closed_loop(pipeline, requests, concurrency, num_warmups, host_profile=host_profile)
    except PipelineContractError as e:
        _fail(f"benchmark aborted: {e}", EXIT_FAILED)
    except KeyboardInterrupt:
        _fail("interrupted", EXIT_INTERRUPTED)
    title = f"cosybatch profile: {profile.name}, C={concurrency}, {'streaming' if stream else 'full'}"
    Console().print(result_table(result, title))
    if result_dir is not None:
        meta = {"model_id": model, "device": device, "profile": profile.to_dict(), "manifest": str(manifest),
                "force_length": force_length, "warm_prompts": warm_prompts, "seed": seed,
                "startup": pipeline.startup.as_dict() if hasattr(pipeline, "startup") else None,
                "environment": environment()}
        path = write_result(result, result_dir, meta, profile.name)
        log.info("result written to %s", path)
    sys.exit(EXIT_FAILED if result.metrics["failed"] else EXIT_OK)


@cli.command("profiles")
def profiles_command() -> None:
    """List the profiles --profile NAME can reach (COSYBATCH_PROFILES first, then the shipped ones)."""
    from cosybatch.profiles import describe_profiles

    for name, desc, path in describe_profiles():
        click.echo(f"{name:40s} {desc}")
        click.echo(f"{'':40s} {path}")


def _run_click(argv: list[str] | None) -> Any:
    """click outside its standalone mode, which would answer a Ctrl-C that lands before a
    command's own handling (while the arguments are parsed) with "Aborted!" and exit 1."""
    try:
        rv = cli.main(args=argv, prog_name="cosybatch", standalone_mode=False)
    except SystemExit as e:  # the commands end with sys.exit(code)
        return e.code
    except click.exceptions.Abort as e:
        if isinstance(e.__cause__, KeyboardInterrupt):
            return interrupt_exit_code(e.__cause__)
        click.echo("Aborted!", err=True)
        return EXIT_FAILED
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except KeyboardInterrupt as e:
        return interrupt_exit_code(e)
    return rv if isinstance(rv, int) else EXIT_OK


def main(argv: list[str] | None = None) -> None:
    _leave(_run_click(argv))


if __name__ == "__main__":
    main()
