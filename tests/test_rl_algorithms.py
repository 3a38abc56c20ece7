"""The critic-free algorithms end to end on the built-in task (CPU, gloo), judged by what
they write: GRPO learns (gold score of held-out generations +0.3 over the SFT policy, KL
bounded) with three roles and no critic anywhere; RLOO and REINFORCE++ run their recipes;
GRPO with every policy-loss option and dynamic sampling runs at DP2, and a rank killed in
the middle of one of its iterations resumes bitwise. Plus the dynamic-sampling selection."""

import pytest
import torch

from stages import linked_run, metrics, stage, summary
from stages import assert_same_run, fault, latest

MIN_GOLD_GAIN, KL_BOUND = 0.3, 6.0  # as tests/test_ppo_stage.py
GRPO_STEPS = 30  # the recipe runs 40 (gold -0.007 -> 0.52 on the full data); 30 keep CI shorter
ROLES = ["actor", "reference", "reward"]
RUN = "critic_free"  # SFT and RM: the shared fixture's run "main"
SHORT = ["rl.steps=2", "rl.eval_interval=2", "rl.rollout_batch_size=8", "rl.mini_batch_size=8", "rl.micro_batch_size=4"]
# GRPO at DP2 with clip-higher, dual-clip, the GSPO ratio and dynamic sampling; short
# responses leave many groups unfinished (all scored by the missing-EOS penalty: equal).
OPTIONS_STEPS = 4
OPTIONS = [f"rl.steps={OPTIONS_STEPS}", "rl.save_interval=2", "rl.eval_interval=4", "rl.rollout_batch_size=4",
           "rl.n_samples_per_prompt=4", "rl.mini_batch_size=8", "rl.micro_batch_size=4", "sampling.max_new_tokens=8",
           "rl.clip_eps_high=0.28", "rl.dual_clip=3.0", "rl.importance_ratio=sequence", "rl.dynamic_sampling=true",
           "rl.max_sampling_rounds=3", "rl.kl_coef=0.01"]


@pytest.fixture(scope="module")
def root(sft_rm_root):
    linked_run(sft_rm_root, RUN, "sft", "rm")
    stage(1, "rl", sft_rm_root, RUN, f"rl.steps={GRPO_STEPS}", recipe="pipelines/tiny_cpu_grpo.yaml")
    stage(1, "rl", sft_rm_root, RUN, *SHORT, recipe="pipelines/tiny_cpu_rloo.yaml")
    stage(1, "rl", sft_rm_root, RUN, *SHORT, recipe="pipelines/tiny_cpu_reinforce_pp.yaml")
    return sft_rm_root


@pytest.fixture(scope="module")
def options_root(sft_rm_root):
    inputs = [f"rl.sft_from={sft_rm_root}/main/sft", f"rl.rm_from={sft_rm_root}/main/rm"]
    stage(2, "rl", sft_rm_root, "options", *OPTIONS, *inputs, recipe="pipelines/tiny_cpu_grpo.yaml")
    return sft_rm_root, inputs


def test_grpo_improves_true_quality_within_the_kl_bound(root):
    s = summary(root, RUN, "grpo")
    assert s["algorithm"] == "grpo" and s["roles"] == ROLES and s["steps"] == GRPO_STEPS
    gain = s["gold_score_eval_after"] - s["gold_score_eval_before"]
    assert gain >= MIN_GOLD_GAIN, s
    assert s["reward_eval_after"] > s["reward_eval_before"]
    assert 0 <= s["kl_mean_final"] < KL_BOUND
    # the same SFT policy and eval prompts as PPO's run: the same "before"
    lines = metrics(root, RUN, "grpo")
    assert lines[0]["step"] == 0 and [x["step"] for x in lines[1:]] == list(range(1, GRPO_STEPS + 1))


def test_critic_free_runs_hold_no_critic(root):
    for algorithm in ("grpo", "rloo", "reinforce_pp"):
        run = root / RUN / algorithm
        ckpt = run / (run / "latest").read_text().strip()
        assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["actor", "trainer_state"], algorithm
        s = summary(root, RUN, algorithm)
        assert s["roles"] == ROLES and s["phase_peak_memory_bytes"]["train"] > 0
        for line in metrics(root, RUN, algorithm)[1:]:
            assert not {"value_loss", "critic_loss", "explained_variance"} & line.keys()
            assert line["logprob_mismatch"] < 1e-5 and "actor_grad_norm" in line and "policy_loss" in line


