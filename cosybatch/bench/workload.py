"""A synthetic "EN1088-shaped" Seed-TTS workload, for benchmarks where the real test set is absent.

Shape of Seed-TTS EN: 1,088 rows, 666 distinct prompts of 3-7 s, English target texts. Prompts
are windows of a pool made from a few speech-like signals (synthetic by default, or WAVs the
caller passes; trimmed, wrapped, gain-varied, some at 16 kHz), so every file differs.
``cosybatch.scheduler.protocol.force_tokens`` turns a target text into a deterministic speech-token
count (mean ~5.1 s of audio over the workload), which ``--force-length`` imposes because
random weights stop at arbitrary lengths. Everything is seeded: the same
arguments give byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from cosybatch.scheduler.protocol import CHARS_PER_SECOND, force_tokens

log = logging.getLogger("cosybatch.bench.workload")

N_ROWS = 1088
N_PROMPTS = 666
PROMPT_SECONDS = (3.0, 7.0)
MEAN_TARGET_SECONDS = 5.1
POOL_RATE = 24000

WORDS = tuple("""
the of and to in is that it was for on are as with his they at be this from have or by one had
not but what all were when we there can an your which their said if do will each about how up
out them then she many some so these would other into has more her two like him see time could
no make than first been its who now people my made over did down only way find use may water
long little very after words called just where most know get through back much before go good
new write our used me man too any day same right look think also around another came come work
three word must because does part even place well such here take why things help put years
different away again off went old number great tell men say small every found still between
name should home big give air line set own under read last never us left end along while might
next sound below saw something thought both few those always looked show large often together
asked house world going want school important until form food keep children feet land side
without boy once animals life enough took sometimes four head above kind began almost live page
got earth need far hand high year mother light parts country father let night following picture
being study second eyes soon times story boys since white days ever paper hard near sentence
better best across during today others however sure means knew try told young miles sun ways
thing whole hear example heard several change answer room sea against top turned learn point
city play toward five using himself usually morning river garden evening window quiet market
""".split())


def _sentence(rng: random.Random, chars: float) -> str:
    """Words up to the length nearest ``chars``, with an occasional comma."""
    words: list[str] = []
    length = 0
    while True:
        w = rng.choice(WORDS)
        nxt = length + len(w) + (1 if words else 0)
        if words and abs(nxt + 1 - chars) > abs(length + 1 - chars):
            break
        words.append(w)
        length = nxt
    for i in range(3, len(words) - 2, 7):
        if rng.random() < 0.5:
            words[i] += ","
    words[0] = words[0].capitalize()
    return " ".join(words) + "."


def target_texts(n: int, seed: int = 0, mean_s: float = MEAN_TARGET_SECONDS) -> list[str]:
    """``n`` distinct English texts whose lengths spread like short read sentences (1.5-12 s)."""
    rng = random.Random(f"targets-{seed}")
    sigma = 0.4
    mu = math.log(mean_s) - sigma * sigma / 2  # lognormal with mean ``mean_s``
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        seconds = min(12.0, max(1.5, rng.lognormvariate(mu, sigma)))
        text = _sentence(rng, seconds * CHARS_PER_SECOND)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


@dataclass(frozen=True)
class PromptSpec:
    file: str  # relative to the workload folder
    start_s: float  # offset into the (circular) source pool
    seconds: float
    sample_rate: int
    gain: float  # peak level
    transcript: str


@dataclass(frozen=True)
class Row:
    utt_id: str
    prompt: int  # index into the prompt specs
    target_text: str


def plan(n_rows: int = N_ROWS, n_prompts: int = N_PROMPTS, seed: int = 0,
         pool_seconds: float = 60.0) -> tuple[list[PromptSpec], list[Row]]:
    """The workload without audio: prompt windows and rows (every prompt used at least once)."""
    if not 1 <= n_prompts <= n_rows:
        raise ValueError(f"need 1 <= prompts ({n_prompts}) <= rows ({n_rows})")
    rng = random.Random(f"prompts-{seed}")
    lo, hi = PROMPT_SECONDS
    prompts = []
    for i in range(n_prompts):
        seconds = round(rng.uniform(lo, hi), 2)
        words = " ".join(rng.choice(WORDS) for _ in range(max(3, round(seconds * 2.5))))
        prompts.append(PromptSpec(
            file=f"prompts/p{i:04d}.wav", start_s=round(rng.uniform(0.0, pool_seconds), 3), seconds=seconds,
            sample_rate=16000 if i % 3 == 2 else 24000, gain=round(rng.uniform(0.4, 0.9), 3),
            transcript=words[0].upper() + words[1:] + "."))
    order = list(range(n_prompts)) + [rng.randrange(n_prompts) for _ in range(n_rows - n_prompts)]
    texts = target_texts(n_rows, seed)
    rows = [Row(f"en1088_{i:04d}", order[i], texts[i]) for i in range(n_rows)]
    return prompts, rows


def speechlike(seconds: float, sample_rate: int, seed: int) -> np.ndarray:
    """A voiced, syllable-modulated signal: harmonics of a drifting f0 under a ~4 Hz envelope
    with pauses, plus a little noise. Stands in when no recorded prompts are at hand."""
    rng = np.random.default_rng(seed)
    n = int(seconds * sample_rate)
    t = np.arange(n) / sample_rate
    f0 = 110 + 40 * rng.random() + 25 * np.sin(2 * np.pi * 0.3 * t + rng.random() * 6)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    syll = np.clip(np.sin(2 * np.pi * (3.5 + rng.random()) * t + rng.random() * 6), 0, None) ** 2
    pauses = (np.sin(2 * np.pi * 0.25 * t + rng.random() * 6) > -0.7).astype(np.float64)
    wav = voiced * syll * pauses + 0.01 * rng.standard_normal(n)
    return (wav / np.max(np.abs(wav))).astype(np.float32)


def _load_mono(path: Path, sample_rate: int) -> np.ndarray:
    import soundfile as sf
    import torch

    from cosybatch.audio.resample import resample

    data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    wav = data.mean(axis=1)
    if sr != sample_rate:
        wav = resample(torch.from_numpy(wav)[None], sr, sample_rate)[0].numpy()
    return wav


def source_pool(sources: Sequence[Path], seconds: float = 60.0) -> np.ndarray:
    """The sources (or synthetic speech if none) joined by short pauses, repeated to ``seconds``."""
    gap = np.zeros(POOL_RATE // 4, dtype=np.float32)
    parts = [_load_mono(p, POOL_RATE) for p in sources]
    parts = [p / max(1e-6, float(np.max(np.abs(p)))) for p in parts if p.size]
    if not parts:
        log.info("no source WAVs: using synthetic speech-like prompts")
        parts = [speechlike(4.0 + i, POOL_RATE, seed=i) for i in range(4)]
    unit = np.concatenate([x for p in parts for x in (p, gap)])
    reps = max(1, math.ceil(seconds * POOL_RATE / unit.size))
    return np.tile(unit, reps).astype(np.float32)


def _window(pool: np.ndarray, rate: int, spec: PromptSpec) -> np.ndarray:
    start = int(spec.start_s * rate) % pool.size
    n = int(round(spec.seconds * rate))
    wav = pool[(start + np.arange(n)) % pool.size]
    # Fade the cut edges so windows do not start or end on a click.
    ramp = min(n // 2, rate // 100)
    fade = np.linspace(0.0, 1.0, ramp, dtype=np.float32)
    wav[:ramp] *= fade
    wav[n - ramp:] *= fade[::-1]
    return wav * (spec.gain / max(1e-6, float(np.max(np.abs(wav)))))


def write(out_dir: str | Path, sources: Sequence[Path] = (), n_rows: int = N_ROWS,
          n_prompts: int = N_PROMPTS, seed: int = 0) -> Path:
    """Write ``prompts/*.wav`` and ``meta.lst`` under ``out_dir``; returns the manifest path."""
    import soundfile as sf
    import torch

    from cosybatch.audio.resample import resample

    out = Path(out_dir)
    (out / "prompts").mkdir(parents=True, exist_ok=True)
    prompts, rows = plan(n_rows, n_prompts, seed)
    pool = source_pool(sources)
    pools = {POOL_RATE: pool}
    for rate in {p.sample_rate for p in prompts} - {POOL_RATE}:  # resample once, not per prompt
        pools[rate] = resample(torch.from_numpy(pool)[None], POOL_RATE, rate)[0].numpy()
    for spec in prompts:
        wav = _window(pools[spec.sample_rate], spec.sample_rate, spec)
        sf.write(str(out / spec.file), np.clip(wav, -1.0, 1.0), spec.sample_rate, subtype="PCM_16")
    lines = [f"{r.utt_id}|{prompts[r.prompt].transcript}|{prompts[r.prompt].file}|{r.target_text}" for r in rows]
    manifest = out / "meta.lst"
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return manifest


def _stamp(sources: Sequence[Path], n_rows: int, n_prompts: int, seed: int) -> dict:
    h = hashlib.sha256()
    for p in sources:
        h.update(Path(p).read_bytes())
    return {"version": 1, "rows": n_rows, "prompts": n_prompts, "seed": seed, "sources_sha256": h.hexdigest()}


def ensure(out_dir: str | Path, sources: Sequence[Path] = (), n_rows: int = N_ROWS,
           n_prompts: int = N_PROMPTS, seed: int = 0) -> Path:
    """:func:`write` unless ``out_dir`` already holds the same workload (checked by a stamp)."""
    out = Path(out_dir)
    stamp = _stamp(sources, n_rows, n_prompts, seed)
    stamp_file = out / "workload.json"
    if (out / "meta.lst").is_file() and stamp_file.is_file():
        try:
            if json.loads(stamp_file.read_text()) == stamp:
                return out / "meta.lst"
        except (OSError, ValueError):
            pass
    log.info("writing an EN1088-shaped workload (%d rows, %d prompts) to %s", n_rows, n_prompts, out)
    manifest = write(out, sources, n_rows, n_prompts, seed)
    stamp_file.write_text(json.dumps(stamp, indent=1) + "\n")
    return manifest


def describe(prompts: Sequence[PromptSpec], rows: Sequence[Row], token_rate: float = 25.0) -> dict:
    secs = [force_tokens(r.target_text, token_rate) / token_rate for r in rows]
    return {"rows": len(rows), "prompts": len(prompts), "mean_forced_s": float(np.mean(secs)),
            "min_forced_s": float(np.min(secs)), "max_forced_s": float(np.max(secs)),
            "prompt_s": [min(p.seconds for p in prompts), max(p.seconds for p in prompts)],
            "example": asdict(rows[0])}
