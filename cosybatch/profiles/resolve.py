"""A profile resolved once into the typed settings each layer receives (design.md, "Layers").

The engine gets an ``EngineConfig``, the codec a ``CodecConfig``, the process a
``ProcessSettings``, and the pipeline the rest (mode, hops, base sampling parameters). Nothing
below this module reads a profile.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from cosybatch.codec.attention import check_dtype
from cosybatch.codec.config import CodecConfig
from cosybatch.models.config import ModelConfig, SamplingConfig, resolve_dtype
from cosybatch.engine.config import EngineConfig
from cosybatch.engine.request import SamplingParams
from cosybatch.profiles.schema import (ARProfile, FrontendProfile, HopsProfile, Profile, ProfileError, SamplingProfile,
                                       TextProfile)
from cosybatch.gpu.runtime import ProcessSettings, triton_available
from cosybatch.scheduler.settings import FrontendSettings, RunSettings, SliceSettings, TextSettings

log = logging.getLogger("cosybatch.profiles")

# CosyVoice3Model hard-codes the hop schedule 25 -> x2 -> 100 whatever chunk_size is (design.md D3).
OFFICIAL_FIRST_HOP, OFFICIAL_MAX_HOP = 25, 100


def resolve_frontend(f: FrontendProfile, device) -> FrontendSettings:
    if f.device == "cuda" and device.type != "cuda":
        raise ProfileError(f"frontend.device=cuda needs a CUDA device, the run uses {device.type}")
    backend = {"auto": "auto", "cuda": "torch", "cpu": "onnxruntime"}[f.device]
    dtype = torch.bfloat16 if f.precision == "bfloat16" else torch.float32
    return FrontendSettings(backend=backend, dtype=dtype, split_tf32=f.precision == "3xtf32", batch=f.batch,
                            gather_s=f.gather_ms / 1e3, row_bucket=f.row_bucket, batch_bucket_s=f.batch_bucket_s,
                            graph_rows=f.graph_rows,
                            warmup=f.warmup, prime=f.prime, audio_processes=f.audio == "process")


def resolve_text(t: TextProfile) -> TextSettings:
    """The text settings both engines hand their frontend (the reference path resolves only these)."""
    return TextSettings(normalizer=t.normalizer)


def resolve_sampling(s: SamplingProfile, checkpoint: SamplingConfig) -> SamplingParams:
    """The engine's sampling parameters: unset RAS values come from the checkpoint's yaml
    (logged), unset standard ones are neutral (temperature 1, top-p 1, top-k off, no penalty)."""
    common = dict(seed=s.seed, enforce_min_len=s.enforce_min_len, max_tokens=s.max_tokens)
    if s.mode == "standard":
        return SamplingParams.standard(s.temperature or 1.0, s.top_p or 1.0, s.top_k or 0,
                                       s.repetition_penalty or 1.0, **common)
    picked = {n: getattr(s, n) if getattr(s, n) is not None else getattr(checkpoint, n)
              for n in ("top_p", "top_k", "win_size", "tau_r")}
    from_ckpt = [n for n in picked if getattr(s, n) is None]
    if from_ckpt:
        log.info("sampling.mode=%s: %s from the checkpoint's yaml", s.mode,
                 ", ".join(f"{n}={picked[n]}" for n in from_ckpt))
    return SamplingParams.ras(SamplingConfig(**picked), **common)


def resolve_hops(h: HopsProfile, chunk_size: int) -> tuple[int, int, int]:
    """(first, max, scale) in tokens; unset values are the official 25 and max(100, first). The
    codec stays exact when hops do not line up with the checkpoint's attention chunks (the
    incomplete chunk is recomputed), so ``chunk_size`` only serves the log line."""
    first = h.first if h.first is not None else OFFICIAL_FIRST_HOP
    mx = h.max if h.max is not None else max(OFFICIAL_MAX_HOP, first)
    if first % chunk_size or mx % chunk_size:
        log.info("hops %d..%d do not line up with chunk_size %d: partial chunks are recomputed", first, mx, chunk_size)
    if mx < first:
        raise ProfileError(f"hops.max={mx} must be >= hops.first={first}")
    return first, mx, h.scale


def engine_config(ar: ARProfile | None = None, **overrides) -> EngineConfig:
    """The engine's config from the profile's ``ar`` section (default: the schema's defaults), with
    ``overrides`` (engine-only knobs too) on top: the one place an ``EngineConfig`` is made."""
    fields = {f.name: getattr(ar or ARProfile(), f.name) for f in dataclasses.fields(ARProfile)}
    return EngineConfig.from_mapping({**fields, **overrides})


def resolve(profile: Profile, cfg: ModelConfig, device) -> RunSettings:
    """The fast engine's settings for ``profile`` on ``device`` (a torch.device)."""
    cuda = device.type == "cuda"
    c, o = profile.codec, profile.optimizations
    flow_dtype = resolve_dtype(c.flow_dtype, device)
    try:  # before any model work, as a profile error
        check_dtype(c.attention, flow_dtype)
    except ValueError as e:
        raise ProfileError(str(e)) from None
    codec = CodecConfig(
        max_num_seqs=c.max_num_seqs, flow_dtype=flow_dtype, attention=c.attention,
        prefix_budget_bytes=int(o.prefix_budget_gb * (1 << 30)) if o.prefix_reuse else 0,
        chunk_causal_final=o.chunk_causal_final, flow_compile=o.flow_compile,
        flow_graphs=o.flow_graphs and cuda, flow_graph_capacity=o.flow_graph_capacity,
        flow_graph_precapture=o.flow_graph_precapture if cuda else None,
        flow_graph_precapture_from=o.flow_graph_precapture_from,
        hift_graphs=o.hift_graphs and cuda, hift_graph_capacity=o.hift_graph_capacity,
        hift_graph_counters=o.hift_graph_counters, hift_graph_capture_after=o.hift_graph_capture_after,
        hift_graph_precapture=o.hift_graph_precapture if cuda else (),
        hift_frame_bucket=o.hift_frame_bucket if cuda else None,  # padding only costs on a CPU
        triton_kernels=o.triton_kernels and cuda and triton_available(),
        # both alternatives launch Triton kernels (the channels-last one its Snake and bias kernels)
        hift_convs=o.hift_convs if cuda and triton_available() else "cudnn")
    # On CUDA the frontend workers give the parallelism; intra-op threads on top of them would
    # oversubscribe the CPU that kernel launches need. HiFT's are the only float32 cuDNN
    # convolutions (flow bf16, F0 float64, LM Triton), so the cuDNN switch is HiFT's.
    process = ProcessSettings(intra_op_threads=1 if cuda and c.frontend_workers > 1 else None,
                              cudnn_tf32=c.hift_tf32 if cuda else None,
                              gemm_sm_carveout=profile.scheduler.gemm_sm_carveout if cuda else None)
    return RunSettings(engine=engine_config(profile.ar, cuda_graphs=profile.ar.cuda_graphs and cuda), codec=codec, process=process,
                       streaming=profile.mode == "streaming", hops=resolve_hops(profile.hops, cfg.chunk_size),
                       sampling=resolve_sampling(profile.sampling, cfg.llm.sampling),
                       frontend_workers=c.frontend_workers, frontend=resolve_frontend(profile.frontend, device),
                       profile=profile.name, text=resolve_text(profile.text),
                       slices=SliceSettings(c.budget_ms, c.budget_max_ms, c.solve_tokens, c.first_wait_ms / 1e3,
                                            c.max_wait_ms / 1e3,
                                            None if c.deadline_lead_ms is None else c.deadline_lead_ms / 1e3,
                                            c.deadline_tokens, c.first_hops_apart),
                       ar_stream=profile.scheduler.ar_stream, frontend_stream=profile.scheduler.frontend_stream,
                       hift_stream=profile.scheduler.hift_stream)
