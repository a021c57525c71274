"""Zero-shot prompt frontend: prompt wav -> (speech tokens, speaker embedding, prompt mel),
and texts -> token ids, as the official ``CosyVoiceFrontEnd.frontend_zero_shot`` does.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .audio import AudioError, kaldi_fbank, load_audio, prompt_mel, resample, to_mono, whisper_log_mel
from .audio.features import WHISPER_N_FFT
from .config import ModelConfig

# Properties of the two ONNX models (not of the checkpoint's yaml): both were trained on 16 kHz
# features, and the v3 tokenizer refuses prompts over 30 s.
ONNX_SAMPLE_RATE = 16000
MIN_SAMPLE_RATE = 16000
MAX_TOKENIZER_SECONDS = 30.0
_DEFAULT_TOKENIZER_MELS = 128
_DEFAULT_CAMPPLUS_MELS = 80


@dataclass(frozen=True)
class PromptFeatures:
    speech_tokens: torch.Tensor  # LongTensor [P]
    embedding: torch.Tensor  # FloatTensor [1, spk_embed_dim]
    mel: torch.Tensor  # FloatTensor [1, token_mel_ratio * P, num_mels]

    def clone(self) -> "PromptFeatures":
        return PromptFeatures(self.speech_tokens.clone(), self.embedding.clone(), self.mel.clone())


@dataclass(frozen=True)
class TextInputs:
    prompt_text_ids: torch.Tensor  # LongTensor [N_prompt]
    segments: list[torch.Tensor]  # one LongTensor [N_s] per synthesised piece
    segment_texts: list[str]


def _session(path: Path, use_cuda: bool, threads: int):
    import onnxruntime as ort

    if not path.is_file():
        raise FileNotFoundError(f"ONNX model not found: {path}")
    opt = ort.SessionOptions()
    opt.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opt.intra_op_num_threads = threads
    providers = ["CPUExecutionProvider"]
    if use_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(str(path), sess_options=opt, providers=providers)


def _static_dim(session, axis: int, default: int) -> int:
    dim = session.get_inputs()[0].shape[axis]
    return dim if isinstance(dim, int) and dim > 0 else default


class Frontend:
    """Prompt features and text ids for CosyVoice3 zero-shot synthesis.

    ``prompt`` results are cached per file (absolute path + size + mtime) in a bounded LRU,
    because bulk manifests reuse a few prompts for many rows. Returned tensors are CPU copies.
    """

    def __init__(
        self,
        model_dir: str | Path,
        cfg: ModelConfig,
        tokenizer=None,
        *,
        onnx_cuda: bool = False,
        onnx_threads: int = 1,
        cache_size: int = 256,
    ):
        self.model_dir = Path(model_dir)
        self.cfg = cfg
        self._tokenizer = tokenizer
        self._tok_session = _session(self.model_dir / "speech_tokenizer_v3.onnx", onnx_cuda, onnx_threads)
        self._spk_session = _session(self.model_dir / "campplus.onnx", False, onnx_threads)
        self.tokenizer_mels = _static_dim(self._tok_session, 1, _DEFAULT_TOKENIZER_MELS)
        self.campplus_mels = _static_dim(self._spk_session, 2, _DEFAULT_CAMPPLUS_MELS)
        self._cache: OrderedDict[tuple, PromptFeatures] = OrderedDict()
        self._cache_size = max(0, int(cache_size))
        self._lock = threading.Lock()

    # ---- text -------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from .text.tokenizer import CosyVoice3Tokenizer

            self._tokenizer = CosyVoice3Tokenizer.from_dir(self.model_dir / "CosyVoice-BlankEN")
        return self._tokenizer

    def prepare(self, prompt_transcript: str, target_text: str) -> TextInputs:
        """Prompt text ids (with the CV3 system prefix) and the target split into pieces."""
        from .text.normalize import prompt_text_for, split_target_text

        tok = self.tokenizer
        prompt_ids = torch.tensor(tok.encode(prompt_text_for(prompt_transcript)), dtype=torch.long)
        texts = list(split_target_text(target_text, tok))
        if not texts:
            raise ValueError(f"target text has nothing to synthesise: {target_text!r}")
        segments = [torch.tensor(tok.encode(t), dtype=torch.long) for t in texts]
        return TextInputs(prompt_text_ids=prompt_ids, segments=segments, segment_texts=texts)

    # ---- audio ------------------------------------------------------------------------
    def prompt(self, wav_path: str | Path) -> PromptFeatures:
        path = Path(wav_path).resolve()
        try:
            st = os.stat(path)
        except OSError as e:
            raise AudioError(f"audio file not found: {path}") from e
        key = (str(path), st.st_size, st.st_mtime_ns)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit.clone()
        feats = self.extract(path)
        if self._cache_size:
            with self._lock:
                self._cache[key] = feats
                self._cache.move_to_end(key)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return feats.clone()

    def extract(self, wav_path: str | Path) -> PromptFeatures:
        """Uncached ``prompt``."""
        wav, sr = load_audio(wav_path)
        if sr < MIN_SAMPLE_RATE:
            raise AudioError(f"{wav_path}: sample rate {sr} Hz is below the supported minimum {MIN_SAMPLE_RATE} Hz")
        wav = to_mono(wav)
        wav16 = resample(wav, sr, ONNX_SAMPLE_RATE)
        seconds = wav16.shape[1] / ONNX_SAMPLE_RATE
        if seconds > MAX_TOKENIZER_SECONDS:
            raise AudioError(
                f"{wav_path}: prompt is {seconds:.2f} s; the speech tokenizer supports at most {MAX_TOKENIZER_SECONDS:.0f} s"
            )
        wav_mel = resample(wav, sr, self.cfg.sample_rate)
        # Reflect padding (whisper n_fft/2, matcha (n_fft-hop)/2) needs more samples than it pads.
        mel_pad = (self.cfg.mel.n_fft - self.cfg.mel.hop_size) // 2
        if wav16.shape[1] <= WHISPER_N_FFT or wav_mel.shape[1] <= max(mel_pad, self.cfg.mel.n_fft // 2):
            raise AudioError(f"{wav_path}: prompt is too short ({seconds * 1000:.0f} ms)")
        tokens = self.speech_tokens(wav16)
        embedding = self.speaker_embedding(wav16)
        mel = prompt_mel(wav_mel, self.cfg.mel)[0].T[None]  # [1, F, mels]
        return self.align(tokens, embedding, mel, wav_path)

    def speech_tokens(self, wav16: torch.Tensor) -> torch.Tensor:
        feats = whisper_log_mel(wav16, n_mels=self.tokenizer_mels)
        inputs = self._tok_session.get_inputs()
        out = self._tok_session.run(
            None,
            {
                inputs[0].name: feats.numpy().astype(np.float32, copy=False),
                inputs[1].name: np.array([feats.shape[2]], dtype=np.int32),
            },
        )[0]
        return torch.from_numpy(np.asarray(out).reshape(-1).astype(np.int64))

    def speaker_embedding(self, wav16: torch.Tensor) -> torch.Tensor:
        fb = kaldi_fbank(wav16, num_mel_bins=self.campplus_mels, sample_rate=ONNX_SAMPLE_RATE)
        if fb.shape[0] == 0:
            raise AudioError("prompt is shorter than one 25 ms analysis frame")
        name = self._spk_session.get_inputs()[0].name
        out = self._spk_session.run(None, {name: fb[None].numpy().astype(np.float32, copy=False)})[0]
        return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(1, -1).copy())

    def align(self, tokens: torch.Tensor, embedding: torch.Tensor, mel: torch.Tensor, what="prompt") -> PromptFeatures:
        """Cut tokens and mel to a common length: n = min(frames // ratio, tokens)."""
        ratio = self.cfg.flow.token_mel_ratio
        n = min(int(mel.shape[1] / ratio), int(tokens.shape[0]))
        if n <= 0:
            raise AudioError(f"{what}: prompt too short to give any speech token")
        return PromptFeatures(
            speech_tokens=tokens[:n].contiguous(),
            embedding=embedding,
            mel=mel[:, : ratio * n].contiguous(),
        )

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()


__all__ = ["Frontend", "PromptFeatures", "TextInputs", "AudioError"]
