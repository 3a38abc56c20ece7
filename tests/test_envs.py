"""Multi-turn environments (megatron_rlhf/envs/, issue 39's foundation): tool-call parsers, the
calculator task and its environment, the episode runner's token trajectories, limits and failure
handling, loading a class from a file, the HTTP environment against real servers on loopback,
and the rl.environment config rules. Pure Python and small: no model, no process group."""

from __future__ import annotations

import json
import math
import random
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from megatron_rlhf.config import ConfigError, load_config, validate
from megatron_rlhf.config.rl import TOOL_PARSERS as CONFIG_TOOL_PARSERS
from megatron_rlhf.config.rl import EnvironmentConfig
from megatron_rlhf.data.tasks import TaskSizes, get_task
from megatron_rlhf.data.tasks.calculator import (
    ANSWER, OPERATORS, SFT_TOOL_RATE, CalculatorError, demonstration, evaluate, expression_of, final_answer, spell,
)
from megatron_rlhf.data.tokenizers import WordTokenizer
from megatron_rlhf.envs import (
    EnvironmentServiceDown, EnvStart, Environment, EpisodeFailed, EpisodeRunner, StepResult, ToolCall,
    ToolEnvironment, TooManyFailedEpisodes, check_failed_fraction, episode_metrics, get_tool_parser,
)
from megatron_rlhf.envs.base import INVALID_OUTPUT, MAX_TOTAL_TOKENS, MAX_TURNS, RAISED, TIMED_OUT, Episode
from megatron_rlhf.envs.calculator import TURN_TEMPLATE, CalculatorEnv
from megatron_rlhf.envs.http import SCHEMA, HttpEnvironmentService
from megatron_rlhf.envs.loading import environment_factory, load_environment_class
from megatron_rlhf.envs.server import serving_environment
from megatron_rlhf.envs.tools import TOOL_PARSERS
from megatron_rlhf.rewards.base import RewardSourceError
from megatron_rlhf.rewards.server import HttpThread

TASK = get_task("calculator")
TOKENIZER = WordTokenizer(TASK.words())
FAST = dict(step_timeout_s=1.0, max_retries=2, backoff_s=0.02, max_backoff_s=0.05)
RECORD = {"prompt": "what is 3 4 7 * 2 1", "answer": "7287"}


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text)


def runner(factory, max_turns: int = 4, max_total_tokens: int = 64, step_timeout_s: float = 1.0) -> EpisodeRunner:
    return EpisodeRunner(factory, TOKENIZER, TURN_TEMPLATE, max_turns=max_turns, max_total_tokens=max_total_tokens,
                         step_timeout_s=step_timeout_s)


def play(run: EpisodeRunner, turns: list[str], record=RECORD) -> Episode:
    """An episode whose policy writes `turns` (the last one ends with EOS) until it ends."""
    episode = run.start(record, ids(record["prompt"]))
    for index, text in enumerate(turns):
        if episode.ended:
            break
        run.policy_turn(episode, ids(text) + ([TOKENIZER.eos_id] if index == len(turns) - 1 else []))
    return episode


class Scripted(Environment):
    """Answers each step with the next of `answers` (a StepResult, an exception to raise, or
    anything else to return as is); `delay_s` before each."""

    def __init__(self, answers, start=None, delay_s: float = 0.0):
        self.answers, self.start, self.delay_s, self.closed = list(answers), start, delay_s, False

    def reset(self, record):
        return EnvStart(self.start)

    def step(self, action_text, action_ids):
        time.sleep(self.delay_s)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def close(self):
        self.closed = True


# ----------------------------------------------------------------------------- tool-call parsers


def test_json_parser_reads_hermes_calls_and_reports_each_malformed_one():
    parser = get_tool_parser("json", ("calc", "search"))
    text = ('let me compute <tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call> and '
            '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>')
    parsed = parser.parse(text)
    assert parsed.calls == [ToolCall("calc", {"expression": "12*34"}), ToolCall("search", {"q": "x"})]
    assert parsed.errors == [] and not parsed.is_final_answer
    garbage = ("<tool_call>{not json}</tool_call> <tool_call>[1, 2]</tool_call> "
               '<tool_call>{"name": "rm -rf", "arguments": {}}</tool_call> <tool_call>{"name": "calc"')
    parsed = parser.parse(garbage)
    assert parsed.calls == []
    assert len(parsed.errors) == 4, parsed.errors
    assert "not JSON" in parsed.errors[0] and '"name"' in parsed.errors[1]
    assert "unknown tool 'rm -rf'" in parsed.errors[2] and "not closed" in parsed.errors[3]
    assert parser.parse("the answer is 408").is_final_answer
    call = ToolCall("calc", {"expression": "1+2"})
    assert parser.parse(parser.format(call)).calls == [call]


