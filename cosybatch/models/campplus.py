"""CAM++ (3D-Speaker's CAMPPlus): the speaker-embedding model of ``campplus.onnx``, in PyTorch.

Input: 80-bin Kaldi fbank with the per-bin time mean removed, [B, T, 80]; output the 192-d
x-vector. Structure (module names = the official state-dict / ONNX scope names):

* ``head`` (FCM): a 2-D ResNet over (frequency, time): ``conv1`` 3x3, ``layer1``/``layer2`` of
  basic residual blocks (the first of each halves the frequency axis and has a 1x1
  ``shortcut.0``), ``conv2`` 3x3 with frequency stride 2; flattened to channels x freq/8 rows;
* ``xvector.tdnn``: conv k5 stride 2 (time 100 -> 50 Hz) + ReLU;
* ``xvector.block{i}.tdnnd{j}``: densely connected TDNN layers: BN-ReLU, 1x1 ``linear1``, ReLU,
  then a context-aware masking ``cam_layer``: a dilated k3 conv ``linear_local`` gated by
  sigmoid(linear2(relu(linear1(global mean + 100-frame segment means)))); each layer's output
  is concatenated to its input; ``xvector.transit{i}`` (BN-ReLU-1x1 conv) halves the channels;
* ``xvector.out_nonlinear`` BN-ReLU, mean + unbiased std pooling over time, ``xvector.dense``:
  1x1 conv and an affine-free BatchNorm.

The official export folds each BatchNorm that directly follows a conv into that conv (weights
and a bias): those convs carry a bias here and have no BatchNorm (FCM convs, ``tdnn.linear``,
each ``tdnnd{j}.linear1`` with its nonlinear2 BN, the last transit conv with out_nonlinear's). BatchNorms that precede a
conv stay BatchNorms. Modules are called the way the official ones are (``xvector`` and the
FCM layers as containers with a forward, ReLU/Sigmoid as modules), so an ONNX export of this
module names its nodes like the official file.

Padding: the official model has no lengths (one prompt per call). Here rows carry lengths:
every conv that mixes time frames sees zeros past a row's end (as the conv's own zero padding
does for a row alone), and the global/segment means and the statistics pooling count valid
frames only, so a row's embedding does not depend on its batch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from cosybatch.models.masks import length_mask


@dataclass(frozen=True)
class CAMPPlusConfig:
    feat_dim: int = 80
    m_channels: int = 32
    fcm_blocks: tuple[int, int] = (2, 2)
    init_channels: int = 128
    tdnn_kernel: int = 5
    growth: int = 32
    bn_channels: int = 128  # bn_size (4) x growth
    cam_hidden: int = 64  # bn_channels // reduction (2)
    block_layers: tuple[int, ...] = (12, 24, 16)
    dilations: tuple[int, ...] = (1, 2, 2)
    kernel: int = 3
    seg_len: int = 100
    embedding: int = 192
    bn_eps: float = 1e-5

    @property
    def fcm_freq(self) -> int:
        f = self.feat_dim
        for _ in range(3):  # layer1, layer2 and conv2 each halve it (k3, pad 1, stride 2)
            f = (f - 1) // 2 + 1
        return f

    @property
    def fcm_out(self) -> int:
        return self.m_channels * self.fcm_freq


def masked(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """x with padded frames zeroed; ``keep`` None means nothing is padded."""
    return x if keep is None else x * keep


def _relu() -> nn.Sequential:
    return nn.Sequential(OrderedDict(relu=nn.ReLU()))


def _bn_relu(channels: int, eps: float) -> nn.Sequential:
    return nn.Sequential(OrderedDict(batchnorm=nn.BatchNorm1d(channels, eps=eps), relu=nn.ReLU()))


class ResBlock2d(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=(stride, 1), padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=(stride, 1)))

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        out = F.relu(self.conv1(masked(x, keep)))
        out = self.conv2(masked(out, keep))
        return F.relu(out + (x if self.shortcut is None else self.shortcut(x)))


class ResLayer(nn.ModuleList):
    def __init__(self, channels: int, blocks: int):
        super().__init__(ResBlock2d(channels, channels, 2 if i == 0 else 1) for i in range(blocks))

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        for block in self:
            x = block(x, keep)
        return x


class FCM(nn.Module):
    def __init__(self, cfg: CAMPPlusConfig):
        super().__init__()
        m = cfg.m_channels
        self.conv1 = nn.Conv2d(1, m, 3, stride=1, padding=1)
        self.layer1 = ResLayer(m, cfg.fcm_blocks[0])
        self.layer2 = ResLayer(m, cfg.fcm_blocks[1])
        self.conv2 = nn.Conv2d(m, m, 3, stride=(2, 1), padding=1)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """x [B, F, T], keep [B, 1, 1, T] or None -> [B, m * F/8, T]."""
        out = F.relu(self.conv1(masked(x[:, None], keep)))
        out = self.layer2(self.layer1(out, keep), keep)
        out = F.relu(self.conv2(masked(out, keep)))
        return out.flatten(1, 2)


class TDNNLayer(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__()
        self.linear = nn.Conv1d(cin, cout, kernel, stride=stride, padding=(kernel - 1) // 2)
        self.nonlinear = _relu()  # its BatchNorm is folded into ``linear``

    def forward(self, x, keep):
        return self.nonlinear(self.linear(masked(x, keep)))

    def out_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        c = self.linear
        return (lengths + 2 * c.padding[0] - c.dilation[0] * (c.kernel_size[0] - 1) - 1) // c.stride[0] + 1


class TimeStats:
    """Per-batch helpers for masked means over time: whole row and ``seg_len`` segments."""

    def __init__(self, lengths: torch.Tensor, frames: int, seg_len: int, dtype: torch.dtype):
        self.keep = length_mask(lengths, frames)[:, None].to(dtype)  # [B, 1, T]
        self.count = lengths.to(dtype)[:, None, None]  # [B, 1, 1]
        self.frames, self.seg_len = frames, seg_len
        n_seg = -(-frames // seg_len)
        starts = torch.arange(n_seg, device=lengths.device) * seg_len
        per_seg = (lengths[:, None] - starts[None, :]).clamp(0, seg_len)  # valid frames per segment
        self.seg_count = per_seg.clamp(min=1).to(dtype)[:, None, :]  # [B, 1, S]

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.keep).sum(-1, keepdim=True) / self.count

    def segment_means(self, x: torch.Tensor) -> torch.Tensor:
        """avg_pool1d(kernel=stride=seg_len, ceil_mode) over valid frames, repeated per frame."""
        n_seg = self.seg_count.shape[-1]
        xm = F.pad(x * self.keep, (0, n_seg * self.seg_len - self.frames))
        seg = xm.unflatten(-1, (n_seg, self.seg_len)).sum(-1) / self.seg_count
        return seg.repeat_interleave(self.seg_len, dim=-1)[..., : self.frames]


class CAMLayer(nn.Module):
    def __init__(self, cfg: CAMPPlusConfig, dilation: int):
        super().__init__()
        c = cfg.bn_channels
        pad = (cfg.kernel - 1) // 2 * dilation
        self.linear_local = nn.Conv1d(c, cfg.growth, cfg.kernel, padding=pad, dilation=dilation, bias=False)
        self.linear1 = nn.Conv1d(c, cfg.cam_hidden, 1)
        self.linear2 = nn.Conv1d(cfg.cam_hidden, cfg.growth, 1)
        self.relu = nn.ReLU()
        self.sigmoid = nn.Sigmoid()

    def forward(self, x: torch.Tensor, ts: TimeStats) -> torch.Tensor:
        y = self.linear_local(x * ts.keep)
        context = ts.mean(x) + ts.segment_means(x)
        return y * self.sigmoid(self.linear2(self.relu(self.linear1(context))))


class DenseTDNNLayer(nn.Module):
    def __init__(self, cfg: CAMPPlusConfig, cin: int, dilation: int):
        super().__init__()
        self.nonlinear1 = _bn_relu(cin, cfg.bn_eps)
        self.linear1 = nn.Conv1d(cin, cfg.bn_channels, 1)  # + the folded nonlinear2 BatchNorm
        self.nonlinear2 = _relu()
        self.cam_layer = CAMLayer(cfg, dilation)

    def forward(self, x: torch.Tensor, ts: TimeStats) -> torch.Tensor:
        return self.cam_layer(self.nonlinear2(self.linear1(self.nonlinear1(x))), ts)


class DenseTDNNBlock(nn.Module):
    def __init__(self, cfg: CAMPPlusConfig, cin: int, layers: int, dilation: int):
        super().__init__()
        for j in range(layers):
            self.add_module(f"tdnnd{j + 1}", DenseTDNNLayer(cfg, cin + j * cfg.growth, dilation))

    def forward(self, x: torch.Tensor, ts: TimeStats) -> torch.Tensor:
        for layer in self.children():
            x = torch.cat([x, layer(x, ts)], dim=1)
        return x


class TransitLayer(nn.Module):
    def __init__(self, cin: int, cout: int, eps: float, folded_bn: bool = False):
        super().__init__()
        self.nonlinear = _bn_relu(cin, eps)
        self.linear = nn.Conv1d(cin, cout, 1, bias=folded_bn)

    def forward(self, x):
        return self.linear(self.nonlinear(x))


class DenseLayer(nn.Module):
    def __init__(self, cin: int, cout: int, eps: float):
        super().__init__()
        self.linear = nn.Conv1d(cin, cout, 1, bias=False)
        self.nonlinear = nn.Sequential(OrderedDict(batchnorm=nn.BatchNorm1d(cout, eps=eps, affine=False)))

    def forward(self, x):  # [B, C] -> [B, cout]
        return self.nonlinear(self.linear(x[:, :, None])[:, :, 0])


class StatsPool(nn.Module):
    def forward(self, x: torch.Tensor, ts: "TimeStats") -> torch.Tensor:
        """Mean and unbiased std (as torch.std) over each row's valid frames: [B, 2C]."""
        mean = ts.mean(x)
        var = (((x - mean) * ts.keep) ** 2).sum(-1) / (ts.count[:, :, 0] - 1)
        return torch.cat([mean[:, :, 0], var.sqrt()], dim=1)


