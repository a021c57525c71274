# `make demo` runs cosybatch on the bundled examples; `make test` runs the CPU test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel keeps the test venv small; a GPU machine should install its own CUDA torch.
TORCH_SPEC ?= torch==2.13.0
DEMO_CKPT ?= examples/checkpoint
DEMO_OUT ?= demo_out

.PHONY: venv test-venv test test-portable test-gpu demo clean

# pip's byte-compiling of every installed module (torch's thousands) is most of an install's time
# on 2 cores; Python compiles what it imports on first use anyway, and keeps the bytecode for the
# next process -- unless PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines): then
# every process compiles torch's source again, ~1.5 s each on 2 cores, and the tests start many
# (docs/design.md D38). Make's commands keep the bytecode in the venv, outside the source tree.
PIP_NO_COMPILE := --no-compile
export PYTHONPYCACHEPREFIX ?= $(abspath $(VENV))/pycache
unexport PYTHONDONTWRITEBYTECODE

# Two stages: `venv` has what running cosybatch needs (all `make demo` installs); `test-venv`
# adds the test extras (pytest, hypothesis and Ray, by far the largest download).
venv: $(VENV)/.installed
test-venv: $(VENV)/.test-installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(PIP_NO_COMPILE) "$(TORCH_SPEC)"
	# A regular (not editable) install: it builds the wheel as users get it. Commands below run
	# `python -m` from the checkout root, so the checkout's code is what runs and is tested.
	$(PY) -m pip install -q $(PIP_NO_COMPILE) .
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed
	$(PY) -m pip install -q $(PIP_NO_COMPILE) ".[test]"
	touch $@

test: test-venv
	$(PY) -m pytest -q

# The numeric tests again as an AVX2-only machine at 3 intra-op threads runs them: MKL and oneDNN
# kernels capped at AVX2, ATen's AVX2 kernels, 3 threads (COSYBATCH_TEST_THREADS: torch caps
# OMP_NUM_THREADS at the core count, and it also overrides the tests that pin one thread). The parity
# criteria must hold on any x86-64 CPU (tests/parity.py); this keeps a second kernel set in CI.
# It covers the tests marked `numeric` (pyproject.toml): every comparison with the official fixture
# outputs (tests/conftest.py refuses an unmarked test that uses them), batch invariance, the flow /
# HiFT / frontend / sampler numerics. The rest (CLI, resume, signals, manifest, ledger, sharding,
# workers, scheduler policy, profiles, formats, layering) does not depend on which kernels run, so a
# second pass would only repeat `make test`; nor do the Triton kernels in the interpreter
# (tests/test_*_interp.py: numpy evaluates them, whatever ATen, MKL and oneDNN are capped to, and the
# tests make its dots sum in a fixed order, whatever BLAS the CPU gets: tests/conftest.py; ~2 min
# of this pass, which kept CI near its 20-minute limit).
PORTABLE_ENV := ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=3 COSYBATCH_TEST_THREADS=3

test-portable: test-venv
	$(PORTABLE_ENV) $(PY) -m pytest -q -m "numeric and not gpu" --ignore-glob="tests/test_*_interp.py"

test-gpu: test-venv
	$(PY) -m pytest -q -m gpu

$(DEMO_CKPT)/cosyvoice3.yaml: | venv
	$(PY) -m cosybatch make-checkpoint $(DEMO_CKPT) --size tiny --seed 0

demo: venv $(DEMO_CKPT)/cosyvoice3.yaml
	$(PY) -m cosybatch synth examples/manifest.lst --model $(DEMO_CKPT) --out $(DEMO_OUT) --device cpu
	@echo "wrote $(DEMO_OUT)/ (random weights: the WAVs are noise, not speech)"

clean:
	rm -rf $(DEMO_OUT) $(DEMO_CKPT) .pytest_cache
