"""One Triton kernel for every convolution of HiFT's decode stack, and the element-wise kernels
that channels-last decodes need (Snake with causal padding, bias + residual); imported only
where Triton runs (CUDA, or the CPU interpreter in tests).

cuDNN runs HiFT's float32 convs on NCL tensors: a 6-request streaming call on the H200 was 721
launches and 10.65 ms of kernels, 2.2 ms of them layout transposes around the convs and 1.9 ms
the Snake and bias kernels between them, and a shape's first call spends ~100 ms of host time
on plans (docs/performance.md). This kernel is an implicit GEMM over channels-last activations
[B, T, C]: a program computes a [time, out-channel] tile as the sum over taps and input-channel
blocks of [time, in] x [in, out] products, both operands contiguous along the summed channels
(what the tensor cores read without a transpose), each tap's input read straight from x at its
shifted rows (zeros outside: the causal padding). It covers

* the input side of every conv HiFT has: left- or right-causal padding (``shift``), dilation,
  stride (the source downsampling), nearest upsampling by ``up`` (the ``ups`` convs, whose
  input is repeated ``up`` times before a left-causal conv), LeakyReLU of the loaded input
  (0 stays 0, so padding stays zero), and an NCL input (the mel, the source STFT);
* the output side: the bias, then optionally Snake (the activation before the next conv of a
  resblock step), a residual add, an add of another tensor and a division (a stage's resblock
  sum and its mean), a second output (Snake of the result with other alphas: the first
  activation of the next step), and an NCL output (``conv_post``, for the ISTFT).

Snake is x + inv * sin(alpha * x)^2 with ``inv = 1 / (alpha + 1e-9)`` precomputed by PyTorch,
as the eager module evaluates it. Products in TF32 round both operands to nearest first (the
MMA instruction would truncate them: measured 17.6 dB further from float32 than cuDNN's TF32):
the weights once (``conv_weight``), the input as it is loaded or, where only convs read it, by
its producer as it is stored; or they run in float32.
cuDNN sums in another order, so outputs are not bit-equal to its.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cosybatch.codec.triton_kernels import snake_of


@triton.jit
def _tf32(x):
    """float32 -> the nearest TF32 value (ties away from zero), as cvt.rna.tf32.f32."""
    bits = x.to(tl.uint32, bitcast=True)
    return (((bits + 0x1000) >> 13) << 13).to(tl.float32, bitcast=True)  # + half the dropped 13 bits' step


@triton.jit
def _snake(y, alpha_ptr, inv_ptr, co, cmask):
    a = tl.load(alpha_ptr + co, mask=cmask, other=1.0)[None, :]
    inv = tl.load(inv_ptr + co, mask=cmask, other=0.0)[None, :]
    return snake_of(y, a, inv)


# The geometry is runtime arguments: one compiled kernel per combination of the fused steps (~8
# in HiFT) and channel counts' divisibility by 16, not per conv and length (a compile costs a
# first run ~1 s). The channel counts stay specialised: a multiple of 16 lets the copies move 16
# bytes at a time (compiled for sm_90: 36 vector copies per stage instead of 144 scalar ones,
# 134 registers a thread instead of 255).
@triton.jit(do_not_specialize=["T_in", "T_out", "shift", "K", "DIL", "STRIDE", "UP", "rate", "margin"])
def _conv1d_kernel(x_ptr, w_ptr, b_ptr, y_ptr, alpha_ptr, inv_ptr, res_ptr, add_ptr, y2_ptr, alpha2_ptr, inv2_ptr,
                   valid_ptr, C_in, C_out, T_in, T_out, shift, K, DIL, STRIDE, UP, rate, margin, slope, div,
                   X_CL: tl.constexpr, Y_CL: tl.constexpr, LEAKY: tl.constexpr, SNAKE: tl.constexpr,
                   RES: tl.constexpr, ADD: tl.constexpr, DIV: tl.constexpr, OUT2: tl.constexpr, TF32: tl.constexpr,
                   ROUND_X: tl.constexpr, ROUND_Y: tl.constexpr, VALID: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_CI: tl.constexpr, BLOCK_CO: tl.constexpr):
    # A row's own offsets are 32-bit (the wrapper checks they fit), only its base 64-bit: tiles of
    # 64-bit offsets, one per pipeline stage, took twice the registers (ptxas, sm_90).
    b = tl.program_id(2).to(tl.int64)
    x_row = x_ptr + b * C_in * T_in
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    co = tl.program_id(1) * BLOCK_CO + tl.arange(0, BLOCK_CO)
    cmask = co < C_out
    ci_r = tl.arange(0, BLOCK_CI)
    n_ci = tl.cdiv(C_in, BLOCK_CI)
    acc = tl.zeros((BLOCK_T, BLOCK_CO), dtype=tl.float32)
    n_iter = K * n_ci
    if VALID:  # a tile wholly past its row's valid frames (and margin) skips the products
        n_iter = tl.where(tl.program_id(0) * BLOCK_T < (tl.load(valid_ptr + b) + margin) * rate, n_iter, 0)
    for i in range(n_iter):  # one flat loop over (tap, input block), so its loads pipeline
        k = i // n_ci
        ci = (i % n_ci) * BLOCK_CI + ci_r
        pos = t * STRIDE + k * DIL - shift  # in the (upsampled) input's frames
        inside = (pos >= 0) & (pos < T_in * UP)
        src = tl.where(inside, pos, 0) // UP
        xm = inside[:, None] & (ci < C_in)[None, :]
        if X_CL:
            xt = tl.load(x_row + (src[:, None] * C_in + ci[None, :]), mask=xm, other=0.0)
        else:
            xt = tl.load(x_row + (ci[None, :] * T_in + src[:, None]), mask=xm, other=0.0)
        if LEAKY:  # F.leaky_relu: x if x > 0 else x * slope
            xt = tl.where(xt > 0, xt, xt * slope)
        wt = tl.load(w_ptr + ((k * C_out + co[None, :]) * C_in + ci[:, None]),
                     mask=(ci < C_in)[:, None] & cmask[None, :], other=0.0)
        if ROUND_X:  # else x holds TF32 values already (its producer rounded them), and the MMA
            xt = _tf32(xt)  # reads the tile from shared memory as loaded; w: rounded by conv_weight
        if TF32:
            acc = tl.dot(xt, wt, acc, input_precision="tf32")
        else:
            acc = tl.dot(xt, wt, acc, input_precision="ieee")
    # the eager ops' order: conv + bias, then Snake, or + residual, then other + it, then / div
    y = acc + tl.load(b_ptr + co, mask=cmask, other=0.0)[None, :]
    row = b * C_out * T_out
    if Y_CL:
        off = row + (t[:, None] * C_out + co[None, :])
    else:
        off = row + (co[None, :] * T_out + t[:, None])
    omask = (t < T_out)[:, None] & cmask[None, :]
    if SNAKE:
        y = _snake(y, alpha_ptr, inv_ptr, co, cmask)
    if RES:
        y = y + tl.load(res_ptr + off, mask=omask, other=0.0)
    if ADD:
        y = tl.load(add_ptr + off, mask=omask, other=0.0) + y
    if DIV:
        y = y / div
    if ROUND_Y:  # an output only convs read, stored as the TF32 values they would round it to
        tl.store(y_ptr + off, _tf32(y), mask=omask)
    else:
        tl.store(y_ptr + off, y, mask=omask)
    if OUT2:
        y2 = _snake(y, alpha2_ptr, inv2_ptr, co, cmask)
        if TF32:  # the next step's conv1 is its only reader
            y2 = _tf32(y2)
        tl.store(y2_ptr + off, y2, mask=omask)


@triton.jit(do_not_specialize=["n", "T", "pad"])
def _snake_kernel(x_ptr, alpha_ptr, inv_ptr, bias_ptr, y_ptr, n, C, T, pad, BLOCK: tl.constexpr,
                  HAS_BIAS: tl.constexpr, TF32: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # over y [B, pad + T, C]
    m = idx < n
    c = idx % C
    row = idx // C
    src = row % (pad + T) - pad
    inside = m & (src >= 0)
    x = tl.load(x_ptr + (row // (pad + T) * T + src) * C + c, mask=inside, other=0.0)
    if HAS_BIAS:  # the bias of the conv that produced x, added as its own eager add would
        x = x + tl.load(bias_ptr + c, mask=m, other=0.0)
    a = tl.load(alpha_ptr + c, mask=m, other=1.0)
    inv = tl.load(inv_ptr + c, mask=m, other=0.0)
    y = tl.where(inside, snake_of(x, a, inv), 0.0)
    if TF32:
        y = _tf32(y)
    tl.store(y_ptr + idx, y, mask=m)


@triton.jit
def _bias_residual_kernel(y_ptr, bias_ptr, x_ptr, out_ptr, n, C, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    y = tl.load(y_ptr + idx, mask=m, other=0.0) + tl.load(bias_ptr + idx % C, mask=m, other=0.0)
    tl.store(out_ptr + idx, y + tl.load(x_ptr + idx, mask=m, other=0.0), mask=m)


BLOCK = 1024
# Frames past a row's valid ones whose outputs ``conv1d(valid=...)`` still computes: HiFT's last
# stage prepends one position (its reflection pad) and the ISTFT reads the spectrum's frame
# up * valid, both one position past the valid frames (TritonConvDecode.decode_spec).
VALID_MARGIN = 2


def snake(x: torch.Tensor, alpha: torch.Tensor, inv: torch.Tensor, pad: int = 0,
          bias: torch.Tensor | None = None, tf32: bool = False) -> torch.Tensor:
    """Channels-last x [B, T, C] float32 -> [B, pad + T, C]: ``pad`` zero rows, then
    s + inv * sin(alpha * s)^2 with s = x (+ bias [C], when given); rounded to TF32 with
    ``tf32`` (for a conv that reads it in TF32 and nothing else)."""
    if not x.is_contiguous():
        raise ValueError("snake: x must be contiguous [B, T, C]")
    B, T, C = x.shape
    y = torch.empty(B, pad + T, C, device=x.device, dtype=x.dtype)
    if y.numel():
        # no multiply-add contraction: the eager ops round after each multiply
        _snake_kernel[(triton.cdiv(y.numel(), BLOCK),)](x, alpha, inv, alpha if bias is None else bias, y, y.numel(),
                                                         C, T, pad, BLOCK=BLOCK, HAS_BIAS=bias is not None,
                                                         TF32=tf32, num_warps=4, enable_fp_fusion=False)
    return y


def bias_residual(y: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(y + bias) + x for channels-last y, x [B, T, C] float32: a conv's deferred bias and the
    residual add after it, one pass."""
    if not (y.is_contiguous() and x.is_contiguous()):
        raise ValueError("bias_residual: y and x must be contiguous [B, T, C]")
    out = torch.empty_like(y)
    if out.numel():
        _bias_residual_kernel[(triton.cdiv(out.numel(), BLOCK),)](y, bias, x, out, out.numel(), y.shape[-1],
                                                                   BLOCK=BLOCK, num_warps=4)
    return out


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest TF32 values (ties away from zero), as the kernel's ``_tf32``."""
    bits = t.contiguous().view(torch.int32).to(torch.int64)
    return (((bits + 0x1000) >> 13) << 13).to(torch.int32).view(torch.float32)


