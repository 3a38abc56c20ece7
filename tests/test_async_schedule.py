"""Asynchronous RL's parts that need no engine (the engine runs in tests/test_async_rl.py): the
config rules, the fixed look-ahead schedule and its checkpointed buffer (driven through a
scripted stand-in for the engine's submit/collect interface), the audit's truncation at resume,
the decoupled objective by hand, the bounded waits, the trainer/engine CPU split and the reaper
that kills an engine whose trainer was SIGKILLed."""

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from distributed import still_running
from megatron_rlhf.colocation import phases_for
from megatron_rlhf.config import ConfigError, RLConfig, load_config, validate, warnings_for
from megatron_rlhf.rollout import Rollout, SamplingParams
from megatron_rlhf.rollout.vllm_process import EngineError, PendingGeneration, timeout_call, trainer_cpus
from megatron_rlhf.trainers.rl import actor_loss
from megatron_rlhf.trainers.rl_async import AsyncRollouts, RolloutAudit

REPO = Path(__file__).resolve().parent.parent
VLLM = REPO / "pipelines/tiny_cpu_vllm.yaml"


def config(*overrides, recipe=VLLM):
    return validate(load_config(recipe, list(overrides)))


# ----------------------------------------------------------------------------- config
def test_max_staleness_needs_the_vllm_engine_and_names_both_fields():
    with pytest.raises(ConfigError, match=r"rl.max_staleness=1 with rollout.engine=megatron.*rollout.engine=vllm"):
        config("rl.max_staleness=1", "rollout.engine=megatron")
    with pytest.raises(ConfigError, match=r"rl.max_staleness=-1: must be >= 0"):
        config("rl.max_staleness=-1")
    with pytest.raises(ConfigError, match=r"rl.dynamic_sampling=true"):
        config("rl.max_staleness=1", "rl.dynamic_sampling=true", "rl.algorithm=grpo", "rl.n_samples_per_prompt=2")
    with pytest.raises(ConfigError, match=r"rollout.engine_cpus=\[1\] with rollout.engine=megatron"):
        config("rollout.engine_cpus=[1]", "rollout.engine=megatron")
    with pytest.raises(ConfigError, match=r"rollout.engine_cpus=\[1, 1\]: distinct"):
        config("rollout.engine_cpus=[1,1]")
    with pytest.raises(ConfigError, match=r"rollout.engine_timeout_seconds=0"):
        config("rollout.engine_timeout_seconds=0")
    cfg = config("rl.max_staleness=2", "rollout.engine_cpus=[1]")
    assert cfg.rl.max_staleness == 2 and list(cfg.rollout.engine_cpus) == [1]
    assert any("rl.tis_cap" in w for w in warnings_for(cfg))  # the staleness uncorrected: said at start-up
    assert not any("rl.max_staleness" in w for w in warnings_for(config("rl.max_staleness=1", "rl.tis_cap=2")))


def test_trainer_keeps_the_cpus_the_engine_does_not_take():
    allowed = sorted(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match=r"not among this process's"):
        trainer_cpus([max(allowed) + 1000])
    with pytest.raises(ConfigError, match=r"leaving none to the trainer"):
        trainer_cpus(allowed)
    if len(allowed) > 1:
        assert trainer_cpus(allowed[-1:]) == allowed[:-1]


def test_async_phases_keep_scores_roles_in_place():
    roles = {"actor": 0, "reference": 0, "reward": 0, "critic": 0}
    table = phases_for(roles, engine="vllm", asynchronous=True)
    assert table["wait"] == table["sync"] == table["generate"] == table["score"]
    assert "wait" not in phases_for(roles, engine="vllm")  # on-policy: unchanged


# ----------------------------------------------------------------------------- bounded waits
def test_a_pending_generation_returns_raises_or_times_out():
    assert PendingGeneration(lambda: 7).wait(5) == 7
    with pytest.raises(ValueError, match="boom"):
        PendingGeneration(lambda: (_ for _ in ()).throw(ValueError("boom"))).wait(5)
    start = time.perf_counter()
    with pytest.raises(EngineError, match=r"refit \(refit_end\) did not finish within rollout.engine_timeout_seconds=0.3"):
        timeout_call(lambda: time.sleep(30), 0.3, "refit (refit_end)")
    assert time.perf_counter() - start < 5


