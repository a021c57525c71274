"""Zero-shot synthesis as a Ray Data stage (``pip install 'cosybatch[ray]'``).

For people who already have a Ray pipeline::

    import ray, cosybatch.run.ray.api
    ds = ray.data.read_csv("rows.csv")          # utt_id, prompt_text, prompt_wav, target_text
    results = cosybatch.run.ray.api.synthesize(ds, model="/shared/ckpt", out="/shared/out")
    results.write_parquet("/shared/results")    # or iterate; nothing runs until consumed

Every input row becomes one result row: the input columns plus ``status`` (ok, failed,
invalid, or skipped when OUT already holds it), ``file`` (its audio file's absolute path; also
as ``wav``, its name from before other formats), ``audio_s``,
``tokens``, ``total_s`` and ``reason``. OUT must be storage every node sees; it is laid out
exactly as ``cosybatch synth`` leaves it, so the same OUT can be resumed, checked or merged
with the CLI. Importing ``cosybatch`` never imports Ray; importing this module does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import ray
    import ray.data
except ImportError as e:  # pragma: no cover - exercised by the CLI's message instead
    raise ImportError("cosybatch.run.ray.api needs Ray Data: pip install 'cosybatch[ray]'") from e

from cosybatch.run.ray.stage import STOP_FILE, SynthStage
from cosybatch.run.options import DEFAULT_FACTORY, SynthOptions
from cosybatch.atomic import TMP_MARK, remove_quietly
from cosybatch.output.audio_files import AudioFormat
from cosybatch.output.ledger import latest_rows, read_ledgers
from cosybatch.output.rows import file_intact, recorded_file

# Rows per actor call. On a GPU a call should keep the engine's admission window (hundreds of
# rows) full for most of its length: a batch's tail runs at low concurrency.
GPU_BATCH_ROWS = 1024
CPU_BATCH_ROWS = 16

__all__ = ["synthesize", "Placement", "placement"]


@dataclass(frozen=True)
class Placement:
    device: str  # what each actor's synthesizer runs on: "cuda" (its one GPU) or "cpu"
    num_gpus: float
    num_cpus: float | None
    actors: int | tuple[int, int]  # a fixed pool, or (min, max) for an autoscaling cluster


def placement(device: str = "auto", concurrency: int | tuple[int, int] | None = None,
              resources: dict[str, float] | None = None) -> Placement:
    """One actor per GPU of the cluster (``num_gpus=1``); one per CPU when it has none."""
    res = ray.cluster_resources() if resources is None else resources
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 0))
    if device == "cpu" or (device == "auto" and gpus == 0):
        return Placement("cpu", 0, 1, concurrency or max(1, cpus))
    if device in ("auto", "cuda"):
        if gpus == 0 and concurrency is None:
            raise ValueError("device='cuda' but the Ray cluster has no GPU now (an autoscaling cluster: "
                             "pass concurrency=(min, max))")
        return Placement("cuda", 1, None, concurrency or gpus)
    raise ValueError(f"device {device!r}: 'auto', 'cuda' or 'cpu' (Ray gives each actor its GPU)")


def remove_stale_actor_tmp(out: Path) -> int:
    """Temp files of actors of earlier runs (killed mid-write, or stopped with their run), and
    an interrupted driver's stop file; returns how many temp files were removed.

    Each actor removes its own at start, but a new run's actors have new ids; before any
    starts, every ``.ray-*`` temp in OUT is a leftover (one pipeline per OUT at a time).
    """
    (out / STOP_FILE).unlink(missing_ok=True)
    n = 0
    for tmp in out.glob(f".*{TMP_MARK}.ray-*"):
        if remove_quietly(tmp):
            n += 1
    return n


def done_records(out: Path) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(utt_id -> latest ok record with its file intact, fingerprint sha -> fingerprint of those).
    The stage compares each row's inputs (``output.rows.finished_with_inputs``) when it meets it."""
    if not out.is_dir():
        return {}, {}
    records = read_ledgers(out)
    done = {}
    for u, rec in latest_rows(records).items():
        if file_intact(out, u, rec):  # only what the actors need: each of them gets a copy
            name, size = recorded_file(rec)
            done[u] = {k: rec.get(k) for k in ("status", "fp", "input", "audio_s", "tokens")}
            done[u].update(file=name, file_bytes=size, timings={"total_s": (rec.get("timings") or {}).get("total_s")})
    return done, fingerprints(records, done.values())


