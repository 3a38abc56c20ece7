"""Every tensor the trainers build follows the device of the role outputs it combines with.

Production runs NCCL on CUDA; this machine has no GPU. FakeTensorMode creates "cuda" tensors
on CPU-only torch and raises FakeTensorDeviceMismatchError wherever a CPU tensor meets a CUDA
one, so the SFT, RM and PPO glue and math (everything between the role outputs and the loss,
advantage and metric values) runs here as it would on a GPU: role outputs, rollouts and the
train batch are "cuda", collated data arrives from the host as the data loader makes it.
Host reads (`.item()`, `.tolist()`) and backward passes (the autograd engine wants a real CUDA
context) cannot run on fake tensors: the glue hands its values to `stack_values` and the test
checks that the vector a collective would reduce is on the device; losses are checked to carry
a gradient graph (the backward ops follow the forward ones' devices).
"""

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

from megatron_rlhf.algorithms.advantages import ESTIMATORS, valid_rows
from megatron_rlhf.config import LOSS_AGGREGATIONS, RLConfig
from megatron_rlhf.parallel.collectives import check_backend_device, masked_moments, stack_values
from megatron_rlhf.rewards import weighted_sum
from megatron_rlhf.rollout import Rollout
from megatron_rlhf.rollout.batch import RolloutBatch
from megatron_rlhf.trainers import rl as rl_stage
from megatron_rlhf.trainers.rl_metrics import iteration_sums
from megatron_rlhf.trainers.rl_records import Iteration
from megatron_rlhf.trainers.rm import bradley_terry_loss
from megatron_rlhf.trainers.sft import response_nll, sft_loss

B, S, NEW = 4, 12, 6
CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake():
    with FakeTensorMode():
        yield


def on_cuda(**tensors):
    for name, t in tensors.items():
        assert t.device == CUDA, f"{name} is on {t.device}"


def rollout() -> Rollout:
    prompt_lengths = torch.tensor([3, 4, 2, 5], device=CUDA)
    lengths = prompt_lengths + torch.tensor([6, 2, 5, 1], device=CUDA)
    return Rollout(tokens=torch.randint(0, 50, (B, S), device=CUDA), prompt_lengths=prompt_lengths,
                   lengths=lengths, logprobs=torch.randn(B, S, device=CUDA), finished=lengths < 10)


def rl_batch(cfg: RLConfig) -> tuple[Rollout, RolloutBatch]:
    """What the score phase makes of a rollout (rl_stage.score without the role forwards)."""
    r = rollout()
    mask = r.response_mask()
    scores = rl_stage.clip_scores(torch.randn(B, device=CUDA), r, cfg)
    return r, RolloutBatch(
        tokens=r.tokens, lengths=r.lengths, prompt_lengths=r.prompt_lengths, mask=mask,
        group_ids=torch.arange(B, device=CUDA) // cfg.n_samples_per_prompt,
        old_logprobs=torch.randn(B, S, device=CUDA) * mask, ref_logprobs=torch.randn(B, S, device=CUDA) * mask,
        scores=scores, values=torch.randn(B, S, device=CUDA) * mask if cfg.has_critic else None)


ALGORITHM_SETTINGS = {
    "ppo": {}, "grpo": {"n_samples_per_prompt": 2, "importance_ratio": "sequence"},
    "rloo": {"n_samples_per_prompt": 2, "dual_clip": 3.0}, "reinforce_pp": {"clip_eps_high": 0.28},
    "reinforce_pp_baseline": {"n_samples_per_prompt": 2}, "batch_mean": {},
}


