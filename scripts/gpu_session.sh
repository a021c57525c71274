#!/usr/bin/env bash
# One H200 lease: carried wheels, a full-size random checkpoint, the EN1088-shaped workload,
# the GPU tests and the target benchmarks. Results land in $OUT (or /tmp/cosybatch-out).
#   scripts/gpu_session.sh [tests|profile|synth|all]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cosybatch-out}; mkdir -p "$OUT"
what=${1:-all}
if ! python3 -c "import soundfile" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
CB="python3 -m cosybatch.cli"
CKPT=/tmp/ckpt-full
[ -f $CKPT/llm.pt ] || $CB make-checkpoint $CKPT --size full --seed 0 >/dev/null || exit 1
WL=/tmp/en1088
python3 scripts/make_workload.py --out $WL > "$OUT/workload.json" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"
if [[ $what == tests || $what == all ]]; then
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
fi
prof() {  # name concurrency prompts warmups [extra...]
  local p=$1 c=$2 n=$3 w=$4; shift 4
  timeout 110 $CB profile $WL/meta.lst --model $CKPT --device cuda --profile $p --concurrency $c \
    --num-prompts $n --num-warmups $w --force-length --result-dir "$OUT" "$@" 2>&1 | tail -26 | tee -a "$OUT/profile.txt"
}
if [[ $what == profile || $what == all ]]; then
  prof packed_streaming_optimized_standard 32 512 32
  prof packed_streaming_optimized_standard 64 768 64 --set ar.max_num_seqs=64 --set codec.max_num_seqs=64
  prof default 256 1024 64
fi
if [[ $what == synth || $what == all ]]; then
  head -n 512 $WL/meta.lst > $WL/synth512.lst
  ( time timeout 120 $CB synth $WL/synth512.lst --model $CKPT --out /tmp/synth-out --device cuda --quiet ) 2>&1 | tail -5 | tee "$OUT/synth.txt"
  python3 - <<'PY' | tee -a "$OUT/synth.txt"
import json; t = json.load(open("/tmp/synth-out/timing.json")); print(json.dumps(t.get("totals", t.get("summary", {})), indent=1))
PY
fi
