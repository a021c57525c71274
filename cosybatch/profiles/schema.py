"""The profile schema: a frozen dataclass tree, strict value typing, and the rules that tie keys
together. Loading, inheritance and overrides live in :mod:`cosybatch.profiles.loader`.

The defaults here are the exact path; a profile opts into every speed-up by name. Where one
setting needs another, :func:`cross_check` rejects the profile and says which and why: nothing
is silently overridden (design.md D11).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

Dtype = Literal["auto", "float32", "bfloat16", "float16"]  # auto: bfloat16 on CUDA, float32 on CPU


class ProfileError(ValueError):
    """A profile cannot be used; the message names the key and the file (or --set)."""


@dataclass(frozen=True)
class ARProfile:
    """The speech-LM engine (field names match ``cosybatch.engine.config.EngineConfig``)."""

    # admission: at most this many sequences decode together (the AR concurrency)
    max_num_seqs: int = 64
    # prompt + generated tokens of one sequence; longer requests are refused when added
    max_model_len: int = 4096
    # paged KV cache: tokens per block, and its size (None: enough for max_num_seqs rows of max_model_len)
    kv_block_size: int = 64
    kv_cache_gb: float | None = None
    # packed prompt tokens per prefill forward (at least one whole prompt always goes through)
    max_prefill_tokens: int = 16384
    dtype: Dtype = "float32"
    # auto: triton on CUDA when importable, else torch. torch: per-sequence eager forward through
    # the model's own layers (the parity path); triton: packed prefill, paged attention and
    # fixed-tile matmuls (batch invariant, graphable)
    executor: Literal["auto", "torch", "triton"] = "auto"
    # linears inside the triton executor: triton (fixed tiles, batch invariant) or torch (cuBLAS:
    # faster at some sizes, but a row's bits may depend on the batch size)
    linear: Literal["triton", "torch"] = "triton"
    # decode steps replayed from CUDA graphs, one per batch size below (CUDA only)
    cuda_graphs: bool = False
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    # when those graphs are captured: startup (every decode bucket and prefill token bucket
    # before the first request) or lazy (a decode bucket right after its first, eager step; a
    # prefill bucket at its second use): a run captures only what it uses (design.md D25);
    # warm: lazy, after one eager decode step and two padded prefills at start-up, so the run's
    # first steps pay no kernel's first load (D25)
    graph_capture: Literal["startup", "lazy", "warm"] = "startup"
    # Prefill batching under a backlog (design.md D29): while rows decode and more prompts wait
    # than rows are free, free rows are held until this many are free, at most prefill_wait_ms
    # from when the first could have gone. Under a backlog rows free up one at a time, and each
    # prefill of one prompt costs the AR stream about one decode step of every running row.
    # Without a backlog nothing is held. 1: every prompt prefills at once.
    prefill_min_rows: int = 1
    prefill_wait_ms: float = 0.0
    # triton executor, decode: RoPE and the K/V cache write inside the attention kernel, one
    # launch fewer per layer with the same bits (design.md D30); off until measured on a GPU
    rope_in_attention: bool = False
    # triton executor: newly admitted prompts prefill inside the running rows' decode step (one
    # forward over both) instead of in a step of their own, which holds every running row's
    # next token; every prefill then runs on the decode phase's matmul tiles, so a row's tokens
    # do not depend on which way its prompt went (design.md D33); on in the default profile
    mixed_prefill: bool = False
    # With mixed_prefill and CUDA graphs: [decoding rows, prompt tokens] pairs whose mixed-step
    # graphs (those rows' and tokens' buckets) are captured at start-up. A bulk run's ramp admits
    # rows while its decode batch grows through every bucket, so it meets most of its pairs at
    # once, each run eagerly at its first use and captured at its second, inside the window
    # (timing.json lists them: graphs.mixed.capture_log). Empty: every pair captured lazily.
    mixed_graph_precapture: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class CodecProfile:
    max_num_seqs: int = 16
    flow_dtype: Dtype = "float32"
    # TF32 tensor cores for HiFT's float32 convolutions (cuDNN): ~2x faster, ~1e-4 from float32.
    # PyTorch enables it for cuDNN by default; cosybatch sets it explicitly either way.
    hift_tf32: bool = False
    attention: Literal["auto", "sdpa", "varlen", "flash", "triton"] = "auto"
    # GPU milliseconds of codec work queued between two AR steps: bounds the time between a
    # row's tokens; an imminent playback deadline may overrun it (design.md D15).
    budget_ms: float = 6.0
    # Experimental (null = off; at 16 ms no measurable change at C32): with fewer rows decoding
    # than the AR admission, the budget grows in proportion (an AR step costs about the same for
    # one row as for a full batch), up to this many milliseconds (``timeline.policy.iteration_budget``).
    budget_max_ms: float | None = None
    # When a flow solve starts (a Euler step costs a fixed few hundred kernels whatever its
    # size, so tiny solves waste the GPU): once the ready hops make ``solve_tokens``
    # transformer tokens (null: where the learned fixed cost is a quarter of a step), or a
    # row's first hop has waited ``first_wait_ms``, or any hop ``max_wait_ms``.
    solve_tokens: int | None = None
    first_wait_ms: float = 50.0
    max_wait_ms: float = 250.0
    # Deadline batching in streaming (null = off; design.md D22): a hop whose player has more
    # than this much audio left waits to join a large solve instead of starting one after
    # max_wait_ms, and solves wait for deadline_tokens (at most that many while the AR engine
    # runs) unless a decoding row's player is within this lead of running dry.
    deadline_lead_ms: float | None = None
    deadline_tokens: int = 8192
    # Streaming (design.md D39): rows' first hops solved at once, whole, in a small solve of their
    # own queued before the steps of the solve in progress, for time to first PCM (not while a
    # decoding row's player is within deadline_lead_ms of running dry); off: a first hop waits
    # for that solve to end and joins the next (with deadline batching a large one).
    first_hops_apart: bool = False
    # Threads that prepare prompts ahead of admission: read, resample and fbank them, and with
    # the onnxruntime frontend also run its models (the GPU frontend's run on the pipeline's thread).
    frontend_workers: int = 4


@dataclass(frozen=True)
class SchedulerProfile:
    """How the one thread that owns the GPU timeline issues work (design.md D15, D22)."""

    # serial: the AR step and the codec's slices on one stream, one after the other; beside:
    # the AR step on a high-priority stream of its own, the codec's slices beside it (CUDA and
    # a graphed decode only; otherwise serial, logged)
    ar_stream: Literal["serial", "beside"] = "serial"
    # serial: the GPU frontend's launches on the codec's stream, between its slices; beside: on
    # a stream of their own, so a launch's small kernels (batch-1 tokenizer and CAM++, 4 ms a
    # prompt at C32) run beside the flow's instead of between them (CUDA and the PyTorch
    # frontend only; design.md D34)
    frontend_stream: Literal["serial", "beside"] = "serial"
    # serial: HiFT's calls on the codec's stream, after the flow's; beside: on a stream of their
    # own, each after the solves that made its mels, so HiFT's kernels (and the host's gaps
    # between them, eager) overlap the flow's (CUDA only; design.md D36)
    hift_stream: Literal["serial", "beside"] = "serial"
    # SMs the cuBLAS GEMMs (the flow's, the frontend's) leave free, process-wide (null: none).
    # Beside the codec an AR decode step took 5.0 ms against 1.45 alone (H200, seed C32): each
    # of its ~220 small kernels waits for SMs the flow's GEMM blocks hold. Experimental
    # (design.md D35): the flow's GEMMs then run on fewer SMs; the Triton kernels take them all.
    gemm_sm_carveout: int | None = None


@dataclass(frozen=True)
class FrontendProfile:
    """Where prompt features (speech tokens, speaker embedding, prompt mel) are computed."""

    # auto: PyTorch on CUDA when the checkpoint's ONNX files load into it, else onnxruntime on
    # the CPU with the reason in the log; cuda: PyTorch on the GPU or an error; cpu:
    # onnxruntime on the CPU (the reference path, slow with a full-size tokenizer)
    device: Literal["auto", "cuda", "cpu"] = "auto"
    # The PyTorch path's arithmetic: float32 (strict: GEMMs on CUDA cores), 3xtf32 (float32
    # with the tokenizer's GEMMs as three TF32 products each: float32-grade codes at
    # tensor-core speed; strict float32 on a CPU), bfloat16 (fastest; moves ~8 % of codes)
    precision: Literal["float32", "3xtf32", "bfloat16"] = "float32"
    # GPU frontend: prompts gathered into one launch while the AR engine has at least that
    # many rows queued (with fewer, what has loaded launches at once: those rows are needed)
    batch: int = 64
    # GPU frontend: with fewer than ``batch`` rows queued and prompts still loading, gathered
    # prompts still wait until the oldest has waited this long, even while the GPU has nothing
    # else to do (0: they launch at once, what latency wants). In bulk runs the engine's queue is
    # short because the run's window, not the engine, limits it, and launches of a few prompts
    # each pay the whole launch's host time (~12 ms) and, with ``row_bucket``, its padding
    gather_ms: float = 0.0
    # GPU frontend: a launch's rows are padded to a multiple of this (copies, dropped), so its
    # shapes repeat; each new shape costs the host the planning of its convolutions (1: exact
    # rows; docs/performance.md)
    row_bucket: int = 1
    # GPU frontend: a launch of more than 4 prompts (a bulk run's, graphed or not) pads its
    # prompts' length to a multiple of this many seconds (launches of 1-4 prompts keep 0.5 s, the
    # shapes the warm-up covers): longer buckets repeat shapes more often (a new one costs ~80 ms
    # of host planning eagerly, a capture with graph_rows) for more padding
    batch_bucket_s: float = 0.5
    # GPU frontend: a launch of at most this many prompts replays a CUDA graph of its shape (rows
    # padded to a power of two, lengths to 0.5 s), captured when first met; a larger one queues
    # its ~1,200 kernels one by one from the host (~1,600 before design.md D40: 50-95 ms a launch
    # on an H200's host, what holds the first tenth of a `synth` window). 4: prompts trickling in
    # under a fixed concurrency
    graph_rows: int = 4
    # GPU frontend: at start-up, run one prompt of every length bucket (and 2 and 4 of the
    # short ones) so that prompts trickling in one by one meet planned shapes and captured
    # graphs (10-14 s on an H200; docs/performance.md). Bulk runs launch padded batches of
    # other shapes, which it does not cover.
    warmup: bool = True
    # GPU frontend, without the warm-up: one small eager launch at start-up on the frontend's
    # loading thread, beside the models' loading, so that the run's first launch does not pay a
    # process's one-time set-up (kernels' first loads, cuDNN / cuBLAS handles: ~0.55 s of the
    # first launch's 0.68 s on an H200, docs/performance.md)
    prime: bool = False
    # Where prompt audio is read, resampled and fbanked: "thread" (in the frontend workers) or
    # "process" (one helper process per worker: its many short torch calls then never wait for
    # the GIL behind the GPU thread; no end-to-end gain measured yet, design.md D32)
    audio: Literal["thread", "process"] = "thread"


@dataclass(frozen=True)
class HopsProfile:
    """Streaming hop schedule in speech tokens (see ``cosybatch.hops``)."""

    first: int | None = None  # None: the official 25 tokens (plus the prompt pad)
    max: int | None = None  # None: the official 100 (or first, if larger)
    scale: int = 2


@dataclass(frozen=True)
class Optimizations:
    hift_graphs: bool = False
    hift_graph_capacity: int = 32
    hift_graph_counters: int = 128
    hift_graph_capture_after: int = 3
    # [requests per batch, window frames] pairs captured at start-up, before the first request
    hift_graph_precapture: tuple[tuple[int, ...], ...] = ()
    # On CUDA, HiFT windows are padded to a multiple of this many mel frames (padding is
    # masked: no result changes), so batch shapes repeat; null: 32 with hift_graphs, else
    # exact (always exact on a CPU, where padding only costs). Coarser buckets trade padded
    # work for fewer shapes, each of which costs a graph or, eager, the host's planning of its
    # convolutions (docs/performance.md)
    hift_frame_bucket: int | None = None
    # The codec's fused Triton kernels on CUDA: HiFT's Snake + causal pad with the conv biases
    # and residual adds, the flow's head-0 rotary and position convs (each checked against its
    # eager ops on the GPU; no effect on CPUs or without Triton)
    triton_kernels: bool = True
    # How HiFT's decode convs run on CUDA (docs/design.md D31). cudnn: cuDNN on NCL tensors, with
    # layout transposes around each conv (~720 launches per streaming call, a per-shape plan of
    # ~100 ms host time at a shape's first call). cudnn_channels_last: cuDNN's NHWC kernels on
    # channels-last activations, no transposes. triton: ~96 launches of one Triton conv kernel
    # with the Snake / LeakyReLU, bias, residual and resblock sums folded in, no per-shape plans.
    # Both alternatives sum in another order than cuDNN's NCL kernels (not bit-equal; TF32 when
    # codec.hift_tf32 is on). triton by default: measured fastest (docs/performance.md, sixteenth
    # session); on CPUs or without Triton always cudnn.
    hift_convs: Literal["cudnn", "cudnn_channels_last", "triton"] = "triton"
    flow_graphs: bool = False  # replay one captured Euler step per layout bucket (CUDA)
    flow_graph_capacity: int = 256  # layout buckets; each holds its step buffers (~6 MB at full size)
    # Capture at start-up, before the first row, every flow bucket of solves of at most this many
    # tokens per CFG branch (rounded up to a bucket; design.md D27); null: each bucket when a
    # solve first needs it. Needs flow_graphs; a bucket outside the set is still captured at first
    # sight and counted in the timeline's captures_in_window. `synth` captures them only for a
    # run of at least 4 codec admissions' worth of rows (synthesizers.PRECAPTURE_MIN_JOBS).
    flow_graph_precapture: int | None = None
    # ... and of at least this many (the buckets a run's solves are sized to, e.g. around
    # codec.solve_tokens / 2 in whole responses, without the hundred smaller ones)
    flow_graph_precapture_from: int = 0
    flow_compile: bool = False
    prefix_reuse: bool = False
    prefix_budget_gb: float = 8.0
    # Opt-in and NOT exact: the official final hop uses full attention (design.md D4).
    chunk_causal_final: bool = False


@dataclass(frozen=True)
class SamplingProfile:
    """``checkpoint``: RAS with the checkpoint yaml's values; ``ras``: RAS with the values set
    here (unset ones from the yaml); ``standard``: temperature, top-k, top-p, repetition
    penalty. A parameter the mode does not use must stay unset (null)."""

    mode: Literal["ras", "standard", "checkpoint"] = "checkpoint"
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    win_size: int | None = None
    tau_r: float | None = None
    repetition_penalty: float | None = None
    seed: int = 0
    enforce_min_len: bool = False
    max_tokens: int | None = None  # per text segment, on top of the official 20 x text cap


@dataclass(frozen=True)
class TextProfile:
    """How target texts are read (``cosybatch.text.normalize``)."""

    # wetext: the official frontend as installed by its requirements (numbers, money, dates,
    # times read as words; decimals stay in one sentence); none: the official frontend with no
    # normaliser installed, digits read one run at a time by inflect -- how the parity fixtures
    # were made, so every comparison with them sets it.
    normalizer: Literal["wetext", "none"] = "wetext"


@dataclass(frozen=True)
class Profile:
    engine: Literal["reference", "fast"] = "fast"
    mode: Literal["streaming", "full"] = "full"
    description: str = ""
    ar: ARProfile = field(default_factory=ARProfile)
    codec: CodecProfile = field(default_factory=CodecProfile)
    scheduler: SchedulerProfile = field(default_factory=SchedulerProfile)
    frontend: FrontendProfile = field(default_factory=FrontendProfile)
    hops: HopsProfile = field(default_factory=HopsProfile)
    optimizations: Optimizations = field(default_factory=Optimizations)
    sampling: SamplingProfile = field(default_factory=SamplingProfile)
    text: TextProfile = field(default_factory=TextProfile)
    # Not YAML keys: what was loaded and from where.
    name: str = field(default="", metadata={"meta": True})
    requires: tuple[tuple[str, Any], ...] = field(default=(), metadata={"meta": True})
    sources: tuple[str, ...] = field(default=(), metadata={"meta": True})
    origins: tuple[tuple[str, str], ...] = field(default=(), metadata={"meta": True}, compare=False, repr=False)

    def get(self, dotted: str) -> Any:
        obj: Any = self
        for part in dotted.split("."):
            obj = getattr(obj, part)
        return obj

    def origin(self, dotted: str) -> str:
        """Where a key's value came from: a file, ``--set k=v``, or ``default``."""
        return dict(self.origins).get(dotted, "default")

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in META}
        d.update(name=self.name, requires=dict(self.requires), sources=list(self.sources))
        return d


