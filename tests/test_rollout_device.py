"""The rollout's per-token work stays on the actor's device: sampling (`sample_next`) and the
bookkeeping after it (`Decoding.record`, `Rollout` helpers) run on "cuda" tensors under
FakeTensorMode (CPU-only torch; mixing devices raises there), the sampling generator must be
on the logits' device, and on CPU the samples are exactly those of the previous host path."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

from megatron_rlhf.rollout import Rollout, SamplingParams, sample_next
from megatron_rlhf.rollout.base import filter_logits
from megatron_rlhf.rollout.megatron_engine import Decoding

CUDA = torch.device("cuda", 0)
SAMPLINGS = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9), SamplingParams(), SamplingParams(greedy=True),
             SamplingParams(temperature=1.3, top_p=0.5), SamplingParams(top_k=1)]


class FakeCudaGenerator(torch.Generator):
    """A generator that says it is on cuda:0 (CPU-only torch cannot make a real one); fake
    tensors never read its state."""

    device = CUDA


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
def test_sample_next_stays_on_the_logits_device(sampling):
    with FakeTensorMode():
        ids, logprob = sample_next(torch.randn(6, 50, device="cuda"), FakeCudaGenerator().manual_seed(0), sampling)
    assert ids.device == CUDA and ids.dtype == torch.long and ids.shape == (6,)
    assert logprob.device == CUDA and logprob.dtype == torch.float32 and logprob.shape == (6,)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
def test_sample_next_refuses_a_generator_on_another_device(sampling):
    # FakeTensorMode lets torch.multinomial take a CPU generator with cuda probabilities, so
    # only sample_next's own check stops it (greedy too: the contract does not depend on mode).
    with FakeTensorMode(), pytest.raises(ValueError, match="generator is on cpu"):
        sample_next(torch.randn(6, 50, device="cuda"), torch.Generator().manual_seed(0), sampling)
    with pytest.raises(ValueError, match="generator is on cuda"):
        sample_next(torch.randn(6, 50), FakeCudaGenerator(), sampling)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
def test_sample_next_on_cpu_equals_the_host_path(sampling):
    """Same seed, same tokens as before (multinomial over the filtered softmax on a CPU
    generator), step after step; the log-prob is the unfiltered tempered softmax's."""
    logits = torch.randn(5, 8, 64, generator=torch.Generator().manual_seed(1)) * 3
    new, old = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for step in logits:
        ids, logprob = sample_next(step, new, sampling)
        scaled = step / sampling.temperature
        if sampling.greedy:
            want = scaled.argmax(-1)
        else:
            probs = filter_logits(scaled, sampling.top_k, sampling.top_p).softmax(-1)
            want = torch.multinomial(probs, 1, generator=old).squeeze(-1)
        assert torch.equal(ids, want)
        assert torch.equal(logprob, scaled.log_softmax(-1).gather(-1, want[:, None]).squeeze(-1))


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [14, 15]]
EOS, PAD, NEW = 1, 0, 4


def decode(dev: torch.device, script: list[list[int]]) -> Decoding:
    """Run the bookkeeping of generate() with scripted samples instead of a model."""
    total = max(map(len, PROMPTS)) + NEW
    state = Decoding.start(PROMPTS, total, PAD, dev)
    for step, pos in enumerate(range(min(map(len, PROMPTS)), total)):
        sampled = torch.tensor(script[step], device=dev)
        state.record(pos, sampled, -torch.arange(1.0, 4.0, device=dev) - pos, EOS, PAD, NEW)
    return state


SCRIPT = [[20, 30, 40], [21, 31, EOS], [22, 32, 42], [EOS, 33, 43], [24, 34, 44], [25, 35, 45], [26, 36, 46]]


def test_bookkeeping_never_mixes_devices():
    with FakeTensorMode():
        state = decode(CUDA, SCRIPT)
        rollout = Rollout(state.tokens, state.prompt_lengths, state.lengths, state.logprobs, state.finished)
        derived = [rollout.response_mask(), rollout.response_lengths()]
        for t in [*vars(state).values(), *derived]:
            assert t.device == CUDA
        with pytest.raises(FakeTensorDeviceMismatchError):  # the check has teeth: a host sample is caught
            state.record(3, torch.tensor([1, 2, 3]), None, EOS, PAD, NEW)


def test_bookkeeping_stops_rows_at_eos_or_budget_and_pads_the_rest():
    s = decode(torch.device("cpu"), SCRIPT)
    assert s.tokens.tolist() == [[5, 6, 7, 21, 22, EOS, PAD, PAD, PAD],  # EOS as 3rd new token
                                 [8, 9, 10, 11, 12, 33, 34, 35, 36],     # budget of 4 new tokens
                                 [14, 15, 40, EOS, PAD, PAD, PAD, PAD, PAD]]
    assert s.lengths.tolist() == [6, 9, 4] and s.finished.tolist() == [True, False, True]
    assert s.done.all()
    want = torch.zeros(3, 9)
    want[0, 2:5] = torch.tensor([-4.0, -5, -6])  # row r at position t: -(r + 1) - (t + 1)
    want[1, 4:8] = torch.tensor([-7.0, -8, -9, -10])
    want[2, 1:3] = torch.tensor([-5.0, -6])
    assert torch.equal(s.logprobs, want)
    rollout = Rollout(s.tokens, s.prompt_lengths, s.lengths, s.logprobs, s.finished)
    assert torch.equal(rollout.response_mask(), (want != 0).float())
    assert rollout.response_ids() == [[21, 22, EOS], [33, 34, 35, 36], [40, EOS]]