def test_the_reaper_kills_the_engine_once_the_trainer_is_sigkilled(tmp_path):
    # a stand-in trainer: starts a long-lived child (the engine's place) and the reaper, then waits
    script = textwrap.dedent(f"""
        import subprocess, sys, time, psutil
        sys.path.insert(0, {str(REPO)!r})
        from megatron_rlhf.rollout.vllm_process import start_reaper
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        start_reaper([psutil.Process(child.pid)])
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    engine_pid = int(trainer.stdout.readline())
    time.sleep(1.5)
    os.kill(engine_pid, 0)  # alive while its trainer is
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    assert not still_running([engine_pid], within=10), "the engine outlived its SIGKILLed trainer"


# ----------------------------------------------------------------------------- the schedule
@pytest.fixture(scope="module")
def one_process_group():
    """A gloo group of this process alone (the audit and the buffer ask for ranks), on a free
    port, destroyed after the module: a pytest worker runs other modules after this one."""
    if dist.is_initialized():
        yield
        return
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class ScriptedEngine:
    """The submit/collect interface of VLLMRolloutEngine, answering with rows that record which
    weights (`version`) and seed generated them; `log`: what was submitted and collected, in order."""

    def __init__(self):
        self.version, self.log, self.in_flight = 0, [], 0

    def submit(self, prompts, sampling, seed):
        assert self.in_flight == 0, "a batch was submitted while another was generating (one engine)"
        self.in_flight += 1
        self.log.append(("submit", seed, self.version))
        return SimpleNamespace(rows=len(prompts), seed=seed, version=self.version, seconds=0.0)

    def collect(self, handle):
        self.in_flight -= 1
        self.log.append(("collect", handle.seed))
        b = handle.rows
        marks = torch.tensor([[handle.version, handle.seed]] * b)
        return Rollout(marks, torch.ones(b, dtype=torch.long), torch.full((b,), 2), marks.float(),
                       torch.ones(b, dtype=torch.bool))


class Prompt:
    def __init__(self, i):
        self.ids = [i]


def schedule(tmp_path, n, steps, engine=None, audit_step=0):
    rl = RLConfig(max_staleness=n, steps=steps, rollout_batch_size=2, mini_batch_size=2, micro_batch_size=2)
    drawn = iter(range(1000))

    def draw():
        batch = [next(drawn), next(drawn)]
        return batch, batch

    return AsyncRollouts(engine or ScriptedEngine(), [Prompt(i) for i in range(1000)], draw, rl,
                         SamplingParams(), lambda k: 100 + k, RolloutAudit(tmp_path / "audit.jsonl", audit_step, n))


@pytest.mark.parametrize("n", [1, 2])
def test_batch_k_is_generated_by_version_k_minus_1_minus_n_whatever_the_timing(tmp_path, one_process_group, n):
    ahead, steps = schedule(tmp_path, n, steps=6), 6
    for step in range(1, steps + 1):
        ahead.wait_in_flight()
        ahead.engine.version = step - 1  # the refit: only with nothing in flight (ScriptedEngine checks)
        generation, batch = ahead.advance(step, version=step - 1)
        assert batch.index == step and batch.version == max(0, step - 1 - n)
        assert generation.rollout.tokens[0].tolist() == [max(0, step - 1 - n), 100 + step]  # weights, seed
        assert ahead.metrics(step, batch)["staleness"] == step - 1 - batch.version
        assert len(ahead.buffer) + (ahead.in_flight is not None) == min(n, steps - step)
    submitted = [seed - 100 for kind, seed, *_ in ahead.engine.log if kind == "submit"]
    assert submitted == list(range(1, steps + 1))  # every batch once, in order


def test_a_checkpointed_buffer_resumes_the_same_schedule(tmp_path, one_process_group):
    def run(ahead, start, stop, resume=None):
        if resume is not None:
            ahead.restore(resume)
        seen = []
        for step in range(start, stop + 1):
            ahead.wait_in_flight()
            ahead.engine.version = step - 1
            generation, batch = ahead.advance(step, version=step - 1)
            seen.append((batch.index, batch.version, batch.drawn, generation.rollout.tokens.tolist()))
        return seen

    for sub in "abc":
        (tmp_path / sub).mkdir()
    full = run(schedule(tmp_path / "a", 2, 6), 1, 6)
    first = schedule(tmp_path / "b", 2, 6)
    head = run(first, 1, 3)
    saved = first.saved_state()  # drains the batch in flight into the buffer
    assert [b["index"] for b in saved["rollout_buffer"]["batches"]] == [4, 5] and first.in_flight is None
    second = schedule(tmp_path / "b", 2, 6)
    second.draw = first.draw  # the sampler's position, as the checkpoint restores it
    assert head + run(second, 4, 6, resume=saved) == full
    with pytest.raises(ConfigError, match="rl.max_staleness=1: the checkpoint to resume holds the buffer of rl.max_staleness=2"):
        schedule(tmp_path / "c", 1, 6).restore(saved)
    with pytest.raises(ConfigError, match="written with rl.max_staleness=0"):
        schedule(tmp_path / "c", 1, 6).restore({})


def test_a_steps_rewind_snapshot_is_the_buffer_from_before_the_step(tmp_path, one_process_group):
    ahead = schedule(tmp_path, 2, 6)
    for step in (1, 2):
        ahead.wait_in_flight()
        rewind = ahead.snapshot()  # taken as the step starts; made into a state only on an error
        ahead.advance(step, version=step - 1)
    assert [b["index"] for b in rewind()["rollout_buffer"]["batches"]] == [2, 3]  # not [3]: step 2 took batch 2
    assert [b.index for b in ahead.buffer] == [3]


def test_the_audit_drops_what_a_lost_run_did_after_its_checkpoint(tmp_path, one_process_group):
    ahead = schedule(tmp_path, 1, 6)
    for step in range(1, 5):
        ahead.wait_in_flight()
        ahead.advance(step, version=step - 1)
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    RolloutAudit(tmp_path / "audit.jsonl", resumed_step=2, max_staleness=1)  # resumed from the step-2 checkpoint
    kept = (tmp_path / "audit.jsonl").read_text().splitlines()
    # the uninterrupted order: drawn 1, drawn 2, trained 1, drawn 3, trained 2 | drawn 4, trained 3, ...
    assert kept == lines[:5] and '"trained", "step": 2' in kept[-1]


# ----------------------------------------------------------------------------- the objective
def test_the_decoupled_objective_by_hand():
    # one row, three response tokens: pi (current), pi_prox (recomputed, old_logprobs), pi_behav (engine)
    pi, prox, behav = [0.5, 0.3, 0.6], [0.4, 0.3, 0.5], [0.1, 0.3, 0.6]
    adv, eps, cap = [1.0, -1.0, 2.0], 0.2, 2.0
    lp = torch.tensor([[0.0, *map(math.log, pi)]]).requires_grad_()
    mb = {"tokens": torch.zeros(1, 4, dtype=torch.long), "mask": torch.tensor([[0.0, 1, 1, 1]]),
          "old_logprobs": torch.tensor([[0.0, *map(math.log, prox)]]),
          "ref_logprobs": torch.tensor([[0.0, *map(math.log, prox)]]), "advantages": torch.tensor([[0.0, *adv]]),
          "rollout_logprobs": torch.tensor([[0.0, *map(math.log, behav)]])}
    rl = RLConfig(tis_cap=cap, clip_eps=eps, max_staleness=1, kl_coef=0.0)
    loss, units, stats = actor_loss({"logprobs": lp, "entropy": torch.zeros(1, 4)}, mb, rl, kl_coef=0.0)
    want = 0.0
    for p, q, b, a in zip(pi, prox, behav, adv):
        r, w = p / q, min(q / b, cap)  # ratio against the proximal policy; the behaviour weight, capped
        want += -w * min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
    assert int(units) == 3 and abs(float(loss) - want) < 1e-6, (float(loss), want)
    assert abs(float(stats["tis_capped_fraction"]) - 1.0) < 1e-6  # 0.4 / 0.1 = 4 > cap: one token capped
    # the objective does not depend on the staleness setting: N only changes which batch arrives
    same, _, _ = actor_loss({"logprobs": lp, "entropy": torch.zeros(1, 4)}, mb, RLConfig(tis_cap=cap, clip_eps=eps), 0.0)
    assert torch.equal(same, loss)
