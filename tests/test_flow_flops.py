"""The flow's FLOP count (``codec/flops.py``), against what PyTorch counts in a real DiT pass."""

import torch

from cosybatch.codec.flops import dit_token_flops, solve_flops
from cosybatch.models.config import DiTConfig, FlowConfig
from cosybatch.models.dit import DiT


def test_the_count_is_what_a_dit_pass_computes():
    """PyTorch's FLOP counter over one row of n frames gives a n + b n^2 + c (c: the time
    embedding and AdaLN, once per row): a must be the per-token count and b the attention's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    d = DiTConfig(dim=128, depth=2, heads=4, dim_head=32)
    torch.manual_seed(0)
    dit = DiT(d).eval()

    def count(n: int) -> int:
        x, mu, cond = (torch.randn(1, d.mel_dim, n) for _ in range(3))
        # the math path: its matmuls are counted (the CPU's fused kernel is not)
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
            dit(x, torch.ones(1, 1, n), mu, torch.tensor(0.5), torch.randn(1, d.spk_dim), cond)
        return fc.get_total_flops()

    n = torch.tensor([64.0, 128.0, 256.0], dtype=torch.float64)
    f = torch.tensor([count(int(k)) for k in n], dtype=torch.float64)
    a, b, c = torch.linalg.solve(torch.stack([n, n * n, torch.ones(3, dtype=torch.float64)], 1), f).tolist()
    assert round(a) == dit_token_flops(d)
    assert round(b) == 4 * d.heads * d.dim_head * d.depth
    assert c > 0


def test_a_solve_is_every_step_of_every_token_and_pair():
    cfg = FlowConfig(dit=DiTConfig(dim=128, depth=2, heads=4, dim_head=32))
    one = solve_flops(cfg, 1) / cfg.n_timesteps
    assert one == dit_token_flops(cfg.dit)
    assert solve_flops(cfg, 100, 1000) == cfg.n_timesteps * (100 * one + 1000 * 4 * 4 * 32 * 2)
    assert round(dit_token_flops(DiTConfig()) / 1e6, 1) == 378.0  # the full model: ~0.38 GFLOP per token