@pytest.mark.parametrize("algorithm", sorted(ESTIMATORS))
@pytest.mark.parametrize("kl_in_reward", [True, False])
def test_rl_glue_and_math_stay_on_the_device(fake, algorithm, kl_in_reward):
    cfg = RLConfig(algorithm=algorithm, missing_eos_penalty=-1.0, kl_in_reward=kl_in_reward,
                   kl_estimator="k1" if kl_in_reward else "k3", entropy_coef=0.01, **ALGORITHM_SETTINGS[algorithm])
    r, batch = rl_batch(cfg)
    on_cuda(**batch.tensors())
    kl_stats = rl_stage.add_advantages(batch, cfg, kl_coef=0.05, max_new_tokens=NEW)
    on_cuda(**batch.tensors(), **kl_stats)
    assert (batch.returns is not None) == cfg.has_critic

    outputs = {"logprobs": torch.randn(B, S, device=CUDA, requires_grad=True),
               "entropy": torch.rand(B, S, device=CUDA), "values": torch.randn(B, S, device=CUDA, requires_grad=True)}
    for mode in LOSS_AGGREGATIONS:
        loss, units, stats = rl_stage.actor_loss(outputs, batch.tensors(),
                                                 dataclasses.replace(cfg, loss_aggregation=mode), kl_coef=0.05)
        on_cuda(loss=loss, units=units, **stats)
        assert loss.requires_grad
        if cfg.has_critic:
            loss, units, stats = rl_stage.critic_loss(outputs, batch.tensors(), cfg)
            on_cuda(loss=loss, units=units, **stats)
            assert loss.requires_grad

    sums = iteration_sums(Iteration(r, batch, kl_stats, sampling={"sampling_rounds": 2, "sampling_shortfall": 1}),
                          gold=1.5, repetition=0.25)
    on_cuda(reduced=stack_values(sums, CUDA))


def test_reward_sources_combine_on_the_device(fake):
    """A service's or rule's scores arrive from the host (on_replica_leader puts them on the
    device); the weighted sum, the clip and the per-source sums stay there."""
    cfg = RLConfig(missing_eos_penalty=-1.0)
    r, batch = rl_batch(cfg)
    per_source = {"rm": torch.randn(B, device=CUDA), "exact": torch.tensor([1.0, 0.0, 1.0, 1.0], device=CUDA)}
    total = rl_stage.clip_scores(weighted_sum(per_source, {"rm": 1.0, "exact": 0.5}), r, cfg)
    on_cuda(total=total)
    kl_stats = rl_stage.add_advantages(batch, cfg, kl_coef=0.05, max_new_tokens=NEW)
    sums = iteration_sums(Iteration(r, batch, kl_stats, sampling={}, per_source=per_source), gold=1.0, repetition=0.0)
    assert {"reward_rm", "reward_exact"} <= sums.keys()
    on_cuda(reduced=stack_values(sums, CUDA))


def test_mismatch_correction_stays_on_the_device(fake):
    cfg = RLConfig(tis_cap=2.0, mismatch_mask_threshold=2.0)
    r, batch = rl_batch(cfg)
    batch.rollout_logprobs = r.logprobs * batch.mask
    rl_stage.add_advantages(batch, cfg, kl_coef=0.05, max_new_tokens=NEW)
    outputs = {"logprobs": torch.randn(B, S, device=CUDA, requires_grad=True), "entropy": torch.rand(B, S, device=CUDA)}
    loss, units, stats = rl_stage.actor_loss(outputs, batch.tensors(), cfg, kl_coef=0.05)
    on_cuda(loss=loss, units=units, **stats)
    assert {"tis_weight_mean", "mismatch_masked_fraction"} <= set(stats)


def test_response_layout_helpers_follow_their_inputs(fake):
    r, batch = rl_batch(RLConfig())
    x = torch.randn(B, S, device=CUDA)
    sliced = batch.response(x, NEW)
    back = batch.sequence(sliced)
    on_cuda(sliced=sliced, back=back, mask=batch.response_mask(NEW), lengths=r.response_lengths(),
            selected=batch.select(torch.tensor([2, 0], device=CUDA)).tokens)


def test_dynamic_sampling_selection_stays_on_the_device(fake):
    scores = torch.randn(B, device=CUDA)
    informative = rl_stage.group_informative(scores, 2, valid_rows(rollout().response_mask()))
    on_cuda(informative=informative)
    joined = Rollout.cat([rollout(), rollout()], pad_id=1).select(torch.tensor([0, 1, 6, 7], device=CUDA))
    on_cuda(**{k: v for k, v in vars(joined).items() if v is not None})  # routes: none recorded


def test_sft_glue_stays_on_the_device(fake):
    logprobs = torch.randn(B, S, device=CUDA, requires_grad=True)
    loss_mask = (torch.rand(B, S) > 0.5).float()  # as collate_sft makes it: on the host
    nll, tokens = response_nll(logprobs, loss_mask)  # evaluation: outputs meet host data
    on_cuda(nll=nll, tokens=tokens, reduced=stack_values({"nll": nll, "tokens": tokens}, CUDA))
    loss, units, _ = sft_loss({"logprobs": logprobs}, {"loss_mask": loss_mask.to(CUDA)})
    on_cuda(loss=loss, units=units)
    assert loss.requires_grad


