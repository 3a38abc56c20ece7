import os
import sys
from pathlib import Path

# One intra-op thread per process, before torch is imported anywhere in the session: `make test`
# runs two pytest workers (pytest-xdist) on two cores, and the tiny models the tests train gain
# nothing from a second thread (measured: a 60-step SFT stage takes the same CPU time with one),
# while idle OpenMP threads spin on a core the other worker needs. torchrun already sets it for
# nproc > 1; the launches inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# tests/ holds helper modules (distributed.py, workers/) imported by the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))


import pytest  # noqa: E402

from shared import built_once  # noqa: E402


@pytest.fixture(scope="session")
def sft_rm_root(tmp_path_factory):
    """One SFT (with a mid-run checkpoint) and one RM run on the default task, shared by the
    stage and RL tests (built once per test run, also under pytest-xdist): run "main" under the
    returned root. Consumers write their own runs next to it, never into main/."""
    from stages import RM_STEPS, SFT_STEPS, stage

    def build(root):
        stage(1, "sft", root, "main", f"sft.steps={SFT_STEPS}", f"sft.save_interval={SFT_STEPS // 2}",
              f"sft.eval_interval={SFT_STEPS // 2}")
        stage(1, "rm", root, "main", f"rm.steps={RM_STEPS}", f"rm.eval_interval={RM_STEPS // 2}")

    return built_once(tmp_path_factory, "pipeline", build)


@pytest.fixture(scope="session")
def lora_runs(tmp_path_factory):
    """The LoRA runs of tests/workers/lora_layouts.py (TP1-PP1 with --init, then TP2 and PP2),
    shared by test_lora and test_lora_export: (root, {layout: results}). root/init holds the
    base and adapter checkpoints of the actor and the critic."""
    import torch
    from distributed import torchrun
    from test_lora import BASE, LAYOUTS, OVERRIDES
    from workers import layout_args

    def build(root):
        worker = "tests/workers/lora_layouts.py"
        torchrun(1, worker, f"--root={root}", f"--layout={BASE}=1x1", "--init", *OVERRIDES)
        torchrun(2, worker, f"--root={root}", *layout_args(LAYOUTS), *OVERRIDES)  # every world-2 layout at once

    root = built_once(tmp_path_factory, "lora", build)
    return root, {name: torch.load(root / f"results_{name}.pt", weights_only=False) for name in [BASE, *LAYOUTS]}


# The heaviest modules, heaviest first (measured: `pytest --durations=0`, summed per module).
# `make test` hands whole modules to two pytest-xdist workers (--dist loadfile) in collection
# order, so these start first and the two workers finish together; every other module keeps its
# place after them. A module missing here only runs later, it is not skipped.
HEAVIEST_FIRST = [
    "test_resilience.py", "test_dpo_stage.py", "test_reward_runs.py", "test_ppo_stage.py", "test_lora_ppo.py",
    "test_reward_hacking.py", "test_ft_launcher.py", "test_lora_sft_dpo.py", "test_slurm.py", "test_hf_stages.py",
    "test_rl_algorithms.py", "test_role_layouts.py", "test_benchmarks.py", "test_lora.py", "test_reward_http.py",
    "test_hf_convert.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# Modules that fake CUDA tensors (FakeTensorMode) to check device discipline on a CPU machine.
FAKE_CUDA_MODULES = {"test_device_discipline", "test_rollout_device", "test_rollout_placement"}


@pytest.fixture(autouse=True)
def cuda_requests_stay_cuda(request):
    """An in-process test that starts a process group (import_hf, an in-process export-hf) turns
    on parallel/cpu.py's CUDA->CPU device mode for the rest of the pytest worker's life; a later
    module that fakes CUDA tensors would then get CPU ones. Those modules run without it."""
    if request.module.__name__ not in FAKE_CUDA_MODULES:
        yield
        return
    from megatron_rlhf.parallel import cpu

    with cpu.hot_path():  # pops the mode when it is on top (a no-op otherwise)
        yield