def test_tag_parser_reads_each_tools_tag_and_reports_broken_tags():
    parser = get_tool_parser("tag", ("calc", "search"))
    assert parser.close_tag == "</calc>"
    parsed = parser.parse("<calc> 3 4 * 2 </calc> then <search>cats</search> and <other>x</other>")
    assert parsed.calls == [ToolCall("calc", {"input": "3 4 * 2"}), ToolCall("search", {"input": "cats"})]
    assert parsed.errors == []
    broken = parser.parse("<calc> 1 + 2 <calc> 3 </calc> </search> <calc> 5")
    assert broken.calls == [ToolCall("calc", {"input": "3"})]
    assert broken.errors == ["<calc> is not closed before <calc>", "</search> closes no <search>",
                             "<calc> is not closed (</calc>)"]
    assert parser.parse("answer 7 <other>x</other>").is_final_answer  # not a tool's tag: text
    call = ToolCall("search", {"input": "dogs"})
    assert parser.parse(parser.format(call)).calls == [call]


def test_parser_names_match_the_config_and_an_unknown_one_names_the_field():
    assert tuple(TOOL_PARSERS) == CONFIG_TOOL_PARSERS
    with pytest.raises(ConfigError, match=r"rl.environment.tool_parser='xml': choose one of \('json', 'tag'\)"):
        get_tool_parser("xml", ("calc",))


# ----------------------------------------------------------------------------- the calculator


def test_calculator_evaluates_integer_arithmetic_like_python():
    rng = random.Random(0)
    for _ in range(300):
        numbers = [rng.randrange(0, 10 ** rng.randint(1, 4)) for _ in range(rng.randint(1, 4))]
        operators = [rng.choice(OPERATORS) for _ in numbers[1:]]
        # the expected value by precedence, computed here without the module's parser
        terms, signs, current = [], [1], numbers[0]
        for op, n in zip(operators, numbers[1:]):
            if op == "*":
                current *= n
            else:
                terms.append(current)
                signs.append(1 if op == "+" else -1)
                current = n
        terms.append(current)
        expected = sum(s * t for s, t in zip(signs, terms))
        expression = " ".join(spell(numbers[0]).split() + [w for op, n in zip(operators, numbers[1:])
                                                           for w in [op, *spell(n).split()]])
        assert evaluate(expression) == expected, expression
    assert evaluate("- 3 * - 4") == 12 and evaluate("2 - - 2") == 4 and evaluate("- " * 501 + "5") == -5


@pytest.mark.parametrize("expression", ["", "1 /2", "2**3", "1 + ", "abc", "__import__('os').getcwd()", "(1+2)",
                                        "1" * 13, "999999999999 * 999999999999", "²"])
def test_calculator_refuses_what_it_does_not_evaluate(expression):
    with pytest.raises(CalculatorError):
        evaluate(expression)


def test_calculator_task_data_fits_its_vocabulary_and_its_gold_scorer():
    splits = TASK.splits(3, TaskSizes(sft_train=400, sft_eval=10, preference_train=20, preference_eval=10,
                                      ppo_prompts=50, eval_prompts=10))
    texts = [t for e in splits.sft_train for t in (e.prompt, e.response)]
    texts += [t for p in splits.preference_train for t in (p.prompt, p.chosen, p.rejected)]
    assert all(TOKENIZER.unk_id not in ids(text) for text in texts)
    for prompt in splits.ppo_prompts:
        value = evaluate(expression_of(prompt.prompt))
        assert prompt.extra["answer"] == str(value)
        assert TASK.gold_score(prompt.prompt, demonstration(expression_of(prompt.prompt), value)) == 1.0
    tool_rate = sum(e.response.startswith("<calc>") for e in splits.sft_train) / len(splits.sft_train)
    assert abs(tool_rate - SFT_TOOL_RATE) < 0.1
    guesses = [e for e in splits.sft_train if not e.response.startswith("<calc>")]
    assert guesses and all(TASK.gold_score(e.prompt, e.response) == 0.0 for e in guesses)  # near misses


