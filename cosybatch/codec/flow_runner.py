"""Packed flow solve: many segments' hops (and their CFG twins) in one DiT call per Euler step.

Each job gives exactly what ``reference.token2wav.flow_chunk`` / ``flow_full`` give for it:
same conditioning (prompt ‖ tokens, look-ahead handling, prompt mel as cond, speaker), the
official fixed noise at each frame's absolute position, the same cosine schedule and CFG, and
the same attention mask (chunk-causal for streaming hops, full for whole responses and, by
default, final hops: design.md D4). Streaming segments reuse the K/V of complete chunks from
their earlier hops (``prefix_cache.py``), so a hop runs the transformer on its new frames only.

A solve is planned once on the host (``start``), then advanced one Euler step at a time
(``FlowSolve.step``), so a scheduler can interleave its steps with other GPU work; on CUDA each
step is one replay of a captured graph for the call's layout bucket (``flow_graphs.py``).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Hashable

import numpy as np
import torch

from cosybatch.gpu.hostcopy import h2d
from cosybatch.codec.attention import LaunchMeta, make_backend
from cosybatch.codec.config import CodecConfig
from cosybatch.codec.dit_step import (ConvPositionEmbed, block_modulation, block_post, block_pre, block_pre_functional,
                                      block_qkv, block_weights, ff1_gelu_epilogue, rotary_qk_, rotary_qk_kv_,
                                      rotary_tables)
from cosybatch.codec import flow_buckets
from cosybatch.codec.flow_conditioning import JobInputs, static_inputs
from cosybatch.codec.flow_graphs import Capture, FlowGraphs
from cosybatch.codec.flow_step import FlowTables, StepBuffers, euler_step
from cosybatch.hops import Hop
from cosybatch.codec.packing import FlowLayout, RowSpec, pack
from cosybatch.codec.prefix_cache import PrefixCache
from cosybatch.models.flow import CausalMaskedDiffWithDiT
from cosybatch.prompt import PromptFeatures

DEFAULT_PREFIX_BUDGET = 4 << 30
# The fused layer's parts (``FlowRunner(fusions=...)``, design.md D26).
FUSIONS = ("chain", "gelu", "kv", "fill", "merge")


@dataclass(eq=False)  # holds tensors: compared by identity
class FlowJob:
    """One flow call: a streaming hop (``chunk``) or a whole response (``chunk=None``)."""

    segment_id: Hashable  # one text segment of one row: the unit of streaming state
    tokens: torch.Tensor  # [N] long: the segment's flow tokens so far (read on the host)
    prompt: PromptFeatures  # speech_tokens read on the host; mel and embedding on any device
    chunk: Hop | None = None


@dataclass
class _HopPlan:
    job: FlowJob
    tokens: np.ndarray  # prompt ‖ flow tokens[:end]
    finalize: bool
    frames: int
    out_start: int
    attn_chunk: int  # attention chunk in frames; 0 = full attention
    end: int
    q_start: int = 0
    conv_start: int = 0
    key: Hashable | None = None  # cache key when the segment's K/V are kept
    record: tuple[int, int] | None = None  # frames whose trajectory the next hop's convs need


class FlowRunner:
    def __init__(
        self,
        flow: CausalMaskedDiffWithDiT,
        dtype: torch.dtype | None = None,
        attention: str = "auto",
        prefix_budget_bytes: int = DEFAULT_PREFIX_BUDGET,
        chunk_causal_final: bool = False,
        compile: bool = False,
        graphs: bool = False,
        graph_capacity: int = 256,
        capture: Capture | None = None,
        conv_form: str | None = None,
        triton_kernels: bool = False,
        fused_ln: bool | None = None,
        fusions: tuple[str, ...] | None = None,
        max_jobs: int = 64,
    ):
        """``chunk_causal_final=True`` is an opt-in optimisation (design.md D4): final hops keep
        the chunk-causal mask and reuse the prefix instead of one full-attention recompute.
        ``graphs``: replay captured Euler steps per layout bucket (CUDA with a varlen attention
        backend; ``capture`` injects the mechanism for tests). ``triton_kernels`` (CUDA): the
        head-0 rotary as one Triton kernel per layer, not five, and the position convs as
        Triton kernels (``conv_form``, one of ``ConvPositionEmbed.FORMS``; by default
        ``"triton"`` with ``triton_kernels`` where the DiT's width allows it, else cuDNN's
        ``"channels_last"`` on CUDA and ``"conv1d"`` elsewhere). ``fused_ln`` (CUDA; by default
        with ``triton_kernels``): each block's gated attention residual and the modulated
        LayerNorm after it as one Triton kernel (``triton_kernels.gated_residual_ln``).
        ``fusions`` (a subset of ``FUSIONS``; by default all of them with ``triton_kernels``, none
        without; design.md D26): ``chain`` each block's feed-forward residual fused with the next
        block's LayerNorm (one LayerNorm kernel per step), ``gelu`` the GELU in
        FF1's cuBLASLt epilogue, ``kv`` the K/V arena writes in the rotary kernel, ``fill`` the
        attention's zeros written by its own launch (no memset, no torch.where), ``merge`` a
        call's pool and self attention launches as one (Triton attention). ``()`` is the
        unfused path, kept as the reference; the eager twins run wherever Triton does not.
        ``max_jobs``: the most jobs a solve holds (the codec admission), which bounds the graph
        buckets (``flow_buckets``)."""
        self.flow = flow
        self.cfg = flow.cfg
        self.device = next(flow.parameters()).device
        self.dtype = dtype or next(flow.parameters()).dtype
        est = flow.decoder.estimator
        self.dit = est if est.proj_out.weight.dtype == self.dtype else copy.deepcopy(est).to(self.dtype)
        dit_cfg = self.cfg.dit
        self.heads, self.inner = dit_cfg.heads, dit_cfg.heads * dit_cfg.dim_head
        self.backend = make_backend(attention, self.device, self.dtype)
        self.chunk_causal_final = chunk_causal_final
        k = dit_cfg.conv_pos_kernel
        self.conv_gap = k - 1  # zero frames between rows in the conv layout
        self.conv_margin = 2 * (k - 1)  # receptive field of the two causal convs
        self.n_steps = self.cfg.n_timesteps
        self.cache = PrefixCache(self.n_steps, dit_cfg.depth, self.heads, self.inner, self.dtype, self.device,
                                 prefix_budget_bytes)
        self.noise = flow.decoder.rand_noise[0].t().to(self.device)  # [noise_len, mel], fp32
        cuda = self.device.type == "cuda"
        if conv_form is None:
            triton_conv = triton_kernels and ConvPositionEmbed.triton_fits(self.dit)
            conv_form = ("triton" if triton_conv else "channels_last") if cuda else "conv1d"
        fusions = set(FUSIONS if triton_kernels else ()) if fusions is None else set(fusions)
        if not fusions <= set(FUSIONS):
            raise ValueError(f"unknown flow fusions {sorted(fusions - set(FUSIONS))}; choose from {FUSIONS}")
        if compile:
            fusions = set()  # the compiled blocks take no fused parts
        rot, rot_kv, residual_ln = rotary_qk_, rotary_qk_kv_, None
        if triton_kernels:
            from cosybatch.codec import triton_kernels

            rot, rot_kv = triton_kernels.rotary_qk_, triton_kernels.rotary_qk_kv_
            if fused_ln is not False:
                residual_ln = triton_kernels.gated_residual_ln
        post_kw = {"residual_ln": residual_ln} if residual_ln is not None else {}
        if "gelu" in fusions:
            post_kw["ff1"] = ff1_gelu_epilogue
        pre = functools.partial(block_pre, rotary_=rot, rotary_kv_=rot_kv)
        post = functools.partial(block_post, **post_kw)
        qkv = functools.partial(block_qkv, rotary_=rot, rotary_kv_=rot_kv)
        if compile:
            pre = torch.compile(block_pre_functional, dynamic=True)
            post = torch.compile(block_post, dynamic=True)
        self.fusions = tuple(f for f in FUSIONS if f in fusions)
        self.tables = self._tables(ConvPositionEmbed(self.dit, conv_form), pre, post)
        self.tables.qkv = qkv
        t = self.tables
        t.chain, t.kv_writes, t.fill, t.merge = ("chain" in fusions, "kv" in fusions, "fill" in fusions,
                                                 "merge" in fusions)
        self.graphs = FlowGraphs(self._step, graph_capacity, capture) if graphs else None
        self.max_jobs = max_jobs
        if graphs and self.device.type == "cuda":
            # Captured steps hold the arena's address, so every growth re-captures every bucket
            # (measured: the growth a minute into a C32 run threw away 91 graphs). Take the whole
            # budget at first use instead (still bounded by free memory).
            self.cache.first_frames = self.cache.budget_frames
        self._arena_version = 0  # the prefix arena the captured steps point into
        # tokens: transformer rows of real jobs (CFG twins included); padded_tokens: rows run
        # including bucket padding; cached_tokens: rows reused instead; uncached_hops: streaming
        # hops recomputed from frame 0 because the budget was full.
        self.stats = {"calls": 0, "jobs": 0, "tokens": 0, "padded_tokens": 0, "cached_tokens": 0, "attn_pairs": 0,
                      "output_frames": 0, "uncached_hops": 0}

    @classmethod
    def from_config(cls, flow: CausalMaskedDiffWithDiT, cfg: CodecConfig) -> "FlowRunner":
        return cls(flow, dtype=cfg.flow_dtype, attention=cfg.attention, prefix_budget_bytes=cfg.prefix_budget_bytes,
                   chunk_causal_final=cfg.chunk_causal_final, compile=cfg.flow_compile, graphs=cfg.flow_graphs,
                   graph_capacity=cfg.flow_graph_capacity, triton_kernels=cfg.triton_kernels,
                   max_jobs=cfg.max_num_seqs)

    # ------------------------------------------------------------------ setup

    @torch.inference_mode()
    def _tables(self, conv, pre, post) -> FlowTables:
        """Euler times exactly as the official solver accumulates them, and every modulation
        vector (they depend on t only, identical for all rows, so computed once)."""
        t_span = self.flow.decoder.t_span(self.n_steps, self.device, torch.float32)
        t, dt = t_span[0].unsqueeze(0), t_span[1] - t_span[0]
        mods, finals, dts = [], [], []
        for step in range(1, self.n_steps + 1):
            temb = self.dit.time_embed(t.to(self.dtype))  # [1, dim]
            mods.append(torch.stack([torch.stack(block_modulation(b, temb)) for b in self.dit.transformer_blocks]))
            scale, shift = self.dit.norm_out.linear(torch.nn.functional.silu(temb)).chunk(2, dim=-1)
            finals.append(torch.stack((1 + scale.reshape(-1), shift.reshape(-1))))
            dts.append(dt.clone().reshape(1))
            t = t + dt
            if step < self.n_steps:
                dt = t_span[step + 1] - t
        dit = self.dit
        return FlowTables(mods=torch.stack(mods), final=torch.stack(finals), dt=torch.cat(dts),
                          cfg_rate=self.cfg.inference_cfg_rate, blocks=block_weights(dit),
                          proj_in=(dit.input_embed.proj.weight, dit.input_embed.proj.bias),
                          proj_out=(dit.proj_out.weight, dit.proj_out.bias), conv=conv, heads=self.heads,
                          pre=pre, post=post)

    def _step(self, b: StepBuffers) -> None:
        euler_step(b, self.tables, self.backend, self.cache if b.pool is not None else None)

    def release(self, segment_id: Hashable) -> None:
        """Free a segment's cached prefix (call when it ends)."""
        self.cache.drop(segment_id)

    # ------------------------------------------------------------------ planning

    def _plan(self, job: FlowJob, grow: bool = True) -> _HopPlan:
        cfg, r = self.cfg, self.cfg.token_mel_ratio
        tokens = job.tokens.reshape(-1)
        if job.chunk is None:
            end, finalize, offset, full = tokens.numel(), True, 0, True
        else:
            end, finalize, offset = job.chunk.end, job.chunk.finalize, job.chunk.offset
            full = finalize and not self.chunk_causal_final
        if end > tokens.numel():
            raise ValueError(f"chunk needs {end} tokens, job has {tokens.numel()}")
        prompt_tok = job.prompt.speech_tokens.reshape(-1).cpu().numpy()
        all_tokens = np.concatenate((prompt_tok, tokens[:end].cpu().numpy())).astype(np.int64)
        frames = r * (len(all_tokens) - (0 if finalize else cfg.pre_lookahead_len))
        n_prompt = job.prompt.mel.shape[1]
        if n_prompt > frames:
            raise ValueError(f"prompt mel ({n_prompt} frames) is longer than the flow input ({frames} frames)")
        if frames > self.noise.shape[0]:
            raise ValueError(f"{frames} mel frames exceed the CFM noise table ({self.noise.shape[0]})")
        p = _HopPlan(job, all_tokens, finalize, frames, n_prompt + r * offset, 0 if full else cfg.dit.static_chunk_size,
                     end)
        if job.chunk is not None and not full:
            self._plan_cache(p, tokens[:end], grow)
        elif job.chunk is not None:
            self.cache.drop(job.segment_id)
        return p

    def _plan_cache(self, p: _HopPlan, tokens: torch.Tensor, grow: bool = True) -> None:
        key = p.job.segment_id
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
        st = self.cache.reserve(key, p.frames, cpu, grow)
        if st is None:
            self.stats["uncached_hops"] += 1
            return  # over budget: recompute this hop from frame 0 like the official code
        if not reuse:
            st.complete, st.traj, st.traj_start = 0, None, 0
        p.key = key
        p.q_start = st.complete
        p.conv_start = st.traj_start if st.complete else 0
        if not p.finalize:
            complete = p.frames // p.attn_chunk * p.attn_chunk
            lo = max(p.q_start, complete - self.conv_margin)
            p.record = (lo, complete)

    # ------------------------------------------------------------------ solve

    @torch.inference_mode()
    def start(self, jobs: list[FlowJob], beside: "FlowSolve | None" = None) -> "FlowSolve | None":
        """Plan one packed call; step the returned solve ``n_steps`` times, then ``finish`` it.

        ``beside``: a solve part-way through, which this one runs before it ends (a row's first
        hop that should not wait for it, design.md D39); this one then leaves everything it holds
        as it is: the prefix arena is not grown (a segment that does not fit recomputes its
        prefix, as over budget), its buffers are its own (a bucket the other one uses, or one
        not captured yet, runs eagerly: a capture could evict that one's graph). None (nothing
        planned) when the arena does not exist yet: making it would move what the other holds."""
        if not jobs:
            raise ValueError("a flow solve needs at least one job")
        keys = [j.segment_id for j in jobs if j.chunk is not None]
        if len(set(keys)) != len(keys):
            raise ValueError("a segment may appear once per call")
        if beside is not None and self.cache.enabled and self.cache.k is None:
            return None
        version = self.cache.version
        plans = [self._plan(j, grow=beside is None) for j in jobs]
        self._follow_arena()
        rows = [RowSpec(p.frames, p.q_start, p.conv_start, p.attn_chunk,
                        tuple(self.cache.get(p.key).regions) if p.key else None) for p in plans]
        real = pack(rows, self.conv_gap)
        lay, sizes, key = real, None, None
        if self.graphs is not None and self.backend.bucketable:
            sizes = self._bucket(real, len(plans), self._both_launches(plans))
            key = flow_buckets.key(sizes)
            if beside is not None and (key == beside.key or not self.graphs.captured(key)):
                sizes, key = None, None
            else:
                lay = pack(rows, self.conv_gap, stride=sizes["stride"], conv_len=sizes["conv_len"], margin=sizes["margin"])
        if beside is not None and self.cache.version != version:
            raise RuntimeError("a flow solve beside another moved the prefix arena")
        self._count(plans, real, lay)
        fresh = self._inputs(plans, lay, sizes)
        if key is None:
            return FlowSolve(self, plans, lay, fresh, None, None)
        entry = self.graphs.entry(key, lambda: fresh)
        if entry.buffers is not fresh:
            _copy_into(entry.buffers, fresh)
        self.graphs.stats.solves += 1
        return FlowSolve(self, plans, lay, entry.buffers, key, entry)

    def run(self, jobs: list[FlowJob]) -> list[torch.Tensor]:
        """New mel [1, mel, F] float32 per job, as the official recompute would produce it."""
        if not jobs:
            return []
        solve = self.start(jobs)
        solve.step(self.n_steps)
        return solve.finish()

    @property
    def geometry(self) -> flow_buckets.Geometry:
        """What the graph buckets depend on besides the solve (``flow_buckets``); coarse with a
        backend whose padded launches cost only empty programs (the Triton attention)."""
        return flow_buckets.Geometry(self.cfg.dit.static_chunk_size, self.conv_gap, self.conv_margin, self.max_jobs,
                                     coarse=getattr(self.backend, "coarse_buckets", False))

    def _both_launches(self, plans: list[_HopPlan]) -> bool:
        """Whether a solve's bucket carries both attention launches whatever its rows: streaming
        hops with a prefix arena on a coarse, merging backend (design.md D27)."""
        return (self.geometry.coarse and self.tables.merge and hasattr(self.backend, "prepare_pair")
                and any(p.job.chunk is not None for p in plans) and self.cache.ensure_arena())

    def _bucket(self, lay: FlowLayout, n_jobs: int, both: bool = False) -> dict:
        """A graph bucket's sizes for a layout: padded so that buckets repeat across calls."""
        pool, self_ = (True, True) if both else (len(lay.pool) > 0, len(lay.self) > 0)
        return flow_buckets.sizes(self.geometry, lay.job_tokens, n_jobs, pool, self_, len(lay.self), lay.self.max_q)

    def bucket_flags(self, streaming: bool) -> list[tuple[bool, bool]]:
        """The (pool, self) launch pairs this runner's buckets can have in a streaming or whole
        response run (``flow_buckets.launch_flags``)."""
        merges = self.tables.merge and hasattr(self.backend, "prepare_pair")
        return flow_buckets.launch_flags(streaming, self.cache.enabled, merges)

    def bucket_keys(self, streaming: bool, max_stride: int, min_stride: int = 0) -> list[tuple]:
        """Every graph bucket a run's solves of ``min_stride`` to ``max_stride`` tokens per branch
        can use."""
        return flow_buckets.keys(self.geometry, max_stride, self.bucket_flags(streaming), min_stride)

    @torch.inference_mode()
    def precapture(self, keys: list[tuple]) -> int:
        """Capture the Euler step of each bucket in ``keys`` now (start-up), on buffers of the
        bucket's shapes that solves then fill; returns how many were captured. Needs graphs and a
        bucketable backend (0 otherwise)."""
        if self.graphs is None or not self.backend.bucketable:
            return 0
        made = 0
        for k in keys:
            s = dict(k)
            if s["pool_seqs"]:
                self.cache.ensure_arena()
                self._follow_arena()
            made += self.graphs.precapture(k, lambda: self._blank_inputs(s))
        return made

    def _follow_arena(self) -> None:
        """Captured steps hold the prefix arena's address: when it grew and moved, drop them."""
        if self.graphs is not None and self.cache.version != self._arena_version:
            self.graphs.clear()
            self._arena_version = self.cache.version

    def _blank_inputs(self, sizes: dict) -> StepBuffers:
        """A bucket's buffers with no job in them: every token padding (its keys none, its conv
        frame the sink), so the capture's warm-up step computes nothing a solve reads."""
        lay = pack([], self.conv_gap, stride=sizes["stride"], conv_len=sizes["conv_len"], margin=sizes["margin"])
        dev, mel, stride = self.device, self.cfg.output_size, sizes["stride"]
        t = lambda a: h2d(torch.from_numpy(np.ascontiguousarray(a)), device=dev)  # noqa: E731
        cos, sin = rotary_tables(self.flow.decoder.estimator.rotary_embed.freqs(t(lay.positions)))
        has_pool, has_self = sizes["pool_seqs"] > 0, sizes["self_seqs"] > 0
        pool, self_, merged = self._attention_tables(lay, sizes, has_pool, has_self)
        static = torch.zeros(sizes["conv_len"], 3 * mel, device=dev, dtype=self.dtype)  # cond | mu | spk
        slots = np.full(2 * stride, self.cache.dump, dtype=np.int64)
        b = StepBuffers(x=torch.zeros(stride, mel, device=dev), step=torch.zeros(1, dtype=torch.long, device=dev),
                        static=static, valid=t(lay.conv_valid), conv_of_token=t(lay.conv_of_token), cos=cos, sin=sin,
                        pool_slots=t(slots), pool_mask=t(lay.pool_slots >= 0)[:, None, None], pool=pool, self_=self_,
                        merged=merged)
        b.margin = torch.zeros(self.n_steps, sizes["margin"], mel, device=dev, dtype=self.dtype)
        b.margin_conv = t(lay.margin_conv.reshape(-1))
        b.record_idx = t(np.zeros(sizes["records"], dtype=np.int64))
        b.traj = torch.zeros(self.n_steps, sizes["records"], mel, device=dev)
        b.extra["record_spans"] = []
        return b

    def _attention_tables(self, lay: FlowLayout, sizes: dict | None, has_pool: bool, has_self: bool):
        """The attention launches' tables: (pool, self, merged); merged, one launch for both (its
        tile count: both bucket bounds together) and ``self`` None."""
        n_att, dev = lay.tokens, self.device
        if self.tables.merge and has_pool and has_self and hasattr(self.backend, "prepare_pair"):
            pool = self.backend.prepare_pair(lay.pool, lay.self, n_att, dev, self._launch_sizes(sizes, "pool"),
                                             self._launch_sizes(sizes, "self"))
            return pool, None, True
        pool = self.backend.prepare(lay.pool, n_att, dev, *self._launch_sizes(sizes, "pool")) if has_pool else None
        self_ = self.backend.prepare(lay.self, n_att, dev, *self._launch_sizes(sizes, "self")) if has_self else None
        return pool, self_, False

    def _inputs(self, plans: list[_HopPlan], lay: FlowLayout, sizes: dict | None) -> StepBuffers:
        dev, mel = self.device, self.cfg.output_size
        stride = lay.stride
        jobs = [JobInputs(p.tokens, p.frames, p.conv_start, p.finalize, p.job.prompt.mel[0], p.job.prompt.embedding)
                for p in plans]
        x = torch.zeros(stride, mel, device=dev)
        real_pos = h2d(torch.from_numpy(lay.positions[: lay.job_tokens]), device=dev)
        x[: lay.job_tokens] = self.noise.index_select(0, real_pos)
        t = lambda a: h2d(torch.from_numpy(np.ascontiguousarray(a)), device=dev)  # noqa: E731
        # Rotary angles from the fp32 module: a bf16 copy of inv_freq would lose precision.
        cos, sin = rotary_tables(self.flow.decoder.estimator.rotary_embed.freqs(t(lay.positions)))
        has_pool, has_self = len(lay.pool) > 0, len(lay.self) > 0
        if sizes is not None:  # a bucket may carry a launch with no rows in this solve (D27)
            has_pool, has_self = sizes["pool_seqs"] > 0, sizes["self_seqs"] > 0
        if has_pool:
            self.cache.ensure_arena()
        pool, self_, merged = self._attention_tables(lay, sizes, has_pool, has_self)
        slots = np.where(lay.pool_slots >= 0, lay.pool_slots, self.cache.dump)
        b = StepBuffers(x=x, step=torch.zeros(1, dtype=torch.long, device=dev),
                        static=static_inputs(self.flow, jobs, lay, self.dtype, dev), valid=t(lay.conv_valid),
                        conv_of_token=t(lay.conv_of_token), cos=cos, sin=sin, pool_slots=t(slots),
                        pool_mask=t(lay.pool_slots >= 0)[:, None, None], pool=pool, self_=self_, merged=merged)
        cached = [p for p in plans if p.q_start > p.conv_start]
        if lay.margin:
            margin = torch.zeros(self.n_steps, lay.margin, mel, device=dev, dtype=self.dtype)
            if cached:
                parts = []
                for p in cached:  # each cached job's trajectory over its conv margin
                    st = self.cache.get(p.key)
                    parts.append(st.traj[:, p.conv_start - st.traj_start: p.q_start - st.traj_start])
                got = torch.cat(parts, dim=1)
                margin[:, : got.shape[1]] = got.to(self.dtype)
            b.margin, b.margin_conv = margin, t(lay.margin_conv.reshape(-1))
        n_rec = sizes["records"] if sizes else sum(p.record[1] - p.record[0] for p in plans if p.record)
        if n_rec:
            idx = np.zeros(n_rec, dtype=np.int64)
            spans = []
            at = 0
            for j, p in enumerate(plans):
                if p.record is None:
                    continue
                lo, hi = p.record
                base = lay.job_offsets[j] - p.q_start
                idx[at : at + hi - lo] = np.arange(base + lo, base + hi)
                spans.append((j, at, at + hi - lo))
                at += hi - lo
            b.record_idx = t(idx)
            b.traj = torch.zeros(self.n_steps, n_rec, mel, device=dev)
            b.extra["record_spans"] = spans
        return b

    def _launch_sizes(self, sizes: dict | None, kind: str) -> tuple:
        if sizes is None:
            return (None, None, None)
        max_q = self.cfg.dit.static_chunk_size if kind == "pool" else sizes["self_max_q"]
        return (sizes[f"{kind}_seqs"], max_q, self.noise.shape[0])

    def _count(self, plans: list[_HopPlan], real: FlowLayout, lay: FlowLayout) -> None:
        """Work done per call (one Euler step, CFG rows included), for benchmarks and tests."""
        st = self.stats
        st["calls"] += 1
        st["jobs"] += len(plans)
        st["tokens"] += real.tokens
        st["padded_tokens"] += lay.tokens
        st["cached_tokens"] += 2 * sum(p.q_start for p in plans)
        st["attn_pairs"] += real.pool.pairs + real.self.pairs
        st["output_frames"] += sum(p.frames - p.out_start for p in plans)

    # ------------------------------------------------------------------ cache bookkeeping

    def _commit(self, plans: list[_HopPlan], traj: torch.Tensor | None, spans: list) -> None:
        for p in plans:
            if p.key is not None and p.finalize:
                self.cache.drop(p.key)  # the segment is over
        for j, a, z in spans:
            p = plans[j]
            st = self.cache.get(p.key)
            lo, complete = p.record
            new = traj[:, a:z]
            keep_from = max(0, complete - self.conv_margin)
            if st.traj is not None and keep_from < lo:
                new = torch.cat((st.traj[:, keep_from - st.traj_start :], new), dim=1)
            st.traj, st.traj_start = new, keep_from
            st.tokens = p.job.tokens.reshape(-1)[: p.end].detach().cpu()
            st.frames, st.complete, st.finalized = p.frames, complete, p.finalize


