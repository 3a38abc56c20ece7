"""Environment and reward calls that must not take a run down (issue 53): a server that trickles
its answer meets a deadline per request (environment and reward service clients); a turn's
environment steps run at the same time (a bounded pool, hung calls replaced, one wait per turn,
results in episode order), one at a time for a class that is not thread-safe; whatever user code
raises (SystemExit, KeyboardInterrupt, ...) fails its episode or its reward source, while a
signal's StageInterrupted ends the wait at once; an environment's constructor failing mid-run
fails episodes; rl.max_failed_episodes holds for the eval. In-process, on loopback servers."""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import torch

from megatron_rlhf.config import ConfigError
from megatron_rlhf.config.rl import EnvironmentConfig
from megatron_rlhf.data.encode import EncodedPrompt
from megatron_rlhf.data.jsonl import PromptExample
from megatron_rlhf.data.tasks import get_task
from megatron_rlhf.data.tokenizers import WordTokenizer
from megatron_rlhf.envs import Environment, EnvironmentServiceDown, EnvStart, EpisodeRunner, TooManyFailedEpisodes
from megatron_rlhf.envs.base import RAISED, TIMED_OUT
from megatron_rlhf.envs.calculator import TURN_TEMPLATE, CalculatorEnv
from megatron_rlhf.envs.http import SCHEMA, HttpEnvironmentService
from megatron_rlhf.envs.loading import environment_factory
from megatron_rlhf.envs.pool import run_calls
from megatron_rlhf.envs.server import serving_environment
from megatron_rlhf.resilience.preemption import StageInterrupted
from megatron_rlhf.rewards.base import RewardInputs, RewardSourceError
from megatron_rlhf.rewards.function import FunctionReward
from megatron_rlhf.rewards.http import SCHEMA as REWARD_SCHEMA
from megatron_rlhf.rewards.http import HttpRewardClient
from megatron_rlhf.rollout import Rollout, SamplingParams
from megatron_rlhf.rollout.episodes import EpisodeEngine

TASK = get_task("calculator")
TOKENIZER = WordTokenizer(TASK.words())
RECORD = {"prompt": "what is 3 4 7 * 2 1", "answer": "7287"}
CALL, ANSWER = "<calc> 3 4 7 * 2 1 </calc>", "answer 7 2 8 7"


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text)


def runner(factory, step_timeout_s: float = 2.0, **kwargs) -> EpisodeRunner:
    return EpisodeRunner(factory, TOKENIZER, TURN_TEMPLATE, max_turns=4, max_total_tokens=64,
                         step_timeout_s=step_timeout_s, **kwargs)


def batch(run: EpisodeRunner, n: int, turn: str = CALL):
    """n episodes of RECORD started, and one turn `turn` of each: (episodes, the turn's seconds)."""
    episodes = run.start_all([dict(RECORD, index=i) for i in range(n)], [ids(RECORD["prompt"])] * n)
    start = time.monotonic()
    run.policy_turns(episodes, [ids(turn)] * n)
    return episodes, time.monotonic() - start


# ----------------------------------------------------------------------------- a server that trickles (item 2)


