"""Where each audio second's GPU time goes, and how much of the wall the GPU ran kernels at all.

Pure functions of the accounting's slice totals (``scheduler.accounting``) and of utilisation
samples, so they are tested on synthetic figures. The slice times alone overstate a busy GPU:
a slice's event time includes any gap in which the GPU waited for the host to queue the rest of
the slice (measured: slices said 1 % idle at C64 while NVML said kernels ran 86.5 % of the
time), so the table puts NVML's kernel-active share beside them when it is available
(design.md D22).
"""

from __future__ import annotations

# Table stage -> the accounting's slice kinds (``Accounting.start``'s names)
STAGES: dict[str, tuple[str, ...]] = {
    "flow_steps": ("flow_step",),
    "flow_setup": ("flow_start", "flow_finish"),
    "captures": ("flow_capture", "hift_capture"),
    "hift": ("hift",),
    "ar_decode": ("ar_decode",),
    "prefill": ("ar_prefill",),
    "ar_mixed": ("ar_mixed",),  # decode steps that carried a prefill (ar.mixed_prefill): only when there are any
    "frontend": ("frontend",),
}
OPTIONAL = ("ar_mixed",)


def kernel_active_share(samples: list[float]) -> float | None:
    """The mean of NVML utilisation samples (percent of each sample period in which any kernel
    ran) as a share of the wall; None without samples."""
    return round(sum(samples) / len(samples) / 100.0, 4) if samples else None


def kernel_active_by_part(samples: list[float], parts: int = 10) -> list[float] | None:
    """The kernel-active share of each of ``parts`` consecutive equal stretches of the samples
    (taken at a fixed period, so of the window's time): a GPU idle while the run ramps up or
    drains shows in the first or last parts, one the host starves throughout in all of them.
    None with fewer samples than parts."""
    if len(samples) < parts:
        return None
    n = len(samples)
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [kernel_active_share(samples[a:b]) for a, b in zip(bounds, bounds[1:])]


def gpu_budget(slice_ms: dict[str, float], wall_s: float, audio_s: float,
               kernel_active: float | None = None) -> dict | None:
    """GPU milliseconds per second of audio produced, by stage (``STAGES``), plus:

    - ``idle``: the wall the slices do not cover (what the slice accounting calls idle);
    - ``wall``: wall milliseconds per audio second (1000 / audio-s per s): the stages and
      ``idle`` add up to it while slices do not overlap; with the AR step beside the codec
      they may, and ``overlap`` says by how much;
    - ``kernel_idle`` (with a kernel-active share): the wall in which no kernel ran at all,
      and ``hidden_idle``, the part of it inside slices (the GPU waiting for the host).

    None when no audio was produced (nothing to divide by)."""
    if audio_s <= 0 or wall_s <= 0:
        return None
    per = lambda ms: round(ms / audio_s, 3)  # noqa: E731
    stages = {name: sum(slice_ms.get(k, 0.0) for k in kinds) for name, kinds in STAGES.items()
              if name not in OPTIONAL or any(k in slice_ms for k in kinds)}
    other = sum(v for k, v in slice_ms.items() if not any(k in kinds for kinds in STAGES.values()))
    if other:
        stages["other"] = other
    wall_ms = wall_s * 1e3
    busy = sum(stages.values())
    out = {name: per(v) for name, v in stages.items()}
    out["idle"] = per(max(0.0, wall_ms - busy))
    out["overlap"] = per(max(0.0, busy - wall_ms))
    out["wall"] = per(wall_ms)
    if kernel_active is not None:
        kernel_idle = wall_ms * (1.0 - kernel_active)
        out["kernel_idle"] = per(kernel_idle)
        out["hidden_idle"] = per(max(0.0, kernel_idle - max(0.0, wall_ms - busy)))
    return out


def budget_rows(budget: dict) -> list[tuple[str, str]]:
    """The budget as (label, value) rows for a report table."""
    labels = {"flow_steps": "flow steps", "flow_setup": "flow set-up", "captures": "graph captures",
              "hift": "HiFT", "ar_decode": "AR decode", "prefill": "AR prefill",
              "ar_mixed": "AR decode with a prefill", "frontend": "frontend",
              "other": "other slices", "idle": "idle (outside slices)", "overlap": "overlap (slices on two streams)",
              "kernel_idle": "no kernel running (NVML)", "hidden_idle": "no kernel running inside slices",
              "wall": "wall"}
    return [(f"GPU ms per audio second: {labels.get(k, k)}", f"{v:.2f}") for k, v in budget.items()]
