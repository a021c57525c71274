"""Where the workers of ``synth --devices/--workers`` run: one slot per worker process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Slot:
    """Where one worker runs."""
    label: str  # what the user reads in logs: "cuda:2" (the parent's numbering) or "cpu#1"
    device: str  # what the worker passes to the synthesizer factory: "cuda:0" or "cpu"
    visible: str | None = None  # the worker's CUDA_VISIBLE_DEVICES (None: inherit the parent's)


class DevicesError(ValueError):
    """A --devices/--workers spelling that cannot be used (exit 2)."""


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def plan_slots(devices: str | None, workers: int | None, device: str,
               gpu_count: Callable[[], int] = cuda_device_count,
               env: dict[str, str] | None = None) -> list[Slot]:
    """Where each worker runs, from ``--devices`` / ``--workers`` / ``--device``."""
    env = dict(os.environ) if env is None else env
    if workers is not None:
        if devices is not None:
            raise DevicesError("--devices and --workers: pick one (--devices for GPUs, --workers for CPU)")
        if device != "cpu":
            raise DevicesError("--workers N starts N CPU worker processes and needs --device cpu; "
                               "for GPUs use --devices all|N|cuda:0,cuda:2")
        return [Slot(f"cpu#{i}", "cpu") for i in range(workers)]
    assert devices is not None
    if device not in ("auto", "cuda"):
        raise DevicesError(f"--devices picks the GPUs; it cannot be combined with --device {device}")
    count = gpu_count()
    if count < 1:
        raise DevicesError("--devices: torch sees no CUDA GPU; for CPU worker processes use --device cpu --workers N")
    spec = devices.strip().lower()
    if spec == "all":
        picked = list(range(count))
    elif spec.isdigit():
        n = int(spec)
        if not 1 <= n <= count:
            raise DevicesError(f"--devices {devices}: between 1 and {count} (the GPUs torch sees)")
        picked = list(range(n))
    else:
        picked = []
        for item in filter(None, (x.strip() for x in spec.split(","))):
            k = item[5:] if item.startswith("cuda:") else item
            if not k.isdigit() or int(k) >= count:
                raise DevicesError(f"--devices {devices}: {item!r} is not one of cuda:0..cuda:{count - 1}")
            if int(k) in picked:
                raise DevicesError(f"--devices {devices}: {item!r} is listed twice")
            picked.append(int(k))
        if not picked:
            raise DevicesError("--devices: expected all, a count, or a list such as cuda:0,cuda:2")
    # cuda:K means what it means to torch in this process: the K-th GPU of an inherited
    # CUDA_VISIBLE_DEVICES (a Slurm allocation, a MIG UUID list), not physical GPU K.
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return [Slot(f"cuda:{k}", "cuda:0", visible[k] if k < len(visible) else str(k)) for k in picked]
