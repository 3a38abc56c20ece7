import sys
from pathlib import Path

# tests/ holds helper modules (distributed.py, workers/) imported by the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def sft_rm_root(tmp_path_factory):
    """One SFT (with a mid-run checkpoint) and one RM run on the default task, shared by the
    stage and PPO tests: run "main" under the returned root."""
    from stages import RM_STEPS, SFT_STEPS, stage

    root = tmp_path_factory.mktemp("pipeline")
    stage(1, "sft", root, "main", f"sft.steps={SFT_STEPS}", f"sft.save_interval={SFT_STEPS // 2}",
          f"sft.eval_interval={SFT_STEPS // 2}")
    stage(1, "rm", root, "main", f"rm.steps={RM_STEPS}", f"rm.eval_interval={RM_STEPS // 2}")
    return root


@pytest.fixture(scope="session")
def lora_runs(tmp_path_factory):
    """The LoRA runs of tests/workers/lora_layouts.py (TP1-PP1 with --init, then TP2 and PP2),
    shared by test_lora and test_lora_export: (root, {layout: results}). root/init holds the
    base and adapter checkpoints of the actor and the critic."""
    import torch
    from distributed import torchrun
    from test_lora import BASE, LAYOUTS, OVERRIDES

    root = tmp_path_factory.mktemp("lora")
    worker = "tests/workers/lora_layouts.py"
    torchrun(1, worker, f"--root={root}", f"--layout={BASE}", "--init", *OVERRIDES)
    for layout, (tp, pp) in LAYOUTS.items():
        torchrun(tp * pp, worker, f"--root={root}", f"--layout={layout}", *OVERRIDES,
                 f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}")
    return root, {name: torch.load(root / f"results_{name}.pt", weights_only=False) for name in [BASE, *LAYOUTS]}