@pytest.mark.parametrize("response,score", [
    ("answer 7 2 8 7", 1.0), ("<calc> 3 4 7 * 2 1 </calc> <obs> 7 2 8 7 </obs> answer 7 2 8 7", 1.0),
    ("<calc> 3 4 7 * 2 1 </calc> <obs> 7 2 8 7 </obs>", 0.0), ("7 2 8 7", 0.0), ("answer 7 2 8 7 answer", 0.0),
    ("answer 7 2 8 6", 0.0), ("answer - 7 2 8 7", 0.0), ("answer", 0.0), ("", 0.0),
    ("answer 7 2 8 7 </obs> answer 1", 0.0),
])
def test_gold_scorer_takes_only_the_exact_final_answer(response, score):
    assert TASK.gold_score(RECORD["prompt"], response) == score
    assert final_answer("answer - 2 2") == -22


# ----------------------------------------------------------------------------- episodes on token ids


def test_a_tool_using_episode_is_the_demonstrations_ids_with_the_policy_tokens_masked_in():
    """Token in, token out: replaying a demonstration's policy turns gives exactly the ids of
    the demonstration's text (and its EOS), with the observation and its markers as context."""
    episode = play(runner(CalculatorEnv), ["<calc> 3 4 7 * 2 1 </calc>", "answer 7 2 8 7"])
    expected = ids(demonstration("3 4 7 * 2 1", 7287)) + [TOKENIZER.eos_id]
    assert episode.tokens == expected
    observation = ids("<obs> 7 2 8 7 </obs>")
    first_turn = len(ids("<calc> 3 4 7 * 2 1 </calc>"))
    assert episode.policy_mask == [True] * first_turn + [False] * len(observation) + [True] * (len(expected) - first_turn - len(observation))
    assert episode.turns[0].observation_ids == observation
    assert episode.done and episode.final_reward == 1.0 and episode.rewards == [None, 1.0]
    assert episode.tool_calls == 1 and episode.failure is None and episode.truncated is None
    assert episode.length == len(ids(RECORD["prompt"])) + len(expected)
    assert play(runner(CalculatorEnv), ["answer 7 2 8 6"]).final_reward == 0.0
    assert runner(CalculatorEnv).stop_ids == (TOKENIZER.eos_id, *ids("</calc>"))


def test_a_malformed_call_is_answered_and_the_episode_goes_on():
    episode = play(runner(CalculatorEnv), ["<calc> 3 4 7 / 2 1 </calc>", "<calc> 1 + </calc> <calc>",
                                           "answer 7 2 8 7"])
    assert [t.observation_ids for t in episode.turns[:2]] == [ids("<obs> error </obs>"),
                                                              ids("<obs> error error </obs>")]
    assert episode.turns[1].tool_errors == ["<calc> is not closed (</calc>)"]
    assert episode.done and episode.failure is None and episode.final_reward == 1.0
    metrics = episode_metrics([episode, play(runner(CalculatorEnv), ["answer 1"])])
    assert metrics["env_turns_per_episode"] == 2.0 and metrics["env_tool_call_rate"] == 0.5
    assert metrics["env_tool_error_rate"] == 0.5 and metrics["env_failed_fraction"] == 0.0


def test_limits_end_episodes_as_truncated():
    many = ["<calc> 1 + 1 </calc>"] * 5
    episode = play(runner(CalculatorEnv, max_turns=3), many)
    assert episode.truncated == MAX_TURNS and len(episode.turns) == 3 and not episode.done
    assert episode.turns[-1].observation_ids == [] and episode.final_reward is None
    prompt = len(ids(RECORD["prompt"]))
    # room for one call and its observation, not for the second observation
    run = runner(CalculatorEnv, max_turns=8, max_total_tokens=prompt + 2 * 5 + 3 + 2)
    episode = play(run, many)
    assert episode.truncated == MAX_TOTAL_TOKENS and len(episode.turns) == 2 and episode.length <= run.max_total_tokens
    assert run.tokens_left(episode) == run.max_total_tokens - episode.length
    with pytest.raises(ValueError, match="tokens_left"):
        runner(CalculatorEnv, max_total_tokens=prompt + 2).policy_turn(
            runner(CalculatorEnv, max_total_tokens=prompt + 2).start(RECORD, ids(RECORD["prompt"])), ids("1 2 3"))


