#!/usr/bin/env python3
"""Compare two `cosybatch synth` output folders row by row: the same rows finished, the same
speech-token counts, equal WAV lengths and the waveform SNR of B against A.

    python scripts/compare_outputs.py OUT_A OUT_B
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import wave
from pathlib import Path

import numpy as np


def _rows(out: Path) -> dict:
    rows = {}
    for ledger in sorted(out.glob("ledger*.jsonl")):
        for line in ledger.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "row" and rec.get("status") == "ok":
                rows[rec["utt_id"]] = rec
    return rows


def _file(rec: dict) -> str:
    """The row's audio file: ``file`` in today's ledgers, ``wav`` in those written before formats."""
    return rec.get("file") or rec["wav"]


def _pcm(path: Path) -> np.ndarray:
    with wave.open(str(path)) as w:
        data = w.readframes(w.getnframes())
        width = w.getsampwidth()
    if width == 2:
        return np.frombuffer(data, dtype="<i2").astype(np.float64) / 32768.0
    return np.frombuffer(data, dtype="<f4").astype(np.float64)  # FLOAT subtype (read as raw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    ra, rb = _rows(args.a), _rows(args.b)
    common = sorted(set(ra) & set(rb))
    tok_diff = [u for u in common if ra[u].get("tokens") != rb[u].get("tokens")]
    len_diff, snrs = [], []
    for u in common:
        x, y = _pcm(args.a / _file(ra[u])), _pcm(args.b / _file(rb[u]))
        if len(x) != len(y):
            len_diff.append(u)
            continue
        noise = float(((x - y) ** 2).sum())
        snrs.append(math.inf if noise == 0 else 10 * math.log10(max(float((x ** 2).sum()), 1e-30) / noise))
    finite = [s for s in snrs if math.isfinite(s)]
    print(f"rows ok: A {len(ra)}, B {len(rb)}, both {len(common)}; only in A {len(set(ra) - set(rb))}, "
          f"only in B {len(set(rb) - set(ra))}")
    print(f"token counts differ: {len(tok_diff)} {tok_diff[:5]}; WAV lengths differ: {len(len_diff)} {len_diff[:5]}")
    print(f"waveform SNR of B vs A: identical {len(snrs) - len(finite)}, "
          + (f"min {min(finite):.1f} dB, median {float(np.median(finite)):.1f} dB" if finite else "all identical"))
    return 0 if common and not tok_diff and not len_diff and len(common) == len(ra) == len(rb) else 1


if __name__ == "__main__":
    sys.exit(main())
