"""The real sbatch scripts on a real (local, 2 emulated nodes) Slurm cluster: a stage across
2 nodes x 1 task, the dependent SFT -> RM -> RL (PPO) chain of pipeline.stages (and the scripts
other stage lists submit, the DPO route's included), and preemption: USR1 to the batch shell mid-PPO -> checkpoint -> requeue ->
resume -> finish; the srun line a job would run in a container (DRY_RUN), the refusal of a
container where srun has no pyxis (this cluster has none), and the submit-time pre-flight. The cluster comes from
slurm/local_cluster.sh, which installs Debian's Slurm when it is missing (needs root)."""

import os
import re
import shutil
import subprocess
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from distributed import REPO
from stages import metrics, summary

pytestmark = pytest.mark.slow

NODES = ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if shutil.which("slurmctld") is None and os.geteuid() != 0:
        pytest.skip("Slurm is not installed and installing it needs root")
    state = tmp_path_factory.mktemp("slurm")
    subprocess.run([REPO / "slurm" / "local_cluster.sh", "start", state, "2"], check=True, timeout=600,
                   capture_output=True)
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "PYTHON": str(REPO / ".venv" / "bin" / "python")}
    yield state, env
    subprocess.run([REPO / "slurm" / "local_cluster.sh", "stop", state], timeout=60)


