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