def test_rloo_and_reinforce_pp_recipes_run(root):
    # rollout_batch_size counts prompts: rloo samples each 4 times, reinforce_pp once
    for algorithm, sequences_per_step in (("rloo", 8 * 4), ("reinforce_pp", 8)):
        s = summary(root, RUN, algorithm)
        assert s["algorithm"] == algorithm and s["steps"] == 2
        assert -1 <= s["gold_score_eval_after"] <= 1
        ckpt = root / RUN / algorithm / "iter_0000002" / "trainer_state" / "rank_00000.pt"
        assert torch.load(ckpt, weights_only=False)["consumed_samples"] == 2 * sequences_per_step


def test_grpo_options_and_dynamic_sampling_at_dp2(options_root):
    root, _ = options_root
    lines = metrics(root, "options", "grpo")
    assert [x["step"] for x in lines] == list(range(0, OPTIONS_STEPS + 1))
    for line in lines[1:]:
        assert line["logprob_mismatch"] < 1e-5 and 0 <= line["clip_fraction"] <= 1
        assert 1 <= line["sampling_rounds"] <= 3 and 0 <= line["sampling_shortfall"] <= 4
        assert line["sampling_shortfall"] == 0 or line["sampling_rounds"] == 3  # short only after every round
        assert abs(line["ratio_mean"] - 1) < 0.5
    # unfinished responses all score the missing-EOS penalty: some groups are dropped and redrawn
    assert any(line["sampling_rounds"] > 1 for line in lines[1:])


def test_critic_free_rank_killed_mid_iteration_resumes_bitwise(options_root):
    root, inputs = options_root
    args = [*OPTIONS, *inputs]
    proc = stage(2, "rl", root, "options_killed", *args, recipe="pipelines/tiny_cpu_grpo.yaml",
                 **fault("kill@train:3:1"))
    assert proc.returncode != 0 and "kill at train of step 3" in proc.stdout
    assert latest(root, "options_killed", "grpo") == "iter_0000002"
    stage(2, "rl", root, "options_killed", *args, recipe="pipelines/tiny_cpu_grpo.yaml")
    assert_same_run(root, "options", "options_killed", "grpo", OPTIONS_STEPS, ["actor"])


# ------------------------------------------------------------------------------ units
def test_dynamic_sampling_keeps_informative_groups_first_and_fills_a_shortfall():
    from megatron_rlhf.trainers.rl import group_informative, select_groups

    scores = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.5, 0.2, 3.0, 3.0, 0.0, 1.0])
    informative = group_informative(scores, 2, torch.ones(10, dtype=torch.bool))
    assert informative.tolist() == [False, False, True, False, True]
    assert select_groups(informative, 2, 2).tolist() == [4, 5, 8, 9]  # groups 2 and 4
    # three groups wanted, two informative: group 0 (uninformative) fills the shortfall
    assert select_groups(informative, 3, 2).tolist() == [4, 5, 8, 9, 0, 1]


def test_a_failed_episodes_reward_does_not_make_its_group_informative():
    """A failed episode's row (no policy token) is no sample to the estimators, so dynamic
    sampling must not keep its group for the reward it got (0, or rl.missing_eos_penalty)."""
    from megatron_rlhf.trainers.rl import group_informative

    # group 0: equal valid rewards + a failed row scored differently; group 1: the valid rewards
    # differ (the failed row's equal one changes nothing); group 2: one valid row; group 3: none
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 0.0, 2.0, 3.0, 5.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0])
    valid = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    assert group_informative(scores, 4, valid).tolist() == [False, True, False, False]
    assert group_informative(scores, 4, torch.ones(16, dtype=torch.bool)).tolist() == [True, True, True, True]


def test_the_phase_table_follows_the_roles_an_algorithm_builds():
    from megatron_rlhf.colocation import PHASES, phases_for

    three = phases_for({"actor", "reference", "reward"})
    assert all("critic" not in needs for needs in three.values())
    assert three["train"] == {"actor": "params+optimizer"}
    assert phases_for(set(PHASES["score"])) == {p: needs for p, needs in PHASES.items() if p != "sync"}
    assert phases_for({"actor", "reference", "reward"}, reward_in_generate=True)["generate"] == {
        "actor": "params", "reward": "params"}


def test_the_report_plots_every_algorithm(root, tmp_path):
    import shutil

    from megatron_rlhf.logging.report import write_report

    run = tmp_path / "main"
    for stage_dir in ("sft", "rm", "grpo", "rloo", "reinforce_pp"):
        shutil.copytree(root / RUN / stage_dir, run / stage_dir, ignore=shutil.ignore_patterns("iter_*"))
    report = write_report(run).read_text()  # default: sft, rm and every algorithm's directory present
    for name in ("grpo", "rloo", "reinforce_pp"):
        png = run / f"report_{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({png.name})" in report
        assert f"samples after {name.upper()}" in report
