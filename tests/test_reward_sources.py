"""Reward sources (rl.rewards): configuration, rule functions and their failures, pipelines
without a reward model. The HTTP service has its own tests (test_reward_http.py); the RL runs
with each source are in test_reward_runs.py."""

import math

import pytest

from megatron_rlhf.config import ConfigError, load_config, validate
from megatron_rlhf.rewards.base import RewardInputs, RewardSourceError
from megatron_rlhf.rewards.function import FunctionReward, check_scores

RULE = "rl.rewards=[{type: function, function: rewards/arithmetic.py:score}]"


def cfg_with(*overrides):
    return validate(load_config("pipelines/tiny_cpu.yaml", list(overrides)), world_size=1)


def error_of(*overrides) -> str:
    with pytest.raises(ConfigError) as err:
        cfg_with(*overrides)
    return str(err.value)


def inputs(n=3, answers=("3", "5", "7")) -> RewardInputs:
    return RewardInputs(prompts=[f"p{i}" for i in range(n)], responses=list(answers[:n]),
                        prompt_ids=[[1, 2]] * n, response_ids=[[3, 0]] * n, finished=[True] * n,
                        extras=[{"answer": a} for a in ("3", "4", "7")[:n]])


def test_default_reward_is_the_reward_model_and_a_list_of_sources_parses():
    cfg = cfg_with()
    assert [(s.type, s.weight, s.label) for s in cfg.rl.rewards] == [("model", 1.0, "rm")]
    assert cfg.rl.has_reward_model and cfg.rl.critic_start == "rm"
    cfg = cfg_with("rl.rewards=[{type: model, weight: 0.5}, {type: function, function: rewards/arithmetic.py:score, "
                   "weight: 2, name: exact}, {type: http, url: 'http://127.0.0.1:9/score', timeout_s: 3}]")
    assert [(s.type, s.weight, s.label) for s in cfg.rl.rewards] == [
        ("model", 0.5, "rm"), ("function", 2.0, "exact"), ("http", 1.0, "http")]
    assert cfg.rl.rewards[2].timeout_s == 3.0


def test_without_a_reward_model_the_pipeline_needs_no_rm_stage_and_the_critic_starts_from_sft():
    cfg = cfg_with(RULE, "pipeline.stages=[sft, rl]")
    assert not cfg.rl.has_reward_model and cfg.rl.critic_start == "sft" and not cfg.rl.needs_rm_checkpoint
    # with a reward model the rm stage (or rl.rm_from) is still needed
    assert "put rm before rl" in error_of("pipeline.stages=[sft, rl]")
    # ... and so it is when the critic is asked to start from one (e.g. the RM a service serves)
    assert "put rm before rl" in error_of(RULE, "rl.critic_from=rm", "pipeline.stages=[sft, rl]")
    assert cfg_with(RULE, "rl.critic_from=rm", "rl.rm_from=elsewhere/rm", "pipeline.stages=[sft, rl]").rl.needs_rm_checkpoint


@pytest.mark.parametrize("override, field", [
    ("rl.rewards=[]", "rl.rewards: empty"),
    ("rl.rewards=[{type: judge}]", "rl.rewards[0].type='judge'"),
    ("rl.rewards=[{type: http}]", "rl.rewards[0].url=None"),
    ("rl.rewards=[{type: http, url: 'localhost:8000'}]", "rl.rewards[0].url='localhost:8000'"),
    ("rl.rewards=[{type: model, url: 'http://x/score'}]", "rl.rewards[0].url: only a reward source of type http"),
    ("rl.rewards=[{type: function, function: rewards/arithmetic.py}]", "rl.rewards[0].function="),
    ("rl.rewards=[{type: function, function: 'a.py:f', timeout_s: 3}]", "rl.rewards[0].timeout_s"),
    ("rl.rewards=[{type: model, weight: 0}]", "rl.rewards[0].weight=0"),
    ("rl.rewards=[{type: model}, {type: model}]", "more than one source of type model"),
    ("rl.rewards=[{type: function, function: 'a.py:f'}, {type: function, function: 'b.py:f'}]", "distinct `name`s"),
    ("rl.rewards=[{type: http, url: 'http://x/score', max_retries: -1}]", "max_retries=-1"),
    ("rl.rewards=[{typ: model}]", "rl.rewards[0].typ: unknown key"),
])
def test_bad_reward_sources_are_refused_naming_the_field(override, field):
    assert field in error_of(override)


def test_critic_from_is_a_critic_setting():
    assert "rl.critic_from" in error_of("rl.algorithm=grpo", "rl.n_samples_per_prompt=4", "rl.critic_from=sft")


