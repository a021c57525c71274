"""The GPU budget per audio second and the kernel-active share, on synthetic accounting data
(design.md D22)."""

import math

import pytest
import torch

from cosybatch.scheduler.budget import budget_rows, gpu_budget, kernel_active_by_part, kernel_active_share


def test_budget_divides_each_stage_by_the_audio_and_names_the_idle_time():
    ms = {"flow_step": 500.0, "flow_start": 30.0, "flow_finish": 20.0, "flow_capture": 40.0, "hift_capture": 10.0,
          "hift": 100.0, "ar_decode": 130.0, "ar_prefill": 25.0, "frontend": 45.0}
    b = gpu_budget(ms, wall_s=1.0, audio_s=50.0)
    assert b["flow_steps"] == 10.0 and b["flow_setup"] == 1.0 and b["captures"] == 1.0
    assert (b["hift"], b["ar_decode"], b["prefill"], b["frontend"]) == (2.0, 2.6, 0.5, 0.9)
    assert b["wall"] == 20.0 and b["idle"] == pytest.approx(20.0 - 900 / 50) and b["overlap"] == 0.0
    stages = sum(v for k, v in b.items() if k not in ("idle", "overlap", "wall"))
    assert math.isclose(stages + b["idle"], b["wall"])  # serial slices: the stages and idle make up the wall
    assert "kernel_idle" not in b  # no NVML: nothing claimed
    assert "ar_mixed" not in b  # no decode step carried a prefill: no row for it
    assert gpu_budget({**ms, "ar_mixed": 50.0}, wall_s=1.0, audio_s=50.0)["ar_mixed"] == 1.0


def test_budget_puts_the_kernel_active_share_beside_the_slices():
    # slices cover 99 % of the wall, NVML says kernels ran 86.5 %: 12.5 % of the wall is the GPU
    # waiting inside slices
    b = gpu_budget({"flow_step": 990.0}, wall_s=1.0, audio_s=100.0, kernel_active=0.865)
    assert b["idle"] == pytest.approx(0.1) and b["kernel_idle"] == pytest.approx(1.35)
    assert b["hidden_idle"] == pytest.approx(1.25)


def test_budget_counts_overlap_when_two_streams_run_at_once_and_keeps_unknown_kinds():
    b = gpu_budget({"flow_step": 900.0, "ar_decode": 300.0, "something_new": 10.0}, wall_s=1.0, audio_s=10.0)
    assert b["idle"] == 0.0 and b["overlap"] == pytest.approx(21.0) and b["other"] == 1.0
    assert gpu_budget({"flow_step": 1.0}, wall_s=1.0, audio_s=0.0) is None
    labels = [label for label, _ in budget_rows(b)]
    assert "GPU ms per audio second: AR decode" in labels and "GPU ms per audio second: wall" in labels


def test_kernel_active_share_and_its_absence():
    from cosybatch.scheduler.gpu_util import KernelActiveSampler

    assert kernel_active_share([80.0, 90.0, 100.0]) == 0.9 and kernel_active_share([]) is None
    s = KernelActiveSampler(torch.device("cpu"))
    out = s.summary()
    assert out["kernel_active_share"] is None and out["unavailable"] == "not a CUDA device"
    s.close()


def test_kernel_active_by_part_shows_a_ramp_and_a_drain():
    # 25 samples: a ramp (40 %), a steady middle (100 %), a drain (10 %)
    samples = [40.0] * 5 + [100.0] * 15 + [10.0] * 5
    parts = kernel_active_by_part(samples, parts=5)
    assert parts == [0.4, 1.0, 1.0, 1.0, 0.1]
    assert kernel_active_by_part(samples[:4], parts=5) is None
    # unequal division: every sample counted once, the parts' sizes differ by at most one
    tenths = kernel_active_by_part([float(i) for i in range(23)])
    assert len(tenths) == 10 and tenths[0] == kernel_active_share([0.0, 1.0])


def test_the_profile_table_shows_the_budget_and_the_kernel_active_share():
    from rich.console import Console

    from cosybatch.bench.closed_loop import result_table
    from test_bench import FakeClock, FakePipeline, reqs
    from cosybatch.bench.closed_loop import run_closed_loop

    clock = FakeClock()
    res = run_closed_loop(FakePipeline(clock), reqs(2), concurrency=2, num_warmups=0, clock=clock)
    res.timeline = {"gpu_kernel": {"kernel_active_share": 0.865, "samples": 10, "by_tenth": [0.5] + [0.9] * 9},
                    "gpu_budget": gpu_budget({"flow_step": 990.0, "ar_decode": 5.0}, 1.0, 100.0, 0.865)}
    console = Console(width=200, record=True)
    console.print(result_table(res, "t"))
    text = console.export_text()
    assert "GPU kernel-active share of wall (NVML, in the process)" in text and "86.5%" in text
    assert "GPU kernel-active share by tenth of the run (%)" in text and "50 90 90" in text
    assert "GPU ms per audio second: flow steps" in text and "9.90" in text
    res.timeline = {"gpu_kernel": {"kernel_active_share": None, "unavailable": "install nvidia-ml-py"}}
    console = Console(width=200, record=True)
    console.print(result_table(res, "t"))
    assert "unavailable: install nvidia-ml-py" in console.export_text()
