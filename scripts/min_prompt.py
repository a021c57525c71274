"""Measure the shortest prompt the reference frontend turns into usable features.

For prompts cut from a fixture recording at 16 and 24 kHz, in steps of 5 ms, run the exact
(onnxruntime, CPU) frontend on the tiny fixture checkpoint and report the first length that
gives at least one speech token after the token/mel alignment cut and a finite, non-empty
speaker embedding, beside what the official frame math predicts. docs/design.md (D-text)
records the result behind ``manifest.MIN_PROMPT_SECONDS``.

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
    log-mel frames, the v3 tokenizer emits one code per 4 of them; the 24 kHz prompt mel
    (reflect pad 720, n_fft 1920, hop 480, no centring) has (n_mel + 1440 - 1920) // 480 + 1
    frames; the alignment keeps min(mel frames // ratio, codes)."""
    codes = (n16 // 160) // 4
    mel = (n_mel + 1440 - 1920) // 480 + 1 if n_mel + 1440 >= 1920 else 0
    return min(mel // ratio, codes)


def main() -> None:
    fixtures = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/fixtures")
    model = fixtures / "cv3-tiny" / "model"
    cfg = load_config(model)
    fe = Frontend(model, cfg, backend="onnxruntime", cache_size=1)
    wav, sr = load_audio(fixtures / "cv3-tiny" / "prompts" / "p2_24k.wav")
    for rate in (16000, 24000):
        src = resample(wav, sr, rate)
        first = None
        for ms in range(5, 200, 5):
            n = rate * ms // 1000
            cut = src[:, :n]
            n16, n_mel = resample(cut, rate, 16000).shape[1], resample(cut, rate, cfg.sample_rate).shape[1]
            try:
                p = fe._prepare(cut, rate, f"{rate}-{ms}", f"{ms} ms")
                feats = fe._align_raw(fe._compute([p])[0], f"{ms} ms")
                ok = feats.speech_tokens.numel() > 0 and feats.embedding.numel() > 0 and bool(
                    torch.isfinite(feats.embedding).all())
                got = f"{feats.speech_tokens.numel()} token(s), embedding {tuple(feats.embedding.shape)}"
            except AudioError as e:
                ok, got = False, f"refused: {e}"
            print(f"{rate} Hz {ms:4d} ms: predicted {predicted_tokens(n16, n_mel)} token(s); {got}")
            if ok and first is None:
                first = ms
        print(f"{rate} Hz: shortest usable prompt {first} ms")


if __name__ == "__main__":
    main()