def write(tmp_path, body: str) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(body)
    return f"{path}:score"


def test_the_shipped_rule_reward_scores_exact_answers():
    reward = FunctionReward("rewards/arithmetic.py:score", "exact", "rl.rewards[0].function")
    assert reward.score(inputs()) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("body, problem", [
    ("def score(**kw):\n    raise ValueError('no answer field')\n", "raised ValueError: no answer field"),
    ("def score(**kw):\n    return [1.0, float('nan'), 0.0]\n", "score 1 is nan"),
    ("def score(**kw):\n    return [1.0, 2.0]\n", "returned 2 scores for 3 samples"),
    ("def score(**kw):\n    return [1.0, 'a', 0.0]\n", "score 1 is 'a' (str), not a number"),
    ("def score(**kw):\n    return [True, 1.0, 0.0]\n", "score 0 is True (bool), not a number"),
    ("def score(**kw):\n    return 1.0\n", "returned float, expected a list of 3 floats"),
    # issue 53: a score past the largest float (was an OverflowError); BaseExceptions of the user's code
    ("def score(**kw):\n    return [10 ** 400, 0.0, 0.0]\n", "score 0 (int) is too large for a float"),
    ("def score(**kw):\n    raise SystemExit(3)\n", "raised SystemExit: 3"),
    ("def score(**kw):\n    raise KeyboardInterrupt('in the grader')\n", "raised KeyboardInterrupt: in the grader"),
])
def test_a_rule_function_that_misbehaves_stops_with_its_file_and_the_problem_named(tmp_path, body, problem):
    spec = write(tmp_path, body)
    with pytest.raises(RewardSourceError) as err:
        FunctionReward(spec, "mine", "rl.rewards[0].function").score(inputs())
    assert problem in str(err.value) and str(tmp_path / "my_reward.py") + ":score" in str(err.value)


def test_a_rule_function_gets_every_documented_keyword(tmp_path):
    spec = write(tmp_path, "def score(prompts, responses, prompt_ids, response_ids, finished, extras):\n"
                           "    return [len(p) + len(r) + len(pi) + len(ri) + f + len(e) for p, r, pi, ri, f, e in "
                           "zip(prompts, responses, prompt_ids, response_ids, finished, extras)]\n")
    assert FunctionReward(spec, "mine", "f").score(inputs()) == [2 + 1 + 2 + 2 + 1 + 1] * 3


@pytest.mark.parametrize("spec, problem", [
    ("nowhere/missing.py:score", "file not found"),
    ("rewards/arithmetic.py:nope", "has no function 'nope'"),
])
def test_a_missing_file_or_function_is_a_config_error(spec, problem):
    with pytest.raises(ConfigError, match=problem):
        FunctionReward(spec, "x", "rl.rewards[0].function")


def test_an_import_error_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="importing .*my_reward.py failed: SyntaxError"):
        FunctionReward(write(tmp_path, "def score(:\n"), "x", "rl.rewards[0].function")


def test_check_scores_accepts_numpy_and_ints():
    np = pytest.importorskip("numpy")
    assert check_scores(np.array([1, 2.5]), 2, "s") == [1.0, 2.5]
    assert check_scores((0, -1), 2, "s") == [0.0, -1.0]
    assert all(isinstance(v, float) and math.isfinite(v) for v in check_scores([1, 2], 2, "s"))


def test_the_pre_flight_check_finds_a_missing_rule_file_before_any_worker_starts(tmp_path):
    from megatron_rlhf.trainers.stage_data import preflight

    cfg = cfg_with(f"rl.rewards=[{{type: function, function: '{tmp_path}/gone.py:score'}}]",
                   f"checkpoint.root={tmp_path}")
    with pytest.raises(ConfigError, match=r"rl.rewards\[0\].function=.*gone.py:score.*file not found"):
        preflight(cfg, "pipeline")
    assert preflight(cfg_with(RULE, "data.task=arithmetic", f"checkpoint.root={tmp_path}"), "rl")  # the shipped one


def test_the_reward_is_the_weighted_sum_of_the_sources():
    import torch

    from megatron_rlhf.rewards import weighted_sum

    rm, exact = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    total = weighted_sum({"rm": rm, "exact": exact}, {"rm": 2.0, "exact": -0.5})
    assert total.dtype == torch.float32 and torch.equal(total, torch.tensor([0.5, -2.0, 3.5]))
    assert torch.equal(weighted_sum({"rm": rm}, {"rm": 1.0}), rm)  # one source of weight 1: its scores, bit for bit
