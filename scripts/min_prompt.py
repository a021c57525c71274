"""Measure the shortest prompt the reference frontend turns into usable features.

Prompts cut from a fixture recording, sample by sample around 40 ms at several sample rates,
go through the exact frontend (onnxruntime on the CPU) of the tiny fixture checkpoint; the
first length that gives at least one speech token after the token/mel alignment cut and a
finite, non-empty speaker embedding is printed beside what the official frame math predicts.
docs/design.md (D23) records the result behind ``manifest.MIN_PROMPT_PER_SECOND``.

    python scripts/min_prompt.py [FIXTURES_DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from cosybatch.audio import AudioError, load_audio, resample
from cosybatch.checkpoint import load_config
from cosybatch.frontend.frontend import Frontend


def predicted_tokens(n16: int, n_mel: int, ratio: int = 2) -> int:
    """The official frame math: whisper's centred STFT minus its last frame gives n16 // 160
    log-mel frames and the v3 tokenizer one code per 4 of them; the 24 kHz prompt mel (reflect
    pad 720 a side, n_fft 1920, hop 480, not centred) has (n_mel + 1440 - 1920) // 480 + 1
    frames; the alignment keeps min(mel frames // ratio, codes)."""
    codes = (n16 // 160) // 4
    mel = (n_mel + 1440 - 1920) // 480 + 1 if n_mel + 1440 >= 1920 else 0
    return min(mel // ratio, codes)


def usable(fe: Frontend, cut: torch.Tensor, rate: int) -> str | None:
    """None when the frontend refuses the prompt, else what it gave."""
    try:
        p = fe._prepare(cut, rate, "", "prompt")
        feats = fe._align_raw(fe._compute([p])[0], "prompt")
    except AudioError:
        return None
    emb = feats.embedding
    if feats.speech_tokens.numel() == 0 or emb.numel() == 0 or not bool(torch.isfinite(emb).all()):
        return None
    return f"{feats.speech_tokens.numel()} token(s), embedding {tuple(emb.shape)}"


def main() -> None:
    fixtures = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/fixtures")
    model = fixtures / "cv3-tiny" / "model" if (fixtures / "cv3-tiny").is_dir() else fixtures / "model"
    cfg = load_config(model)
    fe = Frontend(model, cfg, backend="onnxruntime", cache_size=0)
    wav, sr = load_audio(model.parent / "prompts" / "p2_24k.wav")
    for rate in (16000, 22050, 24000, 44100, 48000):
        src = resample(wav, sr, rate)
        edge = rate // 25  # one speech-token period
        for n in range(edge - 2, edge + 3):
            cut = src[:, :n]
            pred = predicted_tokens(resample(cut, rate, 16000).shape[1], resample(cut, rate, cfg.sample_rate).shape[1])
            got = usable(fe, cut, rate)
            print(f"{rate:5d} Hz, {n:5d} samples ({n / rate * 1000:7.3f} ms): frame math {pred} token(s); "
                  f"frontend: {got or 'refused'}")


if __name__ == "__main__":
    main()
