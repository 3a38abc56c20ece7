"""Turn templates read off a Hugging Face tokenizer's chat template (envs/chat_turns.py): an
episode's trajectory, built from the markers as ids, is the template's own rendering of the
conversation, tokens included; an environment class's own turn_template wins; a template that
cannot frame observations append-only is refused naming rl.environment.observation_role."""

from __future__ import annotations

import pytest

from megatron_rlhf.config import ConfigError
from megatron_rlhf.config.rl import EnvironmentConfig
from megatron_rlhf.data.chat import load_chat_template
from megatron_rlhf.data.tokenizers import HFTokenizer
from megatron_rlhf.envs import EnvStart, Environment, EpisodeRunner, StepResult
from megatron_rlhf.envs.calculator import TURN_TEMPLATE
from megatron_rlhf.envs.chat_turns import turn_template_from_chat
from megatron_rlhf.envs.loading import turn_template
from test_chat_data import CHATML, LLAMA3, make_chat_tokenizer_dir

# Qwen's tool results: a user turn holding <tool_response> blocks (consecutive ones share the turn).
QWEN_TOOL = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
             "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
             "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
             "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
             "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# A template that writes only the last assistant turn's content: not append-only.
LAST_ANSWER_ONLY = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
                    "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}"
                    "{{ '<|im_end|>\\n' }}{% endfor %}"
                    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# A template with no tool role.
NO_TOOL_ROLE = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
                "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CASES = {  # template, EOS token, observation role
    "chatml_eos_im_end": (CHATML, "<|im_end|>", "tool"),  # Qwen instruct: the turn ends with the EOS
    "chatml_eos_endoftext": (CHATML, "<|endoftext|>", "tool"),  # a base tokenizer: EOS after the turn
    "llama3_ipython": (LLAMA3, "<|eot_id|>", "ipython"),
    "qwen_tool_response": (QWEN_TOOL, "<|im_end|>", "tool"),
    "no_tool_role_as_user": (NO_TOOL_ROLE, "<|im_end|>", "user"),
}
TURNS = ["The capital of France is Paris.", "Rome is in Italy.", "Antico Caffè Greco, near the Spanish Steps."]
OBSERVATIONS = ["Paris has a café.", "And one in Rome?"]
QUESTION = "Name a café in Paris."


def tokenizer_with(directory_root, template: str, eos: str) -> HFTokenizer:
    tokenizer = HFTokenizer(make_chat_tokenizer_dir(directory_root / "tok", template, eos))
    tokenizer.chat_template = load_chat_template("auto", tokenizer)
    return tokenizer


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    template, eos, role = CASES[request.param]
    return request.param, tokenizer_with(tmp_path_factory.mktemp(request.param), template, eos), role


def policy_turn_text(chat, eos: str, content: str) -> str:
    """What a chat model writes for an assistant turn and where generation stops: through the
    template's EOS, or (a template without the EOS in its end of turn) the whole end of turn and
    then the EOS, as SFT trains it (data/chat.py)."""
    rendered = chat.render([{"role": "user", "content": "u"}, {"role": "assistant", "content": content}], False)
    end_of_turn = rendered[rendered.index(content) + len(content):]
    return content + (end_of_turn[:end_of_turn.index(eos) + len(eos)] if eos in end_of_turn else end_of_turn + eos)


