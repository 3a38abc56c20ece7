# Sourced by the stage scripts (sft_70b.sh, rm_70b.sh, dpo_70b.sh, rl_70b.sh; ppo_70b.sh and grpo_70b.sh
# are rl_70b.sh with the PPO / GRPO recipe), which set STAGE (sft | rm | dpo | rl) and the default RECIPE:
# launches `python -m megatron_rlhf $STAGE` with srun, one task per device, every output line
# prefixed with its task number (srun --label), and handles preemption.
# slurm/submit_pipeline.sh submits one such job per stage of pipeline.stages. docs/clusters.md has the guide.
# Environment (all optional):
#   REPO       checkout to run from               (default: the sbatch submit directory)
#   RECIPE     pipelines/*.yaml                   (default: the script's 70B recipe)
#   PYTHON     interpreter with megatron_rlhf     (default: $REPO/.venv/bin/python; in a container: python)
#   RUN_ROOT   where runs are written (checkpoint.root; default: a checkpoint.root=... in EXTRA_ARGS,
#              else ${SCRATCH:-$HOME}/megatron_rlhf_runs: outside the checkout, see slurm/common.sh)
#   RUN_NAME   run directory under RUN_ROOT        (checkpoint.run_name; default: the recipe's)
#   EXTRA_ARGS more config overrides, e.g. "rl.steps=100 data.tokenizer=/models/llama3"
#   CONTAINER_IMAGE   run the tasks in this image with pyxis/enroot (srun --container-image),
#              e.g. nvcr.io#nvidia/pytorch:25.04-py3 or /shared/images/rlhf.sqsh
#   CONTAINER_MOUNTS  more SRC:DST[:FLAGS] mounts, comma-separated (REPO and RUN_ROOT are always
#              mounted at their own paths), e.g. /lustre/data:/data:ro,/lustre/models:/models:ro
#   CONTAINER_WORKDIR the tasks' directory in the container            (default: REPO)
#   SRUN_ARGS  more srun arguments, a list of words, e.g. "--cpu-bind=none --mpi=pmix"
#   DRY_RUN=1  print the srun command line this job would run, and exit without running it
#   LAUNCHER   srun (default): one srun task per device.
#              ft_launcher: one nvidia-resiliency-ext ft_launcher per node starts the node's
#              ranks and restarts all ranks of the job in place (they resume from the latest
#              checkpoint) when a rank dies or stops sending heartbeats. Its knobs:
#   NPROC_PER_NODE   ranks per node          (default: --ntasks-per-node, else GPUs on the node)
#   FT_MAX_RESTARTS  in-job restarts before the job fails                            (default 3)
#   FT_INITIAL_HEARTBEAT_TIMEOUT  s from a rank's start to its first heartbeat: model build,
#                    checkpoint load (70B from a shared FS) and first step        (default 1800)
#   FT_HEARTBEAT_TIMEOUT  s between heartbeats: the longest step or RL phase, including a
#                    checkpoint save and an eval; a rank silent this long is killed (default 900)
#   FT_TERM_TIMEOUT  s the ranks get to checkpoint after USR1/SIGTERM before SIGKILL; keep it
#                    under the --signal lead time                                  (default 280)
#   FT_LAUNCHER      the ft_launcher executable   (default: next to $PYTHON; in a container: ft_launcher)
#   FT_ARGS          more ft_launcher arguments, e.g. "--workers-stop-timeout=60"
# The job is requeued when the stage exits with REQUEUE_EXIT (it saved a checkpoint after
# SIGUSR1/SIGTERM); on restart the stage resumes from its latest complete checkpoint.
set -euo pipefail
REPO=${REPO:-${SLURM_SUBMIT_DIR:?run under sbatch or set REPO}}
source "$REPO/slurm/common.sh"  # RUN_ROOT, container_args, require_pyxis
# In a container the image's interpreter (its PATH wins over the job's under pyxis), not the host venv.
if [ -n "${CONTAINER_IMAGE:-}" ]; then PYTHON=${PYTHON:-python}; else PYTHON=${PYTHON:-$REPO/.venv/bin/python}; fi
REQUEUE_EXIT=${REQUEUE_EXIT:-42}
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$REPO"
EXTRA_ARGS="${EXTRA_ARGS:-} checkpoint.root=$RUN_ROOT${RUN_NAME:+ checkpoint.run_name=$RUN_NAME}"
echo "[slurm] job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $STAGE on $SLURM_JOB_NUM_NODES nodes x ${SLURM_NTASKS_PER_NODE:-?} tasks, master $MASTER_ADDR:$MASTER_PORT"
echo "[slurm] run root: $RUN_ROOT (checkpoint.root)${CONTAINER_IMAGE:+; container $CONTAINER_IMAGE, mounts $container_mounts}"
if [ "${DRY_RUN:-0}" = 1 ]; then
  require_pyxis "[slurm] DRY_RUN (a real run stops here)" || true
