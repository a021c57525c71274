"""Reading prompt audio the way the official ``load_wav`` does (torchaudio's soundfile backend)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class AudioError(Exception):
    """A prompt file that cannot be used (unreadable, empty, or at an unsupported rate)."""


def load_audio(path: str | Path) -> tuple[torch.Tensor, int]:
    """Return ``(wav [channels, n] float32, sample_rate)``.

    Integer PCM is scaled to [-1, 1) exactly as ``torchaudio.load(normalize=True)`` with
    the soundfile backend does, because every frontend feature is computed from that scale.
    """
    import soundfile as sf

    p = Path(path)
    if not p.is_file():
        raise AudioError(f"audio file not found: {p}")
    try:
        data, sr = sf.read(str(p), dtype="float32", always_2d=True)
    except Exception as e:  # soundfile raises several unrelated types for bad input
        raise AudioError(f"cannot read audio file {p}: {e}") from e
    if data.shape[0] == 0 or data.shape[1] == 0:
        raise AudioError(f"audio file is empty: {p}")
    wav = torch.from_numpy(np.ascontiguousarray(data.T))
    if not torch.isfinite(wav).all():
        raise AudioError(f"audio file contains NaN/inf samples: {p}")
    return wav, int(sr)


def to_mono(wav: torch.Tensor) -> torch.Tensor:
    """[channels, n] -> [1, n] by the channel mean (the official prompt handling)."""
    return wav.mean(dim=0, keepdim=True)
