#!/usr/bin/env bash
# One H200 lease: carried wheels, a full-size random checkpoint (real-cost frontends), the
# EN1088-shaped workload, then the steps asked for. Results land in $OUT (or /tmp/cosybatch-out).
#   scripts/gpu_session.sh STEP [STEP ...]
# steps: tests pipetests frontendtests frontendparts flowtests hifttests codec conv flowsweep flowprof fuseprof layerparts fp8gemm hiftprof hift frontend c32 c32host c32warm
#        c64 c64cf c64seed full synth synthcache synthhost devices quick coldshapes coldops syncaudit enginetests prefill
#        c32set=KEY=VALUE (the seed profile at C32 with one profile key overridden), c32warmset=KEY=VALUE
#        (the same with --warm-prompts), c64set=KEY=VALUE (packed_streaming_c64 at C64)
#        synthwarm (synth over 128 rows: fills Triton's kernel cache, which the first run of a fresh
#        machine would otherwise compile inside its measured window), synthset=KEY=VALUE,
#        (SYNTH_ARGS: more arguments for every synth run, e.g. "--set codec.frontend_workers=2";
#        PROFILE_ARGS: the same for every profile run)
#        synthbase=DIR (synth with the cosybatch package in DIR, e.g. `git archive C cosybatch`
#        unpacked there: a baseline commit in the same lease), frontendpartsbase=DIR (frontendparts
#        with DIR's package and script: `git archive C cosybatch scripts`; design.md D40's before/after)
#        cold16 (startup16 with an empty Triton cache: what a first run on a machine waits for),
#        bytecode:STEP (STEP with Python's bytecode kept under /tmp/pycache, where the image sets
#        PYTHONDONTWRITEBYTECODE: its first run writes it; e.g. `bytecode:startup16 startup16 bytecode:startup16`;
#        the command now keeps it itself under ~/.cache/cosybatch/pycache, so the A/B is
#        `startup16 nopyc:startup16`: nopyc:STEP is STEP with COSYBATCH_PYCACHE=off),
#        nolist:STEP (STEP without cosybatch/gpu/triton_launches.json: cold, nothing compiled ahead;
#        warm, nothing preloaded; e.g. `cold16 nolist:cold16 startup16 nolist:startup16`),
#        firsthop (the GPU tests of codec.first_hops_apart, design.md D39: then
#        `c32 c32set=codec.first_hops_apart=true`, alternated, three each),
#        pyc (does every import compile source on this host? import time with a pycache prefix),
#        cachetests (the GPU test of D37's premise), record (the Triton launch variants of synth and the seed profile into $OUT/triton_launches.json:
#        copied to cosybatch/gpu/, what a cold cache compiles ahead, design.md D37),
#        startup16, startup16base=DIR (the whole `synth` command over 16 rows, timed, with its
#        start-up phases: what a small job waits for; alternate them, e.g. `startup16base=.base
#        startup16 startup16base=.base startup16`, the first run of a fresh machine also fills
#        Triton's cache and the page cache), startupimports (that command under -X importtime:
#        the imports that cost most, cumulative), startuptests (the GPU tests of what the start-up
#        work changed: weights straight to the GPU, lazy AR graphs, the GPU frontend read from
#        the mapped ONNX files; carry .fixtures for the fixture ones)
#        timeline (design.md D22: C64 and C32, serial vs codec.deadline_lead_ms=500 vs that with
#        scheduler.ar_stream=beside (the seed profiles' own setting), in one lease; needs nvidia-ml-py for the in-process kernel-active share)
#        c64seedset=KEY=VALUE; every *set= step takes several keys joined by "+": K1=V1+K2=V2
#        synthmixed (synth, then the AR mixed-step pairs it met captured at start-up, alternated twice)
#        besidetests (the GPU tests of the graphed mixed step and of the frontend's / HiFT's streams)
#        promptaudio (bench_prompt_audio: prompt loading in threads vs helper processes, design.md D32)
#        arbench (the AR decode alone: ms/step with and without ar.rope_in_attention and the sampler's kernels)
#        hiftconvs (optimizations.hift_convs: the GPU test of its channels-last decodes, and profile_hift
#        beside the NCL path), hiftconvbench (the decode stack alone: cuDNN NCL and channels-last, the
#        Triton convs under several tiles)
#        c32base=DIR, c64seedbase=DIR (the seed profile with the package in DIR: a baseline commit)
#        base (the seed profile at C32 on ad1324d, the engine the timeline replaced: the
#        baseline to run in the same lease)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cosybatch-out}; mkdir -p "$OUT"
if ! python3 -c "import soundfile" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# The parity fixtures do not travel with the repository: scripts/lease_carry.sh copies them into
# the ignored .fixtures/; carry it, so the fixture tests run here too.
[ -d .fixtures/cv3-tiny ] && export COSYBATCH_FIXTURES=$PWD/.fixtures
CB="python3 -m cosybatch"
CKPT=/tmp/ckpt-full
WL=/tmp/en1088
log() { echo "== $(date +%T) $*" | tee -a "$OUT/session.log"; }
setup() {
  [ -f $CKPT/llm.pt ] || { log "make-checkpoint full"; ( time $CB make-checkpoint $CKPT --size full --seed 0 ) 2>&1 | tail -4 | tee -a "$OUT/session.log"; }
  [ -f $WL/meta.lst ] || python3 scripts/make_workload.py --out $WL > "$OUT/workload.json" || exit 1
  [ -f "$OUT/gpu.txt" ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
}
prof() {  # tag profile concurrency prompts warmups [extra...]
  local tag=$1 p=$2 c=$3 n=$4 w=$5; shift 5
  log "profile $tag: $p C$c N$n W$w $*"
  # the share of time any kernel runs (nvidia-smi's utilization.gpu), sampled beside the run:
  # the slice times cannot tell a GPU waiting for the host from one busy with small kernels
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100 > "$OUT/util-$tag.csv" 2>/dev/null &
  local smi=$!
  timeout 300 $CB profile $WL/meta.lst --model $CKPT --device cuda --profile $p --concurrency $c \
    --num-prompts $n --num-warmups $w --force-length --result-dir "$OUT" "$@" ${PROFILE_ARGS:-} > "$OUT/profile-$tag.txt" 2>&1
  echo "rc=$?" >> "$OUT/profile-$tag.txt"; kill $smi 2>/dev/null
  python3 - "$OUT/util-$tag.csv" <<'PY' | tee -a "$OUT/profile-$tag.txt"
import sys
v = [float(x) for x in open(sys.argv[1]).read().split() if x.strip().isdigit()]
busy = [x for x in v if x > 0]  # drop model load / capture idle before the run
print(f"nvidia-smi utilization.gpu over {len(busy)} busy samples of 100 ms: mean {sum(busy) / max(1, len(busy)):.1f} %")
PY
  tail -44 "$OUT/profile-$tag.txt"
  # one line per run in $OUT/summary.txt (a lease's table, whatever else is cut short)
  python3 - "$OUT" "$tag" <<'PY' | tee -a "$OUT/summary.txt"
import glob, json, os, sys
files = sorted(glob.glob(os.path.join(sys.argv[1], "cosybatch-*.json")), key=os.path.getmtime)
if files:
    r = json.load(open(files[-1])); tl = r.get("timeline") or {}; b = tl.get("gpu_budget") or {}
    print(f"{sys.argv[2]}: {r['audio_throughput']:.1f} audio-s/s, first PCM p50 {r['median_ttfp_ms']:.0f} ms, "
          f"kernel-active {(tl.get('gpu_kernel') or {}).get('kernel_active_share')}, AR step p50 {(tl.get('ar_step_ms') or {}).get('p50')}, "
          "GPU-ms/audio-s " + " ".join(f"{k} {b.get(k)}" for k in ("wall", "flow_steps", "hift", "ar_decode", "ar_mixed", "prefill", "frontend")))
PY
}
synth_run() {  # tag [manifest [synth args...]]: synth default --force-length (the 1,088 rows), no prompt cache
  local tag=$1 man=${2:-$WL/meta.lst} n=2; shift; shift
  local base=$tag; while [ -e "$OUT/$tag.txt" ]; do tag=$base-run$n; n=$((n + 1)); done  # a repeated step keeps its own files
  log "$tag: synth default --force-length $man $* (package: $(python3 -c 'import cosybatch; print(cosybatch.__file__)'))"
  rm -rf /tmp/$tag-out
  ( time timeout 400 $CB synth $man --model $CKPT --out /tmp/$tag-out --device cuda --force-length --quiet ${SYNTH_ARGS:-} "$@" ) \
    > "$OUT/$tag.txt" 2>&1; echo "rc=$?" >> "$OUT/$tag.txt"; tail -5 "$OUT/$tag.txt"
  python3 - /tmp/$tag-out/timing.json "$OUT/summary.txt" "$tag" <<'PY' | tee -a "$OUT/$tag.txt"
import json, sys; t = json.load(open(sys.argv[1]))["totals"]; tl = t.get("timeline", {})
print({k: t.get(k) for k in ("ok", "failed", "wall_s", "audio_s", "audio_s_per_s")})
print("busy", tl.get("busy_share"), "idle", tl.get("gpu_idle_share"), "host", tl.get("host_busy_ms_per_iteration"))
print("GPU-ms per audio-s", tl.get("gpu_budget"))
# the window by tenth: where a ramp or a drain goes (design.md D15)
bt, sl = tl.get("by_tenth") or {}, (tl.get("by_tenth") or {}).get("slices", {})
rows = {"kernel-active": (tl.get("gpu_kernel") or {}).get("by_tenth"), "host own": bt.get("host_own"),
        **{k: sl.get(k) for k in ("frontend", "ar_prefill", "ar_decode", "flow_step", "hift")}}
for name, v in rows.items():
    if v:
        print(f"  {name:14s}", " ".join(f"{x:4.2f}" for x in v))
# how large the launches were and what the host paid to queue them (counts and rows per tenth)
for label, part, kinds in (("launches", "count", ("frontend", "ar_prefill")), ("rows", "size", ("frontend", "ar_prefill")),
                           ("host queueing", "queue", ("frontend", "ar_prefill", "ar_mixed", "ar_decode"))):
    for k in kinds:
        v = (bt.get(part) or {}).get(k)
        if v:
            print(f"  {label + ' ' + k:26s}", " ".join(f"{x:5.2f}" if isinstance(x, float) else f"{x:5d}" for x in v))
for k, v in (bt.get("marks") or {}).items():
    print(f"  {k:26s}", " ".join(f"{x:5d}" for x in v))
print("start-up", t.get("startup"))
mixed = (tl.get("graphs") or {}).get("mixed") or {}
if mixed.get("capture_log"):  # the AR engine's mixed-step pairs captured in the window: which, and their host ms
    log = mixed["capture_log"]
    print(f"mixed pairs captured {mixed.get('pairs')} ({sum(e[2] for e in log):.0f} ms of host), eager steps {mixed.get('eager')}:", log)
b = tl.get("gpu_budget") or {}
with open(sys.argv[2], "a") as f:  # one line per run in $OUT/summary.txt
    f.write(f"{sys.argv[3]}: {t.get('audio_s_per_s'):.1f} audio-s/s, kernel-active {(tl.get('gpu_kernel') or {}).get('kernel_active_share')}, "
            "GPU-ms/audio-s " + " ".join(f"{k} {b.get(k)}" for k in ("wall", "flow_steps", "captures", "hift", "prefill", "frontend"))
            + f", window {t.get('wall_s')} s, start-up {(t.get('startup') or {}).get('total_s')} s "
            f"(flow graphs {((t.get('startup') or {}).get('phases_s') or {}).get('flow graphs')}, kernel cache {(t.get('startup') or {}).get('kernel_cache')}), "
            f"Triton in the window {tl.get('kernel_compiles')}\n")
PY
  grep -m1 "^real" "$OUT/$tag.txt" | sed "s/^/$tag: whole command /" >> "$OUT/summary.txt"
  cp /tmp/$tag-out/timing.json "$OUT/$tag-timing.json"
  LAST_TIMING="$OUT/$tag-timing.json"
}
set_args() {  # "K1=V1+K2=V2+..." -> SETS=(--set K1=V1 --set K2=V2 ...)
  local kvs kv; SETS=(); IFS='+' read -ra kvs <<< "$1"; for kv in "${kvs[@]}"; do SETS+=(--set "$kv"); done
}
for step in "$@"; do
  case $step in
    tests) setup; log "pytest -m gpu"
      COSYBATCH_PARITY_LOG=$OUT/parity.jsonl COSYBATCH_FRONTEND_DIR=$CKPT timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -rs -m gpu -p no:cacheprovider -s tests > "$OUT/gpu_tests.txt" 2>&1
      echo "rc=$?" >> "$OUT/gpu_tests.txt"; grep -E "passed|failed|error|rel RMS|graphs:|agree|flip|dB" "$OUT/gpu_tests.txt" | tail -40 ;;
    codec) log "bench_codec"
      timeout 400 python3 scripts/bench_codec.py --size full --device cuda --dtype bf16 --variants eager,graphs \
        --full-jobs 64 --stream-rows 32 --reps 1 --json "$OUT/bench_codec.json" 2>&1 | tee "$OUT/bench_codec.txt" | grep -v "^#" ;;
    flowsweep) log "bench_codec: graphed full passes vs size (fixed cost per Euler step) + eager kernel profile"
      timeout 400 python3 scripts/bench_codec.py --size full --device cuda --dtype bf16 --variants eager,graphs \
        --full-jobs 2,4,8,16,32 --profile 8 --no-baseline --reps 2 --json "$OUT/bench_flowsweep.json" 2>&1 \
        | tee "$OUT/bench_flowsweep.txt" | grep -v "^#" ;;
    flowprof) log "profile_flow: graphed step time vs rows (fixed cost fit) + eager kernel profile"
      timeout 300 python3 scripts/profile_flow.py --rows 1,4,8,16 --hop 1 --profile-rows 16 \
        --json "$OUT/profile_flow.json" 2>&1 | tee "$OUT/profile_flow.txt" | grep -v "^#  " ;;
    fuseprof) log "profile_flow: the unfused layer vs each fused part vs all (design.md D26): graphed step fit + kernels per layer"
      timeout 300 python3 scripts/profile_flow.py --rows ${FUSE_ROWS:-6,12,24} --hop 2 --reps 2 --profile-rows ${FUSE_PROFILE_ROWS:-8} --top 12 \
        --variants ${FUSE_VARIANTS:-unfused,+chain,+gelu,+kv,+fill,triton} --profile-variants unfused,triton \
        --json "$OUT/profile_fuse.json" 2>&1 | tee "$OUT/profile_fuse.txt" | grep -v "^  [ 0-9]" ;;
    layerparts) log "bench_layer_parts: each fused layer part vs the ops it replaces (µs, kernels, difference)"
      timeout 200 python3 scripts/bench_layer_parts.py --json "$OUT/bench_layer_parts.json" 2>&1 | tee "$OUT/bench_layer_parts.txt" | grep "^|" ;;
    fp8gemm) log "bench_fp8_gemm: the DiT layer's four GEMMs, bf16 (cuBLASLt) vs fp8 row-wise (torch._scaled_mm), at the flow's token counts"
      timeout 120 python3 scripts/bench_fp8_gemm.py --json "$OUT/bench_fp8_gemm.json" 2>&1 | tee "$OUT/bench_fp8_gemm.txt" | grep "^|" ;;
    conv) log "bench_codec --conv: the position convs, NCL vs channels-last, by length"
      timeout 200 python3 scripts/bench_codec.py --size full --device cuda --dtype bf16 --variants "" --conv \
        --json "$OUT/bench_conv.json" 2>&1 | tee "$OUT/bench_conv.txt" | grep -v "^#" ;;
    hiftprof) log "profile_hift: host vs GPU ms per streaming HiFT call + kernel profile"
      timeout 200 python3 scripts/profile_hift.py --requests 6 --json "$OUT/profile_hift.json" 2>&1 | tee "$OUT/profile_hift.txt" | cut -c1-120 | tail -45 ;;
    frontendtests) setup; log "pytest -m gpu tests/test_frontend_gpu.py"
      COSYBATCH_FRONTEND_DIR=$CKPT timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_frontend_gpu.py \
        > "$OUT/frontend_tests.txt" 2>&1; echo "rc=$?" >> "$OUT/frontend_tests.txt"
      grep -E "passed|failed|error|frontend-gpu" "$OUT/frontend_tests.txt" | cut -c1-400 | tail -14 ;;
    pipetest=*) log "pytest -m gpu tests/test_pipeline_gpu.py -k ${step#pipetest=}"
      COSYBATCH_FIXTURES=$PWD/.fixtures timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_pipeline_gpu.py \
        -k "${step#pipetest=}" > "$OUT/pipeline_test.txt" 2>&1; echo "rc=$?" >> "$OUT/pipeline_test.txt"; tail -30 "$OUT/pipeline_test.txt" ;;
    pipetests) log "pytest -m gpu tests/test_pipeline_gpu.py (needs .fixtures)"
      COSYBATCH_PARITY_LOG=$OUT/parity.jsonl timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_pipeline_gpu.py \
        > "$OUT/pipeline_tests.txt" 2>&1; echo "rc=$?" >> "$OUT/pipeline_tests.txt"; grep -E "passed|failed|Error|dB" "$OUT/pipeline_tests.txt" | tail -30 ;;
    flowtests) log "pytest -m gpu tests/test_codec_flow_gpu.py"
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_codec_flow_gpu.py > "$OUT/flow_tests.txt" 2>&1
      echo "rc=$?" >> "$OUT/flow_tests.txt"; grep -E "passed|failed|error|rel RMS|graphs:|rotary|conv |gelu|fused" "$OUT/flow_tests.txt" | tail -30 ;;
    hiftconvs) log "HiFT's decode on channels-last tensors (cuDNN, Triton convs): the GPU test against float32 / cuDNN TF32, then profile_hift beside the NCL path"
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_codec_hift.py -k channels_last_decodes > "$OUT/hiftconvs_tests.txt" 2>&1
      echo "rc=$?" >> "$OUT/hiftconvs_tests.txt"; grep -E "passed|failed|Error|SNR" "$OUT/hiftconvs_tests.txt" | cut -c1-300 | tail -12
      timeout 200 python3 scripts/profile_hift.py --requests 6 --variants f0-gemm,cudnn-cl,triton-convs --json "$OUT/profile_hiftconvs.json" 2>&1 \
        | tee "$OUT/profile_hiftconvs.txt" | grep -E "^\||outputs" ;;
    hiftconvbench) log "bench_hift_convs: HiFT's decode stack, cuDNN vs the Triton convs under several tiles"
      timeout 300 python3 scripts/bench_hift_convs.py --json "$OUT/bench_hift_convs.json" 2>&1 | tee "$OUT/bench_hift_convs.txt" | grep "^|" ;;
    hifttests) log "pytest -m gpu tests/test_codec_hift.py tests/test_graph_cache.py"
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_codec_hift.py tests/test_graph_cache.py > "$OUT/hift_tests.txt" 2>&1
      echo "rc=$?" >> "$OUT/hift_tests.txt"; tail -4 "$OUT/hift_tests.txt" ;;
    coldshapes) setup; log "profile_cold_shapes: eager HiFT call and frontend launch at a new shape, then again"
      timeout 200 python3 scripts/profile_cold_shapes.py --model-dir $CKPT --json "$OUT/cold_shapes.json" 2>&1 \
        | tee "$OUT/cold_shapes.txt" | tail -12 ;;
    coldops) setup; log "profile_cold_shapes --host-ops: a frontend launch at a new shape, then again, its costliest host ops (what the first sight pays for)"
      timeout 200 python3 scripts/profile_cold_shapes.py --model-dir $CKPT --shapes 17x5.0,32x6.0 --host-ops 14 \
        --json "$OUT/cold_ops.json" 2>&1 | tee "$OUT/cold_ops.txt" | grep -v "^hift" | tail -40 ;;
    hift) log "bench_hift"
      timeout 300 python3 scripts/bench_hift.py --batched-only --out "$OUT/bench_hift.json" 2>&1 | tee "$OUT/bench_hift.txt" | tail -20 ;;
    frontend) setup; log "bench_frontend"
      timeout 300 python3 scripts/bench_frontend.py --model-dir $CKPT --device cuda --kernels 14 --json "$OUT/bench_frontend.json" \
        2>&1 | tee "$OUT/bench_frontend.txt" | grep -v "^  " | tail -16 ;;
    frontendparts) setup; log "profile_frontend: each part eager and graphed, batch 1/4/64"
      timeout 200 python3 scripts/profile_frontend.py --model-dir $CKPT --batches 1,4,64 --json "$OUT/profile_frontend.json" \
        2>&1 | tee "$OUT/profile_frontend.txt" | grep -v "^  " ;;
    frontendpartsbase=*) setup; d=${step#*=}  # the same from DIR: `git archive COMMIT cosybatch scripts | tar -x -C DIR`
      [ -f "$d/scripts/profile_frontend.py" ] || { log "$step: $d/scripts/profile_frontend.py not found"; continue; }
      log "profile_frontend of the package in $d"
      ( cd "$d" && timeout 200 python3 scripts/profile_frontend.py --model-dir $CKPT --batches 1,4,64 \
          --json "$OUT/profile_frontend-base.json" ) 2>&1 | tee "$OUT/profile_frontend-base.txt" | grep -v "^  " ;;
    quick) setup; prof quick32 packed_streaming_optimized_standard 32 256 32 ;;
    c32) setup; prof c32 packed_streaming_optimized_standard 32 1088 64 ;;
    c32host) setup; prof c32host packed_streaming_optimized_standard 32 512 64 --host-profile "$OUT/c32-host.pstats" ;;
    c32warm) setup; prof c32warm packed_streaming_optimized_standard 32 1088 64 --warm-prompts ;;
    c32set=*) setup; kv=${step#c32set=}; set_args "$kv"; prof "c32-${kv//[^A-Za-z0-9_.-]/_}" packed_streaming_optimized_standard 32 1088 64 "${SETS[@]}" ;;
    c32warmset=*) setup; kv=${step#c32warmset=}; set_args "$kv"; prof "c32warm-${kv//[^A-Za-z0-9_.-]/_}" packed_streaming_optimized_standard 32 1088 64 --warm-prompts "${SETS[@]}" ;;
    c64set=*) setup; kv=${step#c64set=}; set_args "$kv"; prof "c64-${kv//[^A-Za-z0-9_.-]/_}" packed_streaming_c64 64 1088 64 "${SETS[@]}" ;;
    c64seedset=*) setup; kv=${step#c64seedset=}; set_args "$kv"; prof "c64seed-${kv//[^A-Za-z0-9_.-]/_}" packed_streaming_optimized_standard 64 1088 64 "${SETS[@]}" ;;
    timeline) setup; log "D22: serial vs deadline batching vs deadline batching + AR beside, C64 and C32"
      for c in c64 c32; do p=packed_streaming_optimized_standard; [ $c = c64 ] && p=packed_streaming_c64
        prof "$c-serial" $p ${c#c} 1088 64 --set codec.deadline_lead_ms=null --set scheduler.ar_stream=serial
        prof "$c-deadline" $p ${c#c} 1088 64 --set codec.deadline_lead_ms=500 --set scheduler.ar_stream=serial
        prof "$c-deadline-beside" $p ${c#c} 1088 64 --set codec.deadline_lead_ms=500 --set scheduler.ar_stream=beside
      done ;;
    c64seed) setup; prof c64seed packed_streaming_optimized_standard 64 1088 64 ;;
    c32base=*|c64seedbase=*) setup; d=${step#*=}  # the same run with the cosybatch package in DIR (another commit)
      [ -d "$d/cosybatch" ] || { log "$step: $d/cosybatch not found"; continue; }
      c=${step%%base=*}; n=${c//[^0-9]/}
      ( cd "$d" && prof "$c-base" packed_streaming_optimized_standard $n 1088 64 ) ;;
    base) setup; log "baseline ad1324d: seed profile C32"
      rm -rf /tmp/base && mkdir -p /tmp/base && git archive ad1324d | tar -x -C /tmp/base || exit 1
      ( cd /tmp/base && PYTHONPATH=/tmp/base:/tmp/site && export PYTHONPATH &&
        { [ -f /tmp/ckpt-base/llm.pt ] || python3 -m cosybatch.cli make-checkpoint /tmp/ckpt-base --size full --seed 0 >/dev/null; } &&
        timeout 300 python3 -m cosybatch.cli profile $WL/meta.lst --model /tmp/ckpt-base --device cuda \
          --profile packed_streaming_optimized_standard --concurrency 32 --num-prompts 1088 --num-warmups 64 \
          --force-length --result-dir "$OUT/base" ) > "$OUT/profile-base.txt" 2>&1
      echo "rc=$?" >> "$OUT/profile-base.txt"; tail -30 "$OUT/profile-base.txt" ;;
    arbench) log "bench_ar: decode ms/step by batch; RoPE in the attention kernel (ar.rope_in_attention); the sampler as tensor ops (sampler_kernels=False)"
      timeout 300 python3 scripts/bench_ar.py --batches 16,32,64 --eager-batches "" --cublas-batches "" \
        --variant-batches 16,32,64 --out "$OUT/bench_ar.json" 2>&1 | tee "$OUT/bench_ar.txt" | grep "^|" ;;
    c64) setup; prof c64 packed_streaming_c64 64 1088 64 ;;
    c64cf) setup; prof c64cf packed_streaming_c64_chunk_final 64 1088 64 ;;
    full) setup; prof full256 default 256 1088 64 ;;
    synth) setup; synth_run synth ;;
    synthwarm) setup; head -n 128 $WL/meta.lst > $WL/m128.lst; synth_run synthwarm $WL/m128.lst ;;  # Triton's JIT cache
    synthset=*) setup; kv=${step#synthset=}; set_args "$kv"; synth_run "synth-${kv//[^A-Za-z0-9_.-]/_}" $WL/meta.lst "${SETS[@]}" ;;
    synthmixed) setup; log "synth, then synth with the AR mixed-step pairs it met captured at start-up (ar.mixed_graph_precapture), alternated twice"
      synth_run synth
      pairs=$(python3 - "$LAST_TIMING" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))["totals"]["timeline"]["graphs"].get("mixed") or {}
