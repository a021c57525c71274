"""The codec's Triton kernels run by Triton's CPU interpreter, against their eager twins.

Only where ``triton`` is importable and no GPU is present (tests/test_codec_flow_gpu.py and
tests/test_codec_hift.py run the compiled kernels on the GPU, bf16 included). The interpreter
evaluates in float32 with NumPy's math (no CUDA math library), so the bounds here are float32
reordering bounds, not the GPU tests' bit-equality.
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.numeric, pytest.mark.usefixtures("one_thread")]

if torch.cuda.is_available():
    pytest.skip("GPU present: the GPU tests run the compiled kernels", allow_module_level=True)
pytest.importorskip("triton")

from cosybatch.codec import triton_kernels as K  # noqa: E402
from cosybatch.codec.dit_step import ConvPositionEmbed, rotary_qk_, rotary_tables  # noqa: E402
from cosybatch.models.config import DiTConfig  # noqa: E402
from cosybatch.models.dit import DiT  # noqa: E402
from parity import rel_rms  # noqa: E402


def test_position_conv_kernel_matches_the_module_on_packed_rows():
    torch.manual_seed(0)
    dit = DiT(DiTConfig(dim=64, depth=1, heads=2, dim_head=32, conv_pos_kernel=7, conv_pos_groups=4)).eval()
    k, dim = 7, 64
    a, b = torch.randn(20, dim), torch.randn(9, dim)
    gap = torch.zeros(k - 1, dim)
    packed = torch.cat((gap, a, gap, b))
    valid = torch.cat((torch.zeros(k - 1), torch.ones(20), torch.zeros(k - 1), torch.ones(9)))
    with torch.no_grad():
        want = ConvPositionEmbed(dit, "conv1d")(packed, valid)
        got = ConvPositionEmbed(dit, "triton")(packed, valid)
        alone = [dit.input_embed.conv_pos_embed(x[None])[0] + x for x in (a, b)]
    assert (got - want).abs().max().item() <= 1e-5
    assert (got[k - 1 : k - 1 + 20] - alone[0]).abs().max().item() <= 1e-5  # rows stay apart
    assert (got[2 * (k - 1) + 20 :] - alone[1]).abs().max().item() <= 1e-5


def test_position_conv_kernel_masks_and_adds():
    g = torch.Generator().manual_seed(1)
    x, w, bias = torch.randn(45, 32, generator=g), torch.randn(32, 16, 5, generator=g) / 9, torch.randn(32, generator=g)
    valid = (torch.rand(45, generator=g) > 0.3).float()
    conv = F.mish(F.conv1d(F.pad(x.t()[None], (4, 0)), w, bias, groups=2))[0].t()
    wt = K.conv_weight(w, 2)
    for block in (16, 64):  # a tail block, and one block past the end
        assert (K.causal_conv_mish(x, wt, bias, valid=valid, block_t=block) - conv * valid[:, None]).abs().max() <= 1e-5
        assert (K.causal_conv_mish(x, wt, bias, residual=x, block_t=block) - (conv + x)).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="layout"):
        K.causal_conv_mish(x.t(), wt, bias)


def test_snake_bias_residual_and_rotary_kernels_match_their_eager_twins():
    g = torch.Generator().manual_seed(2)
    x, alpha = torch.randn(2, 3, 50, generator=g), torch.rand(3, generator=g) + 0.5
    inv = 1.0 / (alpha + 1e-9)
    want = F.pad(x + inv[None, :, None] * torch.sin(x * alpha[None, :, None]).pow(2), (6, 0))
    assert (K.snake_pad(x, alpha, inv, 6) - want).abs().max() <= 1e-6
    bias = torch.randn(3, generator=g)
    xb = x + bias[None, :, None]
    want = F.pad(xb + inv[None, :, None] * torch.sin(xb * alpha[None, :, None]).pow(2), (2, 0))
    assert (K.snake_pad(x, alpha, inv, 2, bias) - want).abs().max() <= 1e-6
    y = torch.randn_like(x)
    assert (K.bias_residual(y, bias, x) - ((y + bias[None, :, None]) + x)).abs().max() <= 1e-6
    qkv = torch.randn(9, 3, 48, generator=g)
    freqs = torch.arange(9.0)[:, None] * torch.rand(8, generator=g).repeat_interleave(2)
    cos, sin = rotary_tables(freqs)
    a, b = qkv.clone(), qkv.clone()
    rotary_qk_(a, cos, sin)
    K.rotary_qk_(b, cos, sin)
    assert (a - b).abs().max() <= 1e-6 and torch.equal(b[:, 2], qkv[:, 2])


def test_gated_residual_ln_kernel_matches_addcmul_then_layer_norm():
    g = torch.Generator().manual_seed(3)
    h, y = torch.randn(2, 7, 40, generator=g).unbind(0)  # 40 channels: a masked tail in a 64-wide block
    gate, scale1, shift = torch.randn(3, 40, generator=g).unbind(0)
    want_h = torch.addcmul(h, gate, y)
    want_x = F.layer_norm(want_h, (40,), scale1, shift, eps=1e-6)
    got_h, got_x = K.gated_residual_ln(h, gate, y, scale1, shift, 1e-6)
    assert (got_h - want_h).abs().max() <= 1e-6
    assert (got_x - want_x).abs().max() <= 1e-5
    # the LayerNorm reads the updated residual, not the old one
    assert (K.gated_residual_ln(h, gate * 0, y, scale1, shift, 1e-6)[1] - want_x).abs().max() > 1e-2


def test_rotary_kv_kernel_rotates_and_writes_the_arena_rows():
    """The rotary + K/V arena writes against the eager rotary and two index_copy_: the rotary is
    the same float32 multiply-add (1e-6), the copies exact; rows not written stay untouched."""
    from cosybatch.codec.dit_step import rotary_qk_kv_

    g = torch.Generator().manual_seed(4)
    n, heads, dh, rot = 7, 3, 16, 8  # inner 48: a masked tail in a 64-wide block
    inner = heads * dh
    qkv = torch.randn(n, 3, inner, generator=g)
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * torch.rand(rot // 2, generator=g).repeat_interleave(2)
    cos, sin = rotary_tables(freqs)
    rows = torch.tensor([5, 0, 11, 3, 12, 7, 12])  # the dump row (12) written twice, as padding does
    arena = torch.randn(2, 13, heads, dh, generator=g)
    a, b = qkv.clone(), qkv.clone()
    ka, va = arena[0].clone(), arena[1].clone()
    kb, vb = arena[0].clone(), arena[1].clone()
    rotary_qk_kv_(a, cos, sin, ka, va, rows)
    K.rotary_qk_kv_(b, cos, sin, kb, vb, rows)
    assert (a - b).abs().max() <= 1e-6 and torch.equal(b[:, 2], qkv[:, 2]) and torch.equal(b[:, :2, rot:], qkv[:, :2, rot:])
    assert (ka - kb).abs().max() <= 1e-6 and torch.equal(va, vb)
    untouched = [r for r in range(13) if r not in rows.tolist()]
    assert torch.equal(kb[untouched], arena[0, untouched]) and torch.equal(vb[untouched], arena[1, untouched])
    once = [0, 1, 2, 3, 5]  # tokens whose row no other token writes
    assert torch.equal(kb[rows[once]], b[once, 1].unflatten(-1, (heads, dh)))  # the rotated k, as q/k/v hold it
    with pytest.raises(ValueError, match="layout"):
        K.rotary_qk_kv_(b, cos, sin, kb.to(torch.float64), vb, rows)


def test_gated_residual_ln_without_the_residual_store():
    g = torch.Generator().manual_seed(5)
    h, y = torch.randn(2, 5, 40, generator=g).unbind(0)
    gate, scale1, shift = torch.randn(3, 40, generator=g).unbind(0)
    want = K.gated_residual_ln(h, gate, y, scale1, shift, 1e-6)[1]
    none, got = K.gated_residual_ln(h, gate, y, scale1, shift, 1e-6, keep_h=False)
    assert none is None and torch.equal(got, want)


def _snake_ref(x, alpha, inv):
    return x + inv[None, :, None] * torch.sin(x * alpha[None, :, None]).pow(2)


def _cl(x):  # NCL <-> channels-last
    return x.transpose(1, 2).contiguous()


def test_hift_conv_kernel_covers_every_conv_geometry():
    """``triton_conv.conv1d`` against F.conv1d for each way HiFT pads, dilates, strides and
    upsamples, NCL and channels-last in and out, with odd channel counts (masked blocks) and
    lengths past one tile."""
    from cosybatch.codec import triton_conv as C

    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 18, 150, generator=g)
    for c_out, k, dil in ((24, 3, 1), (24, 7, 3), (80, 11, 5)):
        w, b = torch.randn(c_out, 18, k, generator=g) / 8, torch.randn(c_out, generator=g)
        pad = (k - 1) * dil
        want = F.conv1d(F.pad(x, (pad, 0)), w, b, dilation=dil)  # left-causal
        got = C.conv1d(_cl(x), C.conv_weight(w), b, t_out=150, shift=pad, dilation=dil)
        assert (_cl(got) - want).abs().max() <= 1e-4, (c_out, k, dil)
    w, b = torch.randn(40, 18, 5, generator=g) / 8, torch.randn(40, generator=g)
    want = F.conv1d(F.pad(x, (0, 4)), w, b)  # right-causal (conv_pre, zeros past the end), NCL in and out
    got = C.conv1d(x, C.conv_weight(w), b, t_out=150, x_cl=False, y_cl=False)
    assert (got - want).abs().max() <= 1e-4
    w6 = torch.randn(40, 18, 6, generator=g) / 8
    want = F.conv1d(F.pad(x, (2, 0)), w6, b, stride=3)  # the source downsampling: 2 zeros, stride 3
    assert want.shape[2] == 49
    got = C.conv1d(x, C.conv_weight(w6), b, t_out=49, shift=2, stride=3, x_cl=False)
    assert (_cl(got) - want).abs().max() <= 1e-4
    w7 = torch.randn(40, 18, 7, generator=g) / 8  # LeakyReLU, nearest x5 upsampling, left-causal
    up = F.interpolate(F.leaky_relu(x, 0.1), scale_factor=5.0, mode="nearest")
    want = F.conv1d(F.pad(up, (6, 0)), w7, b)
    got = C.conv1d(_cl(x), C.conv_weight(w7), b, t_out=750, shift=6, up=5, leaky=0.1)
    assert (_cl(got) - want).abs().max() <= 1e-4


def test_hift_conv_kernel_epilogues_and_snake():
    """Snake of the output, + residual, other + it, / n, and the second output (Snake with other
    alphas), each in the eager ops' order; the channels-last Snake (with causal padding and a
    bias) and bias + residual kernels."""
    from cosybatch.codec import triton_conv as C

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 32, 70, generator=g)
    w, b = torch.randn(32, 32, 3, generator=g) / 6, torch.randn(32, generator=g)
    conv = F.conv1d(F.pad(x, (2, 0)), w, b)
    wt, xc = C.conv_weight(w), _cl(x)
    alpha, alpha2 = torch.rand(32, generator=g) + 0.3, torch.rand(32, generator=g) + 0.3
    s1, s2 = (alpha, 1.0 / (alpha + 1e-9)), (alpha2, 1.0 / (alpha2 + 1e-9))
    other = torch.randn_like(x)
    assert (_cl(C.snake(xc, *s1)) - _snake_ref(x, *s1)).abs().max() <= 1e-6
    bias = torch.randn(32, generator=g)
    want = F.pad(_snake_ref(x + bias[None, :, None], *s1), (4, 0))
    assert (_cl(C.snake(xc, *s1, pad=4, bias=bias)) - want).abs().max() <= 1e-6
    assert (_cl(C.bias_residual(_cl(other), bias, xc)) - ((other + bias[None, :, None]) + x)).abs().max() <= 1e-6
    got = C.conv1d(xc, wt, b, t_out=70, shift=2, snake=s1)
    assert (_cl(got) - _snake_ref(conv, *s1)).abs().max() <= 1e-4
    y, y2 = C.conv1d(xc, wt, b, t_out=70, shift=2, residual=xc, snake_out=s2)
    assert (_cl(y) - (conv + x)).abs().max() <= 1e-4 and (_cl(y2) - _snake_ref(conv + x, *s2)).abs().max() <= 1e-4
    got = C.conv1d(xc, wt, b, t_out=70, shift=2, residual=xc, add=_cl(other), div=3.0)
    assert (_cl(got) - (other + (conv + x)) / 3).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="cannot be added"):
        C.conv1d(xc, wt, b, t_out=70, shift=2, residual=xc[:, :60].contiguous())


def test_hift_conv_kernel_rounds_tf32_operands_to_nearest():
    """In TF32 both operands are rounded to the nearest TF32 value (ties away) before the
    product, as cuDNN's TF32 does, instead of letting the MMA truncate them (the input in the
    kernel, the weights by ``conv_weight``): the result is the float32 conv of the rounded
    operands."""
    from cosybatch.codec import triton_conv as C

    def rna(t):  # round float32 to 10 mantissa bits, ties away from zero
        bits = t.view(torch.int32).to(torch.int64)
        return (((bits + 0x1000) >> 13) << 13).to(torch.int32).view(torch.float32)

    g = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(2, 40, 64, generator=g), torch.randn(32, 40, 3, generator=g), torch.randn(32, generator=g)
    assert torch.equal(rna(torch.tensor([1 + 2**-11, 1 + 2**-12, -(1 + 2**-11)])),
                       torch.tensor([1 + 2**-10, 1.0, -(1 + 2**-10)]))
    assert torch.equal(C.round_tf32(w), rna(w))
    want = F.conv1d(F.pad(rna(x), (2, 0)), rna(w), b)
    got = _cl(C.conv1d(_cl(x), C.conv_weight(w, tf32=True), b, t_out=64, shift=2, tf32=True))
    assert (got - want).abs().max() <= 1e-4
    assert (got - F.conv1d(F.pad(x, (2, 0)), w, b)).abs().max() > 1e-4  # it did round


def _narrow_hift():
    from cosybatch.models.config import HiFTConfig
    from cosybatch.models.hift import CausalHiFTGenerator, Snake

    torch.manual_seed(6)
    hift = CausalHiFTGenerator(HiFTConfig(base_channels=32, f0_cond_channels=16)).eval()
    with torch.no_grad():
        for m in hift.modules():
            if isinstance(m, Snake):
                m.alpha.uniform_(0.2, 3.0)
    return hift


@pytest.mark.parametrize("tf32", [False, True])
def test_hift_triton_decode_is_the_modules_decode(tf32):
    """``TritonConvDecode.decode_spec`` against ``CausalHiFTGenerator.decode_spec(finalize=True)``
    on a narrow HiFT of the full geometry (its rates, kernels, dilations) with trained-like Snake
    alphas: the same stack, summed in another order (float32: within 1e-4 of the
    largest value). In TF32 against the module with every conv's weight and input rounded to TF32
    (a pre-hook), which is where the decode rounds (in the kernel as loaded, or stored rounded by
    the producer of an input only convs read): another summation order moves a value across a
    TF32 rounding boundary now and then, so the bound is a relative RMS under TF32's unit
    roundoff (2^-11 = 4.9e-4; measured 2.6e-4, against 5.8e-4 from the float32 decode)."""
    import copy

    from cosybatch.codec import triton_conv as C
    from cosybatch.codec.hift_convs import TritonConvDecode, _convs

    hift = _narrow_hift()
    frames, rows = 4, 1 if tf32 else 2  # rows apart are the float32 case's; one keeps TF32's short
    mel = torch.randn(rows, 80, frames)
    s_stft = torch.randn(rows, hift.cfg.n_fft + 2, frames * hift.up_total + 1)
    ref = hift
    if tf32:
        ref = copy.deepcopy(hift)
        for c in _convs(ref):
            c.weight.data = C.round_tf32(c.weight.data)
            c.register_forward_pre_hook(lambda m, args: (C.round_tf32(args[0]), *args[1:]))
    keep = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        with torch.inference_mode():
            want = ref.decode_spec(mel, s_stft, finalize=True)
            got = TritonConvDecode(hift).decode_spec(mel, s_stft)
            plain = hift.decode_spec(mel, s_stft, finalize=True)
            # valid frames per row (HiftRunner's padding rows have 1)
            short = None if tf32 else TritonConvDecode(hift).decode_spec(mel, s_stft, torch.tensor([frames, 1]))
    finally:
        torch.backends.cudnn.allow_tf32 = keep
    assert got.shape == want.shape
    if not tf32:
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
        # with valid frames, the spectrum's frames up to up * valid equal the full decode's bit
        # for bit; past the margin the products were skipped
        keep = hift.up_total + 1
        assert torch.equal(short[0], got[0]) and torch.equal(short[1, :, :keep], got[1, :, :keep])
        assert torch.isfinite(short).all() and not torch.equal(short[1, :, -64:], got[1, :, -64:])
        return
    assert rel_rms(got, want) <= 4e-4 and rel_rms(got, plain) >= 4e-4


def test_hift_triton_decode_launches_only_aligned_tensors(monkeypatch):
    """Triton compiles one variant of a kernel per pointer alignment (a 16-byte boundary or
    not), and the launch list compiled ahead of a run holds aligned launches only: HiftRunner
    hands the decode a row of its [3, B] int64 table as ``valid``, 8 bytes off that boundary for
    an odd B. The decode launches every conv with aligned tensors all the same (else each conv's
    unaligned variant is compiled inside a first run's window), and ``valid`` still counts."""
    from cosybatch.codec import triton_conv as C
    from cosybatch.codec.hift_convs import TritonConvDecode

    offsets = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                offsets.extend(a.data_ptr() % 16 for a in args if isinstance(a, torch.Tensor))
                return launch(*args, **kwargs)
            return run

    for name in ("_conv1d_kernel", "_snake_kernel"):
        monkeypatch.setattr(C, name, Spy(getattr(C, name)))
    hift = _narrow_hift()
    frames = 4
    mel = torch.randn(1, 80, frames)
    s_stft = torch.randn(1, hift.cfg.n_fft + 2, frames * hift.up_total + 1)
    ints = torch.tensor([[0], [1], [0]])  # one row, one valid frame
    assert ints[1].data_ptr() % 16  # the case: the table's second row off the boundary
    decode = TritonConvDecode(hift)
    with torch.inference_mode():
        got = decode.decode_spec(mel, s_stft, ints[1])
        offsets_valid = list(offsets)
        full = decode.decode_spec(mel, s_stft)
    assert offsets_valid and set(offsets_valid) == {0}
    keep = hift.up_total + 1  # up to the valid frame's spectrum the decode's, past the margin skipped
    assert torch.equal(got[..., :keep], full[..., :keep]) and not torch.equal(got[..., -64:], full[..., -64:])