def test_an_episode_goes_on_only_while_a_whole_turn_fits():
    """turn_tokens (the engine's per-turn budget, sampling.max_new_tokens): an observation that
    leaves less room than one whole turn ends the episode; so does a prompt that leaves none."""
    prompt = len(ids(RECORD["prompt"]))
    call = "<calc> 1 + 1 </calc>"  # 5 ids; its observation "<obs> 2 </obs>" 3
    fits = EpisodeRunner(CalculatorEnv, TOKENIZER, TURN_TEMPLATE, max_turns=8, max_total_tokens=prompt + 5 + 3 + 6,
                         step_timeout_s=1.0, turn_tokens=6)
    assert play(fits, [call, "answer 2"]).done
    short = EpisodeRunner(CalculatorEnv, TOKENIZER, TURN_TEMPLATE, max_turns=8, max_total_tokens=prompt + 5 + 3 + 5,
                          step_timeout_s=1.0, turn_tokens=6)
    episode = play(short, [call, "answer 2"])
    assert episode.truncated == MAX_TOTAL_TOKENS and len(episode.turns) == 1 and episode.turns[0].observation_ids == []
    none = EpisodeRunner(CalculatorEnv, TOKENIZER, TURN_TEMPLATE, max_turns=8, max_total_tokens=prompt + 5,
                         step_timeout_s=1.0, turn_tokens=6)
    assert none.start(RECORD, ids(RECORD["prompt"])).truncated == MAX_TOTAL_TOKENS


def test_the_start_context_is_appended_as_context():
    episode = play(runner(lambda: Scripted([StepResult(done=True, reward=0.5)], start="1 2")), ["answer 1"])
    assert episode.tokens[:4] == ids("<obs> 1 2 </obs>") and episode.policy_mask[:4] == [False] * 4
    assert episode.final_reward == 0.5


@pytest.mark.parametrize("answer,reason,detail", [
    (RuntimeError("tool crashed"), RAISED, "Scripted.step raised RuntimeError: tool crashed"),
    ({"observation": "1"}, INVALID_OUTPUT, "step returned dict, not a StepResult"),
    (StepResult(reward=float("nan")), INVALID_OUTPUT, "the reward: score 0 is nan"),
    (StepResult(reward="1"), INVALID_OUTPUT, "the reward: score 0 is '1'"),
    (StepResult([5, 10 ** 6]), INVALID_OUTPUT, "observation token 1 is 1000000, not a token id in [0, 26)"),
    (StepResult(done="yes"), INVALID_OUTPUT, "done is 'yes'"),
    (StepResult(info=["a"]), INVALID_OUTPUT, "info is list, not a dict"),
    (EpisodeFailed(TIMED_OUT, "the sandbox timed out"), TIMED_OUT, "the sandbox timed out"),
    # issue 53 item 8: values that raised in the runner (OverflowError, TypeError) fail the episode
    (StepResult(reward=10 ** 400), INVALID_OUTPUT, "the reward: score 0 (int) is too large for a float"),
    (StepResult(tool_calls=5), INVALID_OUTPUT, "tool_calls is int, not a list of ToolCall"),
    (StepResult(tool_errors=None), INVALID_OUTPUT, "tool_errors is NoneType, not a list of str"),
    (StepResult(tool_calls=[{"name": "calc"}]), INVALID_OUTPUT, "tool_calls holds a dict, not a ToolCall"),
])
def test_an_environment_failure_ends_only_its_episode_with_the_reason(answer, reason, detail):
    environments = []

    def factory():
        environments.append(Scripted([answer]))
        return environments[-1]

    run = runner(factory)
    failed, fine = play(run, ["<calc> 1 </calc>"]), play(runner(CalculatorEnv), ["answer 7 2 8 7"])
    assert failed.failure == reason and detail in failed.failure_detail, failed.failure_detail
    assert failed.ended and not failed.done and failed.final_reward is None
    assert environments[0].closed and run._environments == {}  # closed, forgotten
    assert fine.failure is None and fine.final_reward == 1.0