def test_rm_glue_stays_on_the_device(fake):
    rewards = torch.randn(2 * B, device=CUDA, requires_grad=True)
    loss, units, stats = bradley_terry_loss({"rewards": rewards}, {})
    on_cuda(loss=loss, units=units, **stats)
    assert loss.requires_grad
    count, mean, var = masked_moments(rewards.detach(), torch.ones_like(rewards))  # reward normalisation
    on_cuda(count=count, mean=mean, var=var)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_glue_stays_on_the_device(fake, loss):
    """The DPO loss (the reference's sums as either source hands them over) and the eval's
    reduction vector on the device; the reference table lookup on the table's device."""
    from megatron_rlhf.config import DPOConfig
    from megatron_rlhf.trainers.dpo import ReferenceSource, pair_loss

    logprobs = torch.randn(2 * B, S, device=CUDA, requires_grad=True)
    loss_mask = (torch.rand(2 * B, S) > 0.5).float()  # as collate_preferences makes it: on the host
    table = torch.randn(10, 2, device=CUDA)  # precomputed: [pairs, (chosen, rejected)] on the device
    ref = ReferenceSource(None, {"train": table}, micro_rows=4)("train", [3, 1, 7, 0], {})
    on_cuda(ref=ref)
    for ref_logps in (ref, ref.cpu()):  # train_step moves the batch to the device; eval passes it as it is
        total, units, stats = pair_loss({"logprobs": logprobs}, {"loss_mask": loss_mask, "ref_logps": ref_logps},
                                        DPOConfig(loss=loss, sft_weight=0.1))
        on_cuda(loss=total, units=units, **stats, reduced=stack_values({"loss": total, "pairs": units, **stats}, CUDA))
        assert total.requires_grad


def test_a_host_tensor_among_device_values_is_caught(fake):
    """The old `all_reduce_sum` built its tensor on the host; a host tensor handed to the
    reduction next to device values fails here as it would on a GPU."""
    with pytest.raises(ValueError, match="on_host: a cpu tensor among values for a collective on cuda"):
        stack_values({"on_device": torch.ones((), device=CUDA), "on_host": torch.ones(())}, CUDA)
    with pytest.raises(FakeTensorDeviceMismatchError):  # the old response_slice: arange on the host
        x = torch.randn(B, S, device=CUDA)
        x.gather(1, rollout().prompt_lengths[:, None].cpu() - 1 + torch.arange(NEW))


def test_nccl_refuses_host_tensors_with_a_clear_error():
    check_backend_device(torch.ones(2), "gloo")
    with pytest.raises(ValueError, match="NCCL collective on a cpu tensor"):
        check_backend_device(torch.ones(2), "nccl")
    with FakeTensorMode():
        check_backend_device(torch.ones(2, device=CUDA), "nccl")


def test_expert_and_sequence_parallel_glue_stays_on_the_device(fake):
    """Role glue for MoE routers and sequence parallelism (models/roles.py): the padding mask,
    the routed-token count, the units of the load-balancing scale (from the loss function on
    zero outputs), the sequence-parallel padding and the cut back to width follow the batch."""
    from functools import partial

    from megatron_rlhf.models.microbatches import (
        loss_units, pad_for_sequence_parallel, padding_positions, routed_tokens, to_width,
    )

    cfg = RLConfig(algorithm="grpo", n_samples_per_prompt=2, kl_in_reward=False, kl_estimator="k3")
    _, batch = rl_batch(cfg)
    rl_stage.add_advantages(batch, cfg, kl_coef=0.05, max_new_tokens=NEW)
    rows = batch.tensors()
    on_cuda(padding=padding_positions(batch.lengths, S), routed=routed_tokens(rows),
            routed_without_lengths=routed_tokens({"tokens": batch.tokens}),
            units=loss_units(partial(rl_stage.actor_loss, rl=cfg, kl_coef=0.05), rows,
                             {"logprobs": torch.Size([B, S]), "entropy": torch.Size([B, S])}))
    odd = {k: v[:, : S - 1] if v.dim() == 2 else v for k, v in rows.items()}
    padded = pad_for_sequence_parallel([odd, {"tokens": batch.tokens[:, : S - 1]}], tp=2)
    for mb in padded:
        on_cuda(**mb)
        assert mb["tokens"].size(1) == S
    on_cuda(cut=to_width(padded[0]["mask"], S - 1))


