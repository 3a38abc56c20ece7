#!/usr/bin/env bash
# GRPO stage of the Llama-3.3-70B recipe: 8 nodes x 8 GPUs (TP8 PP4 DP2). The RL stage
# (python -m megatron_rlhf rl, as slurm/rl_70b.sh) with pipelines/llama3_70b_grpo.yaml: actor,
# reference and reward model, no critic -> <run>/grpo. It starts from the SFT and RM stages of
# the llama3_70b run (<run>/sft, <run>/rm); RECIPE=pipelines/llama3_70b_grpo.yaml
# slurm/submit_pipeline.sh runs those first.
# Any size is overridable from the command line, e.g. the tiny CPU GRPO recipe on 2 nodes:
#   sbatch --nodes=2 --ntasks-per-node=1 --gpus-per-node=0 \
#     --export=ALL,RECIPE=pipelines/tiny_cpu_grpo.yaml,RUN_ROOT=/tmp/runs slurm/grpo_70b.sh
# Environment knobs (RECIPE, RUN_ROOT, RUN_NAME, EXTRA_ARGS, REPO, PYTHON, CONTAINER_IMAGE, CONTAINER_MOUNTS,
# SRUN_ARGS, DRY_RUN, LAUNCHER): see slurm/stage.sh and docs/clusters.md.
#SBATCH --job-name=rlhf-grpo-70b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --output=slurm-%x-%j.out
STAGE=rl
RECIPE=${RECIPE:-pipelines/llama3_70b_grpo.yaml}
source "${REPO:-$SLURM_SUBMIT_DIR}/slurm/stage.sh"
