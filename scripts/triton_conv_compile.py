"""Compile the HiFT conv kernel (``codec/triton_conv.py``) for sm_90 on any machine, GPU or not,
and report what ptxas makes of each variant the Triton decode launches: registers a thread,
spilled bytes, wgmma instructions, shared memory. A spill or a missing wgmma shows before any
device time is spent (design.md D31). Needs Triton's NVIDIA backend (its bundled ptxas).

    python scripts/triton_conv_compile.py [--tile BT,BCI,BCO_MAX,WARPS,STAGES]

``--tile``: the tile a bench candidate would use (``scripts/bench_hift_convs.py``'s TILES), instead
of ``triton_conv.conv_blocks``'s choice.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cosybatch.codec import triton_conv as C  # noqa: E402

POINTERS = ["x_ptr", "w_ptr", "b_ptr", "y_ptr", "alpha_ptr", "inv_ptr", "res_ptr", "add_ptr", "y2_ptr", "alpha2_ptr",
            "inv2_ptr", "valid_ptr"]
INTS = ["C_in", "C_out", "T_in", "T_out", "shift", "K", "DIL", "STRIDE", "UP", "rate", "margin"]
# (C_in, C_out, the fused steps) of each kind of launch TritonConvDecode makes, at the full size
VARIANTS = {
    "conv_pre (NCL mel)": (80, 512, dict(X_CL=False, ROUND_X=True)),
    "ups (LeakyReLU, x8)": (512, 256, dict(LEAKY=True, ROUND_X=True)),
    "source down (NCL, 18 in)": (18, 256, dict(X_CL=False, ROUND_X=True)),
    "conv1 (+ Snake, rounded)": (256, 256, dict(SNAKE=True, ROUND_Y=True)),
    "conv2 (+ residual, Snake out)": (64, 64, dict(RES=True, OUT2=True)),
    "last conv2 (+ residual, sum, mean)": (64, 64, dict(RES=True, ADD=True, DIV=True)),
    "conv_post (NCL out, 18)": (64, 18, dict(LEAKY=True, ROUND_X=True, Y_CL=False)),
}


def ptxas() -> str:
    found = sorted(glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas*")))
    if not found:
        raise SystemExit("no ptxas in Triton's NVIDIA backend")
    return found[-1]  # ptxas-blackwell where there is one: the newer PTX versions


def report(c_in: int, c_out: int, t_out: int, flags: dict, tool: str, blocks=None) -> dict:
    bt, bci, bco, warps, stages = (blocks or C.conv_blocks)(t_out, c_out)
    const = dict(X_CL=True, Y_CL=True, LEAKY=False, SNAKE=False, RES=False, ADD=False, DIV=False, OUT2=False,
                 TF32=True, ROUND_X=False, ROUND_Y=False, VALID=True, BLOCK_T=bt, BLOCK_CI=bci, BLOCK_CO=bco) | flags
    sig = {p: "*fp32" for p in POINTERS} | {"valid_ptr": "*i64"} | {n: "i32" for n in INTS} | {"slope": "fp32",
                                                                                             "div": "fp32"}
    sig |= {k: "constexpr" for k in const}
    keys = list(sig)
    aligned = POINTERS + [n for n, v in (("C_in", c_in), ("C_out", c_out)) if v % 16 == 0]  # as the JIT specialises
    attrs = {(keys.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = triton.compile(ASTSource(fn=C._conv1d_kernel, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d, "k.ptx")
        ptx.write_text(k.asm["ptx"])
        err = subprocess.run([tool, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(d, "k.cubin"))],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", err)
    spill = re.search(r"(\d+) bytes spill stores", err)
    return dict(tile=f"{bt}x{bco} ci{bci} w{warps} s{stages}", registers=int(regs.group(1)) if regs else None,
                spill_bytes=int(spill.group(1)) if spill else None, wgmma=k.asm["ptx"].count("wgmma.mma_async"),
                shared_bytes=k.metadata.shared)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tile", help="BT,BCI,BCO_MAX,WARPS,STAGES (as bench_hift_convs.py's TILES)")
    args = ap.parse_args()
    blocks = None
    if args.tile:
        from bench_hift_convs import tiles

        blocks = tiles(*(int(v) for v in args.tile.split(",")))
    tool = ptxas()
    print(f"triton {triton.__version__}, {os.path.basename(tool)}, sm_90a")
    print("| launch | frames | tile | registers | spilled bytes | wgmma | shared bytes |")
    print("|---|---|---|---|---|---|---|")
    for name, (c_in, c_out, flags) in VARIANTS.items():
        for t_out in (512, 8192):
            r = report(c_in, c_out, t_out, flags, tool, blocks)
            print(f"| {name} | {t_out} | {r['tile']} | {r['registers']} | {r['spill_bytes']} | {r['wgmma']} | "
                  f"{r['shared_bytes']} |", flush=True)


if __name__ == "__main__":
    main()
