# Two commands matter on a fresh machine: `make pipeline` (the main job) and `make test`.
# Both create the virtual environment themselves.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NPROC  ?= 2
CONFIG ?= pipelines/tiny_cpu.yaml
ARGS   ?=

# megatron-core >= 0.17 needs Python 3.12. Use a working `python3.12` on PATH, else pyenv's
# (pyenv's shim refuses `python3.12` when the global version is 3.11).
PYTHON312 ?= $(shell (python3.12 -c 'import sys' >/dev/null 2>&1 && command -v python3.12) || \
	(v=$$(pyenv versions --bare 2>/dev/null | grep '^3\.12' | tail -n1); \
	 [ -n "$$v" ] && PYENV_VERSION=$$v pyenv which python3.12 2>/dev/null))

.PHONY: setup test test-fast pipeline smoke sft rm ppo bench clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if [ -z "$(PYTHON312)" ]; then echo "error: Python 3.12 not found (need python3.12 on PATH or under pyenv); set PYTHON312=/path/to/python3.12" >&2; exit 1; fi; \
	  $(PYTHON312) -m venv $(VENV); \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

# The tests also need the optional `nemo` extra (nemo-run; ~400 MB and ~40 s on top of setup):
# tests/test_launch.py dry-runs the nemo-run launcher. `make pipeline` does not install it.
NEMO_STAMP := $(VENV)/.installed-nemo
$(NEMO_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,nemo]'
	@touch $(NEMO_STAMP)

test: $(NEMO_STAMP)
	$(PY) -m pytest -ra --durations=25

test-fast: $(NEMO_STAMP)
	$(PY) -m pytest -ra -m "not slow"

smoke: setup
	$(PY) -m megatron_rlhf.torchrun --nproc-per-node $(NPROC) \
	  smoke --config $(CONFIG) parallel.tensor_parallel=$(NPROC) $(ARGS)

# SFT -> RM -> PPO on the default recipe (finished stages are skipped, partial ones resume).
PIPELINE_NPROC ?= 1
pipeline: setup
	$(PY) -m megatron_rlhf.torchrun --nproc-per-node $(PIPELINE_NPROC) \
	  pipeline --config $(CONFIG) $(ARGS)

# Stages on the default recipe; NPROC processes (data-parallel unless ARGS sets TP/PP).
sft rm rl ppo: setup
	$(PY) -m megatron_rlhf.torchrun --nproc-per-node $(NPROC) \
	  $@ --config $(CONFIG) $(ARGS)

bench: setup
	$(PY) benchmarks/bench_roles.py
	$(PY) benchmarks/rl_step.py
	$(PY) benchmarks/hf_import.py
	$(PY) benchmarks/split_invariance.py

clean-venv:
	rm -rf $(VENV)

# GPU check (issue 11). `make wheels` (here, with network): cp312 wheels of what a CUDA image
# with torch usually lacks (megatron-core, nvidia-resiliency-ext and small dependencies; with
# WHEELS_ALL=1 every dependency except torch's, ~72 MiB) at this venv's versions, plus ours,
# into $(WHEELS_DIR). `make gpu-check` (on a machine with one GPU; no network, no `make setup`):
# SFT -> RM -> PPO, then GRPO on the same SFT and RM, in bf16 on the machine's own CUDA torch, dependencies from $(WHEELS_DIR);
# a table and $(GPU_CHECK_OUT)/gpu_check.json. benchmarks/gpu_check.py says more.
WHEELS_DIR       ?= .whl
WHEEL_PYTHONS    ?= 3.12
WHEELS_ALL       ?=
GPU_CHECK_OUT    ?= benchmarks/results
GPU_CHECK_PYTHON ?=
GPU_CHECK_ARGS   ?=
.PHONY: wheels gpu-check

wheels: setup
	$(PY) benchmarks/gpu_check.py --build-wheels $(WHEELS_DIR) --wheel-python "$(WHEEL_PYTHONS)" $(if $(WHEELS_ALL),--all-deps)

gpu-check:
	python3 benchmarks/gpu_check.py --wheels $(WHEELS_DIR) --out $(GPU_CHECK_OUT) \
	  $(if $(GPU_CHECK_PYTHON),--python $(GPU_CHECK_PYTHON)) $(GPU_CHECK_ARGS)