def fingerprints(records: list[dict[str, Any]], done: Any) -> dict[str, Any]:
    """Fingerprint sha -> fingerprint (from run_start records) for the shas of ``done``."""
    known = {r.get("fp"): r.get("fingerprint") for r in records if r.get("event") == "run_start" and r.get("fp")}
    return {rec["fp"]: known.get(rec["fp"]) for rec in done if rec.get("fp")}


def stage(dataset: Any, options: SynthOptions, out: Path, place: Placement, *, done_fps: dict[str, Any],
          done: dict[str, dict[str, Any]] | None = None, base_dir: str | None = None,
          batch_size: int | None = None, **ray_remote_args: Any) -> Any:
    """The ``map_batches`` call itself (the CLI and ``synthesize`` share it)."""
    pool = (ray.data.ActorPoolStrategy(min_size=place.actors[0], max_size=place.actors[1])
            if isinstance(place.actors, tuple) else ray.data.ActorPoolStrategy(size=place.actors))
    args = {"num_gpus": place.num_gpus, **({"num_cpus": place.num_cpus} if place.num_cpus else {}), **ray_remote_args}
    return dataset.map_batches(
        SynthStage, batch_format="pyarrow", compute=pool,
        batch_size=batch_size or (GPU_BATCH_ROWS if place.device == "cuda" else CPU_BATCH_ROWS),
        fn_constructor_kwargs={"options": options, "out": str(out), "device": place.device,
                               "done_fps": done_fps, "done": done, "base_dir": base_dir},
        **args)


def synthesize(dataset: Any, *, model: str, out: str | Path, profile: str | None = None,
               overrides: tuple[str, ...] | list[str] = (), device: str = "auto", stream: bool | None = None,
               wav_subtype: str = "PCM_16", overwrite: bool = False, base_dir: str | Path | None = None,
               batch_size: int | None = None, concurrency: int | tuple[int, int] | None = None,
               factory: str = DEFAULT_FACTORY, format: str = "wav", sample_rate: int | None = None,
               loudness: float | None = None, **ray_remote_args: Any) -> Any:
    """A lazy ``ray.data.Dataset`` of result rows for ``dataset``'s rows (see the module doc).

    ``dataset`` needs columns utt_id, prompt_text, prompt_wav, target_text (``line`` is kept
    in the ledger if present); relative prompt paths are read from ``base_dir`` (default:
    the current folder). utt_ids must be unique: a row's file is ``out/<utt_id>.<format's suffix>``.
    ``model``, ``profile``, ``overrides``, ``stream``, ``wav_subtype``, ``format``, ``sample_rate``,
    ``loudness`` and ``overwrite`` mean what they mean to ``cosybatch synth`` (its ``--format``,
    ``--sample-rate``, ``--loudness``); unusable output settings raise ValueError here.
    ``device``: ``auto`` (one actor per GPU, or per CPU on a cluster without GPUs), ``cuda``
    or ``cpu``; ``concurrency`` overrides the actor count (an int, or ``(min, max)``). Extra
    keyword arguments go to ``map_batches`` as Ray remote arguments (e.g. ``max_restarts=3``,
    ``memory=...``, ``accelerator_type=...``).

    Rows OUT already holds with the same inputs are not synthesized again (``skipped``);
    when those were made with other settings the first actor stops the run instead of
    mixing outputs (``overwrite=True`` redoes everything). ``synthesize`` reads OUT's
    ledgers once, now; run one pipeline per OUT at a time.
    """
    problem = AudioFormat(format, wav_subtype, sample_rate, loudness).problem()
    if problem:  # before Ray starts: a typo should cost nothing
        raise ValueError(problem)
    if not ray.is_initialized():
        ray.init()  # what Ray Data would do on first use; the actor count depends on the cluster
    options = SynthOptions(model, profile, tuple(overrides), stream, wav_subtype, overwrite, factory,
                           out_format=format, sample_rate=sample_rate, loudness=loudness)
    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_actor_tmp(out)
    done, done_fps = ({}, {}) if overwrite else done_records(out)
    base = str(Path(base_dir).absolute()) if base_dir is not None else str(Path.cwd())
    return stage(dataset, options, out, placement(device, concurrency), done_fps=done_fps, done=done,
                 base_dir=base, batch_size=batch_size, **ray_remote_args)


def cli_batch_size(rows: int, place: Placement) -> int:
    """Big batches on big runs; on small ones, enough batches that every actor gets some."""
    actors = place.actors[1] if isinstance(place.actors, tuple) else place.actors
    cap = GPU_BATCH_ROWS if place.device == "cuda" else CPU_BATCH_ROWS
    return max(1, min(cap, math.ceil(rows / (4 * max(1, actors)))))