META = {f.name for f in dataclasses.fields(Profile) if f.metadata.get("meta")}
NOT_SETTABLE = {"inherits", "requires"}


def _schema_leaves(cls: type, prefix: str = "") -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("meta"):
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(_schema_leaves(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = tp
    return out


LEAVES: dict[str, Any] = _schema_leaves(Profile)
GROUPS = {k.split(".")[0] for k in LEAVES if "." in k}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]


def got(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


_NO = object()


def _coerce(value: Any, tp: Any) -> Any:
    """The value as type ``tp``, or ``_NO``. bool is never an int and an int is a fine float."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value if isinstance(value, str) and value in typing.get_args(tp) else _NO
    if origin in (typing.Union, types.UnionType):
        for a in typing.get_args(tp):
            if a is type(None):
                if value is None:
                    return None
            elif (v := _coerce(value, a)) is not _NO:
                return v
        return _NO
    if origin is tuple:
        if not isinstance(value, list):
            return _NO
        items = [_coerce(v, typing.get_args(tp)[0]) for v in value]
        return _NO if any(v is _NO for v in items) else tuple(items)
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if tp is float:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else _NO
    if tp is str:
        return value if isinstance(value, str) else _NO
    raise TypeError(f"unsupported schema type {tp!r}")


def check_value(key: str, value: Any, src: str) -> Any:
    v = _coerce(value, LEAVES[key])
    if v is _NO:
        raise ProfileError(f"{src}: {key}: expected {_type_name(LEAVES[key])}, got {got(value)}")
    return v


def unknown_key(key: str, src: str) -> ProfileError:
    """The error names the closest key and lists the valid ones: those of the key's group when
    the group exists (``ar.max_num_seq``), else every settable key, so one reading is enough."""
    known = sorted(LEAVES) + sorted(GROUPS)
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    group = key.split(".")[0]
    if "." in key and group in GROUPS:
        valid = f"valid keys of {group}: " + ", ".join(k for k in LEAVES if k.startswith(group + "."))
    else:
        valid = "valid keys: " + ", ".join(LEAVES)
    return ProfileError(f"{src}: unknown key {key!r}{hint}; {valid}")


def flatten(doc: dict, src: str, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in doc.items():
        key = f"{prefix}{k}"
        if not isinstance(k, str):
            raise ProfileError(f"{src}: key {key!r} is not a string")
        if key in GROUPS:
            if not isinstance(v, dict):
                raise ProfileError(f"{src}: {key}: expected a mapping, got {got(v)}")
            out.update(flatten(v, src, key + "."))
        elif key in LEAVES:
            out[key] = check_value(key, v, src)
        else:
            raise unknown_key(key, src)
    return out


# --- value ranges and cross-key rules --------------------------------------------------------

RANGES: dict[str, tuple[Any, str]] = {
    "ar.max_num_seqs": (lambda v: v >= 1, "must be >= 1"),
    "ar.max_model_len": (lambda v: v >= 2, "must be >= 2"),
    "ar.kv_block_size": (lambda v: v >= 1, "must be >= 1"),
    "ar.kv_cache_gb": (lambda v: v is None or v > 0, "must be > 0"),
    "ar.max_prefill_tokens": (lambda v: v >= 1, "must be >= 1"),
    "ar.prefill_min_rows": (lambda v: v >= 1, "must be >= 1"),
    "ar.prefill_wait_ms": (lambda v: v >= 0, "must be >= 0"),
    "ar.graph_batch_sizes": (lambda v: len(v) > 0 and all(b >= 1 for b in v), "must be a non-empty list of sizes >= 1"),
    "ar.mixed_graph_precapture": (lambda v: all(len(p) == 2 and min(p) >= 1 for p in v),
                                  "must be a list of [rows, tokens] pairs >= 1"),
    "optimizations.hift_graph_precapture": (lambda v: all(len(p) == 2 and min(p) >= 1 for p in v),
                                            "must be a list of [requests, frames] pairs >= 1"),
    "codec.max_num_seqs": (lambda v: v >= 1, "must be >= 1"),
    "codec.frontend_workers": (lambda v: v >= 1, "must be >= 1"),
    "frontend.batch": (lambda v: v >= 1, "must be >= 1"),
    "frontend.row_bucket": (lambda v: v >= 1, "must be >= 1"),
    "frontend.gather_ms": (lambda v: v >= 0, "must be >= 0"),
    "hops.first": (lambda v: v is None or v >= 1, "must be >= 1"),
    "hops.max": (lambda v: v is None or v >= 1, "must be >= 1"),
    "hops.scale": (lambda v: v >= 1, "must be >= 1"),
    "optimizations.hift_graph_capacity": (lambda v: v >= 1, "must be >= 1"),
    "optimizations.hift_frame_bucket": (lambda v: v is None or v >= 1, "must be >= 1"),
    "optimizations.flow_graph_capacity": (lambda v: v >= 1, "must be >= 1"),
    "optimizations.flow_graph_precapture": (lambda v: v is None or v >= 1, "must be >= 1 or null"),
    "optimizations.flow_graph_precapture_from": (lambda v: v >= 0, "must be >= 0"),
    "codec.budget_ms": (lambda v: v > 0, "must be > 0"),
    "frontend.batch_bucket_s": (lambda v: v > 0, "must be > 0"),
    "frontend.graph_rows": (lambda v: v >= 0, "must be >= 0"),
    "scheduler.gemm_sm_carveout": (lambda v: v is None or 1 <= v <= 64, "must be from 1 to 64 or null"),
    "codec.budget_max_ms": (lambda v: v is None or v > 0, "must be > 0"),
    "codec.solve_tokens": (lambda v: v is None or v >= 1, "must be >= 1"),
    "codec.first_wait_ms": (lambda v: v >= 0, "must be >= 0"),
    "codec.max_wait_ms": (lambda v: v >= 0, "must be >= 0"),
    # at or below the policy's 0.25 s imminence, every patient hop would start as an overrun
    "codec.deadline_lead_ms": (lambda v: v is None or v > 250, "must be > 250 (the imminent-deadline margin)"),
    "codec.deadline_tokens": (lambda v: v >= 1, "must be >= 1"),
    "optimizations.hift_graph_counters": (lambda v: v >= 1, "must be >= 1"),
    "optimizations.hift_graph_capture_after": (lambda v: v >= 1, "must be >= 1"),
    "optimizations.prefix_budget_gb": (lambda v: v >= 0, "must be >= 0"),
    "sampling.temperature": (lambda v: v is None or v > 0, "must be > 0"),
    "sampling.top_p": (lambda v: v is None or 0 < v <= 1, "must be in (0, 1]"),
    "sampling.top_k": (lambda v: v is None or v >= 1, "must be >= 1"),
    "sampling.win_size": (lambda v: v is None or v >= 1, "must be >= 1"),
    "sampling.tau_r": (lambda v: v is None or v >= 0, "must be >= 0"),
    "sampling.repetition_penalty": (lambda v: v is None or v > 0, "must be > 0"),
    "sampling.seed": (lambda v: 0 <= v < 2**63, "must be in [0, 2**63)"),
    "sampling.max_tokens": (lambda v: v is None or v >= 1, "must be >= 1"),
}

# Parameters each sampling mode reads; any other one that is set would be silently ignored.
_SAMPLING_PARAMS = ("temperature", "top_p", "top_k", "win_size", "tau_r", "repetition_penalty")
_USES = {
    "checkpoint": set(),
    "ras": {"top_p", "top_k", "win_size", "tau_r"},
    "standard": {"temperature", "top_p", "top_k", "repetition_penalty"},
}
DEFAULTS = Profile()
# engine=reference runs the exact one-request path and reads none of these.
_FAST_ONLY = tuple(k for k in LEAVES if k.split(".")[0] in ("ar", "codec", "scheduler", "frontend", "optimizations"))


def fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else str(v)


def cross_check(p: Profile, who: str) -> None:
    def at(key: str) -> str:
        return f"{key}={fmt(p.get(key))} (from {p.origin(key)})"

    if p.engine == "reference":
        changed = [k for k in _FAST_ONLY if p.get(k) != DEFAULTS.get(k)]
        if changed:
            raise ProfileError(f"{who}: engine=reference runs the exact one-request path and does not use "
                               f"{', '.join(at(k) for k in changed)}; unset it or use engine=fast")
    if p.ar.mixed_graph_precapture and not (p.ar.mixed_prefill and p.ar.cuda_graphs):
        raise ProfileError(f"{who}: ar.mixed_graph_precapture needs ar.mixed_prefill=true and ar.cuda_graphs=true, "
                           f"got {at('ar.mixed_prefill')}, {at('ar.cuda_graphs')}")
    o = p.optimizations
    if o.hift_graph_precapture and not o.hift_graphs:
        raise ProfileError(f"{who}: optimizations.hift_graph_precapture needs optimizations.hift_graphs=true, "
                           f"got {at('optimizations.hift_graphs')}")
    if o.flow_graph_precapture is not None and not o.flow_graphs:
        raise ProfileError(f"{who}: optimizations.flow_graph_precapture needs optimizations.flow_graphs=true, "
                           f"got {at('optimizations.flow_graphs')}")
    if o.flow_graph_precapture_from and (o.flow_graph_precapture is None
                                         or o.flow_graph_precapture_from > o.flow_graph_precapture):
        raise ProfileError(f"{who}: optimizations.flow_graph_precapture_from needs optimizations.flow_graph_precapture "
                           f"at least as large, got {at('optimizations.flow_graph_precapture_from')} and "
                           f"{at('optimizations.flow_graph_precapture')}")
    if o.hift_graph_counters < o.hift_graph_capacity:
        raise ProfileError(f"{who}: {at('optimizations.hift_graph_counters')} must be >= "
                           f"{at('optimizations.hift_graph_capacity')} (every graphed shape keeps a counter)")
    for key in ("optimizations.chunk_causal_final", "optimizations.prefix_reuse"):
        if p.get(key) and p.mode != "streaming":
            raise ProfileError(f"{who}: {at(key)} applies only to mode=streaming, got {at('mode')}")
    h = p.hops
    if h.first is not None and h.max is not None and h.max < h.first:
        raise ProfileError(f"{who}: {at('hops.max')} must be >= {at('hops.first')}")
    s = p.sampling
    for name in _SAMPLING_PARAMS:
        if getattr(s, name) is not None and name not in _USES[s.mode]:
            key = f"sampling.{name}"
            raise ProfileError(f"{who}: {at(key)} is not used by {at('sampling.mode')}; "
                               f"set it to null or pick a mode that uses it")


def check_requires(p: Profile, who: str) -> None:
    for key, want in p.requires:
        got = p.get(key)
        if got != want:
            raise ProfileError(f"{who} requires {key}={fmt(want)}, got {key}={fmt(got)} (from {p.origin(key)})")
