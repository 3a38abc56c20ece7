"""Multi-turn episodes (rollout/episodes.py): token in, token out; what trains and what is
context; the environment stepped once per replica; failed episodes; and the advantage math
with environment tokens between the policy's turns. The RL stage with the calculator
environment, interrupted and resumed, is tests/test_agent_stage.py."""

import pytest
import torch

from distributed import TINY_MODEL, torchrun
from megatron_rlhf.data.tasks import get_task
from megatron_rlhf.data.tokenizers import WordTokenizer
from workers import layout_args

VOCAB = WordTokenizer(get_task("calculator").words()).vocab_size
# moe_ep2: an MoE actor with its experts over the two data-parallel ranks (routing replay of
# episodes; each rank's own decoding span, paired forward for forward)
MOE_EP2 = ["model.family=mixtral", "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=96",
           "parallel.expert_parallel=2"]
LAYOUTS = {"dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2), "moe_ep2": (1, 1, MOE_EP2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("episodes")
    model = [o for o in TINY_MODEL if not o.startswith("model.vocab_size")]
    torchrun(2, "tests/workers/episodes.py", f"--root={root}", *layout_args(LAYOUTS), *model,
             f"model.vocab_size={VOCAB}", "seed=11")
    return {name: torch.load(root / f"episodes_{name}.pt", weights_only=False) for name in LAYOUTS}


def each_rank(results, run="ok"):
    return results[run]


def full_rows(r):
    rollout = r["rollout"]
    return [rollout["tokens"][i, :n].tolist() for i, n in enumerate(rollout["lengths"].tolist())]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_trained_ids_are_the_sampled_ids_and_observations_are_appended_as_ids(runs, layout):
    """Token in, token out: every row is its prompt then the episode's ids; each turn's engine
    input is the trajectory so far, and what the engine sampled sits there unchanged, marked as
    the policy's; the rest are the observations between their marker ids."""
    res = runs[layout]
    turns = 0
    for r in res["ok"]:
        rows = full_rows(r)
        for row, e in zip(rows, r["episodes"]):
            assert row == e["prompt_ids"] + e["tokens"]
        covered = [set() for _ in rows]
        for call in r["calls"]:
            assert call["stops"] == [res["markers"]["</calc>"]]
            for prompt, new in zip(call["prompts"], call["new"]):
                matches = [i for i, row in enumerate(rows) if row[:len(prompt)] == prompt and len(row) > len(prompt)
                           and len(prompt) >= len(r["episodes"][i]["prompt_ids"])
                           and r["episodes"][i]["policy_mask"][len(prompt) - len(r["episodes"][i]["prompt_ids"])]]
                if not matches:
                    continue  # a stand-in row, or a turn the runner ended without room
                i = matches[0]
                mask = r["episodes"][i]["policy_mask"]
                start = len(prompt) - len(r["episodes"][i]["prompt_ids"])
                kept = 0
                while start + kept < len(mask) and kept < len(new) and mask[start + kept]:
                    kept += 1
                assert kept > 0 and rows[i][len(prompt):len(prompt) + kept] == new[:kept]
                covered[i].update(range(start, start + kept))
        for i, e in enumerate(r["episodes"]):
            assert covered[i] == {j for j, sampled in enumerate(e["policy_mask"]) if sampled}
            context = [t for t, sampled in zip(e["tokens"], e["policy_mask"]) if not sampled]
            assert context == [t for obs in e["observations"] for t in obs]
            for obs in e["observations"]:
                if obs:
                    assert obs[0] == res["markers"]["<obs>"] and obs[-1] == res["markers"]["</obs>"]
            turns += e["turns"]
    assert turns > len(res["ok"]) * 3  # episodes ran more than one turn, some of them with observations
    assert any(obs for r in res["ok"] for e in r["episodes"] for obs in e["observations"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_only_the_policys_tokens_train_and_their_logprobs_are_the_actors(runs, layout):
    """policy_mask (= response_mask) is 1 exactly where the next token is one the policy
    sampled; the engine's log-probs there equal the actor's recomputed ones (each turn continues
    the trajectory), and they are 0 at the environment's tokens."""
    for r in runs[layout]["ok"]:
        rollout = r["rollout"]
        for i, e in enumerate(r["episodes"]):
            p = len(e["prompt_ids"])
            want = torch.zeros(rollout["tokens"].size(1))
            want[p - 1:p - 1 + len(e["tokens"])] = torch.tensor(e["policy_mask"], dtype=torch.float)
            assert torch.equal(rollout["policy_mask"][i], want)
        mask = rollout["policy_mask"]
        assert mask.sum() > 0 and ((rollout["logprobs"] != 0).float() <= mask).all()
        torch.testing.assert_close(rollout["logprobs"], r["recomputed"] * mask, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_kv_cache_across_turns_changes_nothing_but_what_is_computed(runs, layout):
    """The in-place engine's turn cache: each turn feeds only what its rows have not cached (the
    observation, as one chunk after the cached keys), and the episodes are the ones a run that
    computes every turn's whole trajectory again samples: the same ids (same seeds), the
    same log-probs up to float rounding."""
    reused = 0
    for cached, again in zip(runs[layout]["ok"], runs[layout]["uncached"]):
        (cache,) = cached["cache"]
        assert again["cache"] == [] and cache["capacity"] == 40
        reused += cache["reused"]
        assert [e["tokens"] for e in cached["episodes"]] == [e["tokens"] for e in again["episodes"]]
        for key in ("tokens", "lengths", "policy_mask", "env_reward"):
            assert torch.equal(cached["rollout"][key], again["rollout"][key]), key
        torch.testing.assert_close(cached["rollout"]["logprobs"], again["rollout"]["logprobs"], atol=1e-5, rtol=0)
    assert reused > 20  # later turns started from the cache (an observation chunk after cached keys)


def test_a_replica_steps_its_environments_once_and_shares_the_episodes(runs):
    tp2 = runs["tp2"]["ok"]
    assert [r["runs_environments"] for r in tp2] == [True, False]
    assert tp2[0]["environments_made"] == 6 and tp2[1]["environments_made"] == 0
    for key, value in tp2[0]["rollout"].items():
        assert value is None or torch.equal(value, tp2[1]["rollout"][key]), key
    dp2 = runs["dp2"]["ok"]  # two replicas: each steps its own share of the prompts
    assert [r["environments_made"] for r in dp2] == [3, 3]
    assert dp2[0]["metrics"] == dp2[1]["metrics"] and dp2[0]["metrics"]["env_turns_per_episode"] > 1


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_failed_episodes_train_on_nothing_and_too_many_stop_the_stage(runs, layout):
    failing = runs[layout]["failing"]
    failed = 0
    for r in failing:
        for i, e in enumerate(r["episodes"]):
            if e["failure"] is not None:
                failed += 1
                assert e["failure"] == "raised"
                assert r["rollout"]["policy_mask"][i].sum() == 0 and r["rollout"]["env_reward"][i] == 0
        assert r["too_many"] is not None and "TooManyFailedEpisodes" in r["too_many"]
        assert "rl.max_failed_episodes=0.2" in r["too_many"]
    assert failed >= 2
    assert all(r["too_many"] is None and r["metrics"]["env_failed_fraction"] == 0 for r in runs[layout]["ok"])


def test_an_moe_actors_episodes_carry_the_routes_a_fresh_prefill_takes(runs):
    """Routing replay of multi-turn episodes: each position's experts are the ones recorded by
    the turn that fed it (the turn cache's positions keep the routes of the turn they were fed
    in), so every position but perhaps a trajectory's last is routed, a forward over the whole
    trajectories at the same weights chooses the same top-k set for each of them, replaying them
    is the identity, and the stage's routing metrics are there."""
    for run in ("ok", "uncached"):
        for r in runs["moe_ep2"][run]:
            rollout, routing = r["rollout"], r["routing"]
            routes, lengths = rollout["routes"], rollout["lengths"]
            assert routes is not None and routing is not None, "the episodes' rollout has no routes"
            assert routes.dtype == torch.uint8
            assert routes.shape == (*rollout["tokens"].shape, routing["stage_layers"], 2)
            unrouted = (routes == 255).flatten(2).any(-1)  # [B, S]
            positions = torch.arange(routes.size(1))
            assert not unrouted[positions < lengths[:, None] - 1].any()
            assert unrouted[positions >= lengths[:, None]].all()  # the last token: routed if a later step fed it
            assert routing["differing"] == 0 and routing["compared"] > 0
            torch.testing.assert_close(routing["replayed"], r["recomputed"], atol=1e-6, rtol=0)
            metrics = routing["metrics"]
            assert metrics["routing_replay"] == 1.0 and metrics["routing_disagreement_max"] == 0
            assert metrics["expert_load_imbalance_mean"] >= 1.0


def test_with_experts_across_ranks_each_rank_feeds_its_own_span(runs):
    """The expert all-to-all pairs the ranks' forwards, not their positions: every turn starts
    feeding where this rank's own cache ends (not at another rank's shorter prefix, nor from
    position 0 once the other rank's episodes are all over), both ranks run as many forwards, and
    a rank whose episodes have ended takes part without rows."""
    ranks = runs["moe_ep2"]["ok"]
    calls = [r["calls"] for r in ranks]
    assert len(calls[0]) == len(calls[1]) > 2
    assert any(len(a["prompts"]) != len(b["prompts"]) for a, b in zip(*calls))  # the ranks' episodes ended apart
    assert all(c["start"] == c["own_start"] for rank_calls in calls for c in rank_calls)
    assert any(c["start"] > 0 for rank_calls in calls for c in rank_calls)  # later turns fed from the cache
    for a, b in zip(*calls):
        assert a["forward_steps"] == b["forward_steps"] > 0
    assert any(not c["prompts"] for rank_calls in calls for c in rank_calls)  # no stand-in row


# ------------------------------------------------------------------------------ units
def test_episode_routes_keep_each_positions_routes_from_the_turn_that_fed_it():
    """EpisodeRoutes: a turn's routes overwrite only the positions it routed, so the turn cache's
    positions (unrouted in a later turn's rollout) keep the routes of the turn that fed them,
    and a later turn that feeds a position again (vLLM's whole trajectory) replaces them."""
    from megatron_rlhf.rollout.episodes import EpisodeRoutes

    U = 255
    routes = EpisodeRoutes(episodes=3, capacity=6)
    first = torch.tensor([[1, 2, U], [3, U, U]], dtype=torch.uint8)[..., None, None]  # episodes 0 and 2, [2, 3, 1, 1]
    routes.add_turn(first, [0, 2])
    second = torch.tensor([[U, U, 4, 5, U]], dtype=torch.uint8)[..., None, None]  # episode 2, from the cache on
    routes.add_turn(second, [2])
    routes.add_turn(None, [1])  # an engine without routes changes nothing
    again = torch.tensor([[6, 7, 8, U]], dtype=torch.uint8)[..., None, None]  # episode 0, recomputed whole
    routes.add_turn(again, [0])
    assert routes.tensor[..., 0, 0].tolist() == [[6, 7, 8, U, U, U], [U] * 6, [3, U, 4, 5, U, U]]



def test_the_sequence_score_goes_on_the_policys_last_token_past_the_observations():
    from megatron_rlhf.algorithms.advantages import gae, token_rewards

    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    rewards = token_rewards(torch.zeros(2, 6), torch.tensor([2.0, 3.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 2, 0], [0, 0, 3, 0, 0, 0]]
    values = torch.tensor([[0.5, 0.4, 9.0, 9.0, 0.2, 0.0], [0.1, 0.2, 0.3, 0.0, 0.0, 0.0]])
    advantages, returns = gae(rewards, values * mask, mask, gamma=1.0, lam=1.0)
    # the observation tokens are skipped: the policy's tokens before them bootstrap from its next turn
    assert advantages[0].tolist() == pytest.approx([1.5, 1.6, 0, 0, 1.8, 0])
    assert returns[0, 2:4].tolist() == [0, 0]


def test_the_batchs_response_mask_has_the_episodes_gaps():
    from megatron_rlhf.rollout.batch import RolloutBatch

    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]])
    ones = torch.ones(1, 7)
    batch = RolloutBatch(tokens=torch.zeros(1, 7, dtype=torch.long), lengths=torch.tensor([6]),
                         prompt_lengths=torch.tensor([2]), mask=mask, group_ids=torch.zeros(1, dtype=torch.long),
                         old_logprobs=ones, ref_logprobs=ones, scores=torch.zeros(1))
    assert batch.response_mask(6).tolist() == [[1, 1, 0, 1, 0, 0]]


def test_a_multi_turn_rollout_keeps_its_masks_through_cat_and_select():
    from megatron_rlhf.rollout import Rollout

    def rollout(width, reward):
        policy = torch.zeros(1, width)
        policy[0, 1] = 1.0
        return Rollout(torch.ones(1, width, dtype=torch.long), torch.tensor([1]), torch.tensor([width]),
                       torch.zeros(1, width), torch.tensor([True]), policy_mask=policy, env_reward=torch.tensor([reward]))

    both = Rollout.cat([rollout(3, 1.0), rollout(5, 0.0)], pad_id=0)
    assert both.policy_mask.shape == (2, 5) and both.env_reward.tolist() == [1.0, 0.0]
    assert torch.equal(both.response_mask(), both.policy_mask)
    assert both.select(torch.tensor([1])).env_reward.tolist() == [0.0]
