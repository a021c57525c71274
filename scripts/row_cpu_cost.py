"""Per-row CPU cost of the synth path's host work, and how much of it holds the GIL.

``synth`` drives the GPU from one Python thread; every other thread of the process (frontend
workers, the writer) shares the GIL with it, so what matters for throughput is not how long a
row's host work takes but how long it keeps the GIL. This prints, for each piece of a row's
host work, its wall time alone and its GIL-held time: the time a second thread spinning in
pure Python loses while the piece runs over and over (a GIL-free numpy call costs that thread
nothing; a pure-Python one costs it the whole call).

Inputs are EN1088-like: the benchmark workload's target texts and 5 s of 24 kHz speech-like
audio (``cosybatch.bench.workload``). The ``helper:`` lines are what ``synth``'s fast engine
does: the same work in helper processes (``cosybatch.helper_process``), where the caller's own
CPU is only pickling and a pipe. With few CPUs the GIL column of pure-Python work can exceed its
wall time: contended, the work runs slower (SMT siblings) and every hand-over of the GIL costs
the waiting thread a wake-up; it is the spinner's loss, which is what the GPU thread would lose.

    PYTHONPATH=$PWD python scripts/row_cpu_cost.py [--seconds 2] [--model DIR]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np


# The spinner gets a CPU of its own, and this thread (and the helper processes it starts) the
# others: with few CPUs, a helper process computing would otherwise take the spinner's CPU from
# it now and then, which the spinner cannot tell from waiting for the GIL.
_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
SPINNER_CPUS, OTHER_CPUS = set(_CPUS[:1]), set(_CPUS[1:])


def _pin(cpus: set[int]) -> None:
    """Keep the calling thread (Linux: affinity is per thread) on ``cpus``, where it can."""
    if cpus and len(_CPUS) > 1:
        os.sched_setaffinity(0, cpus)


class Spinner:
    """A thread running pure Python (the GIL-bound thread that drives the GPU) that adds up the
    time it stood still: every gap between two of its loop's clock reads longer than ``GAP_S``
    (it waited for the GIL, or the OS ran something else on its core)."""

    GAP_S = 20e-6

    def __init__(self):
        self.lost = 0.0
        self._run = True
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        _pin(SPINNER_CPUS)
        clock, gap = time.perf_counter, self.GAP_S
        last = clock()
        lost = 0.0
        while self._run:
            now = clock()
            if now - last > gap:
                lost += now - last
                self.lost = lost
            last = now

    def __enter__(self):
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self._run = False
        self._thread.join()


def baseline_lost(seconds: float) -> float:
    """Seconds a second the spinner stands still while this thread sleeps (the OS's share)."""
    with Spinner() as s:
        l0, t0 = s.lost, time.perf_counter()
        time.sleep(seconds)
        l1, t1 = s.lost, time.perf_counter()
    return (l1 - l0) / (t1 - t0)


def measure(fn, items, seconds: float, base: float) -> tuple[float, float, float]:
    """(wall ms a call alone, thread-CPU ms a call, GIL-held ms a call) of ``fn(item)``."""
    it = itertools.cycle(items)
    for _ in range(3):
        fn(next(it))  # warm caches, imports
    n, t0, c0 = 0, time.perf_counter(), time.thread_time()
    while time.perf_counter() - t0 < seconds / 2:
        fn(next(it))
        n += 1
    wall = (time.perf_counter() - t0) / n
    cpu = (time.thread_time() - c0) / n
    held = []
    for _ in range(3):  # the median of three: a VM's CPUs come and go
        with Spinner() as s:
            m, l0, t0 = 0, s.lost, time.perf_counter()
            while time.perf_counter() - t0 < seconds / 6:
                fn(next(it))
                m += 1
            l1, t1 = s.lost, time.perf_counter()
        held.append(max(0.0, ((l1 - l0) - base * (t1 - t0)) / m))
    return wall * 1e3, cpu * 1e3, sorted(held)[1] * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds spent measuring each piece")
    ap.add_argument("--model", default="/work/shared/fixtures/cv3-tiny/model",
                    help="model folder whose CosyVoice-BlankEN tokenizer splits the texts")
    args = ap.parse_args()
    _pin(OTHER_CPUS)

    from cosybatch.bench.workload import speechlike, target_texts
    from cosybatch.helper_process import HelperProcess
    from cosybatch.manifest import ManifestRow
    from cosybatch.output.audio_files import AudioFormat, encode_wav
    from cosybatch.output.ledger import Ledger
    from cosybatch.output.mastering import measure_loudness, normalize_loudness
    from cosybatch.output.rows import finish_row
    from cosybatch.text.normalize import normalize_text, prepare_normalizer, split_target_text

    texts = target_texts(1088)
    sr = 24000
    clips = [speechlike(5.0, sr, seed=i) * np.float32(0.5) for i in range(4)]
    fmt = AudioFormat()
    fmt.prepare()
    prepare_normalizer("wetext")
    prepare_normalizer("none")

    pieces = [
        ("wetext normalize_text", lambda t: normalize_text(t, "wetext"), texts),
        ("no-normalizer normalize_text", lambda t: normalize_text(t, "none"), texts),
    ]
    tok_dir = Path(args.model) / "CosyVoice-BlankEN"
    if tok_dir.is_dir():
        from cosybatch.text.tokenizer import CosyVoice3Tokenizer

        tok = CosyVoice3Tokenizer.from_dir(tok_dir)
        pieces.append(("split_target_text (wetext, tokenizer)",
                       lambda t: split_target_text(t, tok, normalizer="wetext"), texts))
    else:
        print(f"(no tokenizer at {tok_dir}: split_target_text skipped)", file=sys.stderr)
    pieces += [
        ("measure_loudness (5 s)", lambda x: measure_loudness(x, sr), clips),
        ("normalize_loudness -23 LUFS (5 s)", lambda x: normalize_loudness(x, sr, -23.0), clips),
        ("encode_wav PCM_16 (5 s)", lambda x: encode_wav(x, sr), clips),
        ("AudioFormat().encode (5 s wav)", lambda x: fmt.encode(x, sr), clips),
    ]

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        ledger = Ledger(out / "ledger.jsonl")
        rows = [ManifestRow(utt_id=f"r{i:04d}", prompt_text="p", prompt_wav=Path("p.wav"),
                            target_text=texts[i], line=i + 1, prompt_s=4.0, prompt_size=1, prompt_mtime_ns=1)
                for i in range(8)]
        results = [(row, SimpleNamespace(audio=clips[i % 4], sample_rate=sr, tokens=125, chunks=1,
                                             timings={"first_chunk_s": 0.5, "total_s": 2.0, "queue_s": 0.1},
                                         segments=[row.target_text])) for i, row in enumerate(rows)]
        pieces.append(("finish_row (encode, write+fsync, ledger)",
                       lambda rr: finish_row(out, rr[0], rr[1], None, "0" * 16, fmt, ledger), results))
        # What synth's fast engine does: the same work through helper processes (started, and
        # their warm-up waited for, before the baseline: it would take a CPU from the spinner).
        text_helper = HelperProcess("text normalizer", warm=(prepare_normalizer, "wetext"))
        encoder = HelperProcess("encoder", warm=(fmt.prepare,))
        text_helper.run(len, "")
        encoder.run(len, "")
        pieces += [
            ("helper: wetext normalize_text", lambda t: normalize_text(t, "wetext", text_helper), texts),
            ("helper: AudioFormat().encode (5 s wav)", lambda x: encoder.run(fmt.encode, x, sr), clips),
            ("helper: finish_row", lambda rr: finish_row(out, rr[0], rr[1], None, "0" * 16, fmt, ledger,
                                                         helper=encoder), results),
        ]
        base = baseline_lost(1.0)
        print(f"{'piece':42s} {'wall ms':>8s} {'cpu ms':>8s} {'GIL ms':>8s}   (per row; {os.cpu_count()} CPUs)")
        for name, fn, items in pieces:
            wall, cpu, gil = measure(fn, items, args.seconds, base)
            print(f"{name:42s} {wall:8.3f} {cpu:8.3f} {gil:8.3f}")
        ledger.close()
        text_helper.close()
        encoder.close()
        if text_helper.fallbacks or encoder.fallbacks:
            print(f"(helper calls run here instead: text {text_helper.fallbacks}, encoder {encoder.fallbacks})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