def job(env, job_id):
    out = subprocess.run(["scontrol", "show", "job", str(job_id)], env=env, capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def wait_for(env, job_id, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=900):
    # sbatch --wait returns late (it polls with back-off); poll scontrol instead
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = job(env, job_id)
        if info.get("JobState") in states:
            return info
        time.sleep(2)
    raise TimeoutError(f"job {job_id} still {job(env, job_id).get('JobState')}")


def submit(env, script, out, extra_args, *options):
    env = {**env, "RECIPE": "pipelines/tiny_cpu.yaml", "EXTRA_ARGS": " ".join(extra_args)}
    cmd = [str(REPO / "slurm" / script), *NODES, f"--output={out}/slurm-%j.out", "--open-mode=append", *options]
    if script != "submit_pipeline.sh":
        cmd = ["sbatch", "--parsable", *cmd[1:], str(REPO / "slurm" / script)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=True)
    return proc.stdout.split()


def test_ppo_script_runs_on_two_nodes(cluster, sft_rm_root):
    state, env = cluster
    env = {**env, "RUN_ROOT": str(sft_rm_root), "RUN_NAME": "slurm_ppo"}
    args = ["rl.steps=3", "rl.eval_interval=3",
            f"rl.sft_from={sft_rm_root}/main/sft", f"rl.rm_from={sft_rm_root}/main/rm"]
    (job_id,) = submit(env, "ppo_70b.sh", state, args)  # the RL stage with the (PPO) recipe
    info = wait_for(env, job_id)
    log = (state / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert "on 2 nodes x 1 tasks" in log
    assert f"run root: {sft_rm_root} (checkpoint.root)" in log
    assert re.search(r"^0: \[ppo\] 3/3 ", log, re.M), log[-3000:]  # srun --label: the task number on each line
    assert not re.search(r"^\[ppo\]", log, re.M)
    s = summary(sft_rm_root, "slurm_ppo", "ppo")
    assert s["steps"] == 3
    lines = metrics(sft_rm_root, "slurm_ppo", "ppo")
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    acc = EventAccumulator(str(sft_rm_root / "slurm_ppo" / "ppo" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("ppo/gold_score")] == [1, 2, 3]
    assert [e.value for e in acc.Scalars("ppo/reward")] == pytest.approx([x["reward"] for x in lines[1:]], rel=1e-6)


def test_pipeline_submits_dependent_stages_in_order(cluster, tmp_path):
    state, env = cluster
    short = ["sft.steps=6", "sft.eval_interval=6", "sft.optimizer.warmup_steps=1",
             "rm.steps=6", "rm.eval_interval=6", "rm.optimizer.warmup_steps=1", "rl.steps=2", "rl.eval_interval=2"]
    ids = submit(env, "submit_pipeline.sh", state, [f"checkpoint.root={tmp_path}", "checkpoint.run_name=chain", *short])
    assert len(ids) == 3
    assert [job(env, i)["JobName"] for i in ids] == ["rlhf-sft-70b", "rlhf-rm-70b", "rlhf-rl-70b"]
    assert job(env, ids[2])["Dependency"].startswith(f"afterok:{ids[1]}")
    infos = [wait_for(env, i) for i in ids]
    assert [i["JobState"] for i in infos] == ["COMPLETED"] * 3
    starts = [i["StartTime"] for i in infos]
    ends = [i["EndTime"] for i in infos]
    assert ends[0] <= starts[1] and ends[1] <= starts[2]  # ISO timestamps compare as strings
    for stage_name in ("sft", "rm", "ppo"):  # the rl stage writes <run>/<rl.algorithm>
        assert summary(tmp_path, "chain", stage_name)["stage"] == stage_name


@pytest.mark.parametrize("stages", [["sft", "rm"], ["sft", "rm", "dpo", "rl"]])
def test_pipeline_submits_the_recipes_stages(cluster, stages):
    """pipeline.stages (here overridden) decides the jobs, each stage its script; held, so nothing runs."""
    state, env = cluster
    ids = submit(env, "submit_pipeline.sh", state, [f"pipeline.stages=[{','.join(stages)}]"], "--hold")
    try:
        assert len(ids) == len(stages)
        infos = [job(env, i) for i in ids]
        assert [i["Command"] for i in infos] == [str(REPO / "slurm" / f"{s}_70b.sh") for s in stages]
        for before, info in zip(ids, infos[1:]):
            assert info["Dependency"].startswith(f"afterok:{before}")
    finally:
        subprocess.run(["scancel", *ids], env=env, check=True)


def test_usr1_checkpoints_requeues_and_resumes(cluster, sft_rm_root):
    state, env = cluster
    args = [f"checkpoint.root={sft_rm_root}", "checkpoint.run_name=slurm_preempt", "rl.steps=10",
            "rl.eval_interval=10", f"rl.sft_from={sft_rm_root}/main/sft", f"rl.rm_from={sft_rm_root}/main/rm"]
    (job_id,) = submit(env, "rl_70b.sh", state, args)
    out = state / f"slurm-{job_id}.out"
    deadline = time.time() + 600
    while "[ppo] 2/10 " not in (out.read_text() if out.exists() else ""):  # the console line of step 2
        assert time.time() < deadline, "PPO never reached step 2"
        time.sleep(1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=env, check=True)
    info = wait_for(env, job_id, states=("COMPLETED", "FAILED", "CANCELLED"))
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    assert "exiting for requeue" in log and "resumed from" in log
    s = summary(sft_rm_root, "slurm_preempt", "ppo")
    assert s["steps"] == 10
    # the metrics log has each step once: the resumed run truncated what it redid
    assert [x["step"] for x in metrics(sft_rm_root, "slurm_preempt", "ppo")] == list(range(0, 11))


def test_ft_launcher_mode_restarts_a_killed_rank_inside_the_job(cluster, tmp_path):
    """LAUNCHER=ft_launcher: one ft_launcher per node; rank 1 (on the second node) is
    SIGKILLed mid-step 5; both nodes restart their ranks in the same job, which resumes from
    step 4 and completes without a Slurm requeue."""
    state, env = cluster
    env = {**env, "LAUNCHER": "ft_launcher", "MEGATRON_RLHF_FAULT": "kill@train:5:1",
           "FT_INITIAL_HEARTBEAT_TIMEOUT": "120", "FT_HEARTBEAT_TIMEOUT": "60", "FT_TERM_TIMEOUT": "5",
           "FT_ARGS": "--ft-enable-nic-monitor=false --workers-stop-timeout=5"}
    args = [f"checkpoint.root={tmp_path}", "checkpoint.run_name=ft", "sft.steps=8", "sft.save_interval=2",
            "sft.optimizer.warmup_steps=2", "sft.eval_interval=8", "data.task_sizes.sft_train=256",
            "data.task_sizes.sft_eval=64"]
    (job_id,) = submit(env, "sft_70b.sh", state, args)
    info = wait_for(env, job_id)
    log = (state / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log[-3000:]
    assert "[fault injection] rank 1: kill at train of step 5" in log
    assert "at step 4" in log  # the restarted ranks resumed from the last checkpoint
    assert summary(tmp_path, "ft", "sft")["steps"] == 8
    assert [x["step"] for x in metrics(tmp_path, "ft", "sft")][-1] == 8


def has_pyxis():
    return "--container-image" in subprocess.run(["srun", "--help"], capture_output=True, text=True).stdout


def test_container_srun_line_and_pyxis_missing(cluster, tmp_path):
    """DRY_RUN=1 prints the srun command line a job would run (pyxis flags, SRUN_ARGS, --label, the
    image's python, RUN_ROOT's default outside the checkout), for srun and ft_launcher; without
    DRY_RUN the job stops before srun with the pyxis error (this cluster's srun has no pyxis)."""
    state, env = cluster
    env = {**env, "CONTAINER_IMAGE": "nvcr.io#nvidia/pytorch:25.04-py3", "CONTAINER_MOUNTS": "/lustre/data:/data:ro",
           "SRUN_ARGS": "--cpu-bind=none --mpi=none", "SCRATCH": str(tmp_path / "scratch")}
    env.pop("PYTHON")  # in the container: the image's python
    env.pop("RUN_ROOT", None)
    dry = {**env, "DRY_RUN": "1"}
    (srun_job,) = submit(dry, "sft_70b.sh", state, ["sft.steps=2"])
    (ft_job,) = submit({**dry, "LAUNCHER": "ft_launcher"}, "rm_70b.sh", state, [])
    (real_job,) = submit(env, "rl_70b.sh", state, [])
    logs = {}
    for job_id in (srun_job, ft_job, real_job):
        info = wait_for(env, job_id)
        logs[job_id] = (state / f"slurm-{job_id}.out").read_text()
        assert info["JobState"] == ("FAILED" if job_id == real_job else "COMPLETED"), logs[job_id]
    root = tmp_path / "scratch" / "megatron_rlhf_runs"
    mounts = f"{REPO}:{REPO},{root}:{root},/lustre/data:/data:ro".replace(",", "\\,")  # as printf %q quotes it
    pyxis = (f"--container-image=nvcr.io#nvidia/pytorch:25.04-py3 --container-mounts={mounts} "
             f"--container-workdir={REPO}")
    (line,) = [x for x in logs[srun_job].splitlines() if x.startswith("srun ")]
    assert line.split(" /usr/bin/env ")[0] == f"srun --kill-on-bad-exit=1 --label {pyxis} --cpu-bind=none --mpi=none"
    assert line.split(" /usr/bin/env ")[1].strip() == (
        f"python -m megatron_rlhf sft --config pipelines/tiny_cpu.yaml sft.steps=2 checkpoint.root={root}")
    (line,) = [x for x in logs[ft_job].splitlines() if x.startswith("srun ")]
    assert line.startswith(f"srun --kill-on-bad-exit=1 --label {pyxis} --nodes=2 --ntasks=2 --ntasks-per-node=1 ")
    assert " /usr/bin/env bash -c " in line and " ft-node ft_launcher --nnodes=2 " in line
    assert line.rstrip().endswith(f"-m megatron_rlhf rm --config pipelines/tiny_cpu.yaml checkpoint.root={root}")
    assert not root.exists()  # a dry run creates nothing
    if not has_pyxis():
        message = "CONTAINER_IMAGE needs the pyxis Slurm plugin (srun --container-image); this cluster's srun has none"
        assert message in logs[srun_job]  # the dry run warns
        assert f"[slurm] job {real_job}: {message}" in logs[real_job]
        assert "srun: " not in logs[real_job] and not root.exists()  # stopped before srun


def test_pipeline_preflight_refuses_before_anything_is_queued(cluster, tmp_path):
    """The 70B recipe as shipped (placeholders) and a missing data file: exit 2, each field named,
    no job submitted."""
    state, env = cluster

    def jobs():
        out = subprocess.run(["squeue", "-h", "--states=all", "-o", "%i"], env=env, capture_output=True, text=True)
        return set(out.stdout.split())

    before = jobs()
    cmd = [str(REPO / "slurm" / "submit_pipeline.sh"), *NODES]
    recipe = {**env, "RECIPE": "pipelines/llama3_70b.yaml", "RUN_ROOT": str(tmp_path)}
    proc = subprocess.run(cmd, env=recipe, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert "nothing was submitted" in proc.stderr
    for field in ("tokenizer", "sft_train", "preference_eval", "prompts_train"):
        assert f"data.{field}=/path/to/" in proc.stderr
    proc = subprocess.run(cmd, env={**recipe, "EXTRA_ARGS": f"pipeline.stages=[sft] data.tokenizer={REPO} "
                                    f"data.sft_train={tmp_path}/sft.jsonl data.sft_eval=null"},
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and f"data.sft_train={tmp_path}/sft.jsonl: no such file or directory" in proc.stderr
    assert "data.prompts_train" not in proc.stderr  # a stage not submitted needs no data
    assert jobs() == before