@contextmanager
def trickling(answers: dict[str, dict], slow: set[str], interval_s: float = 0.1, give_up_s: float = 3.0):
    """A loopback HTTP/1.1 server answering POST <path> with answers[path] at once, except the
    paths in `slow`: their answer, status line first, one byte every `interval_s` (far inside any
    per-read timeout), for at most `give_up_s`, then the connection closes unfinished."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as stream:
            while request := stream.readline():
                path, length = request.split()[1].decode(), 0
                while (header := stream.readline()) not in (b"\r\n", b""):
                    if header.lower().startswith(b"content-length:"):
                        length = int(header.split(b":")[1])
                stream.read(length)
                body = json.dumps(answers[path]).encode()
                answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
                    len(body), body)
                try:
                    if path not in slow:
                        conn.sendall(answer)
                        continue
                    end = time.monotonic() + give_up_s
                    for byte in answer:
                        if time.monotonic() > end:
                            return
                        conn.sendall(bytes([byte]))
                        time.sleep(interval_s)
                except OSError:  # the client gave up
                    return

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def test_an_environment_service_that_trickles_its_answer_times_out_at_step_timeout_s():
    """Bound: a step with step_timeout_s=1 against a server sending one byte every 0.1 s ends
    TIMED_OUT within 1.5 s (before: httpx's per-read timeout never tripped; the step waited for
    as long as the server trickled, here until it gave up after 3 s)."""
    answers = {"/reset": {"schema": SCHEMA, "episode_id": "e1", "observation": None},
               "/step": {"schema": SCHEMA, "observation": None, "done": True, "reward": 1.0},
               "/close": {"schema": SCHEMA}}
    with trickling(answers, slow={"/step"}) as url:
        service = HttpEnvironmentService(url, step_timeout_s=1.0, max_retries=0)
        (episode,), seconds = batch(runner(service), 1, ANSWER)
        service.close()
    assert episode.failure == TIMED_OUT and "step_timeout_s=1.0" in episode.failure_detail, episode.failure_detail
    assert 0.9 < seconds < 1.5, seconds


def test_a_reward_service_that_trickles_its_answer_times_out_each_attempt_at_timeout_s():
    """Bound: timeout_s=0.5 and one retry against a server sending one byte every 0.1 s: the
    RewardSourceError (ReadTimeout) comes within 1.5 s, two attempts of 0.5 s and the backoff
    (before: each attempt lasted until the server gave up after 3 s, RemoteProtocolError)."""
    with trickling({"/score": {"schema": REWARD_SCHEMA, "scores": [1.0]}}, slow={"/score"}) as url:
        start = time.monotonic()
        with HttpRewardClient(f"{url}/score", timeout_s=0.5, max_retries=1, backoff_s=0.05, max_backoff_s=0.05) \
                as client, pytest.raises(RewardSourceError, match="ReadTimeout.*timeout_s=0.5"):
            client.score(RewardInputs(["p"], ["r"], [[3]], [[4]], [True]))
        assert time.monotonic() - start < 1.5


# ----------------------------------------------------------------------------- a turn's steps at once (item 7)


class Sleepy(CalculatorEnv):
    """The calculator, `delay_s` per step (the episode's record can set its own)."""

    delay_s = 0.2

    def step(self, action_text, action_ids):
        time.sleep(self.record.get("delay_s", self.delay_s))
        return super().step(action_text, action_ids)


class Hanging(CalculatorEnv):
    def step(self, action_text, action_ids):
        time.sleep(3.0)  # far past step_timeout_s; the abandoned thread ends after this
        return super().step(action_text, action_ids)


class NotThreadSafe(CalculatorEnv):
    """Declares its instances unsafe to run at the same time; records how many ran at once."""

    thread_safe = False
    lock, running, most, order = threading.Lock(), 0, 0, []

    def step(self, action_text, action_ids):
        cls = type(self)
        with cls.lock:
            cls.running += 1
            cls.most = max(cls.most, cls.running)
            cls.order.append(self.record["index"])
        time.sleep(0.02)
        with cls.lock:
            cls.running -= 1
        return super().step(action_text, action_ids)


def test_a_turns_steps_run_at_the_same_time_and_apply_in_episode_order():
    """8 episodes of 0.2 s steps: one turn in ~0.2 s, not 1.6 s. The steps finish in reverse
    order (the first sleeps longest): each episode still gets its own answer, and the episodes
    equal those of one-at-a-time stepping (workers=1)."""
    run = runner(Sleepy)
    records = [dict(RECORD, index=i, delay_s=0.03 * (8 - i)) for i in range(8)]
    episodes = run.start_all(records, [ids(RECORD["prompt"])] * 8)
    start = time.monotonic()
    run.policy_turns(episodes, [ids(f"<calc> {i} + 1 </calc>") for i in range(8)])
    assert time.monotonic() - start < 0.8  # the slowest step is 0.24 s; one at a time: 1.1 s
    assert [e.turns[0].observation_ids for e in episodes] == [ids(f"<obs> {i + 1} </obs>") for i in range(8)]
    serial = runner(Sleepy, workers=1)
    again = serial.start_all(records, [ids(RECORD["prompt"])] * 8)
    serial.policy_turns(again, [ids(f"<calc> {i} + 1 </calc>") for i in range(8)])
    assert [(e.tokens, e.policy_mask) for e in again] == [(e.tokens, e.policy_mask) for e in episodes]


def test_steps_that_all_hang_cost_one_step_timeout_per_turn_not_one_per_episode():
    """The issue's drill at test size: every step hangs, step_timeout_s=0.5, 8 episodes. Before,
    each waited its turn (8 x 0.5 = 4 s); now the turn ends after ~0.5 s, every episode timed out."""
    episodes, seconds = batch(runner(Hanging, step_timeout_s=0.5), 8)
    assert all(e.failure == TIMED_OUT and "Hanging.step gave no answer" in e.failure_detail for e in episodes)
    assert seconds < 1.2, seconds


def test_a_class_that_is_not_thread_safe_runs_one_call_at_a_time_in_episode_order():
    NotThreadSafe.most, NotThreadSafe.order = 0, []
    factory = environment_factory(EnvironmentConfig(type="class",
                                                    class_path="megatron_rlhf/envs/calculator.py:CalculatorEnv"))
    assert runner(factory).workers == CalculatorEnv.concurrency  # the shipped environment is thread-safe
    run = runner(NotThreadSafe)
    assert run.workers == 1
    episodes, _ = batch(run, 6)
    assert NotThreadSafe.most == 1 and NotThreadSafe.order == list(range(6))
    assert all(e.failure is None and e.turns[0].observation_ids == ids("<obs> 7 2 8 7 </obs>") for e in episodes)


def test_the_pool_replaces_hung_calls_and_keeps_every_outcome_in_order():
    """Two workers, two calls that hang (0.3 s timeout) ahead of four quick ones: the hung
    calls' threads are replaced, so the quick ones run; ~0.3 s in all. BaseExceptions are
    outcomes, not the caller's."""
    calls = [lambda: time.sleep(2.0)] * 2 + [lambda: 1, lambda: sys.exit(3), lambda: 3, lambda: 4]
    start = time.monotonic()
    outcomes = run_calls(calls, workers=2, timeout_s=0.3)
    assert time.monotonic() - start < 0.8
    assert [o.timed_out for o in outcomes] == [True, True, False, False, False, False]
    assert [o.value for o in outcomes[2:]] == [1, None, 3, 4]
    assert isinstance(outcomes[3].error, SystemExit) and outcomes[3].error.code == 3


def test_a_service_down_stops_the_turn_without_waiting_for_the_other_steps():
    class Down(CalculatorEnv):
        def step(self, action_text, action_ids):
            if self.record["index"] == 3:
                raise EnvironmentServiceDown("environment service POST http://x/step: no answer")
            time.sleep(2.0)
            return super().step(action_text, action_ids)

    start = time.monotonic()
    with pytest.raises(EnvironmentServiceDown):
        batch(runner(Down, step_timeout_s=5.0), 4)
    assert time.monotonic() - start < 1.0


@contextmanager
def sigterm_in(seconds: float):
    """SIGALRM after `seconds`, its handler raising StageInterrupted in the main thread, as the
    stage's SIGTERM handler does (resilience/preemption.py)."""
    def interrupt(signum, frame):
        raise StageInterrupted("SIGTERM", "the test")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_signal_ends_the_wait_for_hung_steps_at_once():
    run = runner(Hanging, step_timeout_s=30.0)
    episodes = run.start_all([RECORD] * 4, [ids(RECORD["prompt"])] * 4)
    start = time.monotonic()
    with sigterm_in(0.2), pytest.raises(StageInterrupted):
        run.policy_turns(episodes, [ids(CALL)] * 4)
    assert time.monotonic() - start < 0.7


# ----------------------------------------------------------------------------- user code's BaseExceptions (item 4)


class Exits(Environment):
    """What a tool wrapper built on argparse does with arguments it does not take."""

    def reset(self, record):
        return EnvStart()

    def step(self, action_text, action_ids):
        import argparse

        parser = argparse.ArgumentParser(prog="calc-tool", exit_on_error=True)
        parser.add_argument("--expression", required=True)
        parser.parse_args(action_text.split())  # SystemExit(2), usage on stderr


class Interrupts(Exits):
    def step(self, action_text, action_ids):
        raise KeyboardInterrupt


class OwnBaseException(BaseException):
    pass


class RaisesBase(Exits):
    def step(self, action_text, action_ids):
        raise OwnBaseException("from the tool")


@pytest.mark.parametrize("cls, detail", [
    (Exits, "Exits.step raised SystemExit: 2"), (Interrupts, "Interrupts.step raised KeyboardInterrupt"),
    (RaisesBase, "RaisesBase.step raised OwnBaseException: from the tool")])
def test_an_environment_raising_a_base_exception_fails_its_episode_not_the_stage(cls, detail):
    run = runner(cls)
    (episode,), _ = batch(run, 1, "3")
    assert episode.failure == RAISED and episode.failure_detail == detail, episode.failure_detail
    assert run._environments == {}  # closed and forgotten
    (fine,), _ = batch(runner(CalculatorEnv), 1, ANSWER)  # the next episode runs as ever
    assert fine.failure is None and fine.final_reward == 1.0


def test_a_served_environment_raising_a_base_exception_fails_its_episode_not_the_server():
    with serving_environment(Exits) as url:
        service = HttpEnvironmentService(url, step_timeout_s=2.0, max_retries=0)
        (episode,), _ = batch(runner(service), 1, "3")
        assert episode.failure == RAISED and "the service: SystemExit: 2" in episode.failure_detail
        (again,), _ = batch(runner(service), 1, "3")  # the server serves on
        assert again.failure == RAISED and httpx.get(f"{url}/health").json()["episodes"] == 0
        service.close()


def test_a_reward_function_interrupted_by_a_signal_lets_the_signal_through(tmp_path):
    """A reward function's own SystemExit is a reward-source failure (tests/test_reward_sources.py);
    the StageInterrupted a SIGTERM raises while it runs (the main thread) is the stage's."""
    path = tmp_path / "slow_reward.py"
    path.write_text("import time\n\ndef score(**kw):\n    time.sleep(3)\n    return [0.0]\n")
    reward = FunctionReward(f"{path}:score", "slow", "rl.rewards[0].function")
    start = time.monotonic()
    with sigterm_in(0.2), pytest.raises(StageInterrupted):
        reward.score(RewardInputs(["p"], ["r"], [[3]], [[4]], [True]))
    assert time.monotonic() - start < 1.0


def test_user_files_and_constructors_that_exit_are_config_errors(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text("import sys\nfrom megatron_rlhf.envs.calculator import CalculatorEnv\n\n"
                    "class Quits(CalculatorEnv):\n    def __init__(self, **kw):\n        sys.exit(0)\n")
    with pytest.raises(ConfigError, match="making a Quits and closing it raised SystemExit: 0"):
        environment_factory(EnvironmentConfig(type="class", class_path=f"{path}:Quits"))
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(ConfigError, match="importing .*exits_at_import.py failed: SystemExit: 0"):
        FunctionReward(f"{tmp_path}/exits_at_import.py:score", "x", "rl.rewards[0].function")


# ----------------------------------------------------------------------------- constructors; the eval (items 8, 7)


def test_a_constructor_that_fails_mid_run_fails_those_episodes(tmp_path):
    """The factory's call is part of the episode's guarded start: the third and later
    environments (the first is made when the class loads) fail their episodes as raised."""
    path = tmp_path / "runs_out.py"
    path.write_text("from megatron_rlhf.envs.calculator import CalculatorEnv\n\n"
                    "class RunsOut(CalculatorEnv):\n    made = 0\n\n    def __init__(self, **kw):\n"
                    "        type(self).made += 1\n        if type(self).made > 3:\n"
                    "            raise RuntimeError('no sandbox left')\n        super().__init__(**kw)\n")
    factory = environment_factory(EnvironmentConfig(type="class", class_path=f"{path}:RunsOut"))
    run = runner(factory, workers=1)  # made in episode order
    episodes = run.start_all([RECORD] * 4, [ids(RECORD["prompt"])] * 4)
    assert [e.failure for e in episodes] == [None, None, RAISED, RAISED]
    assert episodes[2].failure_detail == "making the environment (RunsOut) raised RuntimeError: no sandbox left"
    run.policy_turns(episodes[:2], [ids(ANSWER)] * 2)
    assert [e.final_reward for e in episodes[:2]] == [1.0, 1.0]


class ScriptedPolicy:
    """A rollout engine that writes the calculator demonstration's turns (a stand-in policy):
    the tool call, then the answer read off the observation."""

    pad_id, needs_refit = TOKENIZER.pad_id, False

    def generate(self, prompts, sampling, seed):
        obs, close = ids("<obs>")[0], ids("</obs>")[0]
        new = []
        for row in prompts:
            if obs in row:
                start = len(row) - row[::-1].index(obs)
                new.append(ids("answer") + row[start:row.index(close, start)] + [TOKENIZER.eos_id])
            else:
                new.append(ids(f"<calc> {TOKENIZER.decode(row).split(' is ')[-1]} </calc>"))
        width = max(len(p) + len(n) for p, n in zip(prompts, new))
        tokens = torch.full((len(prompts), width), self.pad_id)
        for i, (p, n) in enumerate(zip(prompts, new)):
            tokens[i, :len(p) + len(n)] = torch.tensor(p + n)
        return Rollout(tokens, torch.tensor([len(p) for p in prompts]),
                       torch.tensor([len(p) + len(n) for p, n in zip(prompts, new)]), torch.zeros(tokens.shape),
                       torch.tensor([n[-1] == TOKENIZER.eos_id for n in new]))


def test_the_failure_limit_holds_for_the_eval(monkeypatch):
    """rl.max_failed_episodes applies to an evaluation's episodes too (before, an eval whose
    episodes all failed scored them 0 and the stage went on)."""
    from megatron_rlhf.trainers import policy_eval

    monkeypatch.setattr(policy_eval, "data_parallel", lambda: (0, 1))  # no process group here
    prompts = [EncodedPrompt(ids(RECORD["prompt"]), PromptExample(RECORD["prompt"], extra={"answer": "7287"}))] * 4
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)

    def evaluate(env_cls, max_failed):
        engine = EpisodeEngine(ScriptedPolicy(), runner(env_cls), max_failed)
        return policy_eval.evaluate(engine, {"env": lambda rollout, rows: rollout.env_reward}, TOKENIZER, None,
                                    prompts, sampling, seed=1)

    metrics = evaluate(CalculatorEnv, 0.0).metrics  # the score and the eval episodes' statistics
    assert metrics["eval_env_score"] == 1.0 and metrics["eval_env_tool_call_rate"] == 1.0
    assert metrics["eval_env_turns_per_episode"] == 2.0 and metrics["eval_env_failed_fraction"] == 0.0
    with pytest.raises(TooManyFailedEpisodes, match="100% of the evaluation's episodes failed, more than "
                                                    "rl.max_failed_episodes=0.5; here, e.g. raised"):
        evaluate(Exits, 0.5)
