"""Random-weight ``speech_tokenizer_v3.onnx`` and ``campplus.onnx`` with the official structure.

The graphs are the official models' (S3TokenizerV3 and CAM++, written by ``onnx_tokenizer`` /
``onnx_campplus`` with the official node naming and I/O contract), so they cost what the real
files cost and a loader written for the official files reads them. ``full`` has the official
dimensions (tokenizer 242,009,608 parameters, ~970 MB fp32); ``tiny`` and ``small`` are scaled
down (head size 64 and the FSMN/rotary/FSQ layout kept) for CI and CPU runs.

Random weights are made usable:

* tokenizer: matrices N(0, 1/fan_in), biases N(0, 0.02^2), LayerNorm gains 1 + N(0, 0.1^2);
  then the FSQ projection is calibrated on speech-like prompts so each of its 8 ternary digits
  is centred and balanced (a third of the frames per value): codes spread over the codebook
  instead of collapsing onto a few. Tokenizing stays a deterministic function of the features.
* CAM++: He-normal convs; every BatchNorm (standalone, or folded into the conv before it) is
  set to the statistics of its input on the same prompts, the way BatchNorm statistics come
  from data, so activations keep unit scale through the 52 dense layers. The last BatchNorm
  only rescales (embedding RMS ~1) and does not remove the across-prompt mean, which would
  amplify rounding differences between implementations.

The calibration prompts are features (reference float32 functions) of deterministic
speech-like audio; the models run in float64 for it and the results are rounded to float32.
Files are identical for a seed on one machine; on another CPU a calibrated value can differ in
its last bit (float32 FFT rounding reaches it), never in anything a test or benchmark sees.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from cosybatch.models.campplus import CAMPPlus, CAMPPlusConfig
from cosybatch.models.s3tokenizer import FSQ_SCALE, S3TokenizerConfig, S3TokenizerV3

TOKENIZER_SIZES = {
    "tiny": S3TokenizerConfig(dim=128, heads=2, layers=2),
    "small": S3TokenizerConfig(dim=256, heads=4, layers=4),
    "full": S3TokenizerConfig(),  # 1280 wide, 20 heads, 12 blocks
}
CAMPPLUS_SIZES = {
    "tiny": CAMPPlusConfig(m_channels=8, init_channels=32, growth=8, bn_channels=16, cam_hidden=8, block_layers=(2, 2, 2)),
    "small": CAMPPlusConfig(m_channels=16, init_channels=64, growth=16, bn_channels=64, cam_hidden=32,
                            block_layers=(4, 6, 4)),
    "full": CAMPPlusConfig(),  # 3D-Speaker CAM++: blocks of 12/24/16 layers, growth 32
}
_CALIB_SECONDS = {"tiny": (3.0, 4.0, 5.0, 6.0), "small": (3.0, 4.0, 5.0, 6.0), "full": (3.0, 4.0)}
_CAMPPLUS_CALIB_ROWS = {"tiny": 4, "small": 8, "full": 8}  # float64 2-D convs are slow on a CPU
_DIGIT_EDGE = math.atanh(0.5 / FSQ_SCALE)  # |projection| below this rounds to the middle digit


def _generator(seed: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + salt) % (2**63))


def _calibration_audio(size: str, seed: int, rows: int | None = None) -> list[torch.Tensor]:
    """16 kHz speech-like float32 prompts [1, n], all of one length (batches without padding)."""
    from cosybatch.checkpoint.synthetic_audio import speech_like

    secs = _CALIB_SECONDS[size]
    n = rows or len(secs)
    length = int(16000 * min(secs))
    return [torch.from_numpy(speech_like(secs[i % len(secs)], 16000, seed * 7919 + i)[:length].astype(np.float32))[None]
            for i in range(n)]


def _stack(feats: list[torch.Tensor], time_axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal-length per-prompt features [1, ...] -> a batch and its (full) lengths."""
    return torch.cat(feats), torch.full((len(feats),), feats[0].shape[time_axis], dtype=torch.long)


