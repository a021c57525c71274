#!/usr/bin/env bash
# The ignored folders (.gitignore) a GPU lease carries (the device run's `carry`), made on the CPU machine:
#   .whl/       the cp312 wheels the H200's image lacks (soundfile with libsndfile, cffi,
#               pycparser), installed by scripts/gpu_session.sh where `import soundfile` fails
#   .fixtures/  the parity fixtures (../shared/fixtures/cv3-tiny), for the fixture GPU tests
#   .base/      BASE's package and scripts (`git archive BASE cosybatch scripts`): the baseline
#               that synthbase=.base, c32base=.base, ... run beside this commit in the same lease
# Usage: scripts/lease_carry.sh [BASE]   (without BASE, no .base/)
# Then, e.g.: carry [".whl", ".fixtures", ".base"], command `scripts/gpu_session.sh synthbase=.base synth`.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl soundfile cffi pycparser
if [ -d ../shared/fixtures/cv3-tiny ]; then
  rm -rf .fixtures && mkdir .fixtures && cp -r ../shared/fixtures/cv3-tiny .fixtures/
else
  echo "lease_carry: no ../shared/fixtures/cv3-tiny: .fixtures/ not made (the fixture GPU tests will skip)" >&2
fi
if [ $# -ge 1 ]; then
  rm -rf .base && mkdir .base && git archive "$1" cosybatch scripts | tar -x -C .base
fi
du -sh .whl .fixtures .base 2>/dev/null || true
