#!/usr/bin/env bash
# Asynchronous GRPO stage of the Llama-3.3-70B recipe (rl.max_staleness=1): the RL stage
# (python -m megatron_rlhf rl, as slurm/grpo_70b.sh) with pipelines/llama3_70b_grpo_async.yaml ->
# <run>/grpo, from the SFT and RM stages of the llama3_70b run (<run>/sft, <run>/rm).
# The trainer: 8 nodes x 8 GPUs (TP8 PP4 DP2), as grpo_70b.sh. The recipe's placement plan adds 2
# generation nodes (one TP8 vLLM engine per data-parallel replica, rollout.placement=separate); its
# header says why, and what runs until an engine can start on a node of its own (on H200:
#   sbatch --export=ALL,EXTRA_ARGS="rollout.placement=colocated rollout.sleep_level=0 rollout.refit_transport=shm" \
#     slurm/grpo_70b_async.sh).
# The tiny CPU recipe on 1 node (the engine on CPU 1, the trainer on CPU 0; needs the vLLM layer):
#   sbatch --nodes=1 --ntasks-per-node=1 --gpus-per-node=0 \
#     --export=ALL,RECIPE=pipelines/tiny_cpu_async.yaml,PYTHON=.venv-vllm/bin/python,RUN_ROOT=/tmp/runs \
#     slurm/grpo_70b_async.sh
# Environment knobs (RECIPE, RUN_ROOT, RUN_NAME, EXTRA_ARGS, REPO, PYTHON, CONTAINER_IMAGE, CONTAINER_MOUNTS,
# SRUN_ARGS, DRY_RUN, LAUNCHER): see slurm/stage.sh and docs/clusters.md.
#SBATCH --job-name=rlhf-grpo-70b-async
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --output=slurm-%x-%j.out
STAGE=rl
RECIPE=${RECIPE:-pipelines/llama3_70b_grpo_async.yaml}
source "${REPO:-$SLURM_SUBMIT_DIR}/slurm/stage.sh"
