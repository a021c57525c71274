#!/usr/bin/env bash
# Build the wheel, install it alone into a fresh virtual environment (no checkout on the path)
# and run every shipped profile by name on the tiny fixture: proves a plain install works.
#   scripts/check_wheel.sh            (CI runs it; TORCH_SPEC picks the torch to install)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
fixtures=${COSYBATCH_FIXTURES:-$repo/../shared/fixtures}
model=$fixtures/cv3-tiny/model
manifest=$fixtures/cv3-tiny/prompts/meta.lst
[ -f "$model/llm.pt" ] || { echo "check_wheel: fixtures not found at $fixtures" >&2; exit 1; }
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
pip="$work/venv/bin/python -m pip"
$pip install -q --upgrade pip
$pip wheel -q --no-deps "$repo" -w "$work/dist"
# --no-compile: byte-compiling all of torch is most of the install's time and proves nothing here
# (what runs is compiled when it is imported; tests/test_layers.py parses every module).
$pip install -q --no-compile "${TORCH_SPEC:-torch==2.13.0}"
$pip install -q --no-compile "$work"/dist/cosybatch-*.whl
cd "$work"  # nothing of the checkout is importable from here
cb="$work/venv/bin/cosybatch"
"$work/venv/bin/python" -c "import cosybatch, sys; assert '$repo' not in cosybatch.__file__, cosybatch.__file__"
"$cb" --version
"$cb" profiles
"$work/venv/bin/python" -m cosybatch --help >/dev/null
profiles=$("$work/venv/bin/python" -c "from cosybatch.profiles import available_profiles; print(' '.join(available_profiles()))")
run_profile() {
  set -euo pipefail
  local profile=$1 out="$work/out-$1" n want
  "$cb" synth "$manifest" --model "$model" --out "$out" --device cpu --profile "$profile" --quiet
  n=$(ls "$out"/*.wav | wc -l)
  want=$(grep -cv '^\s*\(#\|$\)' "$manifest")
  echo "check_wheel: profile $profile wrote $n WAVs"
  [ "$n" -eq "$want" ] || { echo "check_wheel: profile $profile: expected $want" >&2; exit 1; }
}
export -f run_profile
export work cb manifest model
# Two profiles at a time, one intra-op thread each: a run is ~3 s of single-threaded start-up
# (imports, models) and a few seconds of small-tensor work that two threads barely speed up, so two
# side by side keep both cores of a small CI box busy. xargs exits 123 if any run fails.
printf '%s\n' $profiles | OMP_NUM_THREADS=1 xargs -P 2 -I{} bash -c 'run_profile "$1"' _ {}
[ "$(ls -d "$work"/out-* | wc -l)" -eq "$(echo $profiles | wc -w)" ]
echo "check_wheel: ok"
