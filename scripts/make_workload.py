#!/usr/bin/env python3
"""Write an "EN1088-shaped" Seed-TTS workload: OUT/meta.lst and OUT/prompts/*.wav.

    python scripts/make_workload.py --out /data/en1088 [--sources examples/prompts/*.wav]
        [--rows 1088] [--prompts 666] [--seed 0]

Prompts are 3-7 s windows of the source WAVs (default: synthetic speech-like audio, as
`cosybatch profile` uses). `cosybatch profile` builds the same workload by itself
when given no manifest; `--force-length` there imposes the token counts printed here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosybatch.bench import workload  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="output folder")
    ap.add_argument("--sources", nargs="*", type=Path, default=(),
                    help="speech WAVs to cut prompts from (default: synthetic speech-like audio)")
    ap.add_argument("--rows", type=int, default=workload.N_ROWS)
    ap.add_argument("--prompts", type=int, default=workload.N_PROMPTS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token-rate", type=float, default=25.0, help="the checkpoint's token_frame_rate")
    args = ap.parse_args(argv)
    manifest = workload.ensure(args.out, args.sources, args.rows, args.prompts, args.seed)
    prompts, rows = workload.plan(args.rows, args.prompts, args.seed)
    summary = workload.describe(prompts, rows, args.token_rate)
    summary.update(manifest=str(manifest), sources=[str(s) for s in args.sources] or "synthetic")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
