"""The three prompt features of ``cosybatch.audio.features``, batched over padded rows.

Each function takes zero-padded waveforms [B, N] with per-row lengths, runs on their device
and returns features [B, ...] plus per-row frame counts. Row by row the arithmetic is that of
the single-prompt functions (which reproduce openai-whisper, torchaudio's Kaldi fbank and
Matcha's mel): reflect padding is taken from each row's own samples at its own end, the whisper
log floor uses each row's own maximum and the fbank mean each row's own frames. Frames past a
row's count are zero.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from cosybatch.audio.features import WHISPER_HOP, WHISPER_N_FFT
from cosybatch.audio.mel import kaldi_mel_banks, slaney_mel_filterbank
from cosybatch.models.config import MelConfig
from cosybatch.models.masks import length_mask

KALDI_FRAME = 400  # 25 ms at 16 kHz
KALDI_SHIFT = 160  # 10 ms
KALDI_FFT = 512  # next power of two
KALDI_PREEMPH = 0.97


@lru_cache(maxsize=32)
def _slaney(sr: int, n_fft: int, n_mels: int, fmin: float, fmax, device: str, dtype) -> torch.Tensor:
    return slaney_mel_filterbank(sr, n_fft, n_mels, fmin, fmax).to(device=device, dtype=dtype)


@lru_cache(maxsize=8)
def _kaldi_banks(n_mels: int, device: str, dtype) -> torch.Tensor:
    return kaldi_mel_banks(n_mels, KALDI_FFT, 16000.0, 20.0, 0.0).to(device=device, dtype=dtype)


def _key(t: torch.Tensor) -> tuple[str, torch.dtype]:
    return str(t.device), t.dtype


@lru_cache(maxsize=32)
def _window(n: int, periodic: bool, power: float, device: str, dtype) -> torch.Tensor:
    return torch.hann_window(n, periodic=periodic, device=device, dtype=dtype).pow(power)


def pad_reflect(wav: torch.Tensor, lengths: torch.Tensor, pad: int) -> torch.Tensor:
    """[B, N] -> [B, N + 2 pad], each row reflect-padded at both of its own ends (like
    F.pad(mode='reflect') on the row alone); samples past a row's padded end are junk."""
    n = wav.shape[1]
    s = torch.arange(-pad, n + pad, device=wav.device)[None, :].expand(wav.shape[0], -1)
    last = (lengths - 1)[:, None]
    idx = torch.where(s < 0, -s, s)
    idx = torch.where(idx > last, 2 * last - idx, idx).clamp(0, n - 1)
    return torch.gather(wav, 1, idx)


