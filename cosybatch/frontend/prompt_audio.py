"""The CPU part of a prompt: read, validate, mix to mono, resample to 16 kHz (tokenizer, CAM++)
and to the mel rate, and the Kaldi fbank (CAM++ input) with the reference arithmetic.

It is a few dozen small torch calls, each of which gives up the GIL and takes it back. In a
thread beside a thread that keeps the GIL busy, each taking back waits for it, up to the
interpreter's switch interval (5 ms): ~5 ms of work took 340 ms beside a thread spinning in
Python (design.md D32). So ``PromptAudio`` is a small picklable object: ``read(path)`` runs as
well in a helper process (``HelperPool``, ``frontend.audio=process``), which returns numpy
arrays, as here, with the same arithmetic and so the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cosybatch.audio import AudioError, kaldi_fbank, load_audio, resample, to_mono
from cosybatch.audio.features import WHISPER_N_FFT

# Properties of the two ONNX models (not of the checkpoint's yaml): both were trained on 16 kHz
# features, and the v3 tokenizer refuses prompts over 30 s.
ONNX_SAMPLE_RATE = 16000
MIN_SAMPLE_RATE = 16000
MAX_TOKENIZER_SECONDS = 30.0


@dataclass(frozen=True)
class PromptAudio:
    mel_rate: int  # the prompt mel's sample rate (the checkpoint's)
    mel_n_fft: int
    mel_hop: int
    fbank_bins: int  # 0: no fbank here (the device computes it)

    def tensors(self, wav: torch.Tensor, sr: int, source: str):
        """(wav16 [1, n], wav_mel [1, m], fbank [T, bins] or None) of decoded audio [channels, n]."""
        if sr < MIN_SAMPLE_RATE:
            raise AudioError(f"{source}: sample rate {sr} Hz is below the supported minimum {MIN_SAMPLE_RATE} Hz")
        wav = to_mono(wav)
        wav16 = resample(wav, sr, ONNX_SAMPLE_RATE)
        seconds = wav16.shape[1] / ONNX_SAMPLE_RATE
        if seconds > MAX_TOKENIZER_SECONDS:
            raise AudioError(
                f"{source}: prompt is {seconds:.2f} s; the speech tokenizer supports at most {MAX_TOKENIZER_SECONDS:.0f} s"
            )
        wav_mel = resample(wav, sr, self.mel_rate)
        # Reflect padding (whisper n_fft/2, matcha (n_fft-hop)/2) needs more samples than it pads.
        mel_pad = (self.mel_n_fft - self.mel_hop) // 2
        if wav16.shape[1] <= WHISPER_N_FFT or wav_mel.shape[1] <= max(mel_pad, self.mel_n_fft // 2):
            raise AudioError(f"{source}: prompt is too short ({seconds * 1000:.0f} ms)")
        fb = kaldi_fbank(wav16, num_mel_bins=self.fbank_bins, sample_rate=ONNX_SAMPLE_RATE) if self.fbank_bins else None
        return wav16.contiguous(), wav_mel.contiguous(), fb

    def read(self, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``tensors`` of an audio file, as numpy arrays (they cross a pipe as raw bytes)."""
        wav, sr = load_audio(path)
        return tuple(None if t is None else t.numpy() for t in self.tensors(wav, sr, path))


def arrays_to_tensors(arrays) -> tuple:
    """``PromptAudio.read``'s arrays as the tensors ``PromptAudio.tensors`` returns (no copy)."""
    return tuple(None if a is None else torch.from_numpy(a) for a in arrays)


def warm_helper(threads: int) -> None:
    """A helper process's first call: the imports above and one small prompt's kernels, so the
    first row's call does not wait for them; torch on as many threads as in the process that
    started it (``synth`` on CUDA with several workers: one), so that no kernel splits its work
    differently there."""
    torch.set_num_threads(threads)
    wav = torch.sin(torch.arange(2 * ONNX_SAMPLE_RATE, dtype=torch.float32) * 0.05)[None]
    PromptAudio(24000, 1920, 480, 80).tensors(wav, ONNX_SAMPLE_RATE, "<warm-up>")
