"""HiFT's decode stack channels-last, every convolution one Triton launch (``codec.triton_conv``).

``HiftConvs.decode_spec(mel, s_stft)`` is ``CausalHiFTGenerator.decode_spec(mel, s_stft,
finalize=True)`` (the form ``HiftRunner`` decodes every batch in), walked over the same modules
in the same order, with the activations and adds folded into the convs:

* a LeakyReLU into the conv after it (``ups``, ``conv_post``);
* in a resblock step ``x + conv2(snake2(conv1(snake1(x))))``: conv1 writes snake2 of its
  output, conv2 adds its bias and x and also writes snake1 of the next step's input, so a
  step is two launches, and a resblock one more for its first Snake;
* a resblock's last conv adds what its output is added to (the stage's input for the source
  branch, the running sum of the stage's resblocks) and divides the last sum by their count.

Between the convs the activations stay channels-last [B, T, C]: the first conv reads the NCL
mel, the source convs the NCL source STFT, and ``conv_post`` writes NCL for the ISTFT, so no
layout transposes. About 96 launches per call at the full size, against ~720 for the cuDNN path,
and no per-shape planning. The TF32 switch of the convs it replaces
(``torch.backends.cudnn.allow_tf32``) decides the products' precision.
"""

from __future__ import annotations

import torch

from cosybatch.models.hift import CausalHiFTGenerator, ResBlock, Snake


class HiftConvs:
    """The Triton decode of one ``CausalHiFTGenerator``; weights are laid out once, here (later
    changes to the module's parameters are not seen)."""

    def __init__(self, hift: CausalHiFTGenerator) -> None:
        from cosybatch.codec import triton_conv

        self._tc = triton_conv
        self.hift = hift
        convs = [hift.conv_pre, hift.conv_post, *hift.ups, *hift.source_downs]
        for rb in (*hift.source_resblocks, *hift.resblocks):
            convs += [*rb.convs1, *rb.convs2]
        # float32 and TF32-rounded weights: the TF32 switch is read at each call
        self._w = {c: {tf32: triton_conv.conv_weight(c.weight, tf32) for tf32 in (False, True)} for c in convs}
        self._b = {c: c.bias.detach() for c in convs}
        # the eager Snake's expression for its scale, computed by PyTorch as there
        self._alphas = {m: (m.alpha.detach(), 1.0 / (m.alpha.detach() + 1e-9))
                        for m in hift.modules() if isinstance(m, Snake)}

    def _conv(self, conv, x: torch.Tensor, t_out: int, **kw):
        tf32 = torch.backends.cudnn.allow_tf32
        return self._tc.conv1d(x, self._w[conv][tf32], self._b[conv], t_out=t_out, tf32=tf32, **kw)

    def _resblock(self, rb: ResBlock, x: torch.Tensor, add: torch.Tensor | None = None,
                  div: float | None = None) -> torch.Tensor:
        """``add + rb(x)`` (or ``rb(x)``), then ``/ div`` when given; x channels-last."""
        steps = list(zip(rb.convs1, rb.convs2, rb.activations1, rb.activations2))
        n = x.shape[1]
        a = self._tc.snake(x, *self._alphas[steps[0][2]])
        for i, (c1, c2, _, s2) in enumerate(steps):
            y = self._conv(c1, a, n, shift=c1.causal_padding, dilation=c1.dilation[0], snake=self._alphas[s2])
            if i + 1 < len(steps):
                x, a = self._conv(c2, y, n, shift=c2.causal_padding, residual=x,
                                  snake_out=self._alphas[steps[i + 1][2]])
            else:
                x = self._conv(c2, y, n, shift=c2.causal_padding, residual=x, add=add, div=div)
        return x

    def decode_spec(self, mel: torch.Tensor, s_stft: torch.Tensor) -> torch.Tensor:
        """mel [B, in, T] + source STFT [B, n_fft+2, up*T+1] -> conv_post output [B, n_fft+2, up*T+1]."""
        h = self.hift
        # right-causal conv_pre: zeros past the end
        x = self._conv(h.conv_pre, mel.contiguous(), mel.shape[2], x_cl=False)
        s_stft = s_stft.contiguous()
        for i, up in enumerate(h.ups):
            x = self._conv(up, x, x.shape[1] * up.scale, shift=up.causal_padding, up=up.scale,
                           leaky=h.cfg.lrelu_slope)
            if i == h.num_upsamples - 1:  # F.pad(x, (1, 0), mode="reflect") along time
                x = torch.cat([x[:, 1:2], x], dim=1)
            down = h.source_downs[i]
            stride, k = down.stride[0], down.kernel_size[0]
            if (s_stft.shape[2] + down.causal_padding - k) // stride + 1 != x.shape[1]:
                raise ValueError(f"source STFT of {s_stft.shape[2]} frames does not fit stage {i} ({x.shape[1]})")
            s = self._conv(down, s_stft, x.shape[1], shift=down.causal_padding, stride=stride, x_cl=False)
            x = self._resblock(h.source_resblocks[i], s, add=x)
            blocks = h.resblocks[i * h.num_kernels:(i + 1) * h.num_kernels]
            xs = None
            for j, rb in enumerate(blocks):
                last = j == len(blocks) - 1
                xs = self._resblock(rb, x, add=xs, div=float(h.num_kernels) if last else None)
            x = xs
        # conv_post after F.leaky_relu's default slope (0.01, not lrelu_slope: official)
        return self._conv(h.conv_post, x, x.shape[1], shift=h.conv_post.causal_padding, leaky=0.01, y_cl=False)