def whisper_log_mel_batch(wav: torch.Tensor, lengths: torch.Tensor, n_mels: int = 128):
    """-> (feats [B, n_mels, T], frames [B] = length // 160); cf. ``whisper_log_mel``."""
    window = _window(WHISPER_N_FFT, True, 1.0, *_key(wav))
    padded = pad_reflect(wav, lengths, WHISPER_N_FFT // 2)
    stft = torch.stft(padded, WHISPER_N_FFT, WHISPER_HOP, window=window, center=False, return_complex=True)
    frames = lengths // WHISPER_HOP  # whisper drops the last centred frame
    t = wav.shape[1] // WHISPER_HOP
    power = stft[..., :t].abs() ** 2
    mel = _slaney(16000, WHISPER_N_FFT, n_mels, 0.0, None, *_key(wav)) @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    valid = length_mask(frames, t)[:, None, :]
    peak = log_spec.masked_fill(~valid, float("-inf")).amax(dim=(1, 2), keepdim=True)
    log_spec = torch.maximum(log_spec, peak - 8.0)
    return ((log_spec + 4.0) / 4.0) * valid, frames


def kaldi_fbank_batch(wav: torch.Tensor, lengths: torch.Tensor, n_mels: int = 80):
    """-> (fbank [B, M, n_mels] minus each row's mean over its frames, frames [B]); cf.
    ``kaldi_fbank`` (16 kHz, snip_edges, dither 0, Povey window, power spectrum)."""
    if wav.shape[1] < KALDI_FRAME:
        raise ValueError("every row must hold at least one 25 ms frame")
    frames = wav.unfold(1, KALDI_FRAME, KALDI_SHIFT)  # [B, M, 400]
    frames = frames - frames.mean(dim=-1, keepdim=True)
    prev = F.pad(frames, (1, 0), mode="replicate")
    frames = frames - KALDI_PREEMPH * prev[..., :-1]
    window = _window(KALDI_FRAME, False, 0.85, *_key(wav))  # Povey
    frames = F.pad(frames * window, (0, KALDI_FFT - KALDI_FRAME))
    power = torch.fft.rfft(frames).abs().pow(2.0)
    feats = torch.matmul(power, _kaldi_banks(n_mels, *_key(wav)).T)
    eps = torch.tensor(torch.finfo(torch.float32).eps, device=wav.device, dtype=wav.dtype)
    feats = torch.max(feats, eps).log()
    count = (1 + (lengths - KALDI_FRAME) // KALDI_SHIFT).clamp(min=0)
    valid = length_mask(count, feats.shape[1])[:, :, None]
    mean = (feats * valid).sum(1, keepdim=True) / count.clamp(min=1)[:, None, None]
    return (feats - mean) * valid, count


def prompt_mel_batch(wav: torch.Tensor, lengths: torch.Tensor, cfg: MelConfig):
    """-> (mel [B, F, num_mels], frames [B]); cf. ``prompt_mel`` (Matcha, center=False)."""
    if cfg.center:
        raise ValueError("the batched prompt mel implements Matcha's center=False only")
    pad = int((cfg.n_fft - cfg.hop_size) / 2)
    padded = pad_reflect(wav, lengths, pad)
    window = _window(cfg.win_size, True, 1.0, *_key(wav))
    spec = torch.stft(padded, cfg.n_fft, hop_length=cfg.hop_size, win_length=cfg.win_size, window=window,
                      center=False, normalized=False, onesided=True, return_complex=True)
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    basis = _slaney(cfg.sampling_rate, cfg.n_fft, cfg.num_mels, cfg.fmin, cfg.fmax, *_key(wav))
    mel = torch.log(torch.clamp(torch.matmul(basis, mag), min=1e-5))
    frames = 1 + (lengths + 2 * pad - cfg.n_fft) // cfg.hop_size
    valid = length_mask(frames, mel.shape[2])[:, None, :]
    return (mel * valid).transpose(1, 2), frames


def pad_rows(rows: list[torch.Tensor], size: int = 0, out: torch.Tensor | None = None):
    """[1, n_i] or [n_i] CPU tensors -> zero-padded [B, max(size, max n)] (written into ``out``
    if given, e.g. pinned staging memory) and lengths [B] (CPU)."""
    flat = [r.reshape(-1) for r in rows]
    lengths = torch.tensor([r.numel() for r in flat], dtype=torch.long)
    shape = (len(flat), max(int(size), int(lengths.max())))
    out = torch.empty(shape, dtype=flat[0].dtype) if out is None else out.view(-1)[: shape[0] * shape[1]].view(shape)
    for i, r in enumerate(flat):
        out[i, : r.numel()] = r
        out[i, r.numel() :] = 0
    return out, lengths


def pad_frames(rows: list[torch.Tensor], size: int = 0, out: torch.Tensor | None = None):
    """[T_i, F] CPU tensors -> zero-padded [B, max(size, max T), F] and lengths [B] (CPU)."""
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long)
    shape = (len(rows), max(int(size), int(lengths.max())), rows[0].shape[1])
    n = shape[0] * shape[1] * shape[2]
    out = torch.empty(shape, dtype=rows[0].dtype) if out is None else out.view(-1)[:n].view(shape)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
        out[i, r.shape[0] :] = 0
    return out, lengths


__all__ = ["pad_frames", "whisper_log_mel_batch", "kaldi_fbank_batch", "prompt_mel_batch", "pad_reflect", "pad_rows"]