def test_a_step_that_hangs_times_out_and_a_service_down_stops_the_stage():
    start = time.monotonic()
    episode = play(runner(lambda: Scripted([StepResult()], delay_s=5.0), step_timeout_s=0.2), ["<calc> 1 </calc>"])
    assert episode.failure == TIMED_OUT and "rl.environment.step_timeout_s=0.2" in episode.failure_detail
    assert time.monotonic() - start < 2.0
    down = EnvironmentServiceDown("environment service POST http://x/step: no answer")
    with pytest.raises(EnvironmentServiceDown):
        play(runner(lambda: Scripted([down])), ["<calc> 1 </calc>"])
    assert isinstance(down, RewardSourceError)  # the RL stage's clean stop for a failed reward source applies


def test_failed_fraction_above_the_limit_stops_with_the_field_named():
    def episode(failure):
        e = Episode(RECORD, [])
        if failure:
            e.fail(failure, f"{failure} detail")
        return e

    batch = [episode(None)] * 7 + [episode(RAISED), episode(TIMED_OUT), episode(RAISED)]
    assert check_failed_fraction(batch, 0.3) == pytest.approx(0.3)
    assert check_failed_fraction([], 0.0) == 0.0
    with pytest.raises(TooManyFailedEpisodes) as caught:
        check_failed_fraction(batch, 0.25)
    message = str(caught.value)
    assert "3 of 10 episodes failed (30%), more than rl.max_failed_episodes=0.25" in message
    assert "raised: 2, timed_out: 1" in message and "the first: raised detail" in message
    assert isinstance(caught.value, RewardSourceError)


def test_the_failure_limit_counts_every_sampling_round_and_the_metrics_describe_the_kept_rows():
    """rl.dynamic_sampling generates once per sampling round: EpisodeEngine.episode_metrics
    counts the episodes of every round for rl.max_failed_episodes (a round of failures must not
    hide behind a clean later one) and describes the rows the iteration kept. Without a process
    group its sum over data-parallel ranks is this rank's own."""
    import torch

    from megatron_rlhf.config import ModelConfig
    from megatron_rlhf.rollout.episodes import EpisodeEngine
    from megatron_rlhf.rollout.megatron_engine import MegatronRolloutEngine

    def failing_round():
        return [play(runner(lambda: Scripted([RuntimeError("the sandbox is gone")])), ["<calc> 1 </calc>"])
                for _ in range(4)]

    def clean_round():  # a tool call then the answer (2 turns, 1 call), or the answer at once
        return [play(runner(CalculatorEnv), turns) for turns in
                (["<calc> 3 4 7 * 2 1 </calc>", "answer 7 2 8 7"], ["answer 1"]) * 2]

    def engine(max_failed):  # the in-place engine is never asked to generate: the test feeds the
        # episodes each generate (sampling round) leaves in iteration_episodes
        return EpisodeEngine(MegatronRolloutEngine(ModelConfig(), None, TOKENIZER.eos_id, TOKENIZER.pad_id), None,
                             max_failed)

    two_rounds = engine(max_failed=0.25)
    two_rounds.iteration_episodes += failing_round() + clean_round()
    with pytest.raises(TooManyFailedEpisodes) as caught:  # the kept (clean) round alone would pass
        two_rounds.episode_metrics(kept=torch.tensor([4, 5, 6, 7]))
    assert "50% of the episodes generated this iteration (every sampling round) failed" in str(caught.value)
    assert "rl.max_failed_episodes=0.25; here, e.g. raised" in str(caught.value)

    tolerant = engine(max_failed=0.5)
    tolerant.iteration_episodes += clean_round()  # an evaluation's, generated after the last report
    tolerant.new_iteration()  # forgets them
    tolerant.iteration_episodes += failing_round() + clean_round()
    metrics = tolerant.episode_metrics(kept=torch.tensor([7, 5, 0, 1]))  # two failed rows and two answers at once
    assert metrics["env_failed_fraction"] == 0.5 and metrics["env_failed_fraction_all_rounds"] == 0.5
    assert metrics["env_tool_call_rate"] == 0.0 and metrics["env_turns_per_episode"] == 1.0
    tolerant.iteration_episodes += clean_round()  # the next iteration: the last one's are forgotten
    metrics = tolerant.episode_metrics(kept=torch.tensor([0, 1]))
    assert metrics["env_failed_fraction_all_rounds"] == 0.0 and metrics["env_tool_call_rate"] == 0.5
    assert metrics["env_turns_per_episode"] == 1.5
    tolerant.iteration_episodes += clean_round()
    assert tolerant.episode_metrics()["env_tool_calls_per_episode"] == 0.5  # no dynamic sampling: every row kept


