"""The reference frontend: the two ONNX files through onnxruntime, one prompt per call.

This is what the official ``CosyVoiceFrontEnd`` does (features on the CPU, batch 1, the
tokenizer fed ``feats_length = T``, CAM++ on the whole fbank), so it is the parity path, and the
only one for ONNX files without the official structure (which need not honour lengths).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from cosybatch.audio import AudioError, kaldi_fbank, prompt_mel, whisper_log_mel
from cosybatch.models.config import MelConfig
from cosybatch.frontend.torch_backend import RawFeatures

ONNX_SAMPLE_RATE = 16000
_DEFAULT_TOKENIZER_MELS = 128
_DEFAULT_CAMPPLUS_MELS = 80


def ort_session(path: Path, use_cuda: bool, threads: int):
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


class OrtBackend:
    def __init__(self, model_dir: str | Path, mel_cfg: MelConfig, use_cuda: bool = False, threads: int = 1):
        d = Path(model_dir)
        self.mel_cfg = mel_cfg
        self.tok_session = ort_session(d / "speech_tokenizer_v3.onnx", use_cuda, threads)
        self.spk_session = ort_session(d / "campplus.onnx", False, threads)
        self.n_mels = _static_dim(self.tok_session, 1, _DEFAULT_TOKENIZER_MELS)
        self.fbank_bins = _static_dim(self.spk_session, 2, _DEFAULT_CAMPPLUS_MELS)

    def describe(self) -> str:
        return f"onnxruntime {self.tok_session.get_providers()[0]}"

    def speech_tokens(self, wav16: torch.Tensor) -> torch.Tensor:
        feats = whisper_log_mel(wav16, n_mels=self.n_mels)
        inputs = self.tok_session.get_inputs()
        out = self.tok_session.run(None, {
            inputs[0].name: feats.numpy().astype(np.float32, copy=False),
            inputs[1].name: np.array([feats.shape[2]], dtype=np.int32),
        })[0]
        return torch.from_numpy(np.asarray(out).reshape(-1).astype(np.int64))

    def speaker_embedding(self, wav16: torch.Tensor, fbank: torch.Tensor | None = None) -> torch.Tensor:
        fb = kaldi_fbank(wav16, num_mel_bins=self.fbank_bins, sample_rate=ONNX_SAMPLE_RATE) if fbank is None else fbank
        if fb.shape[0] == 0:
            raise AudioError("prompt is shorter than one 25 ms analysis frame")
        name = self.spk_session.get_inputs()[0].name
        out = self.spk_session.run(None, {name: fb[None].numpy().astype(np.float32, copy=False)})[0]
        return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(1, -1).copy())

    def compute(self, wav16: list[torch.Tensor], wav_mel: list[torch.Tensor],
                fbank: list[torch.Tensor] | None = None) -> list[RawFeatures]:
        fbank = fbank or [None] * len(wav16)
        return [
            RawFeatures(self.speech_tokens(a), self.speaker_embedding(a, f), prompt_mel(b, self.mel_cfg)[0].T[None])
            for a, b, f in zip(wav16, wav_mel, fbank)
        ]


__all__ = ["OrtBackend", "ort_session", "ONNX_SAMPLE_RATE"]
