"""The fp8 scripts (``scripts/fp8_parity.py``, ``scripts/bench_fp8_gemm.py``): float8 e4m3 as the
emulation and the benchmark round it, and what each reports, on the CPU at small sizes."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
try:
    import bench_fp8_gemm  # noqa: E402
    import fp8_parity  # noqa: E402
finally:
    sys.path.pop(0)

from cosybatch.models.config import DiTConfig, FlowConfig  # noqa: E402
from cosybatch.models.flow import CausalMaskedDiffWithDiT  # noqa: E402


def test_fp8_rounding_keeps_four_significant_bits_at_any_scale():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)[:, None]
    for dim in (-1, None):
        q = fp8_parity.to_fp8(x, dim)
        # inside e4m3's normal range (2^-6 to 448) below the value scaled to 448 (its row's or the tensor's)
        amax = x.abs().amax() if dim is None else x.abs().amax(dim=-1, keepdim=True)
        normal = x.abs() >= amax * 2.0 ** -6 / 448
        rel = ((q - x).abs() / x.abs())[normal]
        assert rel.max() <= 2.0 ** -4 + 1e-6  # 3 stored mantissa bits: half an ulp is 2^-4
        assert normal.float().mean() > (0.9 if dim == -1 else 0.3)  # the check covers most of x
    q, s = bench_fp8_gemm.quantize(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 1)


def test_every_block_gemm_is_rounded_and_fp8_errs_about_16x_bf16():
    torch.manual_seed(0)
    cfg = FlowConfig(dit=DiTConfig(depth=2))
    flow = CausalMaskedDiffWithDiT(cfg).eval()
    gemms = fp8_parity.wrap_block_gemms(flow)
    assert len(gemms) == 6 * 2
    (prompt, tokens), = fp8_parity.make_rows(cfg, 1, 8, 8, "cpu")
    out = {}
    with torch.inference_mode():
        for v in ("fp32", "bf16", "fp8-row"):
            for g in gemms:
                g.rounding = fp8_parity.ROUNDINGS[v]
            out[v] = fp8_parity.flow_full(flow, tokens, prompt)
    bf16, fp8 = (fp8_parity.compare(out[v], out["fp32"])["rel_rms"] for v in ("bf16", "fp8-row"))
    assert 0 < bf16 < fp8
    assert 6 < fp8 / bf16 < 40  # 2^4 from three mantissa bits against seven, give or take the data


def test_the_gemm_bench_reports_each_gemm_and_the_step_sum():
    r = bench_fp8_gemm.bench(16, torch.device("cpu"), reps=1)
    assert set(r["gemms"]) == {"qkv", "o", "ff1", "ff2"}
    for g in r["gemms"].values():
        assert 0 < g["rel_rms"]["bf16"] < g["rel_rms"]["fp8"] < 0.1
    per_token = {k: sum(r["gemms"][n][k]["us"] for n in r["gemms"]) * 22 / 16 for k in ("bf16", "fp8")}
    assert r["us_per_token_per_step"]["bf16"] == pytest.approx(per_token["bf16"])
    assert r["us_per_token_per_step"]["fp8"] == pytest.approx(per_token["fp8"])
