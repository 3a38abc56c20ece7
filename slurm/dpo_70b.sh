#!/usr/bin/env bash
# DPO stage of the Llama-3.3-70B recipe: 8 nodes x 8 GPUs (TP8 PP4 DP2); the dpo section of
# pipelines/llama3_70b.yaml (actor and reference from <run>/sft) -> <run>/dpo.
# RECIPE=pipelines/llama3_70b_dpo.yaml slurm/submit_pipeline.sh runs SFT first.
# Any size is overridable from the command line, e.g. the tiny CPU DPO recipe on 2 nodes:
#   sbatch --nodes=2 --ntasks-per-node=1 --gpus-per-node=0 \
#     --export=ALL,RECIPE=pipelines/tiny_cpu_dpo.yaml,RUN_ROOT=/tmp/runs slurm/dpo_70b.sh
# Environment knobs (RECIPE, RUN_ROOT, RUN_NAME, EXTRA_ARGS, REPO, PYTHON, CONTAINER_IMAGE, CONTAINER_MOUNTS,
# SRUN_ARGS, DRY_RUN, LAUNCHER): see slurm/stage.sh and docs/clusters.md.
#SBATCH --job-name=rlhf-dpo-70b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --output=slurm-%x-%j.out
STAGE=dpo
RECIPE=${RECIPE:-pipelines/llama3_70b.yaml}
source "${REPO:-$SLURM_SUBMIT_DIR}/slurm/stage.sh"
