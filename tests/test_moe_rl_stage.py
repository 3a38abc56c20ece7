"""The RL stage on a mixture-of-experts model as users run it (pipelines/tiny_cpu_moe.yaml: GRPO,
EP2 over two processes), with rollout routing replay on (rl.routing_replay: auto) and dynamic
sampling: the routes the in-place engine records travel with each rank's rollout through the
dynamic-sampling selection into the score and train forwards, every iteration logs the routing
metrics, and a preempted run resumes bit for bit (the routes are sampled again from the
checkpointed state, as the tokens are)."""

import pytest

from stages import assert_same_tensors, deterministic_metrics, metrics, stage

pytestmark = pytest.mark.slow

RECIPE = "pipelines/tiny_cpu_moe.yaml"
SHORT = ["sft.steps=6", "sft.eval_interval=6", "sft.save_interval=0", "sft.optimizer.warmup_steps=2",
         "rm.steps=4", "rm.eval_interval=4", "rm.save_interval=0", "rm.optimizer.warmup_steps=2",
         "rl.steps=3", "rl.eval_interval=3", "rl.save_interval=1", "rl.rollout_batch_size=4", "rl.mini_batch_size=8",
         "rl.micro_batch_size=4", "rl.epochs=1", "rl.dynamic_sampling=true", "rl.max_sampling_rounds=2",
         "checkpoint.keep_last=3", "data.task_sizes.sft_eval=32", "data.task_sizes.preference_eval=32",
         "data.task_sizes.eval_prompts=16"]
ROUTING = ("routing_disagreement_mean", "routing_disagreement_max", "expert_load_imbalance_mean",
           "expert_load_imbalance_max", "logprob_mismatch_without_replay", "logprob_mismatch", "actor_load_balancing_loss",
           "routing_replay_overridden_mean", "routing_replay_overridden_max")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_rl")
    stage(2, "pipeline", root, "whole", *SHORT, recipe=RECIPE)
    # the same run preempted (SIGUSR1 on rank 0) in its second iteration, then resumed
    for run in ("preempted",):
        (root / run).mkdir()
        for name in ("sft", "rm"):
            (root / run / name).symlink_to(root / "whole" / name)
    stage(2, "rl", root, "preempted", *SHORT, recipe=RECIPE, env={"MEGATRON_RLHF_FAULT": "sigusr1@train:2:0"},
          check=False)
    resumed = stage(2, "rl", root, "preempted", *SHORT, recipe=RECIPE)
    return root, resumed.stdout


def test_every_iteration_logs_the_routing_metrics(root):
    rows = [row for row in metrics(root[0], "whole", "grpo") if row.get("step", 0) > 0 and "reward" in row]
    assert len(rows) == 3
    for row in rows:
        assert row["routing_replay"] == 1.0
        assert all(key in row for key in ROUTING), sorted(set(ROUTING) - row.keys())
        assert 0 <= row["routing_disagreement_mean"] <= row["routing_disagreement_max"] <= 1
        assert row["expert_load_imbalance_max"] >= row["expert_load_imbalance_mean"] >= 1
        assert 0 <= row["routing_replay_overridden_mean"] <= row["routing_replay_overridden_max"] <= 1
        assert row["actor_load_balancing_loss"] > 0
    # the first iteration samples and scores with the same weights: replay changes nothing there
    assert rows[0]["routing_disagreement_max"] == 0


def test_a_preempted_moe_run_resumes_bit_for_bit(root):
    path, stdout = root
    assert "at step 2" in stdout
    assert deterministic_metrics(path, "preempted", "grpo") == deterministic_metrics(path, "whole", "grpo")
    assert_same_tensors(path / "whole" / "grpo" / "iter_0000003" / "actor",
                        path / "preempted" / "grpo" / "iter_0000003" / "actor")
