#!/usr/bin/env bash
# RL stage of the Llama-3.3-70B recipe (python -m megatron_rlhf rl): 8 nodes x 8 GPUs (TP8 PP4 DP2).
# The recipe's rl.algorithm picks the algorithm and the output directory <run>/<rl.algorithm>:
# PPO with the default pipelines/llama3_70b.yaml (<run>/ppo), GRPO with
# RECIPE=pipelines/llama3_70b_grpo.yaml (<run>/grpo; slurm/grpo_70b.sh sets that recipe).
# Any size is overridable from the command line, e.g. the tiny CPU recipe on 2 nodes:
#   sbatch --nodes=2 --ntasks-per-node=1 --gpus-per-node=0 \
#     --export=ALL,RECIPE=pipelines/tiny_cpu.yaml,RUN_ROOT=/tmp/runs slurm/rl_70b.sh
# Environment knobs (RECIPE, RUN_ROOT, RUN_NAME, EXTRA_ARGS, REPO, PYTHON, CONTAINER_IMAGE, CONTAINER_MOUNTS,
# SRUN_ARGS, DRY_RUN, LAUNCHER): see slurm/stage.sh and docs/clusters.md.
#SBATCH --job-name=rlhf-rl-70b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --output=slurm-%x-%j.out
STAGE=rl
RECIPE=${RECIPE:-pipelines/llama3_70b.yaml}
source "${REPO:-$SLURM_SUBMIT_DIR}/slurm/stage.sh"
