"""Packed flow solve: many requests' hops (and their CFG twins) in one DiT call per Euler step.

Each job gives exactly what ``reference.token2wav.flow_chunk`` / ``flow_full`` give for it:
same conditioning (prompt ‖ tokens, look-ahead handling, prompt mel as cond, speaker), the
official fixed noise at each frame's absolute position, the same cosine schedule and CFG, and
the same attention mask (chunk-causal for streaming hops, full for whole responses and, by
default, final hops: spec decision 4). Streaming rows reuse the K/V of complete chunks from
their earlier hops (``prefix_cache.py``), so a hop runs the transformer on its new frames only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Hashable

import torch
import torch.nn.functional as F

from cosybatch.codec.attention import make_backend
from cosybatch.codec.dit_step import ConvPositionEmbed, block_modulation, block_post, block_pre, block_pre_functional, block_weights, rotary_tables
from cosybatch.codec.hops import Chunk
from cosybatch.codec.packing import POOL, SCRATCH, SELF, RowSpec, pack
from cosybatch.codec.prefix_cache import PrefixCache
from cosybatch.models.flow import CausalMaskedDiffWithDiT

DEFAULT_PREFIX_BUDGET = 4 << 30


@dataclass
class FlowJob:
    """One flow call: a streaming hop (``chunk``) or a whole response (``chunk=None``)."""

    request_id: Hashable
    tokens: torch.Tensor  # [N] long: the segment's flow tokens so far
    prompt: object  # .speech_tokens [1, P] long, .mel [1, F, mel], .embedding [1, spk]
    chunk: Chunk | None = None
    segment: int = 0


@dataclass
class _Plan:
    job: FlowJob
    all_tokens: torch.Tensor  # prompt ‖ tokens[:end], on the device
    finalize: bool
    frames: int
    out_start: int
    chunk: int  # 0 = full attention
    q_start: int = 0
    conv_start: int = 0
    key: tuple | None = None  # cache key when the row's K/V are kept
    end: int = 0


class FlowRunner:
    def __init__(
        self,
        flow: CausalMaskedDiffWithDiT,
        dtype: torch.dtype | None = None,
        attention: str = "auto",
        prefix_budget_bytes: int = DEFAULT_PREFIX_BUDGET,
        chunk_causal_final: bool = False,
        compile: bool = False,
        conv_channels_last: bool | None = None,
    ):
        """``chunk_causal_final=True`` is an opt-in optimisation (spec decision 4): final hops keep
        the chunk-causal mask and reuse the prefix instead of one full-attention recompute."""
        self.flow = flow
        self.cfg = flow.cfg
        self.device = next(flow.parameters()).device
        self.dtype = dtype or next(flow.parameters()).dtype
        est = flow.decoder.estimator
        self.dit = est if est.proj_out.weight.dtype == self.dtype else copy.deepcopy(est).to(self.dtype)
        self.heads = self.cfg.dit.heads
        self.inner = self.cfg.dit.heads * self.cfg.dit.dim_head
        self.backend = make_backend(attention, self.device)
        self.chunk_causal_final = chunk_causal_final
        k = self.cfg.dit.conv_pos_kernel
        self.conv_gap = k - 1  # zero frames between rows in the conv layout
        self.conv_margin = 2 * (k - 1)  # receptive field of the two causal convs
        self.n_steps = self.cfg.n_timesteps
        self.cache = PrefixCache(self.n_steps, self.cfg.dit.depth, self.inner, self.dtype, self.device, prefix_budget_bytes)
        self.noise = flow.decoder.rand_noise[0].t().to(self.device)  # [noise_len, mel], fp32
        self._weights = block_weights(self.dit)
        if conv_channels_last is None:
            conv_channels_last = self.device.type == "cuda"
        self._conv = ConvPositionEmbed(self.dit, conv_channels_last)
        self._pre, self._post = block_pre, block_post
        if compile:
            self._pre = torch.compile(block_pre_functional, dynamic=True)
            self._post = torch.compile(block_post, dynamic=True)
        # tokens: transformer rows run (CFG twins included); cached_tokens: rows reused instead;
        # uncached_hops: streaming hops recomputed from frame 0 because the budget was full.
        self.stats = {"calls": 0, "jobs": 0, "tokens": 0, "cached_tokens": 0, "attn_pairs": 0, "output_frames": 0, "uncached_hops": 0}
        self._schedule()

    # ------------------------------------------------------------------ setup

    @torch.inference_mode()
    def _schedule(self) -> None:
        """Euler times exactly as the official solver accumulates them, and every modulation
        vector (they depend on t only, identical for all rows, so computed once)."""
        t_span = self.flow.decoder.t_span(self.n_steps, self.device, torch.float32)
        t, dt = t_span[0].unsqueeze(0), t_span[1] - t_span[0]
        self.steps = []
        for step in range(1, self.n_steps + 1):
            temb = self.dit.time_embed(t.to(self.dtype))  # [1, dim]
            mods = [block_modulation(blk, temb) for blk in self.dit.transformer_blocks]
            self.steps.append((dt.clone(), temb, mods))
            t = t + dt
            if step < self.n_steps:
                dt = t_span[step + 1] - t

    def release(self, request_id: Hashable) -> None:
        """Free every cached prefix of a request (call when it ends)."""
        self.cache.release(request_id)

    # ------------------------------------------------------------------ planning

    def _plan(self, job: FlowJob) -> _Plan:
        cfg, r = self.cfg, self.cfg.token_mel_ratio
        tokens = job.tokens.reshape(-1)
        prompt_tok = job.prompt.speech_tokens.reshape(-1).to(self.device)
        if job.chunk is None:
            end, finalize, offset, full = tokens.numel(), True, 0, True
        else:
            end, finalize, offset = job.chunk.end, job.chunk.finalize, job.chunk.offset
            full = finalize and not self.chunk_causal_final
        if end > tokens.numel():
            raise ValueError(f"chunk needs {end} tokens, job has {tokens.numel()}")
        all_tokens = torch.cat((prompt_tok, tokens[:end].to(self.device, prompt_tok.dtype)))
        n_mu = all_tokens.numel() - (0 if finalize else cfg.pre_lookahead_len)
        frames = r * n_mu
        n_prompt = job.prompt.mel.shape[1]
        if n_prompt > frames:
            raise ValueError(f"prompt mel ({n_prompt} frames) is longer than the flow input ({frames} frames)")
        if frames > self.noise.shape[0]:
            raise ValueError(f"{frames} mel frames exceed the CFM noise table ({self.noise.shape[0]})")
        p = _Plan(job, all_tokens, finalize, frames, n_prompt + r * offset, 0 if full else cfg.dit.static_chunk_size, end=end)
        if job.chunk is not None and not full:
            self._plan_cache(p, tokens[:end])
        elif job.chunk is not None:
            self.cache.drop((job.request_id, job.segment))
        return p

    def _plan_cache(self, p: _Plan, tokens: torch.Tensor) -> None:
        key = (p.job.request_id, p.job.segment)
        cpu = tokens.detach().cpu()
        st = self.cache.get(key)
        reuse = (
            st is not None
            and not st.finalized
            and st.complete <= p.out_start
            and st.tokens.numel() <= cpu.numel()
            and p.frames >= st.frames
            and torch.equal(cpu[: st.tokens.numel()], st.tokens)
        )
        if not reuse:
            self.cache.drop(key)
        st = self.cache.reserve(key, p.frames, cpu)
        if st is None:
            self.stats["uncached_hops"] += 1
            return  # over budget: recompute this hop from frame 0 like the official code
        if not reuse:
            st.complete, st.traj, st.traj_start = 0, None, 0
        p.key = key
        p.q_start = st.complete
        p.conv_start = st.traj_start if st.complete else 0

    # ------------------------------------------------------------------ conditioning

    def _mu(self, p: _Plan, first_frame: int) -> torch.Tensor:
        """mu frames [first_frame, frames) [n, mel] fp32, from a token window just wide enough
        for the look-ahead layer's receptive field (earlier frames' mu never changes)."""
        flow, r = self.flow, self.cfg.token_mel_ratio
        layer = flow.pre_lookahead_layer
        look = layer.conv1.kernel_size[0] - 1
        left = layer.conv2.kernel_size[0] - 1
        n_mu = p.frames // r
        ta = first_frame // r
        lo = max(0, ta - left)
        emb = flow.input_embedding(p.all_tokens[lo : n_mu + look].long().clamp(min=0))  # [n, C]
        e = emb.t().unsqueeze(0)
        if p.finalize:
            e = F.pad(e, (0, n_mu + look - lo - emb.shape[0]))  # official zero right padding
        h = F.leaky_relu(layer.conv1(e))  # tokens [lo, n_mu)
        h = layer.conv2(F.pad(h, (left - (ta - lo), 0)))  # tokens [ta, n_mu)
        mu = h[0].t() + emb[ta - lo : n_mu - lo]
        return mu.repeat_interleave(r, dim=0)[first_frame - r * ta :]

    def _static_inputs(self, plans, lay) -> torch.Tensor:
        """[cond ‖ mu ‖ spk] per conv-layout frame (zero for unconditional rows and padding)."""
        mel = self.cfg.output_size
        static = torch.zeros(lay.conv_len, 2 * mel + self.cfg.dit.spk_dim, device=self.device, dtype=self.dtype)
        base = self.conv_gap
        for p in plans:
            n = p.frames - p.conv_start
            prompt_mel = p.job.prompt.mel[0].to(self.device, torch.float32)
            cond = torch.zeros(n, mel, device=self.device)
            m = max(0, min(prompt_mel.shape[0], p.frames) - p.conv_start)
            cond[:m] = prompt_mel[p.conv_start : p.conv_start + m]
            spk = self.flow.speaker(p.job.prompt.embedding.to(self.device, torch.float32))
            static[base : base + n] = torch.cat((cond, self._mu(p, p.conv_start), spk.expand(n, -1)), dim=1).to(self.dtype)
            base += n + self.conv_gap
        return static

    # ------------------------------------------------------------------ solve

    @torch.inference_mode()
    def run(self, jobs: list[FlowJob]) -> list[torch.Tensor]:
        """New mel [1, mel, F] float32 per job, as the official recompute would produce it."""
        if not jobs:
            return []
        keys = [(j.request_id, j.segment) for j in jobs if j.chunk is not None]
        if len(set(keys)) != len(keys):
            raise ValueError("a request segment may appear once per call")
        plans = [self._plan(j) for j in jobs]
        rows = [RowSpec(p.frames, p.q_start, p.conv_start, p.chunk, tuple(self.cache.get(p.key).regions) if p.key else None) for p in plans]
        lay = pack(rows, self.conv_gap, self.device)
        self._count(plans, lay)
        x = torch.cat([self.noise[p.q_start : p.frames] for p in plans])  # [job tokens, mel] fp32
        static = self._static_inputs(plans, lay)
        margins = [self.cache.get(p.key).traj for p in plans if p.q_start > p.conv_start]
        margin = torch.cat(margins, dim=1).to(self.dtype) if margins else None
        record = self._record_index(plans, lay)
        trace = []
        # Rotary angles from the fp32 module: a bf16 copy of inv_freq would lose precision.
        cos, sin = rotary_tables(self.flow.decoder.estimator.rotary_embed.freqs(lay.positions))
        preps = [self.backend.prepare(ln, self._n_keys(ln.source, lay), self.device) for ln in lay.launches]
        scratch = None
        if lay.scratch_frames:
            shape = (lay.scratch_frames, self.heads, self.inner // self.heads)
            scratch = (torch.empty(shape, device=self.device, dtype=self.dtype), torch.empty(shape, device=self.device, dtype=self.dtype))
        rate = self.cfg.inference_cfg_rate
        valid = lay.conv_valid.to(self.dtype)
        for s, (dt, temb, mods) in enumerate(self.steps):
            if record is not None:
                trace.append(x.index_select(0, record[0]))
            xin = torch.zeros(lay.conv_len, self.cfg.output_size, device=self.device, dtype=self.dtype)
            xin[lay.conv_of_row] = torch.cat((x, x)).to(self.dtype)
            if margin is not None:
                xin[lay.margin_conv] = torch.cat((margin[s], margin[s]))
            h = self.dit.input_embed.proj(torch.cat((xin, static), dim=1)) * valid[:, None]
            h = self._conv(h, valid)[lay.att_to_conv]
            for layer, (m, (wpre, wpost)) in enumerate(zip(mods, self._weights)):
                q, k, v = self._pre(h, m[0], m[1], *wpre, cos, sin, self.heads)
                o = self._attend(q, k, v, s, layer, lay, preps, scratch)
                h = self._post(h, o.flatten(-2), m[2], m[3], m[4], m[5], *wpost)
            vel = self.dit.head(h, temb)[lay.row_to_att].float()
            v_cond, v_uncond = vel.split(lay.job_tokens)
            x = x + dt * ((1.0 + rate) * v_cond - rate * v_uncond)
        self._commit(plans, lay, trace, record)
        outs = []
        for j, p in enumerate(plans):
            xj = x[lay.job_slice(j)]
            outs.append(xj[p.out_start - p.q_start :].t().unsqueeze(0).contiguous())
        return outs

    def _count(self, plans, lay) -> None:
        """Work done per call (one Euler step, CFG rows included), for benchmarks and tests."""
        st = self.stats
        st["calls"] += 1
        st["jobs"] += len(plans)
        st["tokens"] += lay.tokens
        st["cached_tokens"] += 2 * sum(p.q_start for p in plans)
        st["attn_pairs"] += sum(q * k for ln in lay.launches for q, k in zip(ln.q_lens, ln.k_lens))
        st["output_frames"] += sum(p.frames - p.out_start for p in plans)

    def _n_keys(self, source: tuple, lay) -> int:
        if source[0] == SELF:
            return lay.tokens
        if source[0] == SCRATCH:
            return lay.scratch_frames
        return self.cache.slabs[source[1]].k.shape[2]

    def _attend(self, q, k, v, step, layer, lay, preps, scratch):
        if scratch is not None:
            a, b = lay.scratch_span
            scratch[0].index_copy_(0, lay.scratch_slots, k[a:b])
            scratch[1].index_copy_(0, lay.scratch_slots, v[a:b])
        for slab, a, b, slots in lay.pool_writes:
            pk, pv = self.cache.slab_kv(slab, step, layer, self.heads)
            pk.index_copy_(0, slots, k[a:b])
            pv.index_copy_(0, slots, v[a:b])
        if len(lay.launches) == 1 and lay.launches[0].q_end - lay.launches[0].q_start == q.shape[0]:
            ln = lay.launches[0]
            return self.backend.run(q, *self._keys(ln.source, k, v, step, layer, scratch), preps[0])
        out = q.new_empty(q.shape)  # q may be a strided view of the fused q/k/v buffer
        for ln, prep in zip(lay.launches, preps):
            ks, vs = self._keys(ln.source, k, v, step, layer, scratch)
            out[ln.q_start : ln.q_end] = self.backend.run(q[ln.q_start : ln.q_end], ks, vs, prep)
        return out

    def _keys(self, source, k, v, step, layer, scratch):
        if source[0] == SELF:
            return k, v
        if source[0] == SCRATCH:
            return scratch
        assert source[0] == POOL
        return self.cache.slab_kv(source[1], step, layer, self.heads)

    # ------------------------------------------------------------------ cache bookkeeping

    def _record_index(self, plans, lay):
        """Row-layout indices of the frames whose Euler trajectory the next hop's conv margin needs."""
        idx, spans = [], []
        for j, p in enumerate(plans):
            if p.key is None or p.finalize:
                continue
            complete = p.frames // p.chunk * p.chunk
            lo = max(p.q_start, complete - self.conv_margin)
            if complete > lo:
                base = lay.job_offsets[j] - p.q_start
                idx.append(torch.arange(base + lo, base + complete))
            spans.append((j, lo, complete, sum(t.numel() for t in idx)))
        if not spans:
            return None
        return (torch.cat(idx).to(self.device) if idx else torch.zeros(0, dtype=torch.long, device=self.device)), spans

    def _commit(self, plans, lay, trace, record) -> None:
        for p in plans:
            if p.key is not None and p.finalize:
                self.cache.drop(p.key)  # the segment is over
        if record is None:
            return
        trace = torch.stack(trace)  # [steps, recorded, mel]
        start = 0
        for j, lo, complete, stop in record[1]:
            p = plans[j]
            st = self.cache.get(p.key)
            new = trace[:, start:stop]
            start = stop
            keep_from = max(0, complete - self.conv_margin)
            if st.traj is not None and keep_from < lo:
                old = st.traj[:, keep_from - st.traj_start :]
                new = torch.cat((old, new), dim=1)
            st.traj, st.traj_start = new, keep_from
            st.tokens = p.job.tokens.reshape(-1)[: p.end].detach().cpu()
            st.frames, st.complete, st.finalized = p.frames, complete, p.finalize
