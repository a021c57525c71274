"""The GPU frontend's Triton kernels run by Triton's CPU interpreter, against the eager ops they
replace (design.md D40). Both kernels do their twins' float32 operations in the same order, so
they are held to them bit for bit (tests/test_frontend_gpu.py runs the compiled kernels against
onnxruntime on the GPU)."""

import pytest
import torch

pytestmark = [pytest.mark.numeric, pytest.mark.usefixtures("one_thread")]

if torch.cuda.is_available():
    pytest.skip("GPU present: the GPU tests run the compiled kernels", allow_module_level=True)
pytest.importorskip("triton")

from cosybatch.frontend import triton_kernels as K  # noqa: E402
from cosybatch.frontend.split_tf32 import split  # noqa: E402
from cosybatch.models.campplus import CAMPPlus, CAMPPlusConfig  # noqa: E402
from cosybatch.models.campplus_fast import CAMPPlusFast, _Plan  # noqa: E402


def test_tf32_split2_is_the_eager_split_side_by_side():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g) * torch.exp2(torch.randint(-20, 20, (37, 96), generator=g).float())
    x[0, :4] = torch.tensor([0.0, -0.0, 3e38, 1e-40])
    hi, lo = split(x)
    got = K.tf32_split2(x)
    assert got.shape == (37, 192)
    assert torch.equal(got.view(torch.int32), torch.cat([lo, hi], 1).view(torch.int32))  # bits, signed zeros too


@pytest.mark.parametrize("b,t,g,taps,dilation", [(3, 50, 32, 3, 1), (2, 33, 32, 3, 2), (1, 5, 8, 3, 2),
                                                 (2, 40, 24, 5, 3), (1, 2, 16, 3, 4)])
def test_cam_taps_gate_is_the_eager_dense_layer_tail(b, t, g, taps, dilation):
    """``cam_taps_gate`` writes into a channel slice of a wider buffer exactly what
    ``CAMPPlusFast._local`` times the gathered gate writes there, padded rows (the taps that
    read ahead masked past each row's end) and dilations past the row's length included, and
    leaves the rest of the buffer alone."""
    gen = torch.Generator().manual_seed(b * 100 + t)
    h, local = torch.randn(b, t, 16, generator=gen), torch.randn(taps * g, 16, generator=gen)
    lengths = torch.randint(max(1, t // 2), t + 1, (b,), generator=gen)
    lengths[0] = t
    plan = _Plan(lengths, t, 7, torch.float32, padded=bool((lengths < t).any()))
    gate = torch.rand(b, plan.n_seg, g, generator=gen)
    p = {"local": local, "taps": taps, "dilation": dilation}
    want = torch.full((b, t, g + 13), -7.0)
    torch.mul(CAMPPlusFast._local(h, p, plan), gate.index_select(1, plan.seg_of), out=want[..., 5 : 5 + g])
    got = torch.full((b, t, g + 13), -7.0)
    K.cam_taps_gate(torch.nn.functional.linear(h, local), gate, plan.seg_of, plan.keep, got[..., 5 : 5 + g],
                    taps, dilation)
    assert torch.equal(got, want)


def test_campplus_with_the_fused_tail_gives_the_same_embeddings():
    torch.manual_seed(0)
    cfg = CAMPPlusConfig(m_channels=8, init_channels=32, growth=8, bn_channels=16, cam_hidden=8, block_layers=(2, 3, 2))
    model = CAMPPlus(cfg).eval()
    for m in model.modules():  # running statistics away from the identity, as a trained model's
        if isinstance(m, torch.nn.BatchNorm1d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    feats, lengths = torch.randn(3, 260, cfg.feat_dim), torch.tensor([260, 201, 90])
    with torch.no_grad():
        want = CAMPPlusFast(model)(feats, lengths)
        got = CAMPPlusFast(model, K.cam_taps_gate)(feats, lengths)
        alone = CAMPPlusFast(model, K.cam_taps_gate)(feats[:1], lengths[:1])  # unpadded: the other branch
        alone_want = CAMPPlusFast(model)(feats[:1], lengths[:1])
    assert torch.equal(got, want)
    assert torch.equal(alone, alone_want)


def _launches(fn):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        from kernel_census import launches
    finally:
        sys.path.pop(0)
    return launches(fn)


def test_the_fused_ops_take_a_dense_layer_to_nine_launches_and_a_split_linear_to_three(monkeypatch):
    """What D40 counts: a CAM++ dense layer queued 13-14 kernels (the taps' copy, shifted adds,
    the mask, the gate's gather and product), 9 with the fused tail; a 3xTF32 linear 5 (the
    operand's split as two ops, three GEMMs), 3 with the split in one kernel and the two small
    products in one GEMM. A frontend launch went from ~1,640 kernels to ~1,230 (the full-size
    models, 8 prompts: CAM++ 815 -> 555, the tokenizer 600 -> 456)."""
    import torch.nn as nn

    from cosybatch.frontend import split_tf32 as ST

    torch.manual_seed(0)
    cfg = CAMPPlusConfig(m_channels=8, init_channels=32, growth=8, bn_channels=16, cam_hidden=8, block_layers=(2, 3, 2))
    feats, lengths = torch.randn(2, 200, cfg.feat_dim), torch.tensor([200, 150])
    layers = sum(cfg.block_layers)
    counts = {}
    for name, tail in (("eager", None), ("fused", K.cam_taps_gate)):
        fast = CAMPPlusFast(CAMPPlus(cfg).eval(), tail)
        with torch.inference_mode():
            fast(feats, lengths)  # the BatchNorm folds, made once
            ops = _launches(lambda: fast(feats, lengths))
        counts[name] = len(ops)
        if tail is not None:
            assert ops.count("triton._cam_taps_gate_kernel") == layers
            assert not {"clone", "index_select", "add_"} & set(ops), ops
    assert counts["eager"] - counts["fused"] >= 5 * layers, counts

    lin = ST.SplitTF32Linear(nn.Linear(64, 48))
    x = torch.randn(5, 64)
    want = lin(x)
    monkeypatch.setattr(ST, "split2", K.tf32_split2)  # what CUDA takes
    ops = _launches(lambda: lin(x))
    assert ops == ["triton._tf32_split2_kernel", "addmm", "addmm_"], ops
    assert torch.equal(lin(x), want)
