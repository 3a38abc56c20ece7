#!/usr/bin/env bash
# GRPO stage of the long-context Qwen3-8B recipe (32k-token responses): 2 nodes x 8 GPUs
# (TP4 CP2 PP1 DP2; memory plan in pipelines/qwen3_8b_grpo_long.yaml's header). The RL stage
# (python -m megatron_rlhf rl) -> <run>/grpo, starting from the run's SFT stage (<run>/sft);
# RECIPE=pipelines/qwen3_8b_grpo_long.yaml slurm/submit_pipeline.sh --nodes=2 runs SFT first.
# Environment knobs (RECIPE, RUN_ROOT, RUN_NAME, EXTRA_ARGS, REPO, PYTHON, CONTAINER_IMAGE, CONTAINER_MOUNTS,
# SRUN_ARGS, DRY_RUN, LAUNCHER): see slurm/stage.sh and docs/clusters.md.
#SBATCH --job-name=rlhf-grpo-qwen3-8b-long
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=48:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --output=slurm-%x-%j.out
STAGE=rl
RECIPE=${RECIPE:-pipelines/qwen3_8b_grpo_long.yaml}
source "${REPO:-$SLURM_SUBMIT_DIR}/slurm/stage.sh"
