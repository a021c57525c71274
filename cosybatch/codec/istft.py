"""Inverse STFT without the per-call device->host sync, bit-equal to ``torch.istft``.

``torch.istft`` recomputes the overlap-add envelope of the squared window every call and
reads its minimum back to the host (the NOLA check) -- a device sync in the middle of
the vocoder, which also makes it uncapturable in a CUDA graph. The envelope depends
only on the frame count, so it is built once per count and cached. The NOLA check runs once,
on the CPU, when the ISTFT is made: a trimmed envelope is a start pattern, a part periodic
in ``hop`` and an end pattern, all of which appear in the envelopes of the frame counts it
checks, so a window that passes has a non-zero envelope at every count (no sync, ever, on
the device).

The arithmetic is the one ``torch.istft(center=True, onesided, return_complex=False)``
performs (ATen ``istft``): ``irfft`` with 1/n scaling, times the window, overlap-add by
``unfold_backward``, trim ``n_fft/2`` at each end, divide by the envelope. Using the
same ops in the same order makes the result bit-identical, not merely close.

Batched rows may have fewer valid frames than the padded tensor (requests of different
lengths decoded together): frames past a row's count are zeroed before the overlap-add
and the row's own envelope is used, so every row equals its own unpadded ``istft``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import torch

from cosybatch.gpu.hostcopy import h2d

_unfold_backward = torch.ops.aten.unfold_backward


class CachedISTFT:
    """Cached-envelope ISTFT for one (n_fft, hop, window); centred, one-sided."""

    def __init__(self, n_fft: int, hop: int, window: torch.Tensor, max_cached: int = 512) -> None:
        if window.dim() != 1 or window.shape[0] != n_fft:
            raise ValueError("window must be 1-D of length n_fft")
        if not 0 < hop <= n_fft:
            raise ValueError("expected 0 < hop <= n_fft")
        self.n_fft = n_fft
        self.hop = hop
        self.window = window
        self.max_cached = max_cached
        self._windows: dict[tuple, torch.Tensor] = {}
        self._env: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self._check_nola()

    def _check_nola(self) -> None:
        """Every count up to where start and end patterns stop overlapping, and one beyond."""
        w2 = self.window.detach().to("cpu", torch.float64).pow(2)
        period = -(-self.n_fft // self.hop)
        for n in list(range(2, 2 * period + 3)) + [4 * period + 7]:
            env = self._overlap_add(w2, n)
            if env.numel() and float(env.abs().min()) < 1e-11:
                raise ValueError(f"window overlap-add is ~0 somewhere for {n} frames (NOLA)")

    def _overlap_add(self, w2: torch.Tensor, n_frames: int) -> torch.Tensor:
        """The trimmed overlap-add of ``n_frames`` copies of ``w2`` (the squared window)."""
        full = self.n_fft + self.hop * (n_frames - 1)
        env = _unfold_backward(w2.expand(1, n_frames, self.n_fft), [1, full], 1, self.n_fft, self.hop)
        half = self.n_fft // 2
        return env[0, half: full - half].contiguous()

    # ------------------------------------------------------------------ envelope
    def _window_on(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (str(device), dtype)
        w = self._windows.get(key)
        if w is None:
            w = self.window.to(device=device, dtype=dtype)
            self._windows[key] = w
        return w

    def num_samples(self, n_frames: int) -> int:
        return self.hop * (n_frames - 1)

    def envelope(self, n_frames: int, device, dtype=torch.float32) -> torch.Tensor:
        """Trimmed squared-window overlap-add for ``n_frames`` frames: [hop*(n_frames-1)],
        built like ``torch.istft`` builds it (its NOLA check ran at construction)."""
        device = torch.device(device)
        key = (n_frames, str(device), dtype)
        with self._lock:
            env = self._env.get(key)
            if env is not None:
                self._env.move_to_end(key)
                return env
        if n_frames < 1:
            raise ValueError("need at least one frame")
        env = self._overlap_add(self._window_on(device, dtype).pow(2), n_frames)
        with self._lock:
            self._env[key] = env
            while len(self._env) > self.max_cached:
                self._env.popitem(last=False)
        return env

    def envelopes(self, n_frames: Sequence[int], padded_frames: int, device,
                  dtype=torch.float32) -> torch.Tensor:
        """Per-row envelopes [B, hop*(padded_frames-1)], ones past each row's end."""
        length = self.num_samples(padded_frames)
        rows = []
        for n in n_frames:
            env = self.envelope(n, device, dtype)
            if env.shape[0] < length:
                env = torch.cat([env, env.new_ones(length - env.shape[0])])
            rows.append(env)
        return torch.stack(rows)

    def frame_mask(self, n_frames: Sequence[int], padded_frames: int, device) -> torch.Tensor:
        """[B, padded_frames, 1] bool, True where the frame exists for that row."""
        idx = torch.arange(padded_frames).unsqueeze(0)
        lens = torch.tensor(list(n_frames)).unsqueeze(1)
        return h2d(idx < lens, device=device).unsqueeze(-1)

    # ------------------------------------------------------------------ transform
    def __call__(self, real: torch.Tensor, imag: torch.Tensor,
                 envelope: torch.Tensor | None = None,
                 frame_mask: torch.Tensor | None = None) -> torch.Tensor:
        """real, imag [B, n_fft/2+1, F] -> waveform [B, hop*(F-1)].

        Without ``envelope``/``frame_mask`` every row has F frames (== torch.istft).
        With them (from ``envelopes`` / ``frame_mask``), each row equals torch.istft of
        its own first frames, zero beyond; neither argument touches the host.
        """
        n_frames = real.shape[-1]
        spec = torch.complex(real, imag).transpose(1, 2)  # [B, F, bins]
        frames = torch.fft.irfft(spec, n=self.n_fft, dim=-1, norm="backward")
        frames = frames * self._window_on(frames.device, frames.dtype).view(1, 1, self.n_fft)
        if frame_mask is not None:
            frames = torch.where(frame_mask, frames, torch.zeros((), dtype=frames.dtype,
                                                                 device=frames.device))
        full = self.n_fft + self.hop * (n_frames - 1)
        y = _unfold_backward(frames, [frames.shape[0], full], 1, self.n_fft, self.hop)
        half = self.n_fft // 2
        y = y[:, half: full - half]
        if envelope is None:
            envelope = self.envelope(n_frames, frames.device, frames.dtype).unsqueeze(0)
        return y / envelope
