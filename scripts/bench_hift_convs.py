"""HiFT's decode stack (conv_pre to conv_post) as cuDNN runs it (NCL, the default; and, as a
candidate, on channels-last tensors, which cuDNN's NHWC kernels read without the transposes it
puts around the NCL ones) and as the Triton convs run it (``optimizations.hift_convs``) under
several tile choices, at a streaming call's shape and a whole-response batch's: GPU ms per call
from a replayed CUDA graph, GPU ms per audio second, CUDA kernels per call (the profiler's
count: cuDNN's own transposes included), the kernels that take the most time, and the SNR of
the final spectrum against strict float32 cuDNN. Full-size random weights, Snake alphas spread
as trained ones are.

    python scripts/bench_hift_convs.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hift import set_tf32  # noqa: E402
from profile_flow import kernel_table  # noqa: E402

from cosybatch.codec import triton_conv  # noqa: E402
from cosybatch.codec.hift_convs import CudnnChannelsLastDecode, TritonConvDecode  # noqa: E402
from cosybatch.codec.snake import SnakePad  # noqa: E402
from cosybatch.models.config import HiFTConfig  # noqa: E402
from cosybatch.models.hift import CausalHiFTGenerator, Snake  # noqa: E402

# (BLOCK_T, BLOCK_CI, largest BLOCK_CO, warps, stages); under 2,048 frames BLOCK_T is 64, on 4
# warps up to 64 output channels a tile, on 8 above. Each keeps to 32 accumulators a thread
# (ptxas spills with 64, triton_conv.conv_blocks), except 128 x 128 (64, no spills: compiled with
# scripts/triton_conv_compile.py --tile, 196-221 registers). The wider tiles read each input
# tile for more output channels (the 256-channel stage re-reads its input 4 times at 64).
TILES = {"t128-ci32-co64-w8": (128, 32, 64, 8, 3), "t64-ci32-co64-w4": (64, 32, 64, 4, 3),
         "t128-ci64-co64-w8": (128, 64, 64, 8, 3), "t64-ci64-co64-w4": (64, 64, 64, 4, 3),
         "t128-ci32-co64-w8-s4": (128, 32, 64, 8, 4), "t64-ci32-co128-w8": (64, 32, 128, 8, 3),
         "t128-ci32-co128-w8": (128, 32, 128, 8, 3), "t128-ci16-co64-w8-s4": (128, 16, 64, 8, 4)}
SHAPES = {"streaming": (8, 130), "whole": (16, 300)}  # (rows, mel frames)


def tiles(bt, bci, bco_max, warps, stages):
    def blocks(t_out, c_out):
        bco = max(16, min(bco_max, triton_conv.triton.next_power_of_2(c_out)))
        if t_out >= 2048:
            return bt, bci, bco, warps, stages
        return 64, bci, bco, (4 if bco <= 64 else 8), stages
    return blocks


def graph_ms(fn, reps: int) -> tuple[float, torch.Tensor]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps, out.clone()


def snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.double(), want.double()
    return (10 * torch.log10(w.pow(2).sum() / (g - w).pow(2).sum().clamp_min(1e-300))).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=6)
    # each choice compiles every kernel variant again (~1 s each on the first run of a machine)
    ap.add_argument("--tiles", default="t128-ci32-co64-w8,t64-ci32-co128-w8,t128-ci32-co128-w8,t128-ci16-co64-w8-s4,"
                                       "t128-ci32-co64-w8-s4",
                    help=f"comma list of {', '.join(TILES)}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = CausalHiFTGenerator(HiFTConfig())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Snake):
                m.alpha.uniform_(0.2, 3.0)
    model = model.cuda().eval()
    snake_pad, convs, cl = SnakePad(model, "triton"), TritonConvDecode(model), CudnnChannelsLastDecode(model)
    rows_out = []
    with torch.inference_mode():
        for shape, (rows, frames) in SHAPES.items():
            g = torch.Generator().manual_seed(1)
            mel = (torch.randn(rows, 80, frames, generator=g) - 5).cuda()
            s_stft = torch.randn(rows, model.cfg.n_fft + 2, frames * model.up_total + 1, generator=g).cuda()
            audio_s = rows * frames / 50
            set_tf32(False)
            ref = model.decode_spec(mel, s_stft, finalize=True)
            variants = [("cudnn tf32", lambda: model.decode_spec(mel, s_stft, finalize=True, snake_pad=snake_pad), None),
                        ("cudnn tf32 channels-last", lambda: cl.decode_spec(mel, s_stft), None)]
            variants += [(f"triton {name}", lambda: convs.decode_spec(mel, s_stft), TILES[name])
                         for name in args.tiles.split(",")]
            for name, fn, tile in variants:
                set_tf32(True)
                keep = triton_conv.conv_blocks
                if tile is not None:
                    triton_conv.conv_blocks = tiles(*tile)
                try:
                    ms, out = graph_ms(fn, args.reps)
                    fn()  # eager once more, outside the profile: nothing left to compile or plan
                    torch.cuda.synchronize()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        fn()
                        torch.cuda.synchronize()
                    n = kernel_table(prof, f"{name}, {shape}", args.top)["launches"]
                finally:
                    triton_conv.conv_blocks = keep
                row = dict(shape=shape, rows=rows, frames=frames, variant=name, ms_per_call=round(ms, 3),
                           gpu_ms_per_audio_s=round(ms / audio_s, 3), launches=n, snr_db_vs_fp32=round(snr_db(out, ref), 1))
                rows_out.append(row)
                print(row, flush=True)
    print("| shape | variant | ms per call | GPU-ms per audio-s | kernels | SNR dB vs float32 |")
    print("|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['shape']} ({r['rows']} x {r['frames']}) | {r['variant']} | {r['ms_per_call']} | "
              f"{r['gpu_ms_per_audio_s']} | {r['launches']} | {r['snr_db_vs_fp32']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows_out, indent=1))


if __name__ == "__main__":
    main()
