"""CosyVoice3 flow: speech tokens -> mel (CausalMaskedDiffWithDiT + CausalConditionalCFM, design.md "The model").

Submodule names equal flow.pt's keys, so the checkpoint loads with ``strict=True`` as-is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cosybatch.models.config import FlowConfig
from cosybatch.models.dit import DiT


def cfm_noise_table(n_mels: int, length: int) -> torch.Tensor:
    """The fixed CFM start noise: what ``torch.manual_seed(0); torch.randn(1, n_mels, length)`` gives.

    A private generator reproduces it without disturbing the global RNG.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed(0)
    return torch.randn(1, n_mels, length, generator=g)


class PreLookaheadLayer(nn.Module):
    """conv1 looks ``pre_lookahead_len`` tokens ahead, conv2 is causal over 3 tokens, plus a residual."""

    def __init__(self, in_channels: int, channels: int, pre_lookahead_len: int):
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(in_channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, in_channels, kernel_size=3)

    def forward(self, inputs: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """inputs [B, N, C] -> [B, N, C].

        ``context`` [B, pre_lookahead_len, C] holds the embeddings of held-back tokens: they
        replace the zero right-padding but produce no output of their own.
        """
        h = inputs.transpose(1, 2)
        if context is None:
            h = F.pad(h, (0, self.pre_lookahead_len))
        else:
            if context.shape[1] != self.pre_lookahead_len:
                raise ValueError(f"lookahead context must have {self.pre_lookahead_len} frames, got {context.shape[1]}")
            h = torch.cat((h, context.transpose(1, 2)), dim=2)
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (2, 0)))
        return h.transpose(1, 2) + inputs


class CausalConditionalCFM(nn.Module):
    """Euler ODE solve with classifier-free guidance, starting from a fixed noise table."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        self.cfg = cfg
        self.estimator = DiT(cfg.dit)
        # Not in any checkpoint: the official code draws it at construction (design.md D5).
        self.register_buffer("rand_noise", cfm_noise_table(cfg.output_size, cfg.noise_len), persistent=False)

    def t_span(self, n_timesteps: int, device, dtype) -> torch.Tensor:
        t = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
        return 1 - torch.cos(t * 0.5 * torch.pi)

    def initial_noise(self, batch: int, frames: int, device, dtype) -> torch.Tensor:
        if frames > self.rand_noise.shape[2]:
            raise ValueError(f"{frames} mel frames exceed the CFM noise table ({self.rand_noise.shape[2]})")
        return self.rand_noise[:, :, :frames].to(device=device, dtype=dtype).expand(batch, -1, -1)

    def guided_velocity(self, x, mask, mu, t, spks, cond, streaming: bool) -> torch.Tensor:
        """One estimator call on the CFG batch (conditional rows, then rows with mu/spks/cond zeroed)."""
        b = x.shape[0]
        dtype = spks.dtype
        x_in = torch.cat((x, x)).to(dtype)
        mask_in = torch.cat((mask, mask)).to(dtype)
        mu_in = torch.cat((mu, torch.zeros_like(mu))).to(dtype)
        spks_in = torch.cat((spks, torch.zeros_like(spks)))
        cond_in = torch.cat((cond, torch.zeros_like(cond))).to(dtype)
        t_in = t.to(dtype).expand(2 * b).contiguous()
        v = self.estimator(x_in, mask_in, mu_in, t_in, spks_in, cond_in, streaming=streaming)
        v_cond, v_uncond = v.split([b, b], dim=0)
        r = self.cfg.inference_cfg_rate
        return (1.0 + r) * v_cond - r * v_uncond

    def solve_euler(self, x, t_span, mu, mask, spks, cond, streaming: bool = False) -> torch.Tensor:
        # t advances by accumulation and dt is re-derived from t_span, exactly as the official
        # solver does, so the float32 time values match bit for bit.
        t = t_span[0].unsqueeze(0)
        dt = t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            x = x + dt * self.guided_velocity(x, mask, mu, t, spks, cond, streaming)
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x.float()

    @torch.inference_mode()
    def forward(self, mu, mask, spks, cond, streaming: bool = False, n_timesteps: int | None = None) -> torch.Tensor:
        """mu/cond [B, mel, T], mask [B, 1, T], spks [B, spk] -> mel [B, mel, T] float32."""
        n = self.cfg.n_timesteps if n_timesteps is None else n_timesteps
        z = self.initial_noise(mu.shape[0], mu.shape[2], mu.device, mu.dtype)
        return self.solve_euler(z, self.t_span(n, mu.device, mu.dtype), mu, mask, spks, cond, streaming)


class CausalMaskedDiffWithDiT(nn.Module):
    def __init__(self, cfg: FlowConfig):
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.input_size, cfg.pre_lookahead_channels, cfg.pre_lookahead_len)
        self.decoder = CausalConditionalCFM(cfg)

    def speaker(self, embedding: torch.Tensor) -> torch.Tensor:
        """[B, spk_embed_dim] x-vector -> [B, output_size] speaker conditioning."""
        return self.spk_embed_affine_layer(F.normalize(embedding, dim=1))

    def token_features(self, tokens: torch.Tensor, finalize: bool) -> torch.Tensor:
        """tokens [B, N] (prompt ‖ target) -> mu [B, T_mel, input_size], time-major.

        With finalize=False the last ``pre_lookahead_len`` tokens are look-ahead context only,
        so the result covers N - pre_lookahead_len tokens.
        """
        emb = self.input_embedding(tokens.long().clamp(min=0))
        if finalize:
            h = self.pre_lookahead_layer(emb)
        else:
            L = self.cfg.pre_lookahead_len
            h = self.pre_lookahead_layer(emb[:, :-L], context=emb[:, -L:])
        return h.repeat_interleave(self.cfg.token_mel_ratio, dim=1)

    @torch.inference_mode()
    def inference(self, token, prompt_token, prompt_feat, embedding, streaming: bool, finalize: bool) -> torch.Tensor:
        """token [B, N], prompt_token [B, P], prompt_feat [B, F, mel], embedding [B, spk] -> mel [B, mel, T_new].

        The prompt's F mel frames are conditioning only and are cut from the output.
        """
        spks = self.speaker(embedding)
        h = self.token_features(torch.cat((prompt_token.to(token.dtype), token), dim=1), finalize)
        b, frames, _ = h.shape
        n_prompt = prompt_feat.shape[1]
        if n_prompt > frames:
            raise ValueError(f"prompt mel ({n_prompt} frames) is longer than the flow input ({frames} frames)")
        cond = torch.zeros(b, frames, self.cfg.output_size, device=h.device, dtype=h.dtype)
        cond[:, :n_prompt] = prompt_feat
        mask = torch.ones(b, 1, frames, device=h.device, dtype=h.dtype)
        feat = self.decoder(h.transpose(1, 2).contiguous(), mask, spks, cond.transpose(1, 2), streaming=streaming)
        return feat[:, :, n_prompt:].float()