class FlowSolve:
    """One packed call in progress: ``step`` advances its Euler steps, ``finish`` returns mels."""

    def __init__(self, runner: FlowRunner, plans, layout: FlowLayout, buffers: StepBuffers, key, entry):
        self.runner, self.plans, self.layout, self.buffers, self.key, self.entry = runner, plans, layout, buffers, key, entry
        self.done = 0

    @property
    def steps_left(self) -> int:
        return self.runner.n_steps - self.done

    @torch.inference_mode()
    def step(self, n: int = 1) -> int:
        """Run up to ``n`` more Euler steps (queued on the current stream); returns steps left."""
        r = self.runner
        for _ in range(min(n, self.steps_left)):
            if self.entry is None:
                r._step(self.buffers)
            else:
                r.graphs.run_step(self.key, self.entry)
            self.done += 1
        return self.steps_left

    @torch.inference_mode()
    def finish(self) -> list[torch.Tensor]:
        """Commit the prefix cache and return each job's new mel [1, mel, F] float32."""
        if self.steps_left:
            raise RuntimeError(f"flow solve finished with {self.steps_left} steps left")
        b, lay = self.buffers, self.layout
        x = b.x[: lay.job_tokens].clone()  # the buffers belong to the bucket: the next solve reuses them
        spans = b.extra.get("record_spans", [])
        self.runner._commit(self.plans, b.traj.clone() if spans else None, spans)
        outs = []
        for j, p in enumerate(self.plans):
            xj = x[lay.job_slice(j)]
            outs.append(xj[p.out_start - p.q_start :].t().unsqueeze(0))
        return outs


def _copy_into(dst: StepBuffers, src: StepBuffers) -> None:
    """Fill a bucket's buffers with a solve's inputs (same bucket, so the same shapes)."""
    for name, v in vars(src).items():
        d = getattr(dst, name)
        if isinstance(v, torch.Tensor):
            d.copy_(v)
        elif isinstance(v, LaunchMeta):
            for k, tv in v.tensors.items():
                d.tensors[k].copy_(tv)
    dst.extra = dict(src.extra)
