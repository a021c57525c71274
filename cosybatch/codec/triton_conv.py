"""One Triton kernel for every convolution of HiFT's decode stack (imported only where Triton
runs: CUDA, or the CPU interpreter in tests).

cuDNN runs HiFT's float32 convs in NCL with a plan per shape: a streaming call launched ~720
kernels (the convs, layout transposes around them, the Snake and bias kernels) and a shape's
first call spends ~100 ms of host time on plans (docs/performance.md). This kernel is an
implicit GEMM over NCL tensors as they are: a program computes a [time, out-channel] tile as
the sum over taps and input-channel blocks of [time, in] x [in, out] products, reading each
tap's shifted input straight from x (zeros outside it: the causal padding), with

* the input side of every conv HiFT has: left- or right-causal padding (``shift``), dilation,
  stride (the source downsampling) and nearest upsampling by ``up`` (the ``ups`` convs, whose
  input is repeated ``up`` times before a left-causal conv), and LeakyReLU applied to the
  loaded input (it maps 0 to 0, so padding stays zero);
* the output side: the bias, then optionally Snake (the activation before the next conv of a
  resblock pair), a residual add, an add of another tensor and a division (a stage's resblock
  sum and its mean), and a second output, Snake of the result with other alphas (the first
  activation of the next pair).

Snake is x + inv * sin(alpha * x)^2 with ``inv = 1 / (alpha + 1e-9)`` precomputed by PyTorch,
as the eager module and ``triton_kernels.snake_pad`` evaluate it. The products run on tensor
cores in TF32 or, ``ieee``, in float32; cuDNN's TF32 sums in another order, so the outputs are
not bit-equal to its (the tests bound them against float32).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter has no libdevice
    @triton.jit
    def _sin(x):
        return tl.sin(x)
else:  # the CUDA math library's sinf, as PyTorch's own kernels use
    from triton.language.extra import libdevice

    _sin = libdevice.sin

ACT_NONE, ACT_LEAKY = 0, 1


@triton.jit
def _snake(y, alpha_ptr, inv_ptr, co, cmask):
    a = tl.load(alpha_ptr + co, mask=cmask, other=1.0)[None, :]
    inv = tl.load(inv_ptr + co, mask=cmask, other=0.0)[None, :]
    s = _sin(y * a)
    return y + inv * (s * s)


# The geometry is runtime arguments, none specialised: one compiled kernel per combination of
# the fused steps (~8 in HiFT), not per conv and length (each compile costs the first run ~1 s).
@triton.jit(do_not_specialize=["C_in", "C_out", "T_in", "T_out", "shift", "K", "DIL", "STRIDE", "UP"])
def _conv1d_kernel(x_ptr, w_ptr, b_ptr, y_ptr, alpha_ptr, inv_ptr, res_ptr, add_ptr, y2_ptr, alpha2_ptr, inv2_ptr,
                   C_in, C_out, T_in, T_out, shift, K, DIL, STRIDE, UP, slope, div,
                   ACT: tl.constexpr, SNAKE: tl.constexpr, RES: tl.constexpr,
                   ADD: tl.constexpr, DIV: tl.constexpr, OUT2: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_CI: tl.constexpr, BLOCK_CO: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    co = tl.program_id(1) * BLOCK_CO + tl.arange(0, BLOCK_CO)
    cmask = co < C_out
    ci_r = tl.arange(0, BLOCK_CI)
    x_row = x_ptr + b * C_in * T_in
    n_ci = tl.cdiv(C_in, BLOCK_CI)
    acc = tl.zeros((BLOCK_T, BLOCK_CO), dtype=tl.float32)
    for i in range(K * n_ci):  # one flat loop over (tap, input block), so loads pipeline
        k = i // n_ci
        ci = (i % n_ci) * BLOCK_CI + ci_r
        pos = t * STRIDE + k * DIL - shift  # in the (upsampled) input's frames
        inside = (pos >= 0) & (pos < T_in * UP)
        src = tl.where(inside, pos, 0) // UP
        xm = inside[:, None] & (ci < C_in)[None, :]
        xt = tl.load(x_row + ci[None, :].to(tl.int64) * T_in + src[:, None], mask=xm, other=0.0)
        if ACT == 1:  # LeakyReLU before the conv (F.leaky_relu: x if x > 0 else x * slope)
            xt = tl.where(xt > 0, xt, xt * slope)
        wt = tl.load(w_ptr + (k * C_in + ci)[:, None] * C_out + co[None, :],
                     mask=(ci < C_in)[:, None] & cmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xt, wt, acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, wt, acc, input_precision="tf32")
    # the eager ops' order: conv + bias, then Snake, or + residual, then other + it, then / div
    y = acc + tl.load(b_ptr + co, mask=cmask, other=0.0)[None, :]
    off = b * C_out * T_out + co[None, :].to(tl.int64) * T_out + t[:, None]
    omask = (t < T_out)[:, None] & cmask[None, :]
    if SNAKE:
        y = _snake(y, alpha_ptr, inv_ptr, co, cmask)
    if RES:
        y = y + tl.load(res_ptr + off, mask=omask, other=0.0)
    if ADD:
        y = tl.load(add_ptr + off, mask=omask, other=0.0) + y
    if DIV:
        y = y / div
    tl.store(y_ptr + off, y, mask=omask)
    if OUT2:
        tl.store(y2_ptr + off, _snake(y, alpha2_ptr, inv2_ptr, co, cmask), mask=omask)


def conv_weight(w: torch.Tensor) -> torch.Tensor:
    """A Conv1d weight [out, in, K] as the kernel reads it: [K, in, out], contiguous."""
    return w.detach().permute(2, 1, 0).contiguous()


def conv1d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, *, t_out: int, shift: int = 0, dilation: int = 1,
           stride: int = 1, up: int = 1, leaky: float | None = None,
           snake: tuple[torch.Tensor, torch.Tensor] | None = None, residual: torch.Tensor | None = None,
           add: torch.Tensor | None = None, div: float | None = None,
           snake_out: tuple[torch.Tensor, torch.Tensor] | None = None, ieee: bool = False):
    """y[b, o, t] = bias[o] + sum over k, i of w[k, i, o] * act(x_up[b, i, t * stride + k * dilation - shift])
    for x [B, in, T_in] float32 (x_up: x repeated ``up`` times along time; outside it zeros; act:
    LeakyReLU with slope ``leaky`` or none), ``w`` from ``conv_weight``. Then Snake(y) with
    ``snake`` = (alpha, inv), + ``residual``, ``add`` + y, y / ``div``, in that order. Returns y
    [B, out, t_out], and (y, Snake(y) with ``snake_out``'s alphas) when ``snake_out`` is given."""
    B, c_in, t_in = x.shape
    k, c_in_w, c_out = w.shape
    if c_in_w != c_in or not x.is_contiguous() or x.dtype != torch.float32:
        raise ValueError(f"conv1d: x {tuple(x.shape)} {x.dtype} does not fit w {tuple(w.shape)}")
    for other in (residual, add):
        if other is not None and (other.shape != (B, c_out, t_out) or not other.is_contiguous()):
            raise ValueError(f"conv1d: {tuple(other.shape)} cannot be added to [{B}, {c_out}, {t_out}]")
    y = torch.empty(B, c_out, t_out, device=x.device, dtype=x.dtype)
    y2 = torch.empty_like(y) if snake_out is not None else y
    if y.numel():
        block_co = max(16, min(64, triton.next_power_of_2(c_out)))
        block_t = 128 if t_out >= 4096 else 64
        grid = (triton.cdiv(t_out, block_t), triton.cdiv(c_out, block_co), B)
        a1, i1 = snake if snake is not None else (bias, bias)
        a2, i2 = snake_out if snake_out is not None else (bias, bias)
        _conv1d_kernel[grid](x, w, bias, y, a1, i1, y if residual is None else residual, y if add is None else add,
                             y2, a2, i2, c_in, c_out, t_in, t_out, shift, k, dilation, stride, up,
                             0.0 if leaky is None else float(leaky), float(div or 1.0),
                             ACT=ACT_NONE if leaky is None else ACT_LEAKY, SNAKE=snake is not None,
                             RES=residual is not None, ADD=add is not None, DIV=div is not None,
                             OUT2=snake_out is not None, IEEE=ieee, BLOCK_T=block_t, BLOCK_CI=32,
                             BLOCK_CO=block_co, num_warps=4, num_stages=3)
    return (y, y2) if snake_out is not None else y
