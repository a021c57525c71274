"""3xTF32 GEMMs (``frontend_models.split_tf32``): the split is exact, the three-product form
is float32-grade under TF32's input rounding (emulated here), and swapping the tokenizer's
linears keeps its codes. Also the scoped float32 switches (``runtime.float32_math``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cosybatch.frontend.split_tf32 import SplitTF32Linear, split, split_linears, tf32_high
from cosybatch.gpu.runtime import float32_math

pytestmark = pytest.mark.numeric


def _values(n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    return torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-40, -3e38, float(torch.finfo(torch.float32).tiny)])])


def test_split_is_exact_and_high_fits_tf32():
    x = _values()
    hi, lo = split(x)
    assert torch.equal(hi + lo, x)  # exact, not approximately
    assert not (hi.view(torch.int32) & 0x1FFF).any()  # the 13 bits TF32 does not read are clear
    assert torch.equal(tf32_high(hi), hi)
    normal = x.abs() >= torch.finfo(torch.float32).tiny  # subnormals have fewer bits to split
    assert ((lo[normal].abs() / x[normal].abs()) <= 2.0 ** -10).all()
    assert torch.equal(torch.sign(hi[hi != 0]), torch.sign(x[hi != 0]))


def _tf32_gemm(a, b):
    """A TF32 tensor-core GEMM, emulated: inputs truncated to TF32, products summed exactly."""
    return tf32_high(a).double() @ tf32_high(b).double()


def test_three_tf32_products_are_float32_grade():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 512, generator=g), torch.randn(512, 48, generator=g)
    exact = a.double() @ b.double()
    scale = exact.abs().mean()
    (ah, al), (bh, bl) = split(a), split(b)
    three = _tf32_gemm(al, bh) + _tf32_gemm(ah, bl) + _tf32_gemm(ah, bh)
    # as SplitTF32Linear runs them: the two small terms as one GEMM over [a_lo | a_hi], then a_hi b_hi
    pair = _tf32_gemm(torch.cat([al, ah], 1), torch.cat([bh, bl], 0)).float().double() + _tf32_gemm(ah, bh)
    assert (pair - three).abs().max() / scale < 1e-6
    one = _tf32_gemm(a, b)
    f32 = (a @ b).double()
    err3, err1, err32 = ((x - exact).abs().max() / scale for x in (three, one, f32))
    assert err3 < 1e-5 and err3 < 4 * max(err32, 1e-7), (err3, err32)
    assert err1 > 100 * err3  # one TF32 product is what the split avoids


def test_split2_lays_low_then_high_parts_side_by_side():
    from cosybatch.frontend.split_tf32 import split2

    x = _values(1000).reshape(-1, 19)  # 1,007 values: 53 rows of 19
    hi, lo = split(x)
    assert torch.equal(split2(x), torch.cat([lo, hi], 1))


def test_split_linear_equals_linear_on_cpu():
    g = torch.Generator().manual_seed(2)
    for bias in (True, False):
        lin = nn.Linear(96, 40, bias=bias)
        x = torch.randn(3, 7, 96, generator=g)
        y = SplitTF32Linear(lin)(x)
        assert y.shape == (3, 7, 40)
        assert torch.allclose(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-6)


def test_split_linears_keeps_tokenizer_codes():
    from cosybatch.models.s3tokenizer import S3TokenizerConfig, S3TokenizerV3

    torch.manual_seed(0)
    cfg = S3TokenizerConfig(n_mels=16, dim=64, heads=4, layers=2)
    model = S3TokenizerV3(cfg).eval()
    feats, lengths = torch.randn(3, 16, 200), torch.tensor([200, 150, 77])
    with torch.no_grad():
        want, n = model(feats, lengths)
        split_linears(model.blocks)
        got, n2 = model(feats, lengths)
    assert sum(isinstance(m, SplitTF32Linear) for m in model.modules()) == 6 * cfg.layers
    assert not any(isinstance(m, nn.Linear) for m in model.blocks.modules())
    assert isinstance(model.quantizer.project_in, nn.Linear)  # the decision projection stays strict
    assert torch.equal(n, n2)
    for i in range(3):
        assert torch.equal(got[i, : n[i]], want[i, : n[i]])


def test_float32_math_scopes_and_restores_the_switches():
    cudnn, cublas = torch.backends.cudnn, torch.backends.cuda.matmul
    before = cudnn.allow_tf32, cublas.allow_tf32
    try:
        cudnn.allow_tf32, cublas.allow_tf32 = True, False
        with float32_math(False, True):
            assert (cudnn.allow_tf32, cublas.allow_tf32) == (False, True)
            lin = SplitTF32Linear(nn.Linear(8, 8))
            lin(torch.randn(2, 8))
            assert cublas.allow_tf32 is True  # the split linear restores what it found
        assert (cudnn.allow_tf32, cublas.allow_tf32) == (True, False)
        try:
            with float32_math(False, False):
                raise RuntimeError("boom")
        except RuntimeError:
            pass
        assert (cudnn.allow_tf32, cublas.allow_tf32) == (True, False)
    finally:
        cudnn.allow_tf32, cublas.allow_tf32 = before


@pytest.mark.gpu
def test_split_linear_on_cuda_is_float32_grade():
    """On the GPU the switch really makes three TF32 GEMMs: against a float64 reference the
    split linear is within a few times strict float32's error, while one TF32 GEMM is not."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(1280, 1280).cuda()
    x = torch.randn(512, 1280, generator=g).cuda()
    exact = (x.double() @ lin.weight.double().t() + lin.bias.double())
    scale = exact.abs().mean()
    cublas = torch.backends.cuda.matmul
    before = cublas.allow_tf32
    try:
        cublas.allow_tf32 = False
        strict = F.linear(x, lin.weight, lin.bias)
        three = SplitTF32Linear(lin)(x)
        assert cublas.allow_tf32 is False  # restored
        cublas.allow_tf32 = True
        one = F.linear(x, lin.weight, lin.bias)
    finally:
        cublas.allow_tf32 = before
    err32, err3, err1 = (float((y.double() - exact).abs().max() / scale) for y in (strict, three, one))
    print(f"\n[split-tf32] max error / mean |y|: float32 {err32:.2e}, 3xTF32 {err3:.2e}, TF32 {err1:.2e}")
    assert err3 < 8 * err32 and err1 > 50 * err3
