"""The kernel launches of one fused streaming Euler step, per DiT layer (design.md D26), counted
on the CPU (``scripts/kernel_census.py``: aten ops through a dispatch mode, Triton launches through
Triton's interpreter), on the CUDA side of the device branches.

The fused layer is eight launches: the q/k/v GEMM (its bias in the GEMM), the rotary writing
K/V, the attention (pool and self launches as one), the O GEMM, the gated residual + modulated
LayerNorm, FF1 with GELU (CUDA: cuBLASLt's epilogue), FF2 and the feed-forward's gated residual
fused with the next block's LayerNorm. A change that adds a launch to a layer (a copy, a cast,
a fill, an elementwise op) fails here, with the layer's ops in the message. Kernels a library
launches inside one op (cuBLAS's) are not seen here: the torch profiler on a GPU counts them
(``scripts/profile_flow.py``).
"""

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.usefixtures("one_thread")]

if torch.cuda.is_available():
    pytest.skip("GPU present: the profiler counts the kernels (scripts/profile_flow.py)", allow_module_level=True)
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
try:
    from kernel_census import census  # noqa: E402
finally:
    sys.path.pop(0)

from cosybatch.codec.flow_runner import FlowJob, FlowRunner  # noqa: E402
from cosybatch.hops import HopSchedule, plan_segment  # noqa: E402
from cosybatch.models.config import DiTConfig, FlowConfig  # noqa: E402
from cosybatch.models.flow import CausalMaskedDiffWithDiT  # noqa: E402
from cosybatch.prompt import PromptFeatures  # noqa: E402

DEPTH = 3
# The fused layer's launches in order (GEMMs by their aten name, Triton kernels by theirs).
FUSED_LAYER = ["linear", "triton._rotary_kv_kernel", "triton._chunk_attn_kernel", "linear",
               "triton._gated_residual_ln_kernel", "_addmm_activation", "linear", "triton._gated_residual_ln_kernel"]
GEMMS = {"addmm": "linear", "mm": "linear", "matmul": "linear"}  # one GEMM whichever op the dispatcher shows


def _names(ops):
    return [GEMMS.get(op, op) for op in ops]


@pytest.fixture(scope="module")
def flow_rows():
    torch.manual_seed(0)
    cfg = FlowConfig(pre_lookahead_channels=16, n_timesteps=2,
                     dit=DiTConfig(dim=32, depth=DEPTH, heads=2, dim_head=16, static_chunk_size=10))
    flow = CausalMaskedDiffWithDiT(cfg).eval()
    g = torch.Generator().manual_seed(1)
    rows = []
    # two rows with three hops (hop 1 reuses their prefix: the pool launch), one with two (hop 1
    # is final: a full-attention whole response, the self launch)
    for i, (p, n) in enumerate([(5, 17), (4, 16), (4, 12)]):
        pr = PromptFeatures(torch.randint(0, cfg.vocab_size, (p,), generator=g),
                            torch.randn(1, cfg.spk_embed_dim, generator=g), torch.randn(1, 2 * p, cfg.output_size, generator=g))
        tok = torch.randint(0, cfg.vocab_size, (n,), generator=g)
        rows.append((f"r{i}", pr, tok, plan_segment(HopSchedule(hop=5, max_hop=5, scale=1), p, n)))
    return flow, rows


def _no_warmup(fn):
    """A CUDA-graph capture stand-in whose replay runs the step (no warm-up step of its own)."""
    return fn


def _check(c, what):
    listing = c.format(what)
    assert len(c.blocks) == DEPTH, listing
    for i, ops in enumerate(c.blocks):
        assert _names(ops) == FUSED_LAYER, f"layer {i} of {what}: {len(ops)} launches, not {len(FUSED_LAYER)}\n{listing}"


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "bucketed"])
def test_fused_streaming_step_is_eight_launches_per_layer(flow_rows, graphs):
    """Cached hops only (eager: the pool launch alone; in a graph bucket: the merged launch with
    empty self tiles, design.md D27), then cached hops beside uncached rows (one merged launch)."""
    flow, rows = flow_rows
    kw = {"graphs": True, "capture": _no_warmup} if graphs else {}
    runner = FlowRunner(flow, attention="triton", triton_kernels=True, **kw)
    runner.run([FlowJob(name, tok, pr, ch[0]) for name, pr, tok, ch in rows])
    for what, picked in (("cached hops only", rows[:1]), ("cached hops + uncached rows", rows[1:])):
        solve = runner.start([FlowJob(name, tok, pr, ch[1]) for name, pr, tok, ch in picked])
        assert solve.buffers.pool is not None and solve.buffers.merged == (graphs or len(picked) > 1)
        solve.step(1)  # the first step (in a bucket: its capture), then the counted one
        c = census(runner, solve)
        _check(c, f"{what}, {'bucketed' if graphs else 'eager'}")
        assert "_addmm_activation" in c.per_layer() and c.notes  # FF1 counted as CUDA runs it
        solve.step(runner.n_steps)
        solve.finish()
    assert runner.stats["cached_tokens"] > 0


def test_census_sees_an_added_launch(flow_rows, monkeypatch):
    """The census can fail: a copy of the attention's output added to each layer is counted in
    every layer, where it happens."""
    from cosybatch.codec import flow_step

    flow, rows = flow_rows
    runner = FlowRunner(flow, attention="triton", triton_kernels=True)
    attend = flow_step._attend
    monkeypatch.setattr(flow_step, "_attend", lambda *a, **kw: attend(*a, **kw).clone())
    solve = runner.start([FlowJob(name, tok, pr, ch[0]) for name, pr, tok, ch in rows[:1]])
    c = census(runner, solve)
    assert all(_names(ops) == FUSED_LAYER[:3] + ["clone"] + FUSED_LAYER[3:] for ops in c.blocks), c.format()
