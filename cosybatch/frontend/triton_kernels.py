"""The GPU frontend's Triton kernels (imported only on CUDA; the tests run them in Triton's CPU
interpreter). Both replace chains of small ops whose count, not their work, sets a launch's cost:
a frontend launch queued ~1,640 kernels from the host, half of them CAM++'s (design.md D40).

- ``tf32_split2``: the operand of a 3xTF32 linear (``split_tf32``), ``[x_lo | x_hi]`` side by
  side in one pass, so the two small products are one GEMM over twice the inner size.
- ``cam_taps_gate``: the tail of a CAM++ dense layer (``models.campplus_fast``): the dilated
  conv's taps shifted into place and summed, times the context gate of each frame's segment,
  written into the layer's slice of the dense block's buffer (five to six ops before).

Both evaluate their eager twins' float32 operations in the same order, so the tests hold them to
those ops bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit(do_not_specialize=["n"])  # n only bounds a mask
def _tf32_split2_kernel(x_ptr, out_ptr, n, K, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    # int32 0xFFFFE000 (sign, exponent, the top 10 mantissa bits): the high part TF32 holds
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    dst = out_ptr + (offs // K) * (2 * K) + offs % K
    tl.store(dst, x - hi, mask=inside)
    tl.store(dst + K, hi, mask=inside)


def tf32_split2(x: torch.Tensor) -> torch.Tensor:
    """[M, K] float32 -> [M, 2K]: each row's low part, then its high part (``split_tf32.split``)."""
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, 2 * k, dtype=x.dtype, device=x.device)
    n = x.numel()
    if n:
        _tf32_split2_kernel[(triton.cdiv(n, BLOCK),)](x, out, n, k, BLOCK=BLOCK, num_warps=4)
    return out


@triton.jit(do_not_specialize=["T", "dilation", "S", "out_batch", "out_row"])
def _cam_taps_gate_kernel(z_ptr, gate_ptr, seg_ptr, keep_ptr, out_ptr, T, dilation, S, out_batch, out_row,
                          G: tl.constexpr, TAPS: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr, PADDED: tl.constexpr):
    b = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_C)
    rows = t < T
    cols = c < G
    both = rows[:, None] & cols[None, :]
    zb = z_ptr + b.to(tl.int64) * T * (TAPS * G)
    # the centre tap first, then the others in tap order, as ``CAMPPlusFast._local`` adds them
    acc = tl.load(zb + t[:, None] * (TAPS * G) + HALF * G + c[None, :], mask=both, other=0.0)
    for k in tl.static_range(TAPS):
        if k != HALF:
            s = (k - HALF) * dilation  # this tap reads frame t + s
            src = t + s
            ok = both & ((src >= 0) & (src < T))[:, None]
            zk = tl.load(zb + src[:, None] * (TAPS * G) + k * G + c[None, :], mask=ok, other=0.0)
            if PADDED:
                if k > HALF:  # reads ahead: frames past a row's end are zero padding
                    kp = tl.load(keep_ptr + b.to(tl.int64) * T + src, mask=rows & (src >= 0) & (src < T), other=0.0)
                    zk = zk * kp[:, None]
            acc = tl.where(ok, acc + zk, acc)  # no add where the eager op adds nothing
    seg = tl.load(seg_ptr + t, mask=rows, other=0)
    g = tl.load(gate_ptr + (b.to(tl.int64) * S + seg[:, None]) * G + c[None, :], mask=both, other=0.0)
    tl.store(out_ptr + b.to(tl.int64) * out_batch + t[:, None] * out_row + c[None, :], acc * g, mask=both)


def cam_taps_gate(z: torch.Tensor, gate: torch.Tensor, seg_of: torch.Tensor, keep: torch.Tensor | None,
                  out: torch.Tensor, taps: int, dilation: int) -> None:
    """``out`` [B, T, G] (a channel slice of the dense block's buffer) = the dilated conv of taps
    ``z`` [B, T, taps * G] (every tap's GEMM output side by side) times ``gate`` [B, S, G] of each
    frame's segment ``seg_of`` [T]; ``keep`` [B, T, 1] (0/1) masks frames past a row's end where a
    tap reads ahead (None: no row is padded)."""
    bsz, t, width = z.shape
    g = width // taps
    if out.stride(2) != 1 or z.stride(2) != 1 or not z.is_contiguous() or not gate.is_contiguous():
        raise ValueError("cam_taps_gate: z and gate contiguous, out's channels adjacent")
    block_t = 32
    keep_arg = keep.reshape(bsz, t).contiguous() if keep is not None else z  # unread without PADDED
    _cam_taps_gate_kernel[(bsz, triton.cdiv(t, block_t))](
        z, gate, seg_of, keep_arg, out, t, dilation, gate.shape[1], out.stride(0), out.stride(1),
        G=g, TAPS=taps, HALF=(taps - 1) // 2, BLOCK_T=block_t, BLOCK_C=triton.next_power_of_2(g),
        PADDED=keep is not None, num_warps=4)


__all__ = ["cam_taps_gate", "tf32_split2"]
