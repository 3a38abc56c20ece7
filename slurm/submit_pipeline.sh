#!/usr/bin/env bash
# Submit the recipe's pipeline.stages (default: sft, rm, rl) as dependent jobs, in that order:
# each stage waits for the one before it (afterok; a failed stage cancels the rest).
#   [RECIPE=pipelines/x.yaml] [EXTRA_ARGS="key=value ..."] slurm/submit_pipeline.sh [sbatch options...]
# The stages are what `$PYTHON -m megatron_rlhf stages --config "$RECIPE" $EXTRA_ARGS` prints
# (validated), so EXTRA_ARGS can change them, e.g. "pipeline.stages=[sft,rm]"
# (no spaces inside a value). Each stage runs its script: sft -> sft_70b.sh, rm -> rm_70b.sh,
# dpo -> dpo_70b.sh (RECIPE=pipelines/llama3_70b_dpo.yaml: the SFT -> DPO route), rl -> rl_70b.sh (the recipe's rl.algorithm: <run>/ppo for PPO, <run>/grpo for GRPO, ...).
# sbatch options (e.g. --nodes=2 --ntasks-per-node=1 --gpus-per-node=0 --partition=x) apply to
# every stage. RECIPE (default pipelines/llama3_70b.yaml), EXTRA_ARGS, RUN_ROOT, RUN_NAME, REPO
# and PYTHON pass through the environment to every job (see slurm/stage.sh). Run it from the
# checkout (REPO, default: the current directory, which becomes the jobs' submit directory).
# Prints the job ids, one per stage, in order, on one line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export RECIPE=${RECIPE:-pipelines/llama3_70b.yaml}
REPO=${REPO:-$PWD}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
declare -A script=([sft]=sft_70b.sh [rm]=rm_70b.sh [dpo]=dpo_70b.sh [rl]=rl_70b.sh)

read -ra extra <<< "${EXTRA_ARGS:-}"  # words, not globs: pipeline.stages=[sft,rm] stays as given
stages=$(cd "$REPO" && "$PYTHON" -m megatron_rlhf stages --config "$RECIPE" ${extra[@]+"${extra[@]}"})
[ -n "$stages" ] || { echo "submit_pipeline.sh: $RECIPE lists no stages" >&2; exit 2; }
for stage in $stages; do  # check them all before submitting any
  [ -n "${script[$stage]:-}" ] || { echo "submit_pipeline.sh: no Slurm script for stage '$stage'" >&2; exit 2; }
done

common=(--parsable --kill-on-invalid-dep=yes --export=ALL "$@")
ids=()
for stage in $stages; do
  after=()
  [ ${#ids[@]} -eq 0 ] || after=(--dependency=afterok:"${ids[-1]}")
  ids+=("$(sbatch "${common[@]}" ${after[@]+"${after[@]}"} "$here/${script[$stage]}")")
done
echo "${ids[*]}"