def test_the_trajectory_is_the_templates_conversation_text_and_tokens(case):
    """Prompt, policy turns and observations between the derived markers give exactly the text
    the chat template writes for the conversation (a tool message after each assistant turn),
    and its ids encoded piece by piece are the ids of the whole text: the markers are the
    template's own separator tokens."""
    name, tokenizer, role = case
    chat, eos = tokenizer.chat_template, tokenizer.eos_token
    template = turn_template_from_chat(chat, eos, role)
    assert template.tool_call_end == ""  # a tool-calling turn ends at the EOS, as the chat model writes it
    prompt = chat.render([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    pieces = [prompt]
    conversation = [{"role": "user", "content": QUESTION}]
    for index, content in enumerate(TURNS):
        pieces.append(policy_turn_text(chat, eos, content))
        conversation.append({"role": "assistant", "content": content})
        if index < len(OBSERVATIONS):
            pieces += [template.observation_prefix, OBSERVATIONS[index], template.observation_suffix]
            conversation.append({"role": role, "content": OBSERVATIONS[index]})
    trajectory = "".join(pieces)
    rendered = chat.render(conversation, add_generation_prompt=False)
    if eos in rendered:  # the template ends turns with the EOS: it may write more after the last one
        assert rendered.startswith(trajectory), name
        assert rendered[len(trajectory):].strip() == ""
    else:  # the policy's EOS after each turn is the only difference
        assert trajectory.replace(eos, "") == rendered, name
    by_piece = [i for p in pieces for i in tokenizer.encode(p)]
    assert by_piece == tokenizer.encode(trajectory), name
    assert tokenizer.eos_id in tokenizer.encode(pieces[1])  # each policy turn stops at the EOS id


def test_an_episode_appends_the_templates_marker_ids_around_each_observation(case):
    """The episode runner with the derived template: the policy's ids as sampled, then the
    observation's ids between the markers' ids, marked as context."""
    name, tokenizer, role = case
    template = turn_template_from_chat(tokenizer.chat_template, tokenizer.eos_token, role)

    class Echo(Environment):
        def reset(self, record):
            return EnvStart()

        def step(self, action_text, action_ids):
            return StepResult(observation=OBSERVATIONS[0], done=False)

    run = EpisodeRunner(Echo, tokenizer, template, max_turns=2, max_total_tokens=512, step_timeout_s=5.0)
    prompt_ids = tokenizer.encode(QUESTION)
    episode = run.start({"prompt": QUESTION}, prompt_ids)
    action = tokenizer.encode(policy_turn_text(tokenizer.chat_template, tokenizer.eos_token, TURNS[0]))
    appended = run.policy_turn(episode, action)
    expected = [*tokenizer.encode(template.observation_prefix), *tokenizer.encode(OBSERVATIONS[0]),
                *tokenizer.encode(template.observation_suffix)]
    assert appended == expected and episode.tokens == action + expected, name
    assert episode.policy_mask == [True] * len(action) + [False] * len(expected)
    assert tokenizer.eos_id in run.stop_ids


def test_a_classs_own_template_wins_and_without_a_chat_template_there_is_none(tmp_path):
    tokenizer = tokenizer_with(tmp_path, CHATML, "<|im_end|>")
    calculator = EnvironmentConfig(type="class", class_path="megatron_rlhf/envs/calculator.py:CalculatorEnv")
    assert turn_template(calculator, tokenizer) == TURN_TEMPLATE
    service = EnvironmentConfig(type="http", url="http://127.0.0.1:8100")
    derived = turn_template(service, tokenizer)
    assert derived.observation_prefix == "\n<|im_start|>tool\n"
    assert derived.observation_suffix == "<|im_end|>\n<|im_start|>assistant\n"
    tokenizer.chat_template = None
    assert turn_template(service, tokenizer).observation_prefix == ""


@pytest.mark.parametrize("template, role, message", [
    (NO_TOOL_ROLE, "tool", "unknown role tool"),
    (LAST_ANSWER_ONLY, "tool", "not append-only"),
])
def test_a_template_that_cannot_frame_observations_is_refused_naming_the_field(tmp_path, template, role, message):
    tokenizer = tokenizer_with(tmp_path, template, "<|im_end|>")
    with pytest.raises(ConfigError, match=message) as refused:
        turn_template_from_chat(tokenizer.chat_template, tokenizer.eos_token, role)
    assert "rl.environment.observation_role" in str(refused.value)


def test_observation_role_is_checked_and_read_by_class_and_http_environments():
    with pytest.raises(ConfigError, match="observation_role"):
        EnvironmentConfig(type="http", url="http://127.0.0.1:8100", observation_role=" ").check()
    with pytest.raises(ConfigError, match="observation_role"):
        EnvironmentConfig(type="none", observation_role="user").check()
    EnvironmentConfig(type="http", url="http://127.0.0.1:8100", observation_role="ipython").check()
