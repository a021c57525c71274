"""The flow's per-frame conditioning for a whole packed call, in a fixed handful of kernels.

For every conv-layout frame of a conditional row: the prompt mel as ``cond`` (zero past the
prompt), ``mu`` from the speech tokens through the pre-lookahead layer, and the projected
speaker embedding; unconditional rows and gaps stay zero (CFG, design.md "The model"). The
pre-lookahead convolutions run once over all jobs' token windows packed back to back: each
window carries exactly the context the official per-request call sees (real look-ahead tokens,
or its zero right padding on a final call; real left context, or the zero left padding at a
row's start), and outputs that would mix two windows are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from cosybatch.gpu.hostcopy import h2d
from cosybatch.codec.packing import FlowLayout


@dataclass(frozen=True)
class JobInputs:
    """What the conditioning needs of one job."""

    tokens: np.ndarray  # prompt ‖ generated flow tokens the hop sees (look-ahead included)
    frames: int
    conv_start: int
    finalize: bool
    prompt_mel: torch.Tensor  # [P_mel, mel] on the device
    embedding: torch.Tensor  # [1, spk] on the device


def _arange_cat(starts, lens) -> np.ndarray:
    """concat(arange(s, s + n) for s, n in zip(starts, lens))."""
    lens = np.asarray(lens, dtype=np.int64)
    if lens.sum() == 0:
        return np.zeros(0, np.int64)
    offs = np.repeat(np.asarray(starts, dtype=np.int64) - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
    return offs + np.arange(lens.sum())


def mu_frames(flow, jobs: list[JobInputs], device) -> torch.Tensor:
    """mu [sum of (frames - conv_start), mel] float32: each job's frames [conv_start, frames)."""
    layer = flow.pre_lookahead_layer
    r = flow.cfg.token_mel_ratio
    look = layer.conv1.kernel_size[0] - 1  # tokens conv1 reads past the last output
    left = layer.conv2.kernel_size[0] - 1  # conv1 outputs conv2 reads before the first output
    ids, keep, h_src, res_src, out_src = [], [], [], [], []
    emb_off = tok_off = 0
    for j in jobs:
        n_mu = j.frames // r
        ta = j.conv_start // r  # first token whose mu is needed
        lo = max(0, ta - left)  # first token of the window
        real = min(len(j.tokens), n_mu + look) - lo
        width = n_mu + look - lo  # a final call pads its look-ahead with zeros (official)
        ids.append(j.tokens[lo : lo + real])
        ids.append(np.zeros(width - real, dtype=np.int64))
        keep.append(np.r_[np.ones(real, bool), np.zeros(width - real, bool)])
        # conv2's input for this job: zeros where the official call left-pads, then conv1's
        # outputs for tokens [lo, n_mu) (packed index emb_off + i <-> token lo + i)
        pad = left - (ta - lo)
        h_src.append(np.r_[np.full(pad, -1), emb_off + np.arange(n_mu - lo)])
        res_src.append(emb_off + np.arange(ta - lo, n_mu - lo))  # residual: embeddings of [ta, n_mu)
        # frame f of [conv_start, frames) takes token f // r, row (f // r - ta) of this job's outputs
        out_src.append(tok_off + np.arange(j.conv_start, j.frames) // r - ta)
        emb_off += width
        tok_off += n_mu - ta
    ids_t = h2d(torch.from_numpy(np.concatenate(ids).astype(np.int64)), device=device)
    keep_t = h2d(torch.from_numpy(np.concatenate(keep)), device=device)
    emb = flow.input_embedding(ids_t.clamp(min=0)) * keep_t[:, None]  # [T, C]
    h1 = F.leaky_relu(layer.conv1(emb.t().unsqueeze(0)))  # [1, H, T - look]
    h1 = torch.cat((h1, h1.new_zeros(h1.shape[:2] + (1,))), dim=2)  # index -1: a zero column
    hs = np.concatenate(h_src)
    hs[hs < 0] = h1.shape[2] - 1
    h2 = layer.conv2(h1.index_select(2, h2d(torch.from_numpy(hs), device=device)))  # [1, C, ...]
    # conv2 output m reads inputs [m, m + left]: job j's token ta lands at its h_src start
    starts = np.cumsum([0] + [len(s) for s in h_src[:-1]])
    rows = _arange_cat(starts, [len(s) - left for s in h_src])
    mu_tok = h2[0].t().index_select(0, h2d(torch.from_numpy(rows), device=device))
    mu_tok = mu_tok + emb.index_select(0, h2d(torch.from_numpy(np.concatenate(res_src)), device=device))
    return mu_tok.index_select(0, h2d(torch.from_numpy(np.concatenate(out_src)), device=device))


def static_inputs(flow, jobs: list[JobInputs], layout: FlowLayout, dtype, device) -> torch.Tensor:
    """[conv_len, 2 * mel + spk] = cond | mu | spk at the conditional rows' frames, else zero."""
    mel = flow.cfg.output_size
    lens = [j.frames - j.conv_start for j in jobs]
    conv_rows = _arange_cat(layout.conv_first[0], lens)
    # prompt mel rows of every job, then one zero row for frames past a prompt
    # prompt mels / embeddings are already on the device in the pipeline (the codec keeps a copy per row)
    pm = torch.cat([j.prompt_mel.to(device, torch.float32) for j in jobs] + [torch.zeros(1, mel, device=device)])
    pm_off = np.cumsum([0] + [j.prompt_mel.shape[0] for j in jobs[:-1]])
    src = []
    for j, off in zip(jobs, pm_off):
        f = np.arange(j.conv_start, j.frames)
        src.append(np.where(f < j.prompt_mel.shape[0], off + f, pm.shape[0] - 1))
    cond = pm.index_select(0, h2d(torch.from_numpy(np.concatenate(src)), device=device))
    spk = flow.speaker(torch.cat([j.embedding.to(device, torch.float32) for j in jobs]))  # [J, mel]
    spk = spk.index_select(0, h2d(torch.from_numpy(np.repeat(np.arange(len(jobs)), lens)), device=device))
    rows = torch.cat((cond, mu_frames(flow, jobs, device), spk), dim=1).to(dtype)
    static = torch.zeros(layout.conv_len, rows.shape[1], device=device, dtype=dtype)
    static.index_copy_(0, h2d(torch.from_numpy(conv_rows), device=device), rows)
    return static