class XVector(nn.Module):
    """tdnn, block{i} + transit{i}, out_nonlinear, stats, dense (children registered in order)."""

    def __init__(self, cfg: CAMPPlusConfig):
        super().__init__()
        self.cfg = cfg
        self.tdnn = TDNNLayer(cfg.fcm_out, cfg.init_channels, cfg.tdnn_kernel, 2)
        ch = cfg.init_channels
        n = len(cfg.block_layers)
        for i, (layers, dilation) in enumerate(zip(cfg.block_layers, cfg.dilations), start=1):
            self.add_module(f"block{i}", DenseTDNNBlock(cfg, ch, layers, dilation))
            ch += layers * cfg.growth
            # the last transit conv feeds only out_nonlinear's BatchNorm, which the export folds into it
            self.add_module(f"transit{i}", TransitLayer(ch, ch // 2, cfg.bn_eps, folded_bn=i == n))
            ch //= 2
        self.out_nonlinear = _relu()
        self.stats = StatsPool()
        self.dense = DenseLayer(2 * ch, cfg.embedding, cfg.bn_eps)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.tdnn(x, keep)
        lengths = self.tdnn.out_lengths(lengths)
        ts = TimeStats(lengths, x.shape[2], self.cfg.seg_len, x.dtype)
        for i in range(1, len(self.cfg.block_layers) + 1):
            x = getattr(self, f"transit{i}")(getattr(self, f"block{i}")(x, ts))
        return self.dense(self.stats(self.out_nonlinear(x), ts))


class CAMPPlus(nn.Module):
    def __init__(self, cfg: CAMPPlusConfig = CAMPPlusConfig()):
        super().__init__()
        if len(cfg.block_layers) != len(cfg.dilations):
            raise ValueError("one dilation per dense block")
        self.cfg = cfg
        self.head = FCM(cfg)
        self.xvector = XVector(cfg)

    def init_buffers(self) -> None:
        """Zero the BatchNorm step counters (state the ONNX files do not carry)."""
        for m in self.modules():
            if isinstance(m, nn.BatchNorm1d) and m.num_batches_tracked is not None:
                m.num_batches_tracked = torch.zeros((), dtype=torch.long)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """feats [B, T, feat_dim] (zero past each row's length), lengths [B] -> [B, embedding]."""
        if feats.dim() != 3 or feats.shape[2] != self.cfg.feat_dim:
            raise ValueError(f"expected feats [B, T, {self.cfg.feat_dim}], got {tuple(feats.shape)}")
        dtype = self.head.conv1.weight.dtype
        lengths = lengths.to(device=feats.device, dtype=torch.long)
        x = feats.to(dtype).transpose(1, 2)
        keep = length_mask(lengths, x.shape[2]).to(dtype)[:, None, None, :]
        return self.xvector(self.head(x, keep), lengths, keep[:, 0])


__all__ = ["CAMPPlus", "CAMPPlusConfig"]