# ----------------------------------------------------------------------------- loading a class from a file


USER_ENV = '''
from megatron_rlhf.envs import EnvStart, Environment, StepResult, ToolEnvironment


class Echo(Environment):
    def reset(self, record):
        return EnvStart()

    def step(self, action_text, action_ids):
        return StepResult(done=True, reward=float(len(action_ids)))


class Lookup(ToolEnvironment):
    tools = {"look": lambda arguments: "1 2"}

    def final_reward(self, action_text):
        return 1.0


def not_a_class():
    pass
'''


def test_environment_classes_load_from_a_file_with_clear_errors(tmp_path):
    path = tmp_path / "user_env.py"
    path.write_text(USER_ENV)
    echo = environment_factory(EnvironmentConfig(type="class", class_path=f"{path}:Echo"))()
    assert echo.step("a b", [3, 4]).reward == 2.0
    lookup = environment_factory(EnvironmentConfig(type="class", class_path=f"{path}:Lookup", tool_parser="tag"))()
    assert lookup.parser.name == "tag" and lookup.step("<look> x </look>", []).observation == "1 2"
    assert environment_factory(EnvironmentConfig(type="class", class_path=f"{path}:Lookup"))().parser.name == "json"
    assert load_environment_class("megatron_rlhf/envs/calculator.py:CalculatorEnv").__name__ == "CalculatorEnv"
    problems = {f"{path}:not_a_class": "is not a subclass of megatron_rlhf.envs.Environment",
                f"{path}:Missing": "has no class 'Missing'", f"{tmp_path}/nope.py:Echo": "file not found"}
    for spec, problem in problems.items():
        with pytest.raises(ConfigError, match=problem) as caught:
            load_environment_class(spec)
        assert str(caught.value).startswith(f"rl.environment.class_path={spec!r}")
    with pytest.raises(ConfigError, match="Echo is not a ToolEnvironment.*remove rl.environment.tool_parser"):
        environment_factory(EnvironmentConfig(type="class", class_path=f"{path}:Echo", tool_parser="json"))


# ----------------------------------------------------------------------------- HTTP environments


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def calculator_service():
    with serving_environment(CalculatorEnv) as url:
        yield url


class Flaky(ToolEnvironment):
    """The server side of the failure drills: the prompt decides how the step misbehaves."""

    tools = {"calc": lambda arguments: arguments["input"]}

    def final_reward(self, action_text):
        if self.record["prompt"] == "raise":
            raise ValueError("the grader's database is gone")
        if self.record["prompt"] == "slow":
            time.sleep(0.6)
        return 1.0


def test_http_episode_matches_the_in_process_one(calculator_service):
    service = HttpEnvironmentService(calculator_service, **FAST)
    turns = ["<calc> 3 4 7 * 2 1 </calc>", "<calc> oops </calc>", "answer 7 2 8 7"]
    remote, local = play(runner(service), turns), play(runner(CalculatorEnv), turns)
    assert remote.tokens == local.tokens and remote.policy_mask == local.policy_mask
    assert remote.final_reward == 1.0 and remote.failure is None
    assert [t.tool_calls for t in remote.turns] == [t.tool_calls for t in local.turns]
    assert service.pop_stats() == {"requests": 4, "retries": 0}  # reset and three steps (done: no close)
    truncated = play(runner(service, max_turns=1), turns)
    assert truncated.truncated == MAX_TURNS and service.pop_stats()["requests"] == 3  # reset, step, close
    assert httpx.get(f"{calculator_service}/health").json()["episodes"] == 0  # the server forgot both
    service.close()


def test_http_failures_end_the_episode_with_their_reason():
    with serving_environment(Flaky) as url:
        service = HttpEnvironmentService(url, **{**FAST, "step_timeout_s": 0.3})
        raised = play(runner(service), ["answer"], record={"prompt": "raise"})
        assert raised.failure == RAISED and "ValueError: the grader's database is gone" in raised.failure_detail
        slow = play(runner(service), ["answer"], record={"prompt": "slow"})
        assert slow.failure == TIMED_OUT and "step_timeout_s=0.3" in slow.failure_detail
        forgotten = service()
        forgotten.episode_id = "unknown"
        with pytest.raises(EpisodeFailed, match="HTTP 404: no running episode 'unknown'"):
            forgotten.step("x", [])
        assert service.pop_stats()["retries"] == 0  # none of these is retried