# ---- tokenizer ---------------------------------------------------------------------------
def _init_tokenizer(model: S3TokenizerV3, g: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("ln.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))


def _calibrate_fsq(model: S3TokenizerV3, feats: torch.Tensor, lengths: torch.Tensor) -> None:
    """Centre each FSQ digit's projection on its median and scale it so a third of the frames
    fall in the middle digit (and a third on each side)."""
    m64 = model.double()
    with torch.no_grad():
        hidden, tl = m64.encode(feats.double(), lengths)
        valid = torch.arange(hidden.shape[1])[None, :] < tl[:, None]
        h = hidden[valid]  # [frames, dim]
        proj = m64.quantizer.project_in
        z = h @ proj.weight.T + proj.bias
        med = z.median(dim=0).values
        spread = (z - med).abs().quantile(1.0 / 3.0, dim=0).clamp(min=1e-12)
        gain = _DIGIT_EDGE / spread
        proj.weight.mul_(gain[:, None])
        proj.bias.copy_((proj.bias - med) * gain)
    model.float()


def random_tokenizer(size: str, seed: int) -> S3TokenizerV3:
    from cosybatch.audio import whisper_log_mel

    cfg = TOKENIZER_SIZES[size]
    model = S3TokenizerV3(cfg).eval()
    _init_tokenizer(model, _generator(seed, 0x70C))
    feats = [whisper_log_mel(w, n_mels=cfg.n_mels) for w in _calibration_audio(size, seed)]  # [1, 128, T]
    _calibrate_fsq(model, *_stack(feats, 2))
    return model


# ---- CAM++ -------------------------------------------------------------------------------
def _init_campplus(model: CAMPPlus, g: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "batchnorm" in name:
                p.copy_((1 + 0.1 * torch.randn(p.shape, generator=g)) if name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * math.sqrt(2.0 / p[0].numel()))


def _is_folded_conv(name: str, module: torch.nn.Module) -> bool:
    """Convs standing for conv + BatchNorm in the official model (they carry the bias)."""
    return isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d)) and module.bias is not None and ".cam_layer." not in name


def _calibrate_campplus(model: CAMPPlus, feats: torch.Tensor, lengths: torch.Tensor, g: torch.Generator) -> None:
    """One forward pass in float64 in which each BatchNorm, and each conv standing for
    conv + BatchNorm, is normalised with the statistics of what reaches it (hooks run in
    forward order, so every layer sees already-calibrated inputs)."""
    m64 = model.double()
    hooks = []
    dense_bn = m64.xvector.dense.nonlinear.batchnorm

    def bn_pre(mod, args):
        x = args[0]
        dims = [d for d in range(x.dim()) if d != 1]
        if mod is dense_bn:  # rescale only: keep each prompt's offset, unit overall RMS
            mod.running_mean.zero_()
            mod.running_var.fill_(float(x.pow(2).mean()))
        else:
            mod.running_mean.copy_(x.mean(dims))
            mod.running_var.copy_(x.var(dims, unbiased=False))

    def conv_post(mod, args, out):
        dims = [d for d in range(out.dim()) if d != 1]
        mu, sd = out.mean(dims), out.std(dims).clamp(min=1e-6)
        gamma = 1 + 0.1 * torch.randn(mu.shape, generator=g, dtype=mu.dtype)
        beta = 0.1 * torch.randn(mu.shape, generator=g, dtype=mu.dtype)
        scale = gamma / sd
        shape = (-1,) + (1,) * (out.dim() - 2)
        mod.weight.mul_(scale.view(-1, *([1] * (mod.weight.dim() - 1))))
        mod.bias.copy_((mod.bias - mu) * scale + beta)
        return (out - mu.view(shape)) * scale.view(shape) + beta.view(shape)

    for name, mod in m64.named_modules():
        if isinstance(mod, torch.nn.BatchNorm1d):
            hooks.append(mod.register_forward_pre_hook(bn_pre))
        elif _is_folded_conv(name, mod):
            hooks.append(mod.register_forward_hook(conv_post))
    try:
        with torch.no_grad():
            m64(feats.double(), lengths)
    finally:
        for h in hooks:
            h.remove()
    model.float()


def random_campplus(size: str, seed: int) -> CAMPPlus:
    from cosybatch.audio import kaldi_fbank

    cfg = CAMPPLUS_SIZES[size]
    model = CAMPPlus(cfg).eval()
    g = _generator(seed, 0xCA3)
    _init_campplus(model, g)
    audio = _calibration_audio(size, seed, _CAMPPLUS_CALIB_ROWS[size])
    fbank = [kaldi_fbank(w, num_mel_bins=cfg.feat_dim)[None] for w in audio]  # [1, T, 80]
    _calibrate_campplus(model, *_stack(fbank, 1), g)
    return model


# ---- files -------------------------------------------------------------------------------
def write_onnx_standins(out_dir: Path, seed: int, size: str = "tiny") -> None:
    """Write ``speech_tokenizer_v3.onnx`` and ``campplus.onnx`` of ``size`` into ``out_dir``."""
    from cosybatch.checkpoint.onnx_campplus import campplus_graph
    from cosybatch.checkpoint.onnx_graph import save_atomic
    from cosybatch.checkpoint.onnx_tokenizer import tokenizer_graph

    key = size.lower()
    if key not in TOKENIZER_SIZES:
        raise ValueError(f"unknown frontend size {size!r}; choose one of {sorted(TOKENIZER_SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = random_tokenizer(key, seed)
    # the checker serialises the whole model again; at ~1 GB that is slow and adds nothing
    save_atomic(tokenizer_graph(tok.state_dict(), tok.cfg, check=key != "full"), out / "speech_tokenizer_v3.onnx")
    del tok
    cam = random_campplus(key, seed)
    save_atomic(campplus_graph(cam.state_dict(), cam.cfg), out / "campplus.onnx")


__all__ = ["write_onnx_standins", "random_tokenizer", "random_campplus", "TOKENIZER_SIZES", "CAMPPLUS_SIZES"]
