# Sourced by slurm/stage.sh (in the job) and slurm/submit_pipeline.sh (at submit time), so both
# resolve the run root and the container flags by one rule. Needs REPO. Defines:
#   RUN_ROOT        where runs are written (checkpoint.root)
#   container_args  the pyxis srun flags (an array; empty without CONTAINER_IMAGE)
#   container_mounts the --container-mounts list (SRC:DST[:FLAGS],...; empty without an image)
# and require_pyxis, which stops (exit 2) where srun has no --container-image.

# RUN_ROOT: the environment's, else a checkpoint.root=... among EXTRA_ARGS (the last one wins,
# as the config loader reads them), else ${SCRATCH:-$HOME}/megatron_rlhf_runs. Not the recipes'
# `checkpoint.root: checkpoints`: a job's working directory is the checkout, and a 70B run's
# checkpoints (~1 TB each with the optimizer state) do not belong in a git tree. $SCRATCH is
# the large shared filesystem on the sites that define it (NERSC, TACC, CSCS, ...); $HOME is
# shared by all nodes everywhere else (a node-local /tmp would split one run across nodes).
run_root_from_args=
read -ra _extra_words -d "" <<< "${EXTRA_ARGS:-}" || true
for _word in ${_extra_words[@]+"${_extra_words[@]}"}; do
  case $_word in checkpoint.root=*) run_root_from_args=${_word#checkpoint.root=} ;; esac
done
RUN_ROOT=${RUN_ROOT:-${run_root_from_args:-${SCRATCH:-$HOME}/megatron_rlhf_runs}}
case $RUN_ROOT in /*) ;; *) RUN_ROOT=$REPO/$RUN_ROOT ;; esac  # as the job (in REPO) reads it
export RUN_ROOT

# Containers (pyxis/enroot): CONTAINER_IMAGE (e.g. nvcr.io#nvidia/pytorch:25.04-py3 or a
# .sqsh file) runs every task in that image. The checkout (REPO) and RUN_ROOT are always mounted
# at their own paths, since the job runs in REPO and writes RUN_ROOT; CONTAINER_MOUNTS adds
# more (SRC:DST[:FLAGS],... e.g. /lustre/data:/data:ro). CONTAINER_WORKDIR defaults to REPO.
container_args=()
container_mounts=
if [ -n "${CONTAINER_IMAGE:-}" ]; then
  container_mounts="$REPO:$REPO,$RUN_ROOT:$RUN_ROOT${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}"
  container_args=(--container-image="$CONTAINER_IMAGE" --container-mounts="$container_mounts"
                  --container-workdir="${CONTAINER_WORKDIR:-$REPO}")
fi

# pyxis adds --container-image to srun (a SPANK plugin; its options are listed by srun --help).
# Without it srun rejects the flag only once the job has its nodes: say so before anything runs.
has_pyxis() { srun --help 2>&1 | grep -q -- '--container-image'; }
require_pyxis() {  # $1: who is asking (for the message)
  [ -z "${CONTAINER_IMAGE:-}" ] || has_pyxis && return 0
  echo "$1: CONTAINER_IMAGE needs the pyxis Slurm plugin (srun --container-image); this cluster's srun" \
       "has none: ask the admins for pyxis/enroot, or unset CONTAINER_IMAGE and run from a venv on a shared" \
       "filesystem (PYTHON=/shared/venv/bin/python; docs/clusters.md)" >&2
  return 2
}
