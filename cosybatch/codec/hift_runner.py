"""HiFT for many requests: bounded per-request streaming state, decode batched across requests.

The official stream re-vocodes the whole mel history at every chunk and emits the samples
past the previous end (``reference.token2wav.HiftStream``). The new samples depend on the
history only through

* a bounded receptive field to the left: the F0 predictor's left-causal convs, and the
  decoder's left-causal convs, upsamplers, resblocks, STFT/ISTFT windows (all computed
  from the module, ``left_context``);
* the sine phase, a running sum of per-frame phase increments over *all* frames: kept per
  request as a float64 accumulator, continued with the same sequential sum the official
  ``cumsum`` performs, so it is exact rather than approximately re-derived;
* the fixed noise table, indexed by absolute sample position: an offset.

So each request keeps only the last ``left_context`` + look-ahead mel frames, its phase
accumulator (float64, one value per harmonic) and its counters, and a chunk costs
O(new frames). The right edge of the window is the right edge of the history, so the
finalize/look-ahead behaviour is the official one unchanged.

Batching: windows of different requests are right-padded with zeros and decoded together.
Every conv that reads to the right reads only real frames or the zeros the official code
pads with (F0's and conv_pre's look-ahead); the source STFT reflects at each row's own end;
the ISTFT masks each row's frames and uses its own envelope (``CachedISTFT``). Rows are
grouped by window length to bound padding. The host plans a batch into device tensors
(windows, noise rows, phase starts and accumulators, valid lengths, envelopes); everything
after that, F0 through the waveform (``vocode``), is one function of them, which the optional
``GraphCache`` replays from a graph per (rows, frames) bucket.
"""

from __future__ import annotations

import copy
import functools

import math
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

import torch
import torch.nn.functional as F

from cosybatch.gpu.graph_cache import GraphCache
from cosybatch.codec.hift_convs import decoder
from cosybatch.codec.istft import CachedISTFT
from cosybatch.codec.f0_gemm import F0Gemm
from cosybatch.codec.snake import SnakePad
from cosybatch.gpu.hostcopy import h2d
from cosybatch.models import noise as noise_tables
from cosybatch.models.hift import CausalHiFTGenerator


@dataclass(frozen=True)
class HiftJob:
    """New mel frames [1, in, F] of one request's chunk; ``finalize`` on its last chunk."""

    segment_id: Hashable
    mel: torch.Tensor
    finalize: bool


def _resblock_rf(block) -> int:
    return sum(c.causal_padding for c in block.convs1) + sum(c.causal_padding for c in block.convs2)


def left_context(hift: CausalHiFTGenerator) -> tuple[int, int]:
    """(F0 frames, decode frames) of left context that make a window's output exact.

    Summed over every left-looking piece (an upper bound: parallel branches are added,
    not maxed), in mel frames, rounded up, plus one frame of margin.
    """
    cfg = hift.cfg
    f0_ctx = sum(m.causal_padding for m in hift.f0_predictor.condnet
                 if getattr(m, "causal_type", None) == "left")
    up_total = hift.up_total
    total = 0.0
    rate = 1
    for i, u in enumerate(cfg.upsample_rates):
        prev, rate = rate, rate * u
        total += hift.ups[i].causal_padding / rate + 1.0 / prev  # conv + nearest rounding
        total += hift.source_downs[i].kernel_size[0] / up_total
        total += _resblock_rf(hift.source_resblocks[i]) / rate
        blocks = hift.resblocks[i * hift.num_kernels:(i + 1) * hift.num_kernels]
        total += max(_resblock_rf(b) for b in blocks) / rate
    total += (hift.conv_post.causal_padding + 1) / up_total  # conv_post + reflection pad
    total += 2 * cfg.n_fft / hift.samples_per_frame  # source STFT and output ISTFT windows
    return f0_ctx, int(math.ceil(total)) + 1


