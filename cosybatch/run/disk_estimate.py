"""How much a run is likely to write, so that a short disk is said before the first row."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from cosybatch.manifest import ManifestRow
from cosybatch.atomic import free_bytes
from cosybatch.output.audio_files import AudioFormat

log = logging.getLogger(__name__)


# Speaking rates behind the free-space estimate: CosyVoice3 reads about 14 characters of
# English (or other alphabetic text) per second, and about 4 CJK characters per second;
# 0.5 s covers leading/trailing silence. An estimate for a warning, not a limit.
_CHARS_PER_S, _CJK_PER_S, _PAD_S = 14.0, 4.0, 0.5
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_RECORD_BYTES_PER_ROW = 2048  # its ledger line, plus its share of timing.json (rewritten via a temp copy)


def estimated_audio_s(text: str) -> float:
    """Seconds of speech a row's target text is likely to become."""
    cjk = len(_CJK.findall(text))
    return _PAD_S + (len(text) - cjk) / _CHARS_PER_S + cjk / _CJK_PER_S


def estimated_output_bytes(rows: list[ManifestRow], sample_rate: int, audio: AudioFormat | str) -> tuple[int, float]:
    """(bytes, audio seconds) this run is likely to write into OUT; ``sample_rate``: the
    synthesizer's; ``audio``: the files' settings (or a WAV subtype, for a plain WAV run). The
    audio files' size is the format's own estimate (exact for WAV, an upper bound otherwise)."""
    fmt = AudioFormat(wav_subtype=audio) if isinstance(audio, str) else audio
    seconds = [estimated_audio_s(r.target_text) for r in rows]
    files = sum(fmt.estimated_bytes(a, sample_rate) for a in seconds)
    return files + len(rows) * _RECORD_BYTES_PER_ROW, sum(seconds)


def warn_if_short_of_space(out: Path, rows: list[ManifestRow], sample_rate: Any, audio: AudioFormat | str) -> None:
    free = free_bytes(out)
    if free is None or not rows or not isinstance(sample_rate, int) or sample_rate <= 0:
        return
    fmt = AudioFormat(wav_subtype=audio) if isinstance(audio, str) else audio
    need, audio_s = estimated_output_bytes(rows, sample_rate, fmt)
    if need > free:
        kind = fmt.wav_subtype if fmt.format == "wav" else fmt.format.upper()
        log.warning("%s has %s free, but %d row(s) need about %s (~%.0f s of %s audio at %d Hz, estimated from "
                    "text length); the run stops cleanly when the disk fills", out, _mb(free), len(rows),
                    _mb(need), audio_s, kind, fmt.output_rate(sample_rate))


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"
