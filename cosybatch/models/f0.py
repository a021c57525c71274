"""Request-specific front half of the causal HiFT: F0 predictor and sine source."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cosybatch.models.config import HiFTConfig
from cosybatch.models.causal_conv import CausalConv1d

# Fixed by the official class, not by the yaml.
FIRST_KERNEL = 4  # right-causal: it reads FIRST_KERNEL-1 future mel frames
HIDDEN_KERNEL = 3
NUM_HIDDEN_CONVS = 4


class CausalConvF0Predictor(nn.Module):
    """mel [B, in, T] -> f0 [B, T] (Hz, non-negative), always computed in float64.

    The official code converts this module to float64 and folds weight norm in float64
    on every call; f0 feeds a phase accumulator, so one float32 ulp in f0 shows up in the
    waveform. The parameters therefore stay float64 whatever the parent module is cast to
    (``.float()``/``.half()`` only move them to the new device).
    """

    def __init__(self, in_channels: int, cond_channels: int, num_class: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            CausalConv1d(in_channels, cond_channels, FIRST_KERNEL, causal_type="right"),
            nn.ELU(),
        ]
        for _ in range(NUM_HIDDEN_CONVS):
            layers += [CausalConv1d(cond_channels, cond_channels, HIDDEN_KERNEL, causal_type="left"),
                       nn.ELU()]
        # Indices 0, 2, 4, ... of this Sequential are the state-dict's condnet.<i>.
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)
        self.to(torch.float64)

    def _apply(self, fn, recurse=True):
        def keep_float64(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            if t.is_floating_point() and moved.dtype != torch.float64:
                return t.to(device=moved.device, dtype=torch.float64)
            return moved

        return super()._apply(keep_float64, recurse)

    @property
    def look_ahead(self) -> int:
        """Mel frames the predictor needs beyond the last frame it outputs."""
        return self.condnet[0].causal_padding

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        mel = mel.to(torch.float64)
        first = self.condnet[0]
        if finalize:
            x = first(mel)
        else:
            # The last look_ahead frames are only context: the output stops before them.
            k = self.look_ahead
            x = first(mel[:, :, :-k], mel[:, :, -k:])
        for layer in list(self.condnet)[1:]:
            x = layer(x)
        return torch.abs(self.classifier(x.transpose(1, 2)).squeeze(-1))


class SourceModule(nn.Module):
    """Harmonic excitation from F0 (official ``SourceModuleHnNSF`` + causal ``SineGen2``).

    Bug-for-bug: the per-sample phase increments are linearly down-sampled to one value
    per mel frame, accumulated, and nearest-up-sampled again, so each harmonic is
    *constant* within a frame. The noise is a fixed uniform table indexed by absolute
    sample position (``cosybatch.models.noise``).
    """

    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.dim = cfg.nb_harmonics + 1
        self.samples_per_frame = cfg.samples_per_frame
        self.l_linear = nn.Linear(self.dim, 1)

    def frame_phase_increments(self, f0: torch.Tensor, rand_ini: torch.Tensor) -> torch.Tensor:
        """f0 [B, T] -> per-frame phase increments in cycles [B, T, dim] (float32)."""
        spf, sr = self.samples_per_frame, self.cfg.sampling_rate
        harm = torch.arange(1, self.dim + 1, dtype=f0.dtype, device=f0.device)
        if spf >= 3:
            # The official linear down-interpolation (scale 1/spf, align_corners=False)
            # reads only samples spf*t + (spf-1)//2 and + spf//2, both inside frame t where
            # the up-sampled f0 is constant, so it returns the frame value exactly; and it
            # never reads sample 0, the only one rand_ini touches.
            return (f0[:, :, None] * harm / sr) % 1
        f0_up = F.interpolate(f0[:, None], scale_factor=float(spf), mode="nearest").transpose(1, 2)
        rad = (f0_up * harm / sr) % 1
        rad[:, 0, :] = rad[:, 0, :] + rand_ini
        return F.interpolate(rad.transpose(1, 2), scale_factor=1 / spf, mode="linear").transpose(1, 2)

    def harmonics(self, f0: torch.Tensor, rand_ini: torch.Tensor) -> torch.Tensor:
        """f0 [B, T] -> sin(phase) [B, T*spf, dim], before amplitude and voicing."""
        spf = self.samples_per_frame
        rad = self.frame_phase_increments(f0, rand_ini)
        # torch's CPU cumsum of float32 accumulates in float64; do it explicitly so every
        # device matches the reference (phases reach ~1e4 rad).
        phase = torch.cumsum(rad.to(torch.float64), dim=1).to(rad.dtype) * 2 * math.pi
        phase = phase.transpose(1, 2) * spf
        # sin commutes with the nearest up-sampling (a pure copy): take it on frames.
        sines = torch.sin(phase)
        return F.interpolate(sines, scale_factor=float(spf), mode="nearest").transpose(1, 2)

    def forward(self, f0: torch.Tensor, rand_ini: torch.Tensor, sine_table: torch.Tensor) -> torch.Tensor:
        """f0 [B, T] float32 -> source [B, 1, T*spf]; ``sine_table`` is [1, >= T*spf, dim]."""
        cfg = self.cfg
        sines = self.harmonics(f0, rand_ini) * cfg.nsf_alpha
        n = sines.shape[1]
        f0_up = F.interpolate(f0[:, None], scale_factor=float(self.samples_per_frame),
                              mode="nearest").transpose(1, 2)
        uv = (f0_up > cfg.nsf_voiced_threshold).to(f0.dtype)
        noise_amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
        mixed = sines * uv + noise_amp * sine_table[:, :n]
        return torch.tanh(self.l_linear(mixed)).transpose(1, 2)