def conv_weight(w: torch.Tensor, tf32: bool = False) -> torch.Tensor:
    """A Conv1d weight [out, in, K] as the kernel reads it: [K, out, in], contiguous along in;
    rounded to TF32 for ``conv1d(tf32=True)``."""
    w = w.detach().permute(2, 0, 1).contiguous()
    return round_tf32(w) if tf32 else w


def conv_blocks(t_out: int, c_out: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, BLOCK_CI, BLOCK_CO, warps, stages) of a launch. At most 32 accumulators a
    thread: with 64 (a 128 x 64 tile on 4 warps) ptxas for sm_90 needs all 255 registers and
    spills once the Snake epilogue is in (measured by compiling on the CPU)."""
    if t_out >= 2048:
        return 128, 32, max(16, min(64, triton.next_power_of_2(c_out))), 8, 3
    return 64, 32, max(16, min(64, triton.next_power_of_2(c_out))), 4, 3


def conv1d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, *, t_out: int, shift: int = 0, dilation: int = 1,
           stride: int = 1, up: int = 1, leaky: float | None = None, x_cl: bool = True, y_cl: bool = True,
           snake: tuple[torch.Tensor, torch.Tensor] | None = None, residual: torch.Tensor | None = None,
           add: torch.Tensor | None = None, div: float | None = None,
           snake_out: tuple[torch.Tensor, torch.Tensor] | None = None, tf32: bool = False,
           x_tf32: bool = False, round_out: bool = False, valid: torch.Tensor | None = None, rate: int = 1):
    """y[b, t, o] = bias[o] + sum over k, i of w[k, o, i] * act(x_up[b, t * stride + k * dilation - shift, i])
    for x [B, T_in, in] (``x_cl``) or [B, in, T_in] float32 (x_up: x repeated ``up`` times along
    time; outside it zeros; act: LeakyReLU with slope ``leaky``, or none), ``w`` from
    ``conv_weight`` (with its ``tf32`` as here). Then Snake(y) with ``snake`` = (alpha, inv),
    + ``residual``, ``add`` + y, y / ``div``, in that order. Returns y [B, t_out, out]
    (``y_cl``) or [B, out, t_out], and (y, Snake(y) with ``snake_out``'s alphas) when
    ``snake_out`` is given. With ``tf32`` the input is rounded to TF32 as it is loaded unless
    ``x_tf32`` says it holds TF32 values already; ``round_out`` stores y rounded (an output only
    TF32 convs read), and the second output always is. ``valid`` [B] (a device tensor of mel
    frames per row, with ``rate`` output positions per frame): time tiles that start at or past
    (valid + ``VALID_MARGIN``) * rate skip the products, their outputs then only the epilogue of zero
    (finite, and read by nothing a valid output depends on, ``TritonConvDecode.decode_spec``)."""
    B = x.shape[0]
    c_in, t_in = (x.shape[2], x.shape[1]) if x_cl else (x.shape[1], x.shape[2])
    k, c_out, c_in_w = w.shape
    if c_in_w != c_in or not x.is_contiguous() or x.dtype != torch.float32:
        raise ValueError(f"conv1d: x {tuple(x.shape)} {x.dtype} does not fit w {tuple(w.shape)}")
    if max(t_in * up, t_out) * max(c_in, c_out) >= 2**31 or k * c_in * c_out >= 2**31:
        raise ValueError("conv1d: a row of this size needs 64-bit offsets")
    shape = (B, t_out, c_out) if y_cl else (B, c_out, t_out)
    for other in (residual, add):
        if other is not None and (tuple(other.shape) != shape or not other.is_contiguous()):
            raise ValueError(f"conv1d: {tuple(other.shape)} cannot be added to {list(shape)}")
    y = torch.empty(shape, device=x.device, dtype=x.dtype)
    y2 = torch.empty_like(y) if snake_out is not None else y
    if y.numel():
        bt, bci, bco, warps, stages = conv_blocks(t_out, c_out)
        grid = (triton.cdiv(t_out, bt), triton.cdiv(c_out, bco), B)
        a1, i1 = snake if snake is not None else (bias, bias)
        a2, i2 = snake_out if snake_out is not None else (bias, bias)
        _conv1d_kernel[grid](x, w, bias, y, a1, i1, y if residual is None else residual, y if add is None else add,
                             y2, a2, i2, bias if valid is None else valid, c_in, c_out, t_in, t_out, shift, k,
                             dilation, stride, up, rate, VALID_MARGIN, 0.0 if leaky is None else float(leaky),
                             float(div or 1.0),
                             X_CL=x_cl, Y_CL=y_cl, LEAKY=leaky is not None, SNAKE=snake is not None,
                             RES=residual is not None, ADD=add is not None, DIV=div is not None,
                             OUT2=snake_out is not None, TF32=tf32, ROUND_X=tf32 and not x_tf32,
                             ROUND_Y=tf32 and round_out, VALID=valid is not None, BLOCK_T=bt, BLOCK_CI=bci, BLOCK_CO=bco,
                             num_warps=warps, num_stages=stages)
    return (y, y2) if snake_out is not None else y
