#!/usr/bin/env python3
"""Prompts per second that ``synth``'s frontend workers load beside a busy GPU thread, in
threads or in helper processes (``frontend.audio``, design.md D32), and what the GPU thread
keeps of its own pace meanwhile.

The GPU thread's stand-in runs Python with a small torch call every few tens of microseconds
(as the pipeline's thread queues kernels); its pace alone is measured first. CPU only.

    PYTHONPATH=$PWD python scripts/bench_prompt_audio.py --model CKPT --manifest DIR/meta.lst
        [--workers 2] [--prompts 300] [--switch-ms 5 0.5]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosybatch.checkpoint.loader import load_config  # noqa: E402
from cosybatch.frontend.frontend import Frontend  # noqa: E402
from cosybatch.frontend.prompt_audio import warm_helper  # noqa: E402
from cosybatch.helper_process import HelperPool  # noqa: E402


class Pacer:
    """The GPU thread's stand-in: counts its rounds of Python work + one torch call."""

    def __init__(self):
        self.rounds, self._stop = 0, False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        x = torch.zeros(4)
        while not self._stop:
            for _ in range(200):
                pass
            x.add_(1)
            self.rounds += 1

    def rate(self, seconds: float) -> float:
        r0, t0 = self.rounds, time.perf_counter()
        time.sleep(seconds)
        return (self.rounds - r0) / (time.perf_counter() - t0)

    def stop(self):
        self._stop = True
        self._t.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--manifest", required=True, type=Path)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--switch-ms", type=float, nargs="+", default=[5.0, 0.5])
    a = ap.parse_args()
    torch.set_num_threads(1)  # what synth sets on CUDA with several workers
    rows = [line.rstrip("\n").split("|") for line in a.manifest.read_text().splitlines() if line.strip()]
    paths = list(dict.fromkeys(str(a.manifest.parent / r[2]) for r in rows))[: a.prompts]
    fe = Frontend(a.model, load_config(a.model), backend="onnxruntime", warmup=False, text_normalizer="none")
    pool = HelperPool("prompt audio", a.workers, warm=(warm_helper, torch.get_num_threads()))
    results = []
    for where in ("thread", "process"):
        fe.audio_helpers = pool if where == "process" else None
        fe.clear_cache()
        list(map(fe.load, paths[: 2 * a.workers]))  # warm (the helpers' imports)
        for ms in a.switch_ms:
            sys.setswitchinterval(ms / 1e3)
            pacer = Pacer()
            alone = pacer.rate(1.0)
            fe.clear_cache()
            r0, t0 = pacer.rounds, time.perf_counter()
            with ThreadPoolExecutor(a.workers) as ex:
                list(ex.map(fe.load, paths))
            wall = time.perf_counter() - t0
            kept = (pacer.rounds - r0) / wall / alone
            pacer.stop()
            results.append((where, ms, len(paths) / wall, kept))
    pool.close()
    print(f"\n{len(paths)} prompts, {a.workers} workers\n")
    print("| audio in | switch interval ms | prompts/s | GPU thread's pace kept |")
    print("|---|---|---|---|")
    for where, ms, rate, kept in results:
        print(f"| {where} | {ms:g} | {rate:.0f} | {kept * 100:.0f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