met = {(e[0], e[1]) for e in m.get("capture_log", [])} | {tuple(p) for p in m.get("met_once", [])}
print(json.dumps([list(p) for p in sorted(met)]).replace(" ", ""))
PY
)
      log "mixed pairs the run met: $pairs"
      for _ in 1 2; do
        synth_run synth-mixedpre $WL/meta.lst --set "ar.mixed_graph_precapture=$pairs"; synth_run synth
      done ;;
    synthbase=*) setup; d=${step#synthbase=}  # the same synth with the package from folder d (another commit)
      [ -d "$d/cosybatch" ] || { log "synthbase: $d/cosybatch not found"; continue; }
      ( cd "$d" && synth_run "synth-${d//[^A-Za-z0-9_.-]/_}" ) ;;  # python3 -m puts the working folder first
    cold16) setup; head -n 16 $WL/meta.lst > $WL/m16.lst  # a first run on a machine: Triton's cache empty
      ( export TRITON_CACHE_DIR=/tmp/triton-cold-$RANDOM; synth_run cold16 $WL/m16.lst ) ;;
    bytecode:*) echo "-- ${step#bytecode:} with bytecode kept (PYTHONPYCACHEPREFIX=/tmp/pycache, design.md D38):" >> "$OUT/summary.txt"
      PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=/tmp/pycache OUT=$OUT bash "$0" "${step#bytecode:}" ;;
    nopyc:*) echo "-- ${step#nopyc:} with COSYBATCH_PYCACHE=off (every import compiled again where the image keeps no bytecode, D38):" >> "$OUT/summary.txt"
      COSYBATCH_PYCACHE=off OUT=$OUT bash "$0" "${step#nopyc:}" ;;
    nolist:*) L=cosybatch/gpu/triton_launches.json  # a step without the shipped launch list (D37's A/B)
      [ -f $L ] && mv $L /tmp/launches.json; OUT=$OUT bash "$0" "${step#nolist:}"; [ -f /tmp/launches.json ] && mv /tmp/launches.json $L ;;
    cachetests) log "pytest -m gpu tests/test_triton_cache.py (a launch compiled ahead or preloaded is the one a run finds)"
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_cache.py > "$OUT/cache_tests.txt" 2>&1
      echo "rc=$?" >> "$OUT/cache_tests.txt"; tail -3 "$OUT/cache_tests.txt" | tee -a "$OUT/summary.txt" ;;
    record) setup; log "record the Triton launches of synth (1,088 and 16 rows) and the seed profile at C32 and C64"
      export COSYBATCH_RECORD_LAUNCHES=$OUT/triton_launches.json; head -n 16 $WL/meta.lst > $WL/m16.lst
      synth_run record-synth; synth_run record-16 $WL/m16.lst
      prof record-c32 packed_streaming_optimized_standard 32 256 32; prof record-c64 packed_streaming_optimized_standard 64 256 64
      unset COSYBATCH_RECORD_LAUNCHES; python3 -c "import json; r = json.load(open('$OUT/triton_launches.json')); print(len(r), 'launch variants')" | tee -a "$OUT/summary.txt" ;;
    startup16) setup; head -n 16 $WL/meta.lst > $WL/m16.lst; synth_run startup16 $WL/m16.lst ;;
    startup16base=*) setup; d=${step#startup16base=}
      [ -d "$d/cosybatch" ] || { log "startup16base: $d/cosybatch not found"; continue; }
      head -n 16 $WL/meta.lst > $WL/m16.lst; ( cd "$d" && synth_run "startup16-${d//[^A-Za-z0-9_.-]/_}" $WL/m16.lst ) ;;
    firsthop) log "pytest -m gpu: first hops solved apart, beside a graphed solve (design.md D39; carry .fixtures)"
      timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_codec_flow_gpu.py tests/test_pipeline_gpu.py \
        -k "beside_a_graphed or first_hop or apart" > "$OUT/firsthop_tests.txt" 2>&1; echo "rc=$?" >> "$OUT/firsthop_tests.txt"
      grep -E "rel RMS|passed|failed|Error" "$OUT/firsthop_tests.txt" | tail -12 | tee -a "$OUT/summary.txt" ;;
    pyc) log "bytecode: does an import compile source every time (no writable __pycache__)? import time with and without a pycache prefix"
      python3 - <<'PY' 2>&1 | tee "$OUT/pyc.txt"
