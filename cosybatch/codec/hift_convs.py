"""HiFT's decode stack (``conv_pre`` to ``conv_post``) on channels-last activations, two ways.

Each is ``CausalHiFTGenerator.decode_spec(mel, s_stft, finalize=True)`` (the form ``HiftRunner``
decodes every batch in), walked over the same modules in the same order, with the activations
[B, T, C] between convs: the first convs read the NCL mel and source STFT, ``conv_post``'s
output goes back to NCL for the ISTFT. On NCL tensors cuDNN puts layout transposes around its
convs (2.2 of a streaming call's 10.65 ms of kernels on the H200, docs/performance.md).

* ``TritonConvDecode``: every conv one launch of ``triton_conv.conv1d`` with the activations
  and adds folded in: a LeakyReLU into the conv after it (``ups``, ``conv_post``); in a resblock
  step ``x + conv2(snake2(conv1(snake1(x))))`` conv1 writes snake2 of its output, conv2 adds its
  bias and x and also writes snake1 of the next step's input, so a step is two launches and a
  resblock one more for its first Snake; a resblock's last conv adds what its output is added to
  (the stage's input for the source branch, the running sum of the stage's resblocks) and
  divides the last sum by their count. About 96 launches a call, no per-shape planning.
* ``CudnnChannelsLastDecode``: cuDNN's convs over [B, C, 1, T] views of the same memory (its
  NHWC kernels, no transposes), each resblock step as the NCL path's fused kernels do it in
  channels-last (``triton_conv.snake`` with the causal padding and the previous conv's bias,
  ``bias_residual``), PyTorch's ops where no GPU is (tests).

The TF32 switch of the convs these replace (``torch.backends.cudnn.allow_tf32``) decides the
products' precision. ``decoder(hift, name)`` makes one by its profile name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cosybatch.codec.snake import snake_scales
from cosybatch.models.hift import CausalHiFTGenerator, ResBlock, Snake

def _convs(hift: CausalHiFTGenerator) -> list:
    convs = [hift.conv_pre, hift.conv_post, *hift.ups, *hift.source_downs]
    for rb in (*hift.source_resblocks, *hift.resblocks):
        convs += [*rb.convs1, *rb.convs2]
    return convs


def _check_source(hift: CausalHiFTGenerator, i: int, s_frames: int, frames: int) -> None:
    down = hift.source_downs[i]
    if (s_frames + down.causal_padding - down.kernel_size[0]) // down.stride[0] + 1 != frames:
        raise ValueError(f"source STFT of {s_frames} frames does not fit stage {i} ({frames})")


class TritonConvDecode:
    """The decode with ``triton_conv.conv1d`` (see the module docstring); weights are laid out
    once, here (later changes to the module's parameters are not seen)."""

    def __init__(self, hift: CausalHiFTGenerator) -> None:
        from cosybatch.codec import triton_conv

        self._tc = triton_conv
        self.hift = hift
        convs = _convs(hift)
        # float32 and TF32-rounded weights: the TF32 switch is read at each call
        self._w = {c: {tf32: triton_conv.conv_weight(c.weight, tf32) for tf32 in (False, True)} for c in convs}
        self._b = {c: c.bias.detach() for c in convs}
        self._scales = snake_scales(hift)

    def _conv(self, conv, x: torch.Tensor, t_out: int, **kw):
        tf32 = torch.backends.cudnn.allow_tf32
        return self._tc.conv1d(x, self._w[conv][tf32], self._b[conv], t_out=t_out, tf32=tf32, **kw)

    def _resblock(self, rb: ResBlock, x: torch.Tensor, valid: torch.Tensor | None, rate: int,
                  add: torch.Tensor | None = None, div: float | None = None) -> torch.Tensor:
        """``add + rb(x)`` (or ``rb(x)``), then ``/ div`` when given. The Snake outputs feed only
        the convs after them, so in TF32 they are stored rounded, and those convs read their
        tiles as loaded."""
        steps = list(zip(rb.convs1, rb.convs2, rb.activations1, rb.activations2))
        n = x.shape[1]
        tf32 = torch.backends.cudnn.allow_tf32
        a = self._tc.snake(x, *self._scales[steps[0][2]], tf32=tf32)
        for i, (c1, c2, _, s2) in enumerate(steps):
            y = self._conv(c1, a, n, shift=c1.causal_padding, dilation=c1.dilation[0], snake=self._scales[s2],
                           x_tf32=True, round_out=True, valid=valid, rate=rate)
            if i + 1 < len(steps):
                x, a = self._conv(c2, y, n, shift=c2.causal_padding, residual=x, x_tf32=True,
                                  snake_out=self._scales[steps[i + 1][2]], valid=valid, rate=rate)
            else:
                x = self._conv(c2, y, n, shift=c2.causal_padding, residual=x, add=add, div=div, x_tf32=True,
                               valid=valid, rate=rate)
        return x

    def decode_spec(self, mel: torch.Tensor, s_stft: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """mel [B, in, T] + source STFT [B, n_fft+2, up*T+1] -> conv_post output [B, n_fft+2, up*T+1].

        ``valid`` [B] (device, int64): the mel frames of each row whose outputs are wanted. The
        convs then skip the products of time tiles past a row's valid frames and two more
        (``triton_conv.VALID_MARGIN``: the last stage's reflection pad and the spectrum's last frame,
        up * valid, sit one position past them): padding rows and a short row's padded frames cost
        only their epilogues. Outputs inside the valid frames are those of the full decode, bit
        for bit: past ``conv_pre`` (which looks 4 frames right, inside the margin) every conv looks
        only left, so no output before a skipped tile reads it, and rates only grow along the
        stack (a stage's skip starts at ``rate`` times the frames where the last one's did)."""
        h = self.hift
        if valid is not None and valid.data_ptr() % 16:
            # Triton compiles a kernel variant per pointer alignment (16 bytes or not), and the
            # launch list compiled ahead holds aligned launches only (gpu/triton_cache.py): a row
            # of HiftRunner's [3, B] ints sits off that boundary when B is odd, and every conv's
            # unaligned variant was compiled inside a run's window on a fresh cache (~0.6 s each).
            valid = valid.clone()
        # right-causal conv_pre: zeros past the end
        x = self._conv(h.conv_pre, mel.contiguous(), mel.shape[2], x_cl=False, valid=valid)
        s_stft = s_stft.contiguous()
        rate = 1
        for i, up in enumerate(h.ups):
            rate *= up.scale
            x = self._conv(up, x, x.shape[1] * up.scale, shift=up.causal_padding, up=up.scale,
                           leaky=h.cfg.lrelu_slope, valid=valid, rate=rate)
            if i == h.num_upsamples - 1:  # F.pad(x, (1, 0), mode="reflect") along time
                x = torch.cat([x[:, 1:2], x], dim=1)
            down = h.source_downs[i]
            _check_source(h, i, s_stft.shape[2], x.shape[1])
            s = self._conv(down, s_stft, x.shape[1], shift=down.causal_padding, stride=down.stride[0], x_cl=False,
                           valid=valid, rate=rate)
            x = self._resblock(h.source_resblocks[i], s, valid, rate, add=x)
            blocks = h.resblocks[i * h.num_kernels:(i + 1) * h.num_kernels]
            xs = None
            for j, rb in enumerate(blocks):
                last = j == len(blocks) - 1
                xs = self._resblock(rb, x, valid, rate, add=xs, div=float(h.num_kernels) if last else None)
            x = xs
        # conv_post after F.leaky_relu's default slope (0.01, not lrelu_slope: official)
        return self._conv(h.conv_post, x, x.shape[1], shift=h.conv_post.causal_padding, leaky=0.01, y_cl=False,
                          valid=valid, rate=rate)


class CudnnChannelsLastDecode:
    """The decode with cuDNN's convs on channels-last memory (see the module docstring)."""

    def __init__(self, hift: CausalHiFTGenerator) -> None:
        self.hift = hift
        # [out, in, 1, K] channels-last: what cuDNN's NHWC kernels read
        self._w = {c: c.weight.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last) for c in _convs(hift)}
        self._scales = snake_scales(hift)
        self._tc = None
        if next(hift.parameters()).is_cuda:
            from cosybatch.codec import triton_conv

            self._tc = triton_conv

    def _conv(self, conv, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """conv of x [B, T + its padding, C] (padded by the caller) -> [B, T', C]."""
        x4 = x.permute(0, 2, 1).unsqueeze(2)  # [B, C, 1, T]: the same memory, channels-last
        y = F.conv2d(x4, self._w[conv], conv.bias if bias else None, stride=(1, conv.stride[0]),
                     dilation=(1, conv.dilation[0]))
        return y.squeeze(2).permute(0, 2, 1)  # [B, T', C], channels-last as cuDNN wrote it

    def _snake(self, x: torch.Tensor, s: Snake, pad: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Snake(x + bias) after ``pad`` zero rows."""
        if self._tc is not None:
            return self._tc.snake(x.contiguous(), *self._scales[s], pad=pad, bias=None if bias is None else bias.detach())
        if bias is not None:
            x = x + bias.detach()
        alpha, inv = self._scales[s]
        return F.pad(x + inv * torch.sin(x * alpha).pow(2), (0, 0, pad, 0))

    def _bias_residual(self, y: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self._tc is not None:
            return self._tc.bias_residual(y.contiguous(), bias.detach(), x.contiguous())
        return (y + bias.detach()) + x

    def _resblock(self, rb: ResBlock, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, s1, s2 in zip(rb.convs1, rb.convs2, rb.activations1, rb.activations2):
            y = self._conv(c1, self._snake(x, s1, c1.causal_padding), bias=False)
            y = self._conv(c2, self._snake(y, s2, c2.causal_padding, c1.bias), bias=False)
            x = self._bias_residual(y, c2.bias, x)
        return x

    def decode_spec(self, mel: torch.Tensor, s_stft: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """mel [B, in, T] + source STFT [B, n_fft+2, up*T+1] -> conv_post output [B, n_fft+2, up*T+1]
        (``valid`` as ``TritonConvDecode``'s, unused: cuDNN computes every position)."""
        h = self.hift
        x = self._conv(h.conv_pre, F.pad(mel.transpose(1, 2), (0, 0, 0, h.conv_pre.causal_padding)))
        s = s_stft.transpose(1, 2)
        for i, up in enumerate(h.ups):
            # nearest upsampling by repetition (F.interpolate's indices at these integer rates)
            x = F.leaky_relu(x, h.cfg.lrelu_slope).repeat_interleave(up.scale, dim=1)
            x = self._conv(up, F.pad(x, (0, 0, up.causal_padding, 0)))
            if i == h.num_upsamples - 1:  # F.pad(x, (1, 0), mode="reflect") along time
                x = torch.cat([x[:, 1:2], x], dim=1)
            down = h.source_downs[i]
            _check_source(h, i, s.shape[1], x.shape[1])
            x = x + self._resblock(h.source_resblocks[i], self._conv(down, F.pad(s, (0, 0, down.causal_padding, 0))))
            blocks = h.resblocks[i * h.num_kernels:(i + 1) * h.num_kernels]
            xs = self._resblock(blocks[0], x)
            for rb in blocks[1:]:
                xs = xs + self._resblock(rb, x)
            x = xs / h.num_kernels
        x = F.leaky_relu(x)  # default slope 0.01, not lrelu_slope (official)
        return self._conv(h.conv_post, F.pad(x, (0, 0, h.conv_post.causal_padding, 0))).transpose(1, 2).contiguous()


# optimizations.hift_convs -> the decode's class; cudnn: None, the model's own NCL path
DECODERS = {"cudnn": None, "cudnn_channels_last": CudnnChannelsLastDecode, "triton": TritonConvDecode}


def decoder(hift: CausalHiFTGenerator, name: str):
    """The decode named by ``optimizations.hift_convs``; None for ``cudnn`` (the model's own)."""
    if name not in DECODERS:
        raise ValueError(f"hift_convs must be one of {', '.join(DECODERS)}, got {name!r}")
    cls = DECODERS[name]
    return None if cls is None else cls(hift)