else
  require_pyxis "[slurm] job $SLURM_JOB_ID"
  mkdir -p "$RUN_ROOT"  # a container mount needs its source
fi
read -ra srun_extra -d "" <<< "${SRUN_ARGS:-}" || true
read -ra extra_args -d "" <<< "$EXTRA_ARGS" || true
# srun finds the command on this (host) side before pyxis enters the image, so a command that
# exists only in the image fails ("Can not execute"): start it through /usr/bin/env, in both.
in_task=()
[ -z "${CONTAINER_IMAGE:-}" ] || in_task=(/usr/bin/env)
srun_cmd=(srun --kill-on-bad-exit=1 --label ${container_args[@]+"${container_args[@]}"})

LAUNCHER=${LAUNCHER:-srun}
if [ "$LAUNCHER" = ft_launcher ]; then
  NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_NTASKS_PER_NODE:-${SLURM_GPUS_ON_NODE:?set NPROC_PER_NODE}}}
  if [[ $PYTHON == */* ]]; then FT_LAUNCHER=${FT_LAUNCHER:-$(dirname "$PYTHON")/ft_launcher}; fi
  FT_LAUNCHER=${FT_LAUNCHER:-ft_launcher}  # PYTHON found on PATH: so is ft_launcher
  read -ra ft_extra -d "" <<< "${FT_ARGS:-}" || true
  echo "[slurm] ft_launcher: $NPROC_PER_NODE ranks per node, up to ${FT_MAX_RESTARTS:-3} in-job restarts"
  # Each node's task is this shell around ft_launcher. ft_launcher passes SIGTERM on to its
  # ranks (and waits --term-timeout for them) but has no handler for USR1, whose default
  # action would kill it and orphan the ranks; Slurm may signal every process of the step.
  # So ft_launcher runs with USR1 ignored, and the shell turns the USR1 that srun forwards
  # into one SIGTERM for it. SIGTERM from Slurm reaches ft_launcher directly (the shell
  # ignores it: a second SIGTERM would cut ft_launcher's wait for the ranks short).
  # --label prefixes the node's task number (the node), not the rank.
  node_task='trap "" USR1; "$@" & pid=$!; trap "kill -TERM $pid" USR1; trap : TERM
    while :; do wait $pid; rc=$?; kill -0 $pid 2>/dev/null || exit $rc; done'
  srun_cmd+=(--nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1
    ${SLURM_CPUS_ON_NODE:+--cpus-per-task=$SLURM_CPUS_ON_NODE} ${srun_extra[@]+"${srun_extra[@]}"}
    ${in_task[@]+"${in_task[@]}"} bash -c "$node_task" ft-node "$FT_LAUNCHER"
      --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="$NPROC_PER_NODE"
      --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID"
      --max-restarts="${FT_MAX_RESTARTS:-3}" --term-timeout="${FT_TERM_TIMEOUT:-280}"
      --ft-initial-rank-heartbeat-timeout="${FT_INITIAL_HEARTBEAT_TIMEOUT:-1800}"
      --ft-rank-heartbeat-timeout="${FT_HEARTBEAT_TIMEOUT:-900}" ${ft_extra[@]+"${ft_extra[@]}"}
      -m megatron_rlhf "$STAGE" --config "$RECIPE" "${extra_args[@]}")
else
  srun_cmd+=(${srun_extra[@]+"${srun_extra[@]}"}
    ${in_task[@]+"${in_task[@]}"} "$PYTHON" -m megatron_rlhf "$STAGE" --config "$RECIPE" "${extra_args[@]}")
fi
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "[slurm] DRY_RUN: the srun command line (not run):"
  printf '%q ' "${srun_cmd[@]}"; echo
  exit 0
fi
"${srun_cmd[@]}" &
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
# so srun's own code may differ (and ft_launcher exits 1 whenever a rank exited non-zero);
# a signalled run that did not finish is requeued either way.
# Checkpoints are committed atomically, so the restart resumes from the newest complete one.
if [ "$rc" -ne 0 ] && { [ "$signalled" -eq 1 ] || [ "$rc" -eq "$REQUEUE_EXIT" ]; }; then
  echo "[slurm] $STAGE stopped for requeue (exit $rc); requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$rc"
