#!/usr/bin/env bash
# Submit the recipe's pipeline.stages (default: sft, rm, rl) as dependent jobs, in that order:
# each stage waits for the one before it (afterok; a failed stage cancels the rest).
#   [RECIPE=pipelines/x.yaml] [EXTRA_ARGS="key=value ..."] slurm/submit_pipeline.sh [sbatch options...]
# Nothing is queued unless the pre-flight passes (exit 2 otherwise, with every problem listed):
# `$PYTHON -m megatron_rlhf.preflight` validates the recipe with EXTRA_ARGS, refuses `/path/to/...`
# placeholders and data / tokenizer / HF model paths that do not exist (seen through the container
# mounts when CONTAINER_IMAGE is set; PREFLIGHT_FILES=0 skips the file checks when this host
# cannot see the jobs' filesystems), and, with CONTAINER_IMAGE, that srun has pyxis.
# It prints the stages, so EXTRA_ARGS can change them, e.g. "pipeline.stages=[sft,rm]"
# (no spaces inside a value). Each stage runs its script: sft -> sft_70b.sh, rm -> rm_70b.sh,
# dpo -> dpo_70b.sh (RECIPE=pipelines/llama3_70b_dpo.yaml: the SFT -> DPO route), rl -> rl_70b.sh (the recipe's rl.algorithm: <run>/ppo for PPO, <run>/grpo for GRPO, ...).
# sbatch options (e.g. --nodes=2 --ntasks-per-node=1 --gpus-per-node=0 --partition=x) apply to
# every stage. RECIPE (default pipelines/llama3_70b.yaml), EXTRA_ARGS, RUN_ROOT, RUN_NAME, REPO,
# PYTHON, CONTAINER_* and SRUN_ARGS pass through the environment to every job (see slurm/stage.sh);
# RUN_ROOT is resolved here (slurm/common.sh) and printed, so every stage writes the same run.
# Run it from the checkout (REPO, default: the current directory, which becomes the jobs' submit directory).
# Prints the job ids, one per stage, in order, on one line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export RECIPE=${RECIPE:-pipelines/llama3_70b.yaml}
REPO=${REPO:-$PWD}
source "$here/common.sh"  # RUN_ROOT, container_mounts, require_pyxis
# The pre-flight runs here, on the host (it needs only the checkout and PyYAML): PREFLIGHT_PYTHON,
# default PYTHON or the checkout's venv; with a container (whose interpreter the jobs use), the
# venv if there is one, else python3.
if [ -n "${CONTAINER_IMAGE:-}" ] && [ ! -x "$REPO/.venv/bin/python" ]; then
  PREFLIGHT_PYTHON=${PREFLIGHT_PYTHON:-python3}
fi
PREFLIGHT_PYTHON=${PREFLIGHT_PYTHON:-${PYTHON:-$REPO/.venv/bin/python}}
declare -A script=([sft]=sft_70b.sh [rm]=rm_70b.sh [dpo]=dpo_70b.sh [rl]=rl_70b.sh)

require_pyxis submit_pipeline.sh || exit 2
read -ra extra -d "" <<< "${EXTRA_ARGS:-}" || true  # words, not globs: pipeline.stages=[sft,rm] stays as given
checks=(--container-mounts="$container_mounts")
[ "${PREFLIGHT_FILES:-1}" = 1 ] || checks+=(--no-exists-check)
stages=$(cd "$REPO" && "$PREFLIGHT_PYTHON" -m megatron_rlhf.preflight \
  --config "$RECIPE" "${checks[@]}" ${extra[@]+"${extra[@]}"} checkpoint.root="$RUN_ROOT") || exit 2
[ -n "$stages" ] || { echo "submit_pipeline.sh: $RECIPE lists no stages" >&2; exit 2; }
for stage in $stages; do  # check them all before submitting any
  [ -n "${script[$stage]:-}" ] || { echo "submit_pipeline.sh: no Slurm script for stage '$stage'" >&2; exit 2; }
done
echo "submit_pipeline.sh: $RECIPE: ${stages//$'\n'/ } -> $RUN_ROOT (checkpoint.root)" >&2

common=(--parsable --kill-on-invalid-dep=yes --export=ALL "$@")
ids=()
for stage in $stages; do
  after=()
  [ ${#ids[@]} -eq 0 ] || after=(--dependency=afterok:"${ids[-1]}")
  ids+=("$(sbatch "${common[@]}" ${after[@]+"${after[@]}"} "$here/${script[$stage]}")")
done
echo "${ids[*]}"
