"""NVML's kernel-active share, sampled inside the process (design.md D22).

``nvmlDeviceGetUtilizationRates(...).gpu`` is the percentage of the last sample period in
which one or more kernels ran: the figure nvidia-smi's ``utilization.gpu`` shows. A daemon
thread reads it every ``period_s`` while a window is open; the pipeline's thread only reads the
collected samples. Without ``pynvml`` (the ``nvidia-ml-py`` package), or on a CPU, the share is
reported as unavailable, with the reason, rather than guessed.
"""

from __future__ import annotations

import logging
import threading

from cosybatch.scheduler.budget import kernel_active_by_part, kernel_active_share

log = logging.getLogger(__name__)

# NVML's own utilisation period is ~1/6 s to 1 s depending on the product; sampling faster only
# repeats values, slower loses the start and end of short windows.
PERIOD_S = 0.1


class KernelActiveSampler:
    def __init__(self, device, period_s: float = PERIOD_S):
        self.period_s = period_s
        self._samples: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.unavailable: str | None = None
        self._handle = None
        if getattr(device, "type", "cpu") != "cuda":
            self.unavailable = "not a CUDA device"
            return
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(_physical_index(device))
        except Exception as e:  # not installed, no driver library, no permission
            self.unavailable = f"NVML not usable ({type(e).__name__}: {e}); install nvidia-ml-py"
            return
        self._thread = threading.Thread(target=self._run, name="cosybatch-nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                v = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            except Exception as e:  # a driver hiccup ends sampling, never the run
                self.unavailable = f"NVML sampling failed ({type(e).__name__}: {e})"
                return
            with self._lock:
                self._samples.append(v)

    def reset(self) -> None:
        """Start a new window."""
        with self._lock:
            self._samples.clear()

    def summary(self) -> dict:
        with self._lock:
            samples = list(self._samples)
        share = kernel_active_share(samples)
        out: dict = {"kernel_active_share": share, "samples": len(samples)}
        tenths = kernel_active_by_part(samples)
        if tenths is not None:
            out["by_tenth"] = tenths
        if share is None:
            out["unavailable"] = self.unavailable or "no samples yet"
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


def _physical_index(device) -> int:
    """NVML counts every GPU of the host; CUDA_VISIBLE_DEVICES renumbers what CUDA sees."""
    import os

    index = device.index if device.index is not None else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index
