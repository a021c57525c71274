"""Where the GPU frontend's time goes: each part timed alone, eager and from a CUDA graph.

Parts: whisper log-mel, S3TokenizerV3 (per precision), CAM++ (from the reference fbank), the
prompt mel, and all of them as the frontend's slice runs them (3xTF32), with CAM++ on a side
stream beside the tokenizer ("overlapped", the default on CUDA) or after it ("serial"). Each is timed with CUDA events over ``--reps`` runs, eager and replayed from a graph
captured for that part alone, at each ``--batches`` size, on 5 s speech-like prompts. Under a
fixed concurrency prompts arrive one or two at a time, so batch 1 is what the pipeline pays.

  python scripts/profile_frontend.py --model-dir /tmp/ckpt-full --batches 1,4,64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cosybatch.checkpoint.synthetic_audio import speech_like  # noqa: E402
from cosybatch.models.config import ModelConfig  # noqa: E402
from cosybatch.gpu.cuda_graphs import capture_graph  # noqa: E402
from cosybatch.frontend.frontend import Frontend  # noqa: E402
from cosybatch.frontend.batch_features import pad_frames, pad_rows, prompt_mel_batch, whisper_log_mel_batch  # noqa: E402
from cosybatch.gpu.runtime import float32_math  # noqa: E402


def _time(fn, reps: int) -> float:
    """Mean GPU milliseconds of ``fn()`` (after one untimed call)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _graphed(fn):
    """``fn`` captured as the pipeline captures its graphs; returns the replay."""
    graph, _ = capture_graph(fn)
    return graph.replay


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--batches", default="1,4,64")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    cfg = ModelConfig()
    rows = []
    fronts = {p: Frontend(a.model_dir, cfg, backend="torch", device="cuda", dtype=torch.float32, split_tf32=p == "3xtf32",
                          cache_size=0, warmup=False) for p in ("fp32", "3xtf32")}
    loaded = [fronts["fp32"].load_waveform(torch.from_numpy(speech_like(a.seconds, 24000, i).astype(np.float32)), 24000, f"p{i}")
              for i in range(max(int(b) for b in a.batches.split(",")))]
    with torch.inference_mode(), float32_math(False, False):
        for b in (int(x) for x in a.batches.split(",")):
            ps = loaded[:b]
            x16, l16 = (t.cuda() for t in pad_rows([p.wav16 for p in ps]))
            xm, lm = (t.cuda() for t in pad_rows([p.wav_mel for p in ps]))
            fb, nfb = (t.cuda() for t in pad_frames([p.fbank for p in ps]))
            impl = fronts["fp32"]._impl
            feats, frames = whisper_log_mel_batch(x16, l16, impl.n_mels)
            parts = {"whisper log-mel": lambda: whisper_log_mel_batch(x16, l16, impl.n_mels),
                     "prompt mel": lambda: prompt_mel_batch(xm, lm, cfg.mel),
                     "CAM++": lambda: impl.campplus(fb, nfb, padded=False)}
            for p, fe in fronts.items():
                parts[f"tokenizer {p}"] = lambda tok=fe._impl.tokenizer: tok(feats, frames, padded=False)
            # everything the pipeline's frontend slice runs, with CAM++ beside the tokenizer or after it
            both = fronts["3xtf32"]._impl
            side = both._side
            for label, stream in (("all, overlapped", side), ("all, serial", None)):
                parts[label] = lambda s=stream: (setattr(both, "_side", s),
                                                 both._features(x16, l16, fb, nfb, xm, lm, False, False))
            for name, fn in parts.items():
                eager = _time(fn, a.reps)
                graph = _time(_graphed(fn), a.reps)
                rows.append({"part": name, "batch": b, "eager_ms": eager, "graph_ms": graph})
                print(f"  batch {b:3d} {name:<18} eager {eager:7.3f} ms  graph {graph:7.3f} ms", flush=True)
    print(f"\n# frontend parts, {torch.cuda.get_device_name()}, {a.seconds:g} s prompts (GPU ms per call)")
    print(f"{'part':<18} {'batch':>5} {'eager':>8} {'graph':>8} {'graph/prompt':>13}")
    for r in rows:
        print(f"{r['part']:<18} {r['batch']:>5} {r['eager_ms']:>8.3f} {r['graph_ms']:>8.3f} {r['graph_ms'] / r['batch']:>13.3f}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