import importlib.util, os, sys
spec = importlib.util.find_spec("torch")
print("dont_write_bytecode", sys.dont_write_bytecode, "PYTHONDONTWRITEBYTECODE", os.environ.get("PYTHONDONTWRITEBYTECODE"),
      "pycache_prefix", sys.pycache_prefix)
print("torch", spec.origin, "cached", spec.cached, "exists", os.path.exists(spec.cached),
      "dir writable", os.access(os.path.dirname(spec.origin), os.W_OK))
PY
      cnt='import builtins, time, collections; n = collections.Counter(); c0 = builtins.compile
def count(src, filename, *a, **k):
    n[str(filename).split("site-packages/")[-1].split("/")[0]] += 1
    return c0(src, filename, *a, **k)
builtins.compile = count; t = time.perf_counter(); import torch, numpy, cosybatch.cli
print(f"{time.perf_counter() - t:.2f} s, compile calls", sum(n.values()), n.most_common(6))'
      for i in 1 2; do python3 -c "$cnt" 2>&1 | sed "s/^/plain $i: /" | tee -a "$OUT/pyc.txt"; done
      for i in 1 2; do PYTHONPYCACHEPREFIX=/tmp/pycache python3 -c "$cnt" 2>&1 | sed "s/^/prefix $i: /" | tee -a "$OUT/pyc.txt"; done
      for i in 1 2; do PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=/tmp/pycache2 python3 -c "$cnt" 2>&1 | sed "s/^/prefix, writing $i: /" | tee -a "$OUT/pyc.txt"; done
      grep -E "^(plain|prefix)" "$OUT/pyc.txt" | cut -c1-160 >> "$OUT/summary.txt" ;;
    startupimports) setup; head -n 16 $WL/meta.lst > $WL/m16.lst; log "synth over 16 rows under -X importtime"
      rm -rf /tmp/startupimports
      python3 -X importtime -m cosybatch synth $WL/m16.lst --model $CKPT --out /tmp/startupimports --device cuda \
        --force-length --quiet 2> "$OUT/startupimports.txt"; echo "rc=$?" >> "$OUT/startupimports.txt"
      python3 - "$OUT/startupimports.txt" <<'PY' | tee -a "$OUT/startupimports-top.txt"
