"""CAM++ inference with the dense TDNN part as GEMMs over [B, T, C]: same weights, same results.

``CAMPPlus.forward`` follows the official module structure: ~230 small convolutions over
[B, C, T]. On a GPU that is bound by per-call CPU cost (cuDNN calls cost ~50 us each on the
host) and by cuDNN's per-shape planning whenever a prompt length is new, so the first prompt
of a run was slow. Here, after the FCM head and the tdnn conv (kept as convolutions):

* 1x1 convs are ``F.linear`` on channels-last activations, with the bias and a following ReLU
  in the GEMM's epilogue; BatchNorms (eval) are one cached per-channel scale/shift (``addcmul``);
* the dilated k-tap ``linear_local`` conv is one GEMM giving every tap, then shifted adds
  (conv zero padding = no contribution past either end of a row);
* the context-aware gate depends only on the 100-frame segment a frame is in (global mean +
  segment mean, one averaging GEMM), so it is computed once per segment and gathered per frame;
* dense concatenation writes each layer's output into a preallocated channel slice instead of
  re-copying the growing tensor.

Padding rules are those of ``CAMPPlus``: taps past a row's end contribute zero, means count
valid frames only. ``tests/test_frontend_models.py`` checks this path against ``CAMPPlus`` and
onnxruntime.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from cosybatch.models.campplus import CAMPPlus
from cosybatch.models.masks import length_mask


def _bn(bn: nn.BatchNorm1d) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval BatchNorm as y = x * scale + shift."""
    scale = torch.rsqrt(bn.running_var + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight
    shift = -bn.running_mean * scale
    if bn.bias is not None:
        shift = shift + bn.bias
    return scale, shift


def _linear_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """relu(F.linear(x, w, b)) as one GEMM with the bias and ReLU in its epilogue (cuBLASLt on
    CUDA; on a CPU the same two steps): a kernel fewer per call, two per dense layer."""
    return torch._addmm_activation(b, x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], w.shape[0])


