"""The nemo-run launcher runs the recipe's pipeline.stages as dependent jobs of our stage
command. The experiment tests build the Experiment through launch.py and dry-run it for real
(nemo-run writes the sbatch scripts): they need the optional `nemo` extra, which `make test`
(CI) installs; without it they are skipped. Choosing the stages does not need it."""

import io
import logging
import sys
from pathlib import Path

import pytest

from megatron_rlhf import launch, preflight
from megatron_rlhf.config import ConfigError, load_config, validate
from megatron_rlhf.parallel import device_index
from megatron_rlhf.preflight import preflight_paths

REPO = Path(__file__).resolve().parent.parent


def test_default_stages_are_the_recipes_pipeline_stages(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert launch.recipe_stages("pipelines/llama3_70b.yaml", []) == ["sft", "rm", "rl"]
    assert launch.recipe_stages("pipelines/llama3_70b.yaml", ["pipeline.stages=[sft,rm]"]) == ["sft", "rm"]
    recipe = tmp_path / "rl_only.yaml"
    recipe.write_text(f"base: {REPO}/pipelines/tiny_cpu_grpo.yaml\npipeline: {{stages: [rl]}}\n"
                      "rl: {sft_from: /ckpt/sft, rm_from: /ckpt/rm}\n")
    assert launch.recipe_stages(str(recipe), []) == ["rl"]
    # the stages are validated before anything is submitted (or nemo-run is needed)
    assert launch.main(["--config", "pipelines/tiny_cpu.yaml", "--dryrun", "pipeline.stages=[rl]"]) == 2
    assert "config error: pipeline.stages=['rl']: rl starts from a sft checkpoint" in capsys.readouterr().err


@pytest.fixture
def nemo_run(tmp_path, monkeypatch):
    """nemo_run with NEMORUN_HOME in tmp_path; the root logger is restored afterwards (every
    nemo-run Experiment reconfigures it with logging.basicConfig(force=True)). Slurm packaging
    runs shell commands through invoke, which reads stdin: give it an empty one (pytest's raises)."""
    run = pytest.importorskip("nemo_run")  # the `nemo` extra (CI installs it)
    monkeypatch.setattr(sys, "stdin", io.StringIO())
    root = logging.getLogger()
    handlers, level, home = root.handlers[:], root.level, run.config.get_nemorun_home()
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "home"))
    run.config.set_nemorun_home(str(tmp_path / "home"))
    yield run
    run.config.set_nemorun_home(home)
    root.handlers[:] = handlers
    root.setLevel(level)


SLURM = ["--config", "pipelines/llama3_70b.yaml", "--executor", "slurm", "--nodes", "8", "--tasks-per-node", "8",
         "--gpus-per-node", "8", "--partition", "batch", "--account", "acct", "--time", "04:00:00",
         "--run-root", "/lustre/runs"]


def test_slurm_dryrun_submits_the_recipes_stages_in_order(nemo_run, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)

    def dryrun(*argv):
        """The experiment launch.main would submit, dry-run for real (nemo-run writes each stage's
        sbatch script); its jobs and their sbatch scripts by stage."""
        args = launch.parse_args([*SLURM, "--job-dir", str(tmp_path / "jobs"), *argv])
        with launch.build_experiment(args) as experiment:
            experiment.dryrun(log=False, delete_exp_dir=False)
            exp_dir = Path(experiment._exp_dir)
            jobs = list(experiment.jobs)
        assert exp_dir.is_relative_to(tmp_path / "home")
        return jobs, {job.id: (exp_dir / f"{job.executor.job_name}_sbatch.sh").read_text() for job in jobs}

    jobs, sbatch = dryrun("rl.steps=7")
    assert [job.id for job in jobs] == ["sft", "rm", "rl"]
    assert [job.dependencies for job in jobs] == [[], ["sft"], ["rm"]]
    for job in jobs:
        stage = job.id
        command = [sys.executable, "-m", "megatron_rlhf", stage, "--config", "pipelines/llama3_70b.yaml", "rl.steps=7",
                   "checkpoint.root=/lustre/runs"]  # --run-root: outside nemo-run's copy of the code
        assert isinstance(job.task, nemo_run.Script) and job.task.to_command(with_entrypoint=True) == command
        executor = job.executor
        assert isinstance(executor, nemo_run.SlurmExecutor) and executor.dependency_type == "afterok"
        assert (executor.nodes, executor.ntasks_per_node, executor.gpus_per_node) == (8, 8, 8)
        assert (executor.partition, executor.account, executor.time) == ("batch", "acct", "04:00:00")
        script = sbatch[stage]
        for line in ("#SBATCH --nodes=8", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                     "#SBATCH --partition=batch", "#SBATCH --account=acct", "#SBATCH --time=04:00:00"):
            assert line in script.splitlines(), (stage, line, script)
        srun = [line for line in script.splitlines() if line.startswith("srun ")]
        assert len(srun) == 1 and srun[0].endswith(" " + " ".join(command)), script
        assert str(tmp_path / "jobs") in srun[0]  # logs go to the --job-dir
        assert " --label " in srun[0] and "--container-image" not in srun[0]

    jobs, sbatch = dryrun("pipeline.stages=[sft,rm]")
    assert [job.id for job in jobs] == ["sft", "rm"] and sorted(sbatch) == ["rm", "sft"]
    assert [job.dependencies for job in jobs] == [[], ["sft"]]
    # other stages, in a container: pyxis flags on the srun line, the image's python, the run root mounted
    jobs, sbatch = dryrun("--stages", "rm", "rl", "--container-image", "nvcr.io#nvidia/pytorch:25.04-py3",
                          "--container-mounts", "/lustre/data:/data:ro", "--srun-args=--cpu-bind=none")
    assert [job.id for job in jobs] == ["rm", "rl"] and jobs[1].dependencies == ["rm"]
    (srun,) = [line for line in sbatch["rm"].splitlines() if line.startswith("srun ")]
    assert "--container-image nvcr.io#nvidia/pytorch:25.04-py3" in srun
    assert "/lustre/runs:/lustre/runs,/lustre/data:/data:ro," in srun  # then nemo-run's own code mount
    assert " --label --cpu-bind=none " in srun
    assert srun.endswith(" python -m megatron_rlhf rm --config pipelines/llama3_70b.yaml checkpoint.root=/lustre/runs")


