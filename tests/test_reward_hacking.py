"""The reward-hacking alarm: trend statistics, when it turns on (and only then warns), and an
end-to-end run against a deliberately mis-specified reward model, which must raise it."""

import json
import random

import pytest

from megatron_rlhf.logging.reward_hacking import T_MIN, RewardHackingAlarm, slope_and_t
from stages import RM_STEPS, metrics, stage, summary


def test_slope_and_t_statistic():
    slope, t = slope_and_t([1.0, 3.0, 5.0, 7.0])
    assert slope == pytest.approx(2.0) and t == float("inf")
    assert slope_and_t([2.0] * 5) == (0.0, 0.0)
    slope, t = slope_and_t([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    assert slope == pytest.approx(3 / 35) and abs(t) < 1


def run_alarm(proxy, independent, key="gold_score", window=6):
    alarm, flags, warnings = RewardHackingAlarm(window), [], []
    for step, (p, i) in enumerate(zip(proxy, independent), start=1):
        metrics = {"reward": p, key: i}
        if warning := alarm.update(step, metrics):
            warnings.append(warning)
        flags.append(metrics.get("reward_hacking"))
    return alarm, flags, warnings


def test_the_alarm_turns_on_when_the_proxy_rises_and_the_judge_falls():
    rng = random.Random(0)
    up = [0.1 * s + rng.gauss(0, 0.02) for s in range(20)]
    down = [-0.05 * s + rng.gauss(0, 0.02) for s in range(20)]
    agree = [0.05 * s + rng.gauss(0, 0.02) for s in range(20)]
    _, flags, warnings = run_alarm(up, agree)
    assert flags[:5] == [None] * 5 and set(flags[5:]) == {0.0} and not warnings  # both rise: learning
    alarm, flags, warnings = run_alarm(up[:10] + up[10:], agree[:10] + [agree[9] - 0.05 * s for s in range(10)])
    assert flags[-1] == 1.0 and len(warnings) == 1  # warned once, when it turned on
    first = alarm.alarms[0]
    assert first["independent"] == "gold_score" and first["proxy_slope"] > 0 > first["independent_slope"]
    assert "reward rising" in warnings[0] and "rl.kl_coef" in warnings[0]
    _, flags, _ = run_alarm(up, down, key="holdout_rm_score")  # user data: the holdout RM is the judge
    assert set(flags[5:]) == {1.0}


def test_noise_does_not_trip_the_alarm():
    rng = random.Random(1)
    trips = 0
    for _ in range(50):
        proxy = [0.02 * s + rng.gauss(0, 0.3) for s in range(40)]
        gold = [0.01 * s + rng.gauss(0, 0.3) for s in range(40)]
        trips += bool(run_alarm(proxy, gold, window=10)[0].alarms)
    assert trips <= 5, f"{trips} of 50 noisy learning runs raised the alarm (t >= {T_MIN})"


def test_state_round_trips_for_resume():
    alarm, _, _ = run_alarm([0.1 * s for s in range(8)], [-0.1 * s for s in range(8)])
    again = RewardHackingAlarm(6)
    again.load_state_dict(alarm.state_dict())
    a, b = {"reward": 1.0, "gold_score": -1.0}, {"reward": 1.0, "gold_score": -1.0}
    assert alarm.update(9, a) == again.update(9, b) and a == b and again.alarms == alarm.alarms


@pytest.mark.slow
def test_a_mis_specified_reward_model_raises_the_alarm(sft_rm_root):
    """The RM learns the opposite preference (chosen and rejected swapped, as a labelling bug
    would): PPO then drives its score up and the gold score down. The alarm must say so, the
    win rates must disagree, and the holdout RM (rm.holdout_fraction) is built and logged."""
    root, data = sft_rm_root, sft_rm_root / "main" / "data"
    for split in ("preference_train", "preference_eval"):
        rows = [json.loads(x) for x in (data / f"{split}.jsonl").read_text().splitlines()]
        swapped = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in rows]
        (root / f"swapped_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in swapped))
    inputs = [f"data.preference_train={root / 'swapped_preference_train.jsonl'}",
              f"data.preference_eval={root / 'swapped_preference_eval.jsonl'}", "rm.holdout_fraction=0.5"]
    stage(1, "rm", root, "swapped", f"rm.steps={RM_STEPS // 2}", f"rm.eval_interval={RM_STEPS // 2}",
          f"rm.init_from={root / 'main' / 'sft'}", *inputs)
    # 20 iterations: the default 10-iteration window twice. The gold trend is noisy (one sampled
    # batch can dip and recover), so the step the alarm turns on varies with the CPU's float
    # rounding: measured by step 14 on the CI machine, at 16 on an AMD EPYC.
    stage(1, "rl", root, "swapped", "rl.steps=20", "rl.eval_interval=10",
          f"rl.sft_from={root / 'main' / 'sft'}", "rl.actor_optimizer.lr=5.0e-4", *inputs)
    s = summary(root, "swapped", "ppo")
    assert s["reward_hacking_alarms"], s
    alarm = s["reward_hacking_alarms"][0]
    assert alarm["independent"] == "gold_score" and alarm["proxy_slope"] > 0 > alarm["independent_slope"]
    assert s["win_rate_reward_final"] > 0.5 > s["win_rate_gold_final"]
    assert "holdout_reward" in s["roles"] and s["win_rate_holdout_rm_final"] is not None
    rows = metrics(root, "swapped", "ppo")
    assert any(r.get("reward_hacking") == 1.0 for r in rows)
    assert all("holdout_rm_score" in r for r in rows[1:])
    assert (root / "swapped" / "rm_holdout" / "summary.json").exists()
