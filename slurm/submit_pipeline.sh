#!/usr/bin/env bash
# Submit SFT -> RM -> PPO as three dependent jobs (afterok; a failed stage cancels the rest).
#   slurm/submit_pipeline.sh [sbatch options...]
# sbatch options (e.g. --nodes=2 --ntasks-per-node=1 --gpus-per-node=0 --partition=x) apply
# to every stage; RECIPE, EXTRA_ARGS, REPO, PYTHON pass through the environment.
# Prints the three job ids.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
common=(--parsable --kill-on-invalid-dep=yes --export=ALL "$@")
sft=$(sbatch "${common[@]}" "$here/sft_70b.sh")
rm_job=$(sbatch "${common[@]}" --dependency=afterok:"$sft" "$here/rm_70b.sh")
ppo=$(sbatch "${common[@]}" --dependency=afterok:"$rm_job" "$here/ppo_70b.sh")
echo "$sft $rm_job $ppo"
