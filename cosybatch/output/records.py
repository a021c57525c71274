"""What one finished row becomes in the ledger, shared by every way rows are run (``runner``,
the Ray stage): the checks a synthesizer's result must pass and the record shape that resume,
``check`` and ``merge`` read."""

from __future__ import annotations

import math
import time
from typing import Any, Iterator

import numpy as np

from cosybatch.manifest import ManifestRow
import hashlib
import json



def finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def check_audio(audio: Any) -> np.ndarray:
    """Mono float32 samples, or ValueError saying why they cannot be written."""
    a = np.asarray(audio)
    if a.ndim > 1:
        if sum(d > 1 for d in a.shape) > 1:
            raise ValueError(f"audio must be mono, got shape {tuple(a.shape)}")
        a = a.reshape(-1)
    if a.size == 0:
        raise ValueError("empty audio (the speech LM stopped before its first speech token)")
    bad = int(np.size(a) - np.count_nonzero(np.isfinite(a)))
    if bad:
        raise ValueError(f"non-finite audio ({bad} NaN/inf samples)")
    return a.astype(np.float32, copy=False)


def base_record(row: ManifestRow, fp_sha: str) -> dict[str, Any]:
    return {"event": "row", "utt_id": row.utt_id, "line": row.line, "fp": fp_sha, "input": input_key(row)}


def ok_record(row: ManifestRow, res: Any, elapsed: float | None, fp_sha: str) -> tuple[dict[str, Any], np.ndarray]:
    """(the row's ok record without its file, its samples) from a ``RowResult``-like result;
    raises for a result that cannot be written (the row then fails alone). ``output.rows``
    adds the file's name, size, format, rate and loudness."""
    audio = check_audio(res.audio)
    sr = int(res.sample_rate)
    if sr <= 0:
        raise ValueError(f"bad sample rate {sr}")
    tokens, chunks = int(res.tokens), int(res.chunks)
    timings = {k: finite(v) for k, v in dict(res.timings or {}).items()}
    if timings.get("total_s") is None and elapsed is not None:
        timings["total_s"] = elapsed
    rec = {**base_record(row, fp_sha), "status": "ok", "sample_rate": sr,
           "audio_s": round(len(audio) / sr, 6), "tokens": tokens, "chunks": chunks,
           "prompt_s": round(row.prompt_s, 4), "timings": timings}
    segments = getattr(res, "segments", None)
    if segments is not None:  # the transcript actually spoken: what normalization made of the target
        rec["segments"] = [str(s) for s in segments]
    return rec, audio


def one_by_one(synth: Any, rows: list[ManifestRow], stream: bool) -> Iterator[tuple[ManifestRow, Any, float]]:
    """(row, result or the exception it raised, seconds) for a synthesizer without batches."""
    for row in rows:
        t0 = time.perf_counter()
        try:
            outcome = synth.synthesize(row, stream)
        except Exception as e:
            outcome = e
        yield row, outcome, time.perf_counter() - t0


def input_key(row: ManifestRow) -> str:
    """Everything about a row's inputs that changes its output."""
    blob = json.dumps([row.prompt_text, row.target_text, str(row.prompt_wav),
                       row.prompt_size, row.prompt_mtime_ns], ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
