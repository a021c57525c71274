"""Process-wide numeric settings, set in one place at start-up and logged (design.md D12).

PyTorch keeps intra-op threads and TF32 switches per process. The pipeline builders call
:func:`apply_process_settings` once, before any model work; a component whose precision is its
own (the GPU frontend) scopes it with :func:`float32_math` and leaves the process's as it was.
"""

from __future__ import annotations

import importlib
import logging
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessSettings:
    intra_op_threads: int | None = None  # None: leave torch's default
    cudnn_tf32: bool | None = None  # float32 convolutions on TF32 tensor cores (CUDA only)
    matmul_tf32: bool | None = None  # float32 matmuls on TF32 tensor cores (CUDA only)
    gemm_sm_carveout: int | None = None  # SMs cuBLAS(Lt) GEMMs leave free (CUDA only); None: none


def triton_available() -> bool:
    """Whether Triton imports (the CUDA kernels of the AR engine and of the codec)."""
    try:
        importlib.import_module("triton")
    except Exception:
        return False
    return True


def apply_process_settings(s: ProcessSettings) -> None:
    import torch

    if s.intra_op_threads is not None and s.intra_op_threads != torch.get_num_threads():
        log.info("torch intra-op threads: %d -> %d", torch.get_num_threads(), s.intra_op_threads)
        torch.set_num_threads(s.intra_op_threads)
    if s.cudnn_tf32 is not None:
        torch.backends.cudnn.allow_tf32 = s.cudnn_tf32
    if s.matmul_tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = s.matmul_tf32
    if s.cudnn_tf32 is not None or s.matmul_tf32 is not None:
        log.info("float32 on CUDA: convolutions %s, matmuls %s", _tf32(s.cudnn_tf32), _tf32(s.matmul_tf32))
    if s.gemm_sm_carveout is not None:
        # PyTorch's switch for cuBLASLt's SM count target (the matmuls it routes there, which
        # include linear layers with a bias); kept by the graphs captured after it
        set_carveout = getattr(torch._C, "_set_sm_carveout_experimental", None)
        if set_carveout is None:
            log.warning("this PyTorch cannot leave SMs free for other streams' kernels: "
                        "scheduler.gemm_sm_carveout is ignored")
        else:
            set_carveout(s.gemm_sm_carveout)
            log.info("cuBLAS GEMMs leave %d SMs free", s.gemm_sm_carveout)


@contextmanager
def float32_math(conv_tf32: bool, matmul_tf32: bool):
    """Run a block with its own float32 switches and restore the process's afterwards.

    For a component whose numerics must not follow the process setting (the GPU frontend keeps
    strict float32 convolutions while HiFT's profile turns TF32 on). The switches are
    process-wide: only for code on the one thread that issues the GPU work. Kernels captured
    into a CUDA graph inside the block keep its settings."""
    import torch

    cudnn, cublas = torch.backends.cudnn, torch.backends.cuda.matmul
    before = cudnn.allow_tf32, cublas.allow_tf32
    cudnn.allow_tf32, cublas.allow_tf32 = conv_tf32, matmul_tf32
    try:
        yield
    finally:
        cudnn.allow_tf32, cublas.allow_tf32 = before


def _tf32(flag: bool | None) -> str:
    return "unchanged" if flag is None else ("TF32" if flag else "strict float32")
