# `make demo` runs cosybatch on the bundled examples; `make test` runs the CPU test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel keeps the test venv small; a GPU machine should install its own CUDA torch.
TORCH_SPEC ?= torch==2.13.0
DEMO_CKPT ?= examples/checkpoint
DEMO_OUT ?= demo_out

.PHONY: venv test test-gpu demo clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

test: venv
	$(PY) -m pytest -q

test-gpu: venv
	$(PY) -m pytest -q -m gpu

$(DEMO_CKPT)/cosyvoice3.yaml: | venv
	$(VENV)/bin/cosybatch make-checkpoint $(DEMO_CKPT) --size tiny --seed 0

demo: venv $(DEMO_CKPT)/cosyvoice3.yaml
	$(VENV)/bin/cosybatch synth examples/manifest.lst --model $(DEMO_CKPT) --out $(DEMO_OUT) --device cpu
	@echo "wrote $(DEMO_OUT)/ (random weights: the WAVs are noise, not speech)"

clean:
	rm -rf $(DEMO_OUT) $(DEMO_CKPT) .pytest_cache