@contextmanager
def answering(answers: dict[str, list]):
    """A server answering each endpoint's requests with the next (status, body) of its list
    (a body that is not a dict or list is sent as raw text)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    lock = threading.Lock()

    def route(name):
        async def handle(request):
            with lock:
                status, body = answers[name].pop(0) if len(answers[name]) > 1 else answers[name][0]
            if isinstance(body, (dict, list)):
                return JSONResponse(body, status_code=status)
            return Response(str(body), status_code=status)
        return Route(f"/{name}", handle, methods=["POST"])

    http = HttpThread(Starlette(routes=[route(name) for name in answers])).start()
    try:
        yield f"http://127.0.0.1:{http.port}"
    finally:
        http.stop()


STARTED = (200, {"schema": SCHEMA, "episode_id": "e1", "observation": None})


@pytest.mark.parametrize("step_answer,detail", [
    ((200, "<html>oops</html>"), "the answer is not JSON"),
    ((200, {"schema": "other.v9", "done": True}), "'schema' is 'other.v9'"),
    ((200, {"schema": SCHEMA, "observation": 7, "done": False}), "'observation' must be a string"),
    ((200, {"schema": SCHEMA, "observation": "1", "done": "no"}), "'done' must be true or false"),
    ((200, {"schema": SCHEMA, "failure": {"reason": "bored"}}), "'failure' must be"),
    ((200, {"schema": SCHEMA, "observation": [3, -1], "done": False}), "observation token 1 is -1"),
    ((200, {"schema": SCHEMA, "observation": None, "done": True, "reward": "high"}), "the reward"),
])
def test_http_garbage_ends_the_episode_as_invalid_output(step_answer, detail):
    with answering({"reset": [STARTED], "step": [step_answer], "close": [(200, {"schema": SCHEMA})]}) as url:
        episode = play(runner(HttpEnvironmentService(url, **FAST)), ["answer 1"])
    assert episode.failure == INVALID_OUTPUT and detail in episode.failure_detail, episode.failure_detail


def test_http_retries_only_what_the_server_did_not_act_on():
    done = (200, {"schema": SCHEMA, "observation": None, "done": True, "reward": 1.0})
    with answering({"reset": [(503, {"error": "starting"}), (429, "busy"), STARTED], "step": [done]}) as url:
        service = HttpEnvironmentService(url, **FAST)
        episode = play(runner(service), ["answer 1"])
        assert episode.final_reward == 1.0 and service.pop_stats() == {"requests": 4, "retries": 2}
    with answering({"reset": [STARTED], "step": [(500, {"error": "step crashed"}), done]}) as url:
        service = HttpEnvironmentService(url, **FAST)
        episode = play(runner(service), ["answer 1"])
        assert episode.failure == RAISED and "HTTP 500: step crashed" in episode.failure_detail
        assert service.pop_stats()["retries"] == 0  # a step is never sent twice


def test_a_service_that_is_down_raises_a_distinct_error_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    service = HttpEnvironmentService(url, **FAST)
    run = runner(service)
    start = time.monotonic()
    with pytest.raises(EnvironmentServiceDown) as caught:
        run.start(RECORD, ids(RECORD["prompt"]))
    message = str(caught.value)
    assert f"POST {url}/reset" in message and "after 3 attempts" in message and "ConnectError" in message
    assert "rl.environment.url" in message and time.monotonic() - start < 2.0
    with answering({"reset": [STARTED], "step": [(503, "stopping")]}) as url:
        with pytest.raises(EnvironmentServiceDown, match="HTTP 503: stopping"):
            play(runner(HttpEnvironmentService(url, **FAST)), ["answer 1"])


def test_the_server_refuses_requests_off_the_schema(calculator_service):
    bad = {"reset": {"schema": SCHEMA, "record": {"no_prompt": 1}},
           "step": {"schema": SCHEMA, "episode_id": "e", "action": "x", "action_ids": [1.5]}}
    for endpoint, body in bad.items():
        response = httpx.post(f"{calculator_service}/{endpoint}", content=json.dumps(body))
        assert response.status_code == 400, response.text
    assert "action_ids'[0]=1.5" in response.json()["error"]
    assert httpx.post(f"{calculator_service}/reset", content=b"{").status_code == 400


# ----------------------------------------------------------------------------- config


def config(*overrides):
    return load_config("pipelines/tiny_cpu.yaml", list(overrides))


def test_defaults_are_single_turn_and_change_no_existing_recipe():
    cfg = validate(config())
    assert not cfg.rl.multi_turn and cfg.rl.environment == EnvironmentConfig()
    assert cfg.rl.episode_token_budget(cfg.model) == cfg.model.max_seq_length


@pytest.mark.parametrize("overrides,message", [
    (["rl.max_turns=4"], r"rl.max_turns: only multi-turn episodes read it \(rl.environment.type=none\)"),
    (["rl.environment.type=gym"], r"rl.environment.type='gym': choose one of \('none', 'class', 'http'\)"),
    (["rl.environment.url=http://x:1"], "rl.environment.url: only an environment of type http reads it"),
    (["rl.environment.step_timeout_s=5"], "step_timeout_s: only an environment of type class or http reads it"),
    (["rl.environment.type=class"], "rl.environment.class_path=None: give the file and the class"),
    (["rl.environment.type=class", "rl.environment.class_path=envs.Calc"], "class_path='envs.Calc'"),
    (["rl.environment.type=http"], r"rl.environment.url=None: give the service's base URL"),
    (["rl.environment.type=http", "rl.environment.url=http://h:1", "rl.environment.tool_parser=json"],
     r"rl.environment.tool_parser: only an environment of type class reads it \(the service parses its own"),
    (["rl.environment.type=class", "rl.environment.class_path=a.py:B", "rl.environment.tool_parser=xml"],
     "rl.environment.tool_parser='xml': choose one of"),
    (["rl.environment.type=class", "rl.environment.class_path=a.py:B", "rl.environment.step_timeout_s=0"],
     "rl.environment.step_timeout_s=0.0: must be > 0"),
    (["rl.environment.type=http", "rl.environment.url=http://h:1", "rl.environment.backoff_s=9"],
     "0 <= backoff_s <= max_backoff_s"),
    (["rl.environment.type=class", "rl.environment.class_path=a.py:B", "rl.max_turns=0"], "rl.max_turns=0"),
    (["rl.environment.type=class", "rl.environment.class_path=a.py:B", "rl.max_total_tokens=100000"],
     r"rl.max_total_tokens=100000: must be in \[0, model.max_seq_length="),
    (["rl.environment.type=class", "rl.environment.class_path=a.py:B", "rl.max_failed_episodes=1.5"],
     r"rl.max_failed_episodes=1.5: a fraction .* in \[0, 1\]"),
    (["rl.environment.type=class", "rl.environment.class_path=a.py:B", "rl.max_staleness=1", "rollout.engine=vllm"],
     "multi-turn episodes run in the synchronous loop only so far"),
    (["rl.rewards=[{type: environment}]"], "rl.rewards has a source of type environment with rl.environment.type=none"),
])
def test_config_rules_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(config(*overrides))


def test_a_valid_multi_turn_section_passes_its_rules():
    cfg = config("rl.environment.type=class", "rl.environment.class_path=megatron_rlhf/envs/calculator.py:CalculatorEnv",
                 "rl.environment.tool_parser=tag", "rl.max_turns=3", "rl.max_total_tokens=48",
                 "rl.max_failed_episodes=0")
    validate(cfg)
    assert cfg.rl.multi_turn and cfg.rl.episode_token_budget(cfg.model) == 48
    http = config("rl.environment.type=http", "rl.environment.url=http://127.0.0.1:8100", "rl.max_turns=2")
    validate(http)
    assert math.isclose(http.rl.environment.step_timeout_s, 30.0)
    factory = environment_factory(http.rl.environment)
    assert isinstance(factory, HttpEnvironmentService) and factory.url == "http://127.0.0.1:8100"
    factory.close()


def test_answer_marker_is_in_the_vocabulary():
    assert TOKENIZER.unk_id not in ids(f"{ANSWER} <calc> </calc> <obs> </obs> error")
