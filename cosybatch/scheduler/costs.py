"""Slice costs for the scheduling policy, learned from measured GPU times.

A flow Euler step costs about ``a + b * tokens`` milliseconds (``a``: a few hundred kernels
whatever the size; ``b``: the arithmetic) and a HiFT batch about ``c + d * frames``. Both
lines start from priors and follow the measured slices by least squares with exponential
forgetting, fixed part and slope together: fitting the slope alone would fold the fixed cost
into it, price small solves as efficient, and shrink the solves further.
"""

from __future__ import annotations

from cosybatch.scheduler.policy import Costs


class _Line:
    """y = a + b x, fitted to decaying observations, seeded with prior points."""

    def __init__(self, a: float, b: float, x_prior: tuple[float, float], decay: float = 0.99, weight: float = 20.0):
        self.prior = (a, b)
        self.decay = decay
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        for x in x_prior:
            self.add(x, a + b * x, weight / len(x_prior))

    def add(self, x: float, y: float, weight: float = 1.0) -> None:
        d = self.decay
        self.w = self.w * d + weight
        self.sx = self.sx * d + weight * x
        self.sy = self.sy * d + weight * y
        self.sxx = self.sxx * d + weight * x * x
        self.sxy = self.sxy * d + weight * x * y

    def coef(self) -> tuple[float, float]:
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):
            return self.prior
        b = max((self.sxy / self.w - mx * my) / var, 1e-9)
        return max(my - b * mx, 0.0), b


class CostModel:
    """Priors: one H200, bf16 flow from CUDA graphs, TF32 HiFT (docs/performance.md)."""

    def __init__(self, flow_ms_per_token: float = 6e-4, flow_ms: float = 1.5, hift_ms_per_frame: float = 5e-3,
                 hift_ms: float = 1.0, learn: bool = True):
        self.flow = _Line(flow_ms, flow_ms_per_token, (1000.0, 20000.0))
        self.hift = _Line(hift_ms, hift_ms_per_frame, (100.0, 5000.0))
        self.learn = learn  # off on the CPU: its timings would make the policy depend on the machine

    def costs(self) -> Costs:
        fa, fb = self.flow.coef()
        ha, hb = self.hift.coef()
        return Costs(flow_step_ms_per_token=fb, flow_step_ms=fa, hift_ms_per_frame=hb, hift_ms=ha)

    def observe_flow_step(self, tokens: int, ms: float) -> None:
        if self.learn and tokens > 0 and ms > 0:
            self.flow.add(tokens, ms)

    def observe_hift(self, frames: int, ms: float) -> None:
        if self.learn and frames > 0 and ms > 0:
            self.hift.add(frames, ms)
