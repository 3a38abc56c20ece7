# Sourced by the stage scripts (sft_70b.sh, rm_70b.sh, ppo_70b.sh): launches one stage with
# srun, one task per device, and handles preemption. Environment (all optional):
#   REPO       checkout to run from               (default: the sbatch submit directory)
#   RECIPE     pipelines/*.yaml                   (default: the script's 70B recipe)
#   PYTHON     interpreter with megatron_rlhf     (default: $REPO/.venv/bin/python)
#   RUN_ROOT   where runs are written              (checkpoint.root; default: the recipe's)
#   RUN_NAME   run directory under RUN_ROOT        (checkpoint.run_name; default: the recipe's)
#   EXTRA_ARGS more config overrides, e.g. "ppo.steps=100 data.tokenizer=/models/llama3"
# The job is requeued when the stage exits with REQUEUE_EXIT (it saved a checkpoint after
# SIGUSR1/SIGTERM); on restart the stage resumes from its latest complete checkpoint.
set -euo pipefail
REPO=${REPO:-${SLURM_SUBMIT_DIR:?run under sbatch or set REPO}}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
REQUEUE_EXIT=${REQUEUE_EXIT:-42}
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$REPO"
EXTRA_ARGS="${EXTRA_ARGS:-}${RUN_ROOT:+ checkpoint.root=$RUN_ROOT}${RUN_NAME:+ checkpoint.run_name=$RUN_NAME}"
echo "[slurm] job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $STAGE on $SLURM_JOB_NUM_NODES nodes x ${SLURM_NTASKS_PER_NODE:-?} tasks, master $MASTER_ADDR:$MASTER_PORT"

# shellcheck disable=SC2086  # EXTRA_ARGS is a list of key=value words
srun --kill-on-bad-exit=1 "$PYTHON" -m megatron_rlhf "$STAGE" --config "$RECIPE" $EXTRA_ARGS &
srun_pid=$!
# --signal=B:USR1@T reaches this shell only; srun forwards USR1 to every task.
signalled=0
trap 'signalled=1; echo "[slurm] USR1: asking $STAGE to checkpoint and exit"; kill -USR1 $srun_pid' USR1
set +e
while :; do
  wait $srun_pid; rc=$?
  kill -0 $srun_pid 2>/dev/null || break  # wait returned because of the trap: keep waiting
done
set -e
# The first task to exit with REQUEUE_EXIT makes srun stop the others (--kill-on-bad-exit),
# so srun's own code may differ; a signalled run that did not finish is requeued either way.
# Checkpoints are committed atomically, so the restart resumes from the newest complete one.
if [ "$rc" -ne 0 ] && { [ "$signalled" -eq 1 ] || [ "$rc" -eq "$REQUEUE_EXIT" ]; }; then
  echo "[slurm] $STAGE stopped for requeue (exit $rc); requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$rc"
