# Quickstart: `make demo` then `make test`. Both create .venv on first use.
# torch is installed first, pinned (TORCH), unless the venv already has one: on a GPU machine,
# create .venv and `pip install` your CUDA build of torch before running make.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
LOWMEM_DPO := $(VENV)/bin/lowmem-dpo
RECIPE ?= lowmem_dpo:tiny-cpu

.PHONY: demo demo-sft test lint bench gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	touch $@

$(VENV)/.install-base: setup.cfg pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.install-test: setup.cfg pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e '.[test]'
	touch $@

$(VENV)/.install-report: setup.cfg pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e '.[report]'
	touch $@

$(VENV)/.install-bench: setup.cfg pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

# Ends with the report: runs/tiny/curves.png and the summary (runs/tiny is the output_dir of the default RECIPE,
# the built-in lowmem_dpo:tiny-cpu shipped in the package: lowmem_dpo/demo/tiny-cpu.yaml)
demo: $(VENV)/.install-report
	$(LOWMEM_DPO) precompute $(RECIPE)
	$(LOWMEM_DPO) train $(RECIPE)
	$(LOWMEM_DPO) report runs/tiny

# Stacked SFT -> DPO on the tiny model (docs/stacked-sft-dpo.md)
demo-sft: $(VENV)/.install-base
	$(LOWMEM_DPO) sft lowmem_dpo:tiny-sft
	$(LOWMEM_DPO) precompute lowmem_dpo:tiny-dpo-after-sft
	$(LOWMEM_DPO) train lowmem_dpo:tiny-dpo-after-sft

# One pytest worker per core (pytest-xdist; TEST_WORKERS=0 runs in this process), each with its share of the
# cores for torch (tests/conftest.py); worksteal keeps both busy to the end, past the few long tests.
TEST_WORKERS ?= auto

test: $(VENV)/.install-test
	$(VENV)/bin/ruff check lowmem_dpo tests bench
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

bench: $(VENV)/.install-bench
	$(PY) bench/step_time.py bench/recipes/llama-25m-cpu.yaml --devices cpu,cuda --steps 20 --vs-trl --json bench/out/step_time.json

# On a CUDA machine: the 12 GB recipes under what torch gets of a 12 GB card, against TRL (bench/gpu_check.py).
gpu-check: $(VENV)/.install-bench
	$(PY) bench/gpu_check.py --json bench/results/gpu_check.json

clean:
	rm -rf $(VENV) runs bench/out
