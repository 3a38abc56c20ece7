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

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

from megatron_rlhf.algorithms import ppo as alg
from megatron_rlhf.config import PPOConfig
from megatron_rlhf.parallel.collectives import check_backend_device, masked_moments, stack_values
from megatron_rlhf.rollout import Rollout
from megatron_rlhf.trainers import ppo as ppo_stage
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


def ppo_batch(cfg: PPOConfig) -> dict:
    r = rollout()
    actor_out = {"logprobs": torch.randn(B, S, device=CUDA), "entropy": torch.rand(B, S, device=CUDA)}
    return r, ppo_stage.assemble_batch(r, actor_out, ref_logprobs=torch.randn(B, S, device=CUDA),
                                       values=torch.randn(B, S, device=CUDA),
                                       scores=torch.randn(B, device=CUDA), ppo=cfg)


@pytest.mark.parametrize("kl_in_reward", [True, False])
def test_ppo_glue_and_math_stay_on_the_device(fake, kl_in_reward):
    cfg = PPOConfig(max_new_tokens=NEW, missing_eos_penalty=-1.0, kl_in_reward=kl_in_reward,
                    kl_estimator="k1" if kl_in_reward else "k3", entropy_coef=0.01)
    r, batch = ppo_batch(cfg)
    on_cuda(**batch)
    kl_stats = ppo_stage.add_advantages(batch, cfg, kl_coef=0.05)
    on_cuda(advantages=batch["advantages"], returns=batch["returns"], **kl_stats)

    outputs = {"logprobs": torch.randn(B, S, device=CUDA, requires_grad=True),
               "entropy": torch.rand(B, S, device=CUDA), "values": torch.randn(B, S, device=CUDA, requires_grad=True)}
    for mode in alg.LOSS_AGGREGATIONS:
        cfg.loss_aggregation = mode
        loss, units, stats = ppo_stage.actor_loss(outputs, batch, cfg, kl_coef=0.05)
        on_cuda(loss=loss, units=units, **stats)
        assert loss.requires_grad
        loss, units, stats = ppo_stage.critic_loss(outputs, batch, cfg)
        on_cuda(loss=loss, units=units, **stats)
        assert loss.requires_grad

    sums = ppo_stage.iteration_sums(r, batch, kl_stats, gold=1.5, repetition=0.25)
    on_cuda(reduced=stack_values(sums, CUDA))


def test_response_layout_helpers_follow_their_inputs(fake):
    r = rollout()
    x = torch.randn(B, S, device=CUDA)
    sliced = ppo_stage.response_slice(x, r.prompt_lengths, NEW)
    back = ppo_stage.response_unslice(sliced, r.prompt_lengths, S)
    on_cuda(sliced=sliced, back=back, mask=r.response_mask(), lengths=r.response_lengths())


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
