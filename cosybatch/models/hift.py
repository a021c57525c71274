"""CosyVoice3 vocoder: causal HiFT (neural source filter + iSTFTNet), official behaviour.

The work is split so that a batched / graph-captured path can reuse the pieces:

* ``f0_and_source(mel, finalize)`` -- request-specific: F0 predictor (float64) and the
  sine source, which indexes the fixed noise table by absolute sample position;
* ``source_stft(source)`` -- STFT of the source (real || imag channels);
* ``decode(mel, s_stft, finalize)`` -- deterministic conv stack, ends in ``spec_to_wav``
  (exp/sin + iSTFT + clamp).

Parameter names equal the official hift.pt keys after ``fold_weight_norm``.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cosybatch.models.config import HiFTConfig, ModelConfig
from cosybatch.models import noise as noise_tables
from cosybatch.models.causal_conv import CausalConv1d, CausalConv1dDownSample, CausalConv1dUpsample
from cosybatch.models.f0 import CausalConvF0Predictor, SourceModule

_WN_G = ".parametrizations.weight.original0"
_WN_V = ".parametrizations.weight.original1"
# Modules the official code runs in float64; their weights are folded in float64 too.
_FLOAT64_PREFIXES = ("f0_predictor.",)


def _weight_norm(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    if hasattr(torch, "_weight_norm"):  # what the weight_norm parametrization calls
        return torch._weight_norm(v, g, 0)
    norm = v.reshape(v.shape[0], -1).norm(2, dim=1).reshape(-1, *([1] * (v.dim() - 1)))
    return v * (g / norm)


def fold_weight_norm(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace weight-norm pairs by plain ``X.weight`` = g * v / ||v|| (norm over dims > 0).

    Accepts both the parametrization layout (``X.parametrizations.weight.original0/1``)
    and the legacy one (``X.weight_g``/``X.weight_v``); other keys pass through. Weights
    are folded in their stored dtype, as the official forward does each call, except
    under ``f0_predictor.``: folded (and returned) in float64 like the official run.
    """
    out: dict[str, torch.Tensor] = {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, val in state_dict.items():
        for g_sfx, v_sfx in ((_WN_G, _WN_V), (".weight_g", ".weight_v")):
            if key.endswith(g_sfx):
                pairs.setdefault(key[: -len(g_sfx)], {})["g"] = val
                break
            if key.endswith(v_sfx):
                pairs.setdefault(key[: -len(v_sfx)], {})["v"] = val
                break
        else:
            out[key] = val
    for base, gv in pairs.items():
        if set(gv) != {"g", "v"}:
            raise KeyError(f"incomplete weight-norm pair for {base!r}: have {sorted(gv)}")
        g, v = gv["g"], gv["v"]
        if base.startswith(_FLOAT64_PREFIXES):
            g, v = g.to(torch.float64), v.to(torch.float64)
        out[base + ".weight"] = _weight_norm(v, g)
    for key in list(out):
        if key.startswith(_FLOAT64_PREFIXES) and out[key].is_floating_point():
            out[key] = out[key].to(torch.float64)
    return out


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, alpha per channel (linear scale)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.unsqueeze(0).unsqueeze(-1)
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """Snake -> left-causal dilated conv -> Snake -> left-causal conv, residual, per dilation."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            CausalConv1d(channels, channels, kernel_size, dilation=d) for d in dilations)
        self.convs2 = nn.ModuleList(
            CausalConv1d(channels, channels, kernel_size, dilation=1) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor, snake_pad=None) -> torch.Tensor:
        """``snake_pad.pair(x, conv1, snake1, conv2, snake2)``, when given, returns one step
        ``conv2(snake2(conv1(snake1(x)))) + x`` in fused kernels (``cosybatch.codec.snake``)."""
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            if snake_pad is None:
                x = c2(a2(c1(a1(x)))) + x
            else:
                x = snake_pad.pair(x, c1, a1, c2, a2)
        return x


def hann_window_periodic(n: int) -> torch.Tensor:
    """scipy ``get_window('hann', n, fftbins=True)`` computed in float64, as float32."""
    fac = np.linspace(-np.pi, np.pi, n + 1)[:-1]
    return torch.from_numpy((0.5 + 0.5 * np.cos(fac)).astype(np.float32))


def spec_to_wav(spec: torch.Tensor, window: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
    """conv_post output [B, n_fft+2, F] -> waveform [B, hop*(F-1)] (no clamp).

    Channels [0, n_fft/2] are log-magnitudes, the rest phases (through sin, as trained).
    """
    nb = n_fft // 2 + 1
    magnitude = torch.exp(spec[:, :nb, :]).clip(max=1e2)
    phase = torch.sin(spec[:, nb:, :])
    real = magnitude * torch.cos(phase)
    imag = magnitude * torch.sin(phase)
    return torch.istft(torch.complex(real, imag), n_fft, hop, n_fft, window=window)


class CausalHiFTGenerator(nn.Module):
    """Official ``CausalHiFTGenerator`` in inference mode.

    ``model_cfg`` only selects the fixed noise tables (their RNG replay depends on a few
    flow shapes); it defaults to the official flow with this HiFT config.
    """

    def __init__(self, cfg: HiFTConfig, model_cfg: ModelConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.noise_cfg = model_cfg if model_cfg is not None else ModelConfig(hift=cfg)
        if self.noise_cfg.hift != cfg:
            raise ValueError("model_cfg.hift differs from cfg")
        base = cfg.base_channels
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        self.num_upsamples = len(cfg.upsample_rates)
        self.up_total = int(np.prod(cfg.upsample_rates))  # STFT frames per mel frame
        self.samples_per_frame = cfg.samples_per_frame

        self.f0_predictor = CausalConvF0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels,
                                                  cfg.f0_num_class)
        self.m_source = SourceModule(cfg)
        self.conv_pre = CausalConv1d(cfg.in_channels, base, cfg.conv_pre_look_right + 1,
                                     causal_type="right")
        self.ups = nn.ModuleList(
            CausalConv1dUpsample(base // 2**i, base // 2**(i + 1), k, u)
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)))

        n_spec = cfg.n_fft + 2
        # stage i fuses the source at stage i's rate: downsample by the remaining ups.
        down_rates = np.cumprod([1] + list(cfg.upsample_rates[::-1][:-1]))[::-1]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(zip(down_rates, cfg.source_resblock_kernel_sizes,
                                          cfg.source_resblock_dilation_sizes)):
            ch = base // 2**(i + 1)
            u = int(u)
            if u == 1:
                self.source_downs.append(CausalConv1d(n_spec, ch, 1))
            else:
                self.source_downs.append(CausalConv1dDownSample(n_spec, ch, 2 * u, u))
            self.source_resblocks.append(ResBlock(ch, k, tuple(d)))

        self.resblocks = nn.ModuleList()
        for i in range(self.num_upsamples):
            ch = base // 2**(i + 1)
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes):
                self.resblocks.append(ResBlock(ch, k, tuple(d)))
        self.conv_post = CausalConv1d(ch, n_spec, 7)
        self.register_buffer("stft_window", hann_window_periodic(cfg.n_fft), persistent=False)

    # ------------------------------------------------------------------ source side
    def f0_and_source(self, mel: torch.Tensor, finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, in, T] -> (f0 [B, T'] float32, source [B, 1, T'*samples_per_frame]).

        T' = T, or T - look-ahead (3) when ``finalize`` is False.
        """
        f0 = self.f0_predictor(mel, finalize=finalize).to(mel.dtype)
        n = f0.shape[1] * self.samples_per_frame
        rand_ini, table = noise_tables.sine_noise(self.noise_cfg, n)
        dev = mel.device
        source = self.m_source(f0, rand_ini.to(dev), table.to(dev))
        return f0, source

    def source_stft(self, source: torch.Tensor) -> torch.Tensor:
        """source [B, 1, L] -> [B, n_fft+2, L/hop + 1] (real || imag), centred, reflect."""
        cfg = self.cfg
        spec = torch.stft(source.squeeze(1), cfg.n_fft, cfg.hop_len, cfg.n_fft,
                          window=self.stft_window, center=True, pad_mode="reflect",
                          return_complex=True)
        spec = torch.view_as_real(spec)
        return torch.cat([spec[..., 0], spec[..., 1]], dim=1)

    # ------------------------------------------------------------------ decode side
    def decode_spec(self, mel: torch.Tensor, s_stft: torch.Tensor, finalize: bool = True,
                    snake_pad=None) -> torch.Tensor:
        """mel [B, in, T] + source STFT -> conv_post output [B, n_fft+2, F].

        With ``finalize`` False the last ``conv_pre_look_right`` mel frames only serve as
        conv_pre's right context and the matching source frames are dropped. ``snake_pad``:
        see ``ResBlock.forward``.
        """
        r = self.cfg.conv_pre_look_right
        if finalize or r == 0:
            x = self.conv_pre(mel)
        else:
            x = self.conv_pre(mel[:, :, :-r], mel[:, :, -r:])
            s_stft = s_stft[:, :, : -self.up_total * r]
        for i in range(self.num_upsamples):
            x = F.leaky_relu(x, self.cfg.lrelu_slope)
            x = self.ups[i](x)
            if i == self.num_upsamples - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft), snake_pad)
            xs = self.resblocks[i * self.num_kernels](x, snake_pad)
            for j in range(1, self.num_kernels):
                xs = xs + self.resblocks[i * self.num_kernels + j](x, snake_pad)
            x = xs / self.num_kernels
        x = F.leaky_relu(x)  # default slope 0.01, not lrelu_slope (official)
        return self.conv_post(x)

    def decode(self, mel: torch.Tensor, s_stft: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """Deterministic part: mel + source STFT -> waveform [B, L] clamped to +-audio_limit."""
        cfg = self.cfg
        wav = spec_to_wav(self.decode_spec(mel, s_stft, finalize), self.stft_window,
                          cfg.n_fft, cfg.hop_len)
        if not finalize:
            wav = wav[:, : -self.samples_per_frame]
        return torch.clamp(wav, -cfg.audio_limit, cfg.audio_limit)

    @torch.inference_mode()
    def inference(self, speech_feat: torch.Tensor, finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, in, T] -> (wav [B, L], source [B, 1, L_src]).

        finalize=True: L = T * samples_per_frame. finalize=False (streaming; the caller
        re-runs the whole mel so far): the last 3 frames are F0 look-ahead and the next
        ``conv_pre_look_right`` conv_pre look-ahead, and the last frame's samples are
        withheld, so L = samples_per_frame * (T - 3 - look_right - 1); these samples
        equal the same prefix of a later run.
        """
        _, source = self.f0_and_source(speech_feat, finalize)
        mel = speech_feat
        if not finalize:
            k = self.f0_predictor.look_ahead
            min_frames = k + self.cfg.conv_pre_look_right + 1
            if mel.shape[2] < min_frames:
                raise ValueError(f"streaming HiFT needs at least {min_frames} mel frames, "
                                 f"got {mel.shape[2]}")
            mel = mel[:, :, :-k]
        wav = self.decode(mel, self.source_stft(source), finalize)
        return wav, source
