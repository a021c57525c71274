"""``scripts/profile_flow.py``'s split of a DiT layer's kernels into GEMMs, attention and the
element-wise rest, in microseconds per padded token of a whole Euler step (the graphed step fit's
unit) and the rate each class reaches: the arithmetic the issue's per-kernel budget is read by."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
try:
    from profile_flow import by_class, kernel_class  # noqa: E402
finally:
    sys.path.pop(0)

from cosybatch.models.config import DiTConfig  # noqa: E402


@pytest.mark.parametrize("name, cls", [
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNT", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off", "gemm"),
    ("aten::addmm", "gemm"),
    ("_chunk_attn_kernel", "attention"),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>>", "attention"),
    ("_gated_residual_ln_kernel", "elementwise"),
    ("_rotary_kv_kernel", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "elementwise"),
])
def test_kernel_class(name, cls):
    assert kernel_class(name) == cls


def test_by_class_sums_a_layer_per_token_and_rates():
    d = DiTConfig(dim=1024, depth=22, heads=16, dim_head=64, ff_mult=2)
    tokens, pairs = 10_000, 3_000_000
    per_layer = [{"kernel": "nvjet_qkv", "count": 1.0, "us": 30.0}, {"kernel": "nvjet_o", "count": 2.0, "us": 12.0},
                 {"kernel": "_chunk_attn_kernel", "count": 1.0, "us": 40.0},
                 {"kernel": "_gated_residual_ln_kernel", "count": 2.0, "us": 10.0}]
    out = by_class(per_layer, tokens, pairs, d.depth, d)
    assert list(out) == ["gemm", "attention", "elementwise"]  # costliest first
    gemm = out["gemm"]
    assert gemm["kernels"] == 3.0 and gemm["us_layer"] == 42.0
    assert gemm["us_per_token"] == pytest.approx(42.0 * 22 / tokens)
    # q/k/v, O and the two feed-forward GEMMs: 2 * (3 * 1024 * 1024 + 1024 * 1024 + 2 * 1024 * 2048) FLOPs a token
    assert gemm["tflops"] == pytest.approx(2 * tokens * 8 * 1024 * 1024 / 42e-6 / 1e12)
    assert out["attention"]["tflops"] == pytest.approx(4 * 1024 * pairs / 40e-6 / 1e12)
    assert "tflops" not in out["elementwise"]
    assert sum(c["us_per_token"] for c in out.values()) == pytest.approx(92.0 * 22 / tokens)