def continue_phase(rad: torch.Tensor, first: Sequence[int] | torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Running phase (cycles, float64 [B, W, H]) of per-frame increments ``rad`` [B, W, H].

    Row b continues from ``acc[b]`` = the sum of all increments before window frame
    ``first[b]``; frames before that get ``acc[b]`` (they only feed discarded outputs).
    The sum is ``acc + r_first + r_first+1 + ...`` in that order, the same sequence of
    float64 additions the official ``cumsum`` over the whole history performs on the CPU,
    so the phase is bit-identical there (on CUDA both are parallel scans: ~1 ulp).
    """
    dev = rad.device
    start = (first if isinstance(first, torch.Tensor) else h2d(list(first), torch.long, dev)).unsqueeze(1)
    keep = torch.arange(rad.shape[1], device=dev).unsqueeze(0) >= start
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    steps = torch.where(keep.unsqueeze(-1), rad.to(torch.float64), zero)
    steps[:, 0] += acc  # acc is 0 where first == 0, so r_0 stays exact
    return torch.cumsum(steps, dim=1)


@dataclass
class _State:
    tail: torch.Tensor | None  # [in, K] mel frames [tail_start, total)
    phase: torch.Tensor  # [harmonics] float64: sum of phase increments (cycles) of frames < anchor
    tail_start: int = 0
    total: int = 0
    emitted: int = 0  # mel frames' worth of samples already returned
    anchor: int = 0


@dataclass
class _WindowPlan:
    job_index: int
    segment_id: Hashable
    state: _State
    window: torch.Tensor  # [in, W] mel frames [start, total)
    start: int  # s: first frame of the window
    f0_end: int  # T': frames with an F0 value (total - look-ahead unless finalize)
    out_start: int  # frames
    out_end: int
    next_anchor: int
    finalize: bool


class HiftRunner:
    """Streaming / full-response HiFT over many requests; see the module docstring.

    ``graphs``: False (eager), True, or a dict of ``GraphCache`` options (``capacity``,
    ``max_counters``, ``capture_after``, ``backend``, ...) to run the decode through a
    graph cache, available as ``self.graphs``. ``frame_bucket`` pads
    window lengths up to a multiple (and batch sizes, see ``_batch_rows``) so graph shapes
    repeat; defaults to 32 frames when graphs are used, 1 otherwise. ``bounded=False``
    keeps the whole history (the official recompute, for comparison and for configs where
    the phase shortcut does not apply). ``f0_gemm``: the float64 F0 predictor as GEMMs
    (``codec.f0_gemm.F0Gemm``; None: on CUDA, where cuDNN's float64 convs are slow).
    ``convs``: how the decode's convs run (``codec.hift_convs.DECODERS``): ``cudnn``, the
    model's NCL path (with ``fused_snake``'s kernels); ``cudnn_channels_last``; ``triton``.
    """

    def __init__(self, hift: CausalHiFTGenerator, *, graphs: bool | dict = False,
                 max_batch: int = 64, max_batch_frames: int = 8192,
                 frame_bucket: int | None = None, bounded: bool = True,
                 context_frames: int | None = None, fused_snake: bool = False,
                 f0_gemm: bool | None = None, convs: str = "cudnn") -> None:
        self.hift = hift
        self.cfg = hift.cfg
        self.spf = hift.samples_per_frame
        self.look_ahead = hift.f0_predictor.look_ahead
        self.look_right = self.cfg.conv_pre_look_right
        self.istft = CachedISTFT(self.cfg.n_fft, self.cfg.hop_len, hift.stft_window)
        self.max_batch = max_batch
        self.max_batch_frames = max_batch_frames
        self.frame_bucket = frame_bucket or (32 if graphs else 1)
        f0_ctx, dec_ctx = left_context(hift)
        if context_frames is not None:  # for experiments; smaller than the bound is inexact
            dec_ctx = context_frames
        # The frame-level phase shortcut needs spf >= 3 (see SourceModule); else recompute all.
        self.bounded = bounded and self.spf >= 3
        self.f0_context, self.decode_context = f0_ctx, dec_ctx
        self.graphs: GraphCache | None = None
        if graphs:
            opts = dict(graphs) if isinstance(graphs, dict) else {}
            opts.setdefault("name", "hift")
            self.graphs = GraphCache(self.vocode, **opts)
        self.convs = decoder(hift, convs)
        # The NCL path's resblock Snake + causal pad + conv biases + residual as Triton kernels
        # (cosybatch.codec.snake); None: the eager ops, or a channels-last decode (its own kernels)
        self.snake_pad = SnakePad(hift, "triton") if fused_snake and self.convs is None else None
        if f0_gemm is None:
            f0_gemm = self.device.type == "cuda"
        self._f0 = F0Gemm(hift.f0_predictor) if f0_gemm else functools.partial(hift.f0_predictor, finalize=True)
        self._states: dict[Hashable, _State] = {}
        self._table: torch.Tensor | None = None
        self._rand_ini: torch.Tensor | None = None

    # ------------------------------------------------------------------ public API
    @property
    def device(self) -> torch.device:
        return self.hift.stft_window.device

    def active(self) -> int:
        return len(self._states)

    def release(self, segment_id: Hashable) -> None:
        self._states.pop(segment_id, None)

    @torch.inference_mode()
    def run(self, jobs: Sequence[HiftJob | tuple]) -> list[torch.Tensor]:
        """New waveform samples [1, n] per job, in job order (n = 0 while the stream is
        shorter than the look-ahead). A finalize job ends (and frees) its request.
        Jobs of the same request in one call are applied in order.
        """
        jobs = [j if isinstance(j, HiftJob) else HiftJob(*j) for j in jobs]
        for j in jobs:
            self._check(j)
        # All or nothing: planning advances each request's state before decoding, so a failed
        # call (e.g. out of memory) must put the states back for the caller's retry to be exact.
        saved = {j.segment_id: copy.copy(self._states.get(j.segment_id)) for j in jobs}
        try:
            return self._run(jobs)
        except BaseException:
            for rid, st in saved.items():
                if st is None:
                    self._states.pop(rid, None)
                else:
                    self._states[rid] = st
            raise

    def _run(self, jobs: list[HiftJob]) -> list[torch.Tensor]:
        outs: list[torch.Tensor | None] = [None] * len(jobs)
        pending = list(range(len(jobs)))
        while pending:  # rounds: one job per request each
            seen, this_round, later = set(), [], []
            for i in pending:
                rid = jobs[i].segment_id
                (later if rid in seen else this_round).append(i)
                seen.add(rid)
            plans = [self._plan(i, jobs[i]) for i in this_round]
            empty = [p for p in plans if p.out_end <= p.out_start]
            for p in empty:
                outs[p.job_index] = self._finish(p, None, None)
            work = sorted((p for p in plans if p.out_end > p.out_start), key=lambda p: p.window.shape[1])
            for batch in self._batches(work):
                self._run_batch(batch, outs)
            pending = later
        return outs  # type: ignore[return-value]

    def precapture(self, shapes: Iterable[tuple[int, int]]) -> int:
        """Capture decode graphs at start-up for (requests per batch, window frames) pairs
        (bucketed like live batches); returns how many were captured."""
        if self.graphs is None:
            return 0
        with torch.inference_mode():  # as in run(): no autograd state in the graphs
            return self.graphs.precapture(self._dummy_inputs(self._batch_rows(n), self._bucket(f))
                                          for n, f in shapes)

    def _dummy_inputs(self, rows: int, width: int) -> tuple[torch.Tensor, ...]:
        dev, dtype = self.device, self.hift.stft_window.dtype
        n_frames = width * self.hift.up_total + 1
        self._ensure_table(1)
        harmonics = self.hift.m_source.dim
        ints = torch.zeros(3, rows, dtype=torch.long, device=dev)
        ints[1] = width
        return (torch.zeros(rows, self.cfg.in_channels, width, device=dev, dtype=dtype),
                torch.zeros(rows, width * self.spf, harmonics, device=dev, dtype=dtype),
                ints, torch.zeros(rows, harmonics, dtype=torch.float64, device=dev), self._rand_ini,
                self.istft.envelopes([n_frames] * rows, n_frames, dev, dtype),
                self.istft.frame_mask([n_frames] * rows, n_frames, dev))

    # ------------------------------------------------------------------ planning
    def _check(self, job: HiftJob) -> None:
        mel = job.mel
        if mel.dim() != 3 or mel.shape[0] != 1 or mel.shape[1] != self.cfg.in_channels:
            raise ValueError(f"segment {job.segment_id!r}: mel must be [1, {self.cfg.in_channels}, F]")
        st = self._states.get(job.segment_id)
        total = (st.total if st else 0) + mel.shape[2]
        f0_end = total if job.finalize else total - self.look_ahead
        if f0_end * self.spf > self.cfg.sine_table_len:
            raise ValueError(f"segment {job.segment_id!r}: {f0_end * self.spf} samples exceed the "
                             f"fixed sine noise table ({self.cfg.sine_table_len})")

    def _plan(self, index: int, job: HiftJob) -> _WindowPlan:
        st = self._states.get(job.segment_id)
        if st is None:
            st = _State(tail=None, phase=torch.zeros(self.hift.m_source.dim, dtype=torch.float64,
                                                     device=self.device))
            self._states[job.segment_id] = st
        new = job.mel[0].to(device=self.device, dtype=self.hift.stft_window.dtype)
        st.tail = new if st.tail is None else torch.cat([st.tail, new], dim=1)
        st.total += new.shape[1]
        total, fin = st.total, job.finalize
        f0_end = total if fin else total - self.look_ahead
        out_end = total if fin else total - self.look_ahead - self.look_right - 1
        out_end = max(out_end, st.emitted)
        if self.bounded:
            start = max(0, st.anchor - self.f0_context)
            next_anchor = max(st.anchor, out_end - self.decode_context)
        else:
            start, next_anchor = 0, 0
        assert start >= st.tail_start
        window = st.tail[:, start - st.tail_start:]
        return _WindowPlan(index, job.segment_id, st, window, start, f0_end, st.emitted, out_end,
                     next_anchor, fin)

    def _batches(self, plans: list[_WindowPlan]) -> list[list[_WindowPlan]]:
        out, cur = [], []
        for p in plans:  # sorted by length: the last one added is the longest
            width = self._bucket(p.window.shape[1])
            full = len(cur) >= self.max_batch
            if cur and (full or width * self._batch_rows(len(cur) + 1) > self.max_batch_frames):
                out.append(cur)
                cur = []
            cur.append(p)
        if cur:
            out.append(cur)
        return out

    def _bucket(self, frames: int) -> int:
        q = self.frame_bucket
        return -(-frames // q) * q

    def _batch_rows(self, n: int) -> int:
        """Rows to allocate for n requests: exact when eager; with graphs, a power of two
        up to 8, then a multiple of 8, so shapes repeat without much padding."""
        if self.graphs is None:
            return n
        rows = 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8
        return max(n, min(rows, self.max_batch))

    # ------------------------------------------------------------------ compute
    def _ensure_table(self, need: int) -> None:
        """Device copy of the fixed noise table, at least ``need`` samples (or all of it)."""
        full = self.cfg.sine_table_len
        if self._table is None or self._table.shape[0] < min(need, full):
            grown = 1 << 20
            while grown < need:
                grown *= 2
            rand_ini, table = noise_tables.sine_noise(self.hift.noise_cfg, min(grown, full))
            self._rand_ini = rand_ini.to(self.device)
            self._table = table[0].to(self.device)

    def _noise(self, starts: list[int], length: int) -> torch.Tensor:
        """[B, length, harmonics] rows of the fixed noise table from each row's sample offset."""
        self._ensure_table(max(starts) + length)
        base = h2d(starts, torch.long, self.device).unsqueeze(1)
        idx = (base + torch.arange(length, device=self.device)).clamp_(max=self._table.shape[0] - 1)
        return self._table[idx]

    def _source(self, f0: torch.Tensor, cycles: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """``SourceModule.forward`` with the phase (cycles, float64 [B, W, H]) given; same op
        order, so a window starting at frame 0 reproduces it bit for bit."""
        cfg, spf, ms = self.cfg, self.spf, self.hift.m_source
        phase = cycles.to(f0.dtype) * 2 * math.pi
        phase = phase.transpose(1, 2) * spf
        sines = F.interpolate(torch.sin(phase), scale_factor=float(spf), mode="nearest").transpose(1, 2)
        sines = sines * cfg.nsf_alpha
        f0_up = F.interpolate(f0[:, None], scale_factor=float(spf), mode="nearest").transpose(1, 2)
        uv = (f0_up > cfg.nsf_voiced_threshold).to(f0.dtype)
        noise_amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
        mixed = sines * uv + noise_amp * noise
        return torch.tanh(ms.l_linear(mixed)).transpose(1, 2)

    def _source_stft(self, source: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Centred STFT of each row's first ``lengths[b]`` samples, reflecting at its own end."""
        cfg = self.cfg
        half = cfg.n_fft // 2
        n = source.shape[-1]
        pos = torch.arange(-half, n + half, device=source.device).unsqueeze(0)
        last = lengths.unsqueeze(1) - 1
        pos = pos.abs()
        pos = torch.where(pos > last, 2 * last - pos, pos).clamp_(0, n - 1)
        padded = torch.gather(source[:, 0], 1, pos)
        spec = torch.stft(padded, cfg.n_fft, cfg.hop_len, cfg.n_fft, window=self.hift.stft_window,
                          center=False, return_complex=True)
        spec = torch.view_as_real(spec)
        return torch.cat([spec[..., 0], spec[..., 1]], dim=1)

    def decode_padded(self, mel: torch.Tensor, s_stft: torch.Tensor, envelope: torch.Tensor,
                      frame_mask: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """The deterministic (graphable) part: padded mel [B, in, D] + source STFT
        [B, n_fft+2, up*D+1] -> waveform [B, spf*D], each row cut at its own frame count
        by ``frame_mask``/``envelope``. Decodes as ``finalize=True``; a streaming row's
        look-ahead is handled by the caller keeping only samples that do not depend on it.
        ``valid`` [B] (device): each row's frames with an F0 value, past which the Triton
        convs skip their products (``TritonConvDecode.decode_spec``); no kept sample lies there.
        """
        if self.convs is not None:
            spec = self.convs.decode_spec(mel, s_stft, valid)
        else:
            spec = self.hift.decode_spec(mel, s_stft, finalize=True, snake_pad=self.snake_pad)
        nb = self.cfg.n_fft // 2 + 1
        magnitude = torch.exp(spec[:, :nb, :]).clip(max=1e2)
        phase = torch.sin(spec[:, nb:, :])
        wav = self.istft(magnitude * torch.cos(phase), magnitude * torch.sin(phase),
                         envelope, frame_mask)
        return torch.clamp(wav, -self.cfg.audio_limit, self.cfg.audio_limit)

    def vocode(self, mel: torch.Tensor, noise: torch.Tensor, ints: torch.Tensor, acc: torch.Tensor,
               rand_ini: torch.Tensor, envelope: torch.Tensor, frame_mask: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A padded batch from device tensors alone, so one CUDA graph serves it: mel windows
        [B, in, W], their noise rows [B, W*spf, harmonics], ``ints`` [3, B] = (first frame
        whose phase increment counts, frames with an F0 value, frame whose running phase the
        row keeps), the rows' phase accumulators ``acc`` [B, harmonics] float64 -> (waveform
        [B, spf*W], the kept running phase [B, harmonics] float64)."""
        first, valid, keep_at = ints
        # F0 (float64 inside the predictor) as if finalize: a streaming row's look-ahead
        # frames are real, its F0 values past its valid frames are simply not used.
        f0 = self._f0(mel).to(mel.dtype)
        rad = self.hift.m_source.frame_phase_increments(f0, rand_ini)
        cycles = continue_phase(rad, first, acc)
        source = self._source(f0, cycles, noise)
        wav = self.decode_padded(mel, self._source_stft(source, valid * self.spf), envelope, frame_mask, valid)
        phase = cycles.gather(1, keep_at[:, None, None].expand(-1, 1, cycles.shape[2]))[:, 0]
        return wav, phase

    def _run_batch(self, plans: list[_WindowPlan], outs: list) -> None:
        dev, spf, up = self.device, self.spf, self.hift.up_total
        rows = self._batch_rows(len(plans))
        pad = rows - len(plans)
        width = self._bucket(max(p.window.shape[1] for p in plans))
        mel = torch.zeros(rows, self.cfg.in_channels, width, device=dev, dtype=plans[0].window.dtype)
        for b, p in enumerate(plans):
            mel[b, :, : p.window.shape[1]] = p.window
        self._ensure_table(1)
        valid = [(p.f0_end - p.start) for p in plans] + [1] * pad
        advance = [p.next_anchor > p.state.anchor for p in plans]
        ints = h2d([[p.state.anchor - p.start for p in plans] + [0] * pad, valid,
                    [p.next_anchor - p.start - 1 if adv else 0 for p, adv in zip(plans, advance)] + [0] * pad],
                   torch.long, dev)
        acc = torch.stack([p.state.phase for p in plans] + [plans[0].state.phase.new_zeros(self.hift.m_source.dim)] * pad)
        noise = self._noise([p.start * spf for p in plans] + [0] * pad, width * spf)
        frames = [v * up + 1 for v in valid[: len(plans)]] + [1] * pad
        env = self.istft.envelopes(frames, width * up + 1, dev, mel.dtype)
        mask = self.istft.frame_mask(frames, width * up + 1, dev)
        args = (mel, noise, ints, acc, self._rand_ini, env, mask)
        wav, phase = self.graphs(*args) if self.graphs is not None else self.vocode(*args)
        for b, (p, adv) in enumerate(zip(plans, advance)):
            a = (p.out_start - p.start) * spf
            z = (p.out_end - p.start) * spf
            outs[p.job_index] = self._finish(p, wav[b: b + 1, a:z].clone(), phase[b].clone() if adv else None)

    def _finish(self, p: _WindowPlan, wav: torch.Tensor | None, new_phase: torch.Tensor | None) -> torch.Tensor:
        st = p.state
        if wav is None:
            wav = torch.zeros(1, 0, device=self.device, dtype=p.window.dtype)
        if p.finalize:
            self._states.pop(p.segment_id, None)
            return wav
        st.emitted = p.out_end
        if new_phase is not None:
            st.phase = new_phase
            st.anchor = p.next_anchor
        if self.bounded:
            keep_from = max(0, st.anchor - self.f0_context)
            st.tail = st.tail[:, keep_from - st.tail_start:].clone()
            st.tail_start = keep_from
        return wav