class _Plan:
    """What every dense layer of a batch shares: the valid-frame mask, the segment/global
    averaging matrix and each frame's segment."""

    def __init__(self, lengths: torch.Tensor, frames: int, seg_len: int, dtype, padded: bool):
        dev = lengths.device
        n_seg = -(-frames // seg_len)
        t = torch.arange(frames, device=dev)
        self.seg_of = t // seg_len  # [T]
        valid = t[None, :] < lengths[:, None]  # [B, T]
        in_seg = (self.seg_of[None, :] == torch.arange(n_seg, device=dev)[:, None])  # [S, T]
        w = (in_seg[None] & valid[:, None]).to(dtype)  # [B, S, T]
        avg = torch.cat([w / w.sum(-1, keepdim=True).clamp(min=1), valid[:, None].to(dtype) / lengths[:, None, None]], 1)
        self.avg = avg  # [B, S + 1, T]: segment means, then the global mean
        # what each dense layer's gate reads: its segment's mean plus the global mean, as one
        # averaging matrix (one GEMM a layer, not two products and their sum)
        self.ctx_avg = avg[:, :n_seg] + avg[:, n_seg:]  # [B, S, T]
        self.std_w = valid[:, None].to(dtype) / (lengths[:, None, None] - 1).to(dtype)  # unbiased, as torch.std
        self.keep = valid[:, :, None].to(dtype) if padded else None  # [B, T, 1]
        self.n_seg = n_seg


class CAMPPlusFast(nn.Module):
    """Wraps a loaded ``CAMPPlus``; ``forward(feats, lengths, padded)`` -> [B, embedding]."""

    def __init__(self, model: CAMPPlus, taps_gate: Callable | None = None):
        """``taps_gate``: a dense layer's tail as one fused call, ``taps_gate(z, gate, seg_of,
        keep, out, taps, dilation)`` writing what ``_local`` times the gathered gate gives (the
        frontend passes its Triton kernel on CUDA); None: those ops one by one."""
        super().__init__()
        self.model = model.eval()
        self.taps_gate = taps_gate
        self._folded: dict | None = None

    @property
    def cfg(self):
        return self.model.cfg

    def _apply(self, fn, recurse=True):
        self._folded = None  # device/dtype changed: fold again
        return super()._apply(fn, recurse)

    def _fold(self) -> dict:
        if self._folded is not None:
            return self._folded
        xv, cfg = self.model.xvector, self.cfg
        blocks = []
        for i in range(1, len(cfg.block_layers) + 1):
            layers = []
            for layer in getattr(xv, f"block{i}").children():
                cam = layer.cam_layer
                w = cam.linear_local.weight  # [G, C, k]: tap k reads frame t + (k - (K-1)/2) * dilation
                layers.append({
                    "bn": _bn(layer.nonlinear1.batchnorm), "w1": layer.linear1.weight[:, :, 0], "b1": layer.linear1.bias,
                    "local": w.permute(2, 0, 1).reshape(-1, w.shape[1]).contiguous(), "taps": w.shape[2],
                    "dilation": cam.linear_local.dilation[0], "wc1": cam.linear1.weight[:, :, 0], "bc1": cam.linear1.bias,
                    "wc2": cam.linear2.weight[:, :, 0], "bc2": cam.linear2.bias,
                })
            tr = getattr(xv, f"transit{i}")
            blocks.append((layers, _bn(tr.nonlinear.batchnorm), tr.linear.weight[:, :, 0], tr.linear.bias))
        self._folded = {"blocks": blocks, "dense_w": xv.dense.linear.weight[:, :, 0], "dense_bn": _bn(xv.dense.nonlinear.batchnorm)}
        return self._folded

    @staticmethod
    def _local(h: torch.Tensor, p: dict, plan: _Plan) -> torch.Tensor:
        """The dilated conv: every tap in one GEMM, then taps shifted into place."""
        g = p["local"].shape[0] // p["taps"]
        z = F.linear(h, p["local"])  # [B, T, taps * G]
        half, d, t = (p["taps"] - 1) // 2, p["dilation"], h.shape[1]
        y = z[..., half * g : (half + 1) * g].clone()
        for k in range(p["taps"]):
            s = (k - half) * d  # this tap reads frame t + s
            if s == 0 or abs(s) >= t:
                continue
            zk = z[..., k * g : (k + 1) * g]
            if s > 0:  # reads ahead: frames past a row's end are zero padding
                y[:, : t - s] += zk[:, s:] if plan.keep is None else (zk * plan.keep)[:, s:]
            else:
                y[:, -s:] += zk[:, : t + s]
        return y

    def _dense_layer(self, buf: torch.Tensor, cin: int, p: dict, plan: _Plan) -> None:
        scale, shift = p["bn"]
        h = torch.addcmul(shift, buf[..., :cin], scale).relu_()
        h = _linear_relu(h, p["w1"], p["b1"])
        ctx = torch.matmul(plan.ctx_avg, h)  # [B, S, C]: segment mean + global mean
        gate = torch.sigmoid(F.linear(_linear_relu(ctx, p["wc1"], p["bc1"]), p["wc2"], p["bc2"]))
        out = buf[..., cin : cin + p["local"].shape[0] // p["taps"]]
        if self.taps_gate is not None:
            self.taps_gate(F.linear(h, p["local"]), gate, plan.seg_of, plan.keep, out, p["taps"], p["dilation"])
            return
        torch.mul(self._local(h, p, plan), gate.index_select(1, plan.seg_of), out=out)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor, padded: bool | None = None) -> torch.Tensor:
        m, cfg = self.model, self.cfg
        if feats.dim() != 3 or feats.shape[2] != cfg.feat_dim:
            raise ValueError(f"expected feats [B, T, {cfg.feat_dim}], got {tuple(feats.shape)}")
        dtype = m.head.conv1.weight.dtype
        lengths = lengths.to(device=feats.device, dtype=torch.long)
        x = feats.to(dtype).transpose(1, 2)
        if padded is None:
            padded = bool((lengths < x.shape[2]).any())
        keep = length_mask(lengths, x.shape[2]).to(dtype)[:, None, None, :] if padded else None
        x = m.xvector.tdnn(m.head(x, keep), None if keep is None else keep[:, 0])  # [B, C, T']
        lengths = m.xvector.tdnn.out_lengths(lengths)
        plan = _Plan(lengths, x.shape[2], cfg.seg_len, dtype, padded)
        folded = self._fold()
        x = x.transpose(1, 2)  # channels-last from here: [B, T', C]
        blocks = folded["blocks"]
        for i, (layers, (scale, shift), wt, bt) in enumerate(blocks):
            cin = x.shape[-1]
            buf = x.new_empty(x.shape[0], x.shape[1], cin + len(layers) * cfg.growth)
            buf[..., :cin] = x
            for j, p in enumerate(layers):
                self._dense_layer(buf, cin + j * cfg.growth, p, plan)
            h = torch.addcmul(shift, buf, scale).relu_()
            # transit: [B, T', C / 2]; after the last, out_nonlinear's ReLU (its BatchNorm is
            # folded into that transit) in the GEMM's epilogue
            x = _linear_relu(h, wt, bt) if i == len(blocks) - 1 else F.linear(h, wt, bt)
        mean = torch.matmul(plan.avg[:, plan.n_seg :], x)  # [B, 1, C]
        std = torch.matmul(plan.std_w, (x - mean).square_()).sqrt_()
        emb = F.linear(torch.cat([mean, std], -1)[:, 0], folded["dense_w"])
        scale, shift = folded["dense_bn"]
        return torch.addcmul(shift, emb, scale)


__all__ = ["CAMPPlusFast"]