def test_microbatches_are_halved_to_the_count_an_expert_group_agrees_on():
    from megatron_rlhf.models.microbatches import split_rows

    assert split_rows([4, 1], 4) == [1, 1, 2, 1]  # the largest first, in place: rows stay in order
    assert split_rows([3], 3) == [1, 1, 1]
    with pytest.raises(ValueError, match="equal shares"):
        split_rows([1, 1], 3)


def test_routing_replay_glue_stays_on_the_device(fake):
    """Rollout routing replay (models/routing.py): the routes a rollout records per decoding step,
    the replay targets of a microbatch (a sequence-parallel rank's slice too), the top-k set
    comparison, the expert loads and the rollout's selection and concatenation (dynamic sampling)
    all stay where the routes are; only the iteration's metrics are read on the host."""
    from megatron_rlhf.models.routing import RoleRouterReplay, RoutingReplay, expert_load

    routers = RoutingReplay([RoleRouterReplay(1), RoleRouterReplay(2)], num_experts=4, topk=2)
    routes = routers.new_routes(B, S, CUDA)
    for router in routers.routers:  # what megatron's routers record for a 2-position step: [2 * B, k]
        router.recorded_topk_idx = torch.zeros(2 * B, 2, dtype=torch.long, device=CUDA)
    routers.write_step(routes, 3, 5)
    lengths = torch.full((B,), S, device=CUDA)
    targets, routed = routers.targets(routes, lengths, (1, 2))
    on_cuda(routes=routes, routed=routed, load=expert_load(routes, 4), **{f"targets_{i}": t for i, t in enumerate(targets)})
    for router in routers.routers:  # a whole-sequence forward's choices: [S * B, k]
        router.recorded_topk_idx = torch.zeros(S * B, 2, dtype=torch.long, device=CUDA)
    routers.compare(routes, lengths, None)
    on_cuda(**routers.take_disagreement(sequence_parallel=False))
    r = dataclasses.replace(rollout(), routes=routes)
    both = Rollout.cat([r, r.select(torch.tensor([1, 0], device=CUDA))], pad_id=0)
    on_cuda(selected=r.select(torch.tensor([2, 3], device=CUDA)).routes, concatenated=both.routes)


def test_episode_routes_stay_on_the_device(fake):
    """A multi-turn rollout's routes (rollout/episodes.py: EpisodeRoutes), put together from the
    turns' routes on the device, stay there."""
    from megatron_rlhf.rollout.episodes import EpisodeRoutes

    routes = EpisodeRoutes(episodes=B, capacity=S)
    routes.add_turn(torch.zeros(2, 5, 3, 2, dtype=torch.uint8, device=CUDA), [1, 3])
    routes.add_turn(torch.ones(1, 7, 3, 2, dtype=torch.uint8, device=CUDA), [3])
    on_cuda(routes=routes.tensor)


def test_vllm_routes_land_on_the_device(fake):
    """The vLLM engine's rollout (rollout/vllm_engine.py: `_to_rollout`) with each request's routed
    experts (numpy, as vLLM returns them): the routes land on the actor's device with the rest,
    and a pipeline stage's layer selection stays there."""
    from types import SimpleNamespace

    import numpy as np

    from megatron_rlhf.config import load_config
    from megatron_rlhf.models.routing import RoleRouterReplay, RoutingReplay
    from megatron_rlhf.rollout.vllm_engine import VLLMRolloutEngine, stage_routes

    m = load_config("pipelines/tiny_cpu.yaml", ["model.family=mixtral", "model.num_experts=4", "model.moe_router_topk=2",
                                                "model.num_layers=4", "model.moe_dense_layers=[1]"]).model
    engine = object.__new__(VLLMRolloutEngine)
    engine.model, engine.eos_id, engine.pad_id, engine.returns_routes = m, 1, 0, True
    prompts, responses = [[5, 6, 7], [8, 9]], [[3, 4, 1], [2]]
    completions = [SimpleNamespace(token_ids=r, finish_reason="stop", logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in r],
                                   routed_experts=np.zeros((len(p) + len(r) - 1, 4, 2), dtype=np.uint8))
                   for p, r in zip(prompts, responses)]
    r = engine._to_rollout(prompts, completions, CUDA)
    stage = stage_routes(r.routes, RoutingReplay([RoleRouterReplay(3), RoleRouterReplay(4)], num_experts=4, topk=2), m)
    on_cuda(routes=r.routes, tokens=r.tokens, stage=stage)
    assert r.routes.shape == (2, 6, 3, 2) and stage.shape == (2, 6, 2, 2)
