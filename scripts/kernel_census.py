"""A census of kernel launches, on any device: of one flow Euler step per DiT layer (``census``),
or of any callable (``launches``: an AR decode step, say).

Every op of the step that would launch a GPU kernel is recorded in order: the aten ops (through a
``TorchDispatchMode``, less the pure metadata ops in ``NO_KERNEL``) and the Triton launches (the
kernels' ``run``, whatever module launches them). Blocks are told apart by marks around the
runner's per-block callables (``FlowTables.qkv``/``pre`` open a layer, ``post`` closes it), so the
census splits into the ops before the first block, each block's and those after the last.

On the CPU the step takes the CPU side of each device branch; ``cuda=True`` counts the CUDA side
where the op count differs: FF1 with the GELU epilogue (``dit_step.ff1_gelu_epilogue``) is one
``_addmm_activation`` there, the eager GEMM + GELU pair here (its ops are run, not counted). Not
emulated, outside the blocks: the position convs' form (``conv1d`` on the CPU, Triton's on CUDA).
What the census cannot see are kernels a library launches inside one op (cuBLAS's split-K
reductions, say): the torch profiler on a GPU counts those (``scripts/profile_flow.py``).

    from kernel_census import census
    c = census(runner, solve)           # one step of an unfinished solve
    c.per_layer(), c.format()
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that launch no kernel: views, shapes and strides, allocations without a fill
NO_KERNEL = frozenset("""
    view _unsafe_view _reshape_alias reshape as_strided t transpose permute expand expand_as unsqueeze squeeze
    slice select narrow diagonal detach alias unbind split split_with_sizes chunk unflatten flatten view_as
    empty empty_strided new_empty new_empty_strided empty_like resize_ lift_fresh set_ sym_size sym_stride
    sym_numel sym_storage_offset is_contiguous _has_compatible_shallow_copy_type unsafe_split