import re, sys
rows = [m.groups() for m in re.finditer(r"import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)", open(sys.argv[1]).read())]
top = sorted(((int(c), len(ind) // 2, name) for _, c, ind, name in rows if len(ind) <= 4), reverse=True)[:40]
for c, depth, name in top:
    print(f"{c / 1e6:7.3f} s  {'  ' * depth}{name}")
PY
      ;;
    startuptests) setup; log "pytest -m gpu: models and tokenizer loaded straight to the GPU, lazy AR graph capture"
      COSYBATCH_FRONTEND_DIR=$CKPT timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
        tests/test_startup.py tests/test_engine_gpu.py tests/test_frontend_gpu.py tests/test_pipeline_gpu.py \
        -k "straight or lazy or matches_onnxruntime or test_pipeline_gpu" > "$OUT/startup_tests.txt" 2>&1
      echo "rc=$?" >> "$OUT/startup_tests.txt"; grep -E "passed|failed|error|SKIP" "$OUT/startup_tests.txt" | tail -20 ;;
    synthcache) setup; log "synth default --force-length twice with one --prompt-cache: cold, then every prompt from the cache"
      rm -rf /tmp/pc; for run in cold cached; do synth_run synth-$run $WL/meta.lst --prompt-cache /tmp/pc; done ;;
    synthhost|synthhost=*) setup; n=${step#synthhost}; n=${n#=}; man=$WL/meta.lst  # synthhost=N: the first N rows (a ramp and a drain)
      [ -n "$n" ] && { head -n "$n" $WL/meta.lst > $WL/m$n.lst; man=$WL/m$n.lst; }
      log "synth default --force-length ${n:+($n rows) }under cProfile (the scheduling thread): where its host time goes"
      rm -rf /tmp/synth-host
      timeout 400 python3 -m cProfile -o "$OUT/synth-host$n.pstats" -m cosybatch synth $man --model $CKPT \
        --out /tmp/synth-host --device cuda --force-length --quiet > "$OUT/synth-host$n.txt" 2>&1; echo "rc=$?" >> "$OUT/synth-host$n.txt"
      python3 - "$OUT/synth-host$n.pstats" <<'PY' | tee -a "$OUT/synth-host$n.txt"
import pstats, sys
st = pstats.Stats(sys.argv[1])
st.sort_stats("cumulative").print_stats("_launch_ar|_run_batch|launch_features|prefill_launch|decode_launch|run_solve|step|frontend", 40)
st.sort_stats("tottime").print_stats(30)
st.sort_stats("tottime").print_callers("pin_memory|synchronize|'item'|tolist|'copy_'|'to'", 12)
PY
      ;;
    syncaudit) setup; log "synth over 128 rows with CUDA's sync debug mode warning on every synchronizing call: where the host waits"
      [ -f $WL/m128.lst ] || head -n 128 $WL/meta.lst > $WL/m128.lst; rm -rf /tmp/syncaudit
      timeout 300 python3 -W always -c "import runpy, sys, torch; torch.cuda.set_sync_debug_mode('warn'); sys.argv[0] = 'cosybatch'; runpy.run_module('cosybatch', run_name='__main__')" \
        synth $WL/m128.lst --model $CKPT --out /tmp/syncaudit --device cuda --force-length --quiet > "$OUT/syncaudit.txt" 2>&1
      echo "rc=$?" >> "$OUT/syncaudit.txt"
      # one warning per synchronizing call, attributed to the Python line that made it
      grep "synchronizing CUDA operation" "$OUT/syncaudit.txt" | grep -o "[A-Za-z0-9_/.]*\.py:[0-9]*" | sed 's|.*/cosybatch/|cosybatch/|' \
        | sort | uniq -c | sort -rn | head -40 | tee "$OUT/syncaudit-sites.txt" ;;
    besidetests) log "pytest -m gpu: the graphed mixed step (engine) and the frontend / HiFT beside the codec (pipeline; carry .fixtures)"
      timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_gpu.py tests/test_pipeline_gpu.py \
        -k "mixed or riding or matches_official" > "$OUT/beside_tests.txt" 2>&1; echo "rc=$?" >> "$OUT/beside_tests.txt"
      tail -5 "$OUT/beside_tests.txt" | tee -a "$OUT/summary.txt" ;;
    promptaudio) setup; log "bench_prompt_audio: prompts/s of the frontend workers beside a busy GPU thread, threads vs helper processes"
      timeout 200 python3 scripts/bench_prompt_audio.py --model $CKPT --manifest $WL/meta.lst 2>&1 | tee "$OUT/bench_prompt_audio.txt" | tail -9 ;;
    prefill) log "bench_prefill: prefill GPU time per token bucket under alternative fixed matmul tiles"
      timeout 300 python3 scripts/bench_prefill.py --json "$OUT/bench_prefill.json" 2>&1 | tee "$OUT/bench_prefill.txt" | tail -30 ;;
    enginetests) log "pytest -m gpu tests/test_engine_gpu.py"
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_gpu.py ${ENGINE_TESTS:+-k "$ENGINE_TESTS"} > "$OUT/engine_tests.txt" 2>&1
      echo "rc=$?" >> "$OUT/engine_tests.txt"; grep -E "passed|failed|Error|error" "$OUT/engine_tests.txt" | tail -12; tail -2 "$OUT/engine_tests.txt" >> "$OUT/summary.txt" ;;
    devices) setup; log "synth --devices all vs --devices 1 (one GPU)"
      head -n 257 $WL/meta.lst > $WL/m256.lst
      for d in 1 all; do rm -rf /tmp/dev-$d
        ( time timeout 200 $CB synth $WL/m256.lst --model $CKPT --out /tmp/dev-$d --device cuda --devices $d --force-length --quiet ) \
          > "$OUT/devices-$d.txt" 2>&1; echo "rc=$?" >> "$OUT/devices-$d.txt"; tail -4 "$OUT/devices-$d.txt"; done
      python3 scripts/compare_outputs.py /tmp/dev-1 /tmp/dev-all 2>&1 | tee "$OUT/devices-compare.txt" | tail -5 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