def test_local_experiment_runs_the_stages_under_torchrun(nemo_run, monkeypatch):
    monkeypatch.chdir(REPO)
    args = launch.parse_args(["--config", "pipelines/tiny_cpu.yaml", "--nproc", "2", "rl.steps=3"])
    with launch.build_experiment(args) as experiment:
        jobs = list(experiment.jobs)
        experiment.dryrun(log=False)
    assert [(job.id, job.dependencies) for job in jobs] == [("sft", []), ("rm", ["sft"]), ("rl", ["rm"])]
    for job in jobs:
        assert isinstance(job.executor, nemo_run.LocalExecutor) and job.executor.ntasks_per_node == 2
        assert isinstance(job.executor.get_launcher(), nemo_run.Torchrun)
        assert job.task.to_command() == ["-m", "megatron_rlhf", job.id, "--config", "pipelines/tiny_cpu.yaml",
                                         "rl.steps=3"]


def test_preflight_refuses_placeholders_and_missing_inputs_before_anything_is_submitted(tmp_path, monkeypatch, capsys):
    """slurm/submit_pipeline.sh and the launcher refuse a recipe a job could not start with (no nemo-run needed)."""
    monkeypatch.chdir(REPO)
    cfg = validate(load_config("pipelines/llama3_70b.yaml", []))
    problems = preflight_paths(cfg)
    assert [p.split("=")[0] for p in problems] == ["data.tokenizer", "data.sft_train", "data.sft_eval",
                                                   "data.preference_train", "data.preference_eval",
                                                   "data.prompts_train", "data.prompts_eval"]
    assert problems[0].startswith("data.tokenizer=/path/to/Llama-3.3-70B-Instruct: a placeholder")
    # only the files of the stages run: SFT -> DPO never reads the prompts
    assert [p.split("=")[0] for p in preflight_paths(cfg, ["sft", "dpo"])][-1] == "data.preference_eval"

    # real paths: those that exist pass, inside a container seen through its mounts
    (tmp_path / "tok").mkdir()
    (tmp_path / "sft.jsonl").write_text("{}\n")
    given = [f"data.tokenizer={tmp_path}/tok", "data.sft_train=/data/sft.jsonl", "data.sft_eval=null",
             "data.preference_train=/data/missing.jsonl", "data.preference_eval=null"]
    cfg = validate(load_config("pipelines/llama3_70b.yaml", given))
    assert preflight_paths(cfg, ["sft", "rm"], mounts=f"/lustre/runs:/runs,{tmp_path}:/data:ro") == [
        f"data.preference_train=/data/missing.jsonl: no such file or directory (on this host: {tmp_path}/missing.jsonl)"]
    assert preflight_paths(cfg, ["sft", "rm"], mounts=f"{tmp_path}:/data", check_exists=False) == []
    assert preflight_paths(validate(load_config("pipelines/tiny_cpu.yaml", []))) == []  # built-in task and tokenizer

    assert preflight.main(["--config", "pipelines/llama3_70b.yaml", *given, "--stages", "sft"]) == 2
    err = capsys.readouterr().err
    assert "nothing was submitted" in err and "data.sft_train=/data/sft.jsonl: no such file or directory" in err
    assert preflight.main(["--config", "pipelines/tiny_cpu.yaml"]) == 0
    assert capsys.readouterr().out.split() == ["sft", "rm", "rl"]  # what submit_pipeline.sh submits
    # the launcher runs the same check before it needs nemo-run
    assert launch.main(["--config", "pipelines/llama3_70b.yaml", "--executor", "slurm", "--dryrun"]) == 2
    assert "data.prompts_eval=/path/to/prompts_eval.jsonl: a placeholder" in capsys.readouterr().err


def test_each_rank_uses_a_device_it_can_see():
    """8 tasks per node: all 8 GPUs visible to each (local rank = device), or one bound per task (device 0)."""
    assert [device_index(rank, 8) for rank in range(8)] == list(range(8))
    assert [device_index(rank, 1) for rank in range(8)] == [0] * 8
    with pytest.raises(ConfigError, match="parallel.backend=nccl: this process sees no GPU"):
        device_index(0, 0)