""".split())

OPEN, CLOSE = "<block>", "</block>"


def _storages(xs) -> set:
    return {x.untyped_storage().data_ptr() for x in xs if isinstance(x, torch.Tensor) and x.numel()}


def _aliases(name: str, args, kwargs, out) -> bool:
    """An op that is no copy here: not in place, and its output is (a view of) an input, e.g. a
    ``to`` or ``contiguous`` that had nothing to do, or a ``reshape`` that could view."""
    if name.endswith("_") or (kwargs or {}).get("out") is not None or not isinstance(out, torch.Tensor):
        return False
    return bool(_storages([out]) & _storages(list(args) + list((kwargs or {}).values())))


def _self_copy(name: str, args) -> bool:
    """A ``copy_`` of a tensor onto the same memory (what ``t[i] += x`` dispatches after the
    in-place add): ATen returns before launching anything."""
    if name != "copy_" or len(args) < 2 or not all(isinstance(a, torch.Tensor) for a in args[:2]):
        return False
    dst, src = args[0], args[1]
    return (dst.data_ptr() == src.data_ptr() and dst.shape == src.shape and dst.stride() == src.stride()
            and dst.dtype == src.dtype)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if (not self.paused and name not in NO_KERNEL and not _aliases(name, args, kwargs, out)
                and not _self_copy(name, args)):
            self.ops.append(name)
        return out

    def add(self, name: str) -> None:
        if not self.paused:
            self.ops.append(name)

    @contextlib.contextmanager
    def quiet(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


@dataclass
class Census:
    """Kernel-launching ops of one step: ``before`` the first block, per block, ``after`` the last."""

    before: list[str]
    blocks: list[list[str]]
    after: list[str]
    notes: list[str] = field(default_factory=list)

    def per_layer(self) -> list[str]:
        """The ops of a middle block (every block's list, checked to be the same, when depth > 2;
        the first and last can differ only where they may, e.g. the last stores no residual)."""
        return self.blocks[len(self.blocks) // 2]

    @property
    def total(self) -> int:
        return len(self.before) + sum(map(len, self.blocks)) + len(self.after)

    def format(self, what: str = "") -> str:
        lines = [f"# kernel census {what}: {self.total} launches per step, {len(self.per_layer())} per layer "
                 f"({len(self.blocks)} layers; {len(self.before)} before the first, {len(self.after)} after the last)"]
        for i, op in enumerate(self.per_layer()):
            lines.append(f"    {i + 1:2d}. {op}")
        lines.append("  before the first layer: " + ", ".join(self.before))
        lines.append("  after the last layer: " + ", ".join(self.after))
        distinct = {tuple(b) for b in self.blocks}
        if len(distinct) > 1:
            lines.append("  layers differ: " + "; ".join(f"layer {i}: {len(b)}" for i, b in enumerate(self.blocks)))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _triton_classes() -> list[type]:
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    return classes


@contextlib.contextmanager
def _triton_launches(rec: _Recorder):
    """Each Triton kernel launch recorded as ``triton.<kernel>``; the interpreter's own tensor
    copies (arguments to the host and back) are not counted."""
    saved = []
    for cls in _triton_classes():
        orig = cls.__dict__.get("run")
        if orig is None:
            continue

        def run(self, *args, _orig=orig, **kwargs):
            fn = getattr(self, "fn", None)
            rec.add("triton." + getattr(fn, "__name__", type(self).__name__))
            with rec.quiet():
                return _orig(self, *args, **kwargs)

        saved.append((cls, orig))
        cls.run = run
    try:
        yield
    finally:
        for cls, orig in saved:
            cls.run = orig


def _cuda_ff1(rec: _Recorder, ff1):
    """FF1 as CUDA runs it when ``ff1`` is the epilogue form: one ``_addmm_activation``."""
    from cosybatch.codec.dit_step import ff1_gelu_epilogue

    if ff1 is not ff1_gelu_epilogue:
        return ff1, None

    def run(x, w1, b1):
        if x.is_cuda:
            return ff1(x, w1, b1)
        rec.add("_addmm_activation")
        with rec.quiet():
            return ff1(x, w1, b1)

    return run, "FF1: the CUDA op (_addmm_activation, GELU epilogue) counted, the CPU's GEMM + GELU run"


def launches(fn) -> list[str]:
    """The kernel-launching ops of ``fn()`` in order (aten ops less ``NO_KERNEL``, and Triton
    launches as ``triton.<kernel>``): the same census for any step, e.g. an AR decode step."""
    rec = _Recorder()
    with _triton_launches(rec), rec:
        fn()
    return rec.ops


def census(runner, solve, cuda: bool = True) -> Census:
    """Run one Euler step of ``solve`` (a ``FlowSolve`` of ``runner`` with steps left) and
    return its kernel census. ``cuda``: count the CUDA side of the device branches (above). The
    step must run its ops: eager, or a graph bucket whose capture is a stand-in that replays the
    step (a CUDA graph's replay issues no op to count)."""
    t = runner.tables
    rec = _Recorder()
    saved = {k: getattr(t, k) for k in ("pre", "qkv", "post")}
    notes = []

    def opening(fn):
        @functools.wraps(fn)
        def run(*a, **kw):
            rec.ops.append(OPEN)
            return fn(*a, **kw)
        return run

    post = t.post
    if cuda and isinstance(post, functools.partial) and "ff1" in post.keywords:
        ff1, note = _cuda_ff1(rec, post.keywords["ff1"])
        if note:
            post = functools.partial(post.func, *post.args, **{**post.keywords, "ff1": ff1})
            notes.append(note)

    def closing(*a, **kw):
        out = post(*a, **kw)
        rec.ops.append(CLOSE)
        return out

    t.pre, t.qkv, t.post = opening(t.pre), opening(t.qkv), closing
    try:
        with _triton_launches(rec), rec:
            solve.step(1)
    finally:
        for k, v in saved.items():
            setattr(t, k, v)
    before, blocks, after, cur = [], [], [], None
    for op in rec.ops:
        if op == OPEN:
            cur = []
        elif op == CLOSE:
            blocks.append(cur)
            cur = None
        elif cur is not None:
            cur.append(op)
        elif blocks:
            after.append(op)
        else:
            before.append(op)
    return Census(before, blocks, after, notes)
