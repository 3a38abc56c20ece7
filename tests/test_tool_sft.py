"""Tool-use SFT: `messages` records with assistant `tool_calls` and `role: tool` results (and a
record's `tools`) are rendered by the tokenizer's chat template, trained on the assistant turns
only (their calls included), with token ids and mask equal to transformers'
apply_chat_template(..., return_assistant_tokens_mask=True); the same conversation built as an
RL episode (envs/chat_turns.py markers, envs/episode.py token in / token out) gives the same ids;
templates that cannot be split at tool messages, or do not write the calls, are refused."""

from __future__ import annotations

import json

import pytest

from megatron_rlhf.data.chat import tokenize_chat, tokenize_chat_prompt
from megatron_rlhf.data.encode import encode_prompt_records, encode_sft
from megatron_rlhf.data.jsonl import DataError, read_prompts, read_sft, write_jsonl
from megatron_rlhf.envs import EnvStart, Environment, EpisodeRunner, StepResult
from megatron_rlhf.envs.chat_turns import turn_template_from_chat
from test_chat_turns import tokenizer_with
from tool_use_demo import TEMPLATE

# Qwen 2.5 style: the tools in the system turn, calls as <tool_call> JSON in the assistant turn,
# results as <tool_response> blocks in a user turn (consecutive results share it); the demo's too.
QWEN_TOOLS = TEMPLATE
# Llama 3.1 style: BOS from the template, results under an ipython header, calls as JSON.
LLAMA_TOOLS = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{% else %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{% if m['tool_calls'] %}"
    "{% for c in m['tool_calls'] %}{{ '{\"name\": \"' + c['function']['name'] + '\", \"parameters\": ' + "
    "(c['function']['arguments'] | tojson) + '}' }}{% endfor %}{% else %}{{ m['content'] | trim }}{% endif %}"
    "{{ '<|eot_id|>' }}{% endgeneration %}{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# Closes a tool block only when a message follows: the conversation up to an assistant turn,
# with the generation prompt, is not how the whole conversation begins.
CLOSES_LATE = QWEN_TOOLS.replace("{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}",
                                 "{% if not loop.last and messages[loop.index0 + 1]['role'] != 'tool' %}")
# A ChatML template without a tool-call format: it writes the content only.
NO_CALLS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
CALL = {"type": "function", "function": {"name": "calc", "arguments": {"expression": "17*23"}}}
CONVERSATION = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is 17*23?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "content": "391", "name": "calc"},
                {"role": "assistant", "content": "17*23 = 391."}]
# Two calls at once: their results are consecutive tool messages, which QWEN_TOOLS merges into one
# block (not append-only message by message); the masks come from the whole conversation's text.
PARALLEL = [*CONVERSATION[1:2], {"role": "assistant", "content": "", "tool_calls": [CALL, {
    "type": "function", "function": {"name": "calc", "arguments": '{"expression": "2+2"}'}}]},
            {"role": "tool", "content": "391"}, {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "391, and 4."}]
CASES = {"qwen_tools": (QWEN_TOOLS, "<|im_end|>", TOOLS), "llama_tools": (LLAMA_TOOLS, "<|eot_id|>", None)}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    template, eos, tools = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    tokenizer = tokenizer_with(root, template, eos)
    from transformers import AutoTokenizer

    return request.param, tokenizer, AutoTokenizer.from_pretrained(str(root / "tok")), tools


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("conversation", [CONVERSATION, PARALLEL], ids=["one_call", "parallel_calls"])
def test_tool_use_records_are_read_and_trained_as_transformers_masks_them(case, tmp_path, conversation):
    """read_sft keeps tool_calls, tool names and the record's tools; the ids and the loss mask
    equal apply_chat_template's (the turn's EOS ends the sequence, as in test_chat_data)."""
    name, ours, theirs, tools = case
    record = {"messages": conversation, **({"tools": json.dumps(tools)} if tools else {})}
    (example,) = read_sft(write_records(tmp_path / "sft.jsonl", [record]))
    assert list(example.messages) == conversation and (example.tools == (tuple(tools) if tools else None))
    (encoded,), _ = encode_sft([example], ours, 512, "truncate")
    out = theirs.apply_chat_template(conversation, tools=tools, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
    want_ids, want_mask = list(out["input_ids"]), [bool(x) for x in out["assistant_masks"]]
    if name == "qwen_tools":  # the newline after the last <|im_end|> (the EOS) is left out
        want_ids, want_mask = want_ids[:-1], want_mask[:-1]
        assert '{"name": "calc"' in ours.decode(encoded.tokens) and "# Tools" in ours.decode(encoded.tokens)
    assert encoded.tokens == want_ids and list(encoded.targets) == want_mask
    trained = ours.decode([t for t, m in zip(encoded.tokens, encoded.targets, strict=True) if m])
    assert "calc" in trained and "17*23" in trained and conversation[-1]["content"] in trained
    assert "391" not in trained.replace(conversation[-1]["content"], "")  # the tool's result is context
    # written back and read again: the same record
    write_jsonl(tmp_path / "again.jsonl", [example])
    assert read_sft(tmp_path / "again.jsonl") == [example]
    assert read_sft(tmp_path / "again.jsonl")[0].tools == example.tools


def test_the_sft_rendering_is_the_rl_episodes_trajectory(case):
    """[system, user, assistant(tool_calls), tool, assistant]: the RL prompt (rendered with the
    generation prompt), the policy's turns as the model writes them, and the tool's result
    between the chat-turn markers (token in, token out) give exactly the SFT ids; every token
    the policy wrote is one SFT trains on."""
    name, ours, _, tools = case
    chat, eos = ours.chat_template, ours.eos_token
    sft = tokenize_chat(ours, CONVERSATION, 0, False, "test", tools)
    prompt_ids = tokenize_chat_prompt(ours, CONVERSATION[:2], "test", tools)
    markers = turn_template_from_chat(chat, eos, "tool")

    def written(i: int) -> str:  # what the model writes for assistant message i, through its EOS
        before = chat.render(CONVERSATION[:i], add_generation_prompt=True, tools=tools)
        turn = chat.render(CONVERSATION[: i + 1], add_generation_prompt=False, tools=tools)[len(before):]
        return turn[: turn.index(eos) + len(eos)]

    class Calculator(Environment):
        def reset(self, record):
            return EnvStart()

        def step(self, action_text, action_ids):
            done = "tool_call" not in action_text and '"name"' not in action_text
            return StepResult(observation=None if done else CONVERSATION[3]["content"], done=done)

    runner = EpisodeRunner(Calculator, ours, markers, max_turns=3, max_total_tokens=512, step_timeout_s=5.0)
    episode = runner.start({"messages": CONVERSATION[:2]}, prompt_ids)
    for i in (2, 4):
        runner.policy_turn(episode, ours.encode(written(i)))
    assert episode.done and len(episode.turns) == 2
    assert prompt_ids + episode.tokens == sft.ids, name
    policy = [False] * len(prompt_ids) + list(episode.policy_mask)
    assert all(sft.targets[t] for t, p in enumerate(policy) if p)
    assert sum(policy) == sum(sft.targets) - (name == "qwen_tools")  # (SFT also trains the "\n" after <|im_end|>)


def test_a_template_that_cannot_be_split_at_tool_messages_is_refused_naming_the_record_and_fix(tmp_path):
    tokenizer = tokenizer_with(tmp_path / "late", CLOSES_LATE, "<|im_end|>")
    path = write_records(tmp_path / "sft.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(DataError, match="example 0: .*not append-only around the tool messages before or after "
                                        "assistant message 4.*data.chat_loss=last_assistant.*one record per"):
        encode_sft(read_sft(path), tokenizer, 512, "truncate")
    tokenizer = tokenizer_with(tmp_path / "plain", NO_CALLS, "<|im_end|>")
    with pytest.raises(DataError, match="does not write message 2's tool call 'calc'.*tool-call format"):
        encode_sft(read_sft(path), tokenizer, 512, "truncate")


def test_rl_prompts_with_tool_messages_render_with_the_records_tools(tmp_path):
    tokenizer = tokenizer_with(tmp_path, QWEN_TOOLS, "<|im_end|>")
    record = {"messages": CONVERSATION[:4], "tools": TOOLS, "answer": "391"}
    (prompt,) = read_prompts(write_records(tmp_path / "prompts.jsonl", [record]))
    assert prompt.tools == tuple(TOOLS) and prompt.extra == {"tools": TOOLS, "answer": "391"}
    (encoded,), _ = encode_prompt_records([prompt], tokenizer, 512)
    text = tokenizer.decode(encoded.ids)
    assert "# Tools" in text and "<tool_response>\n391\n</tool_response>" in text
    rendered = tokenizer.chat_template.render(CONVERSATION[:4], add_generation_prompt=True, tools=TOOLS)
    assert encoded.ids == tokenizer.encode(rendered) and rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("messages, tools, message", [
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "1"}, {"role": "assistant", "content": "a"}],
     None, r"\[1\]: a tool message .* must follow the assistant message that called the tool"),
    ([{"role": "user", "content": "q", "tool_calls": [CALL]}, {"role": "assistant", "content": "a"}],
     None, r"\[0\]: tool_calls on a 'user' message"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]},
      {"role": "tool", "content": "1"}, {"role": "assistant", "content": "a"}],
     None, r"\[1\]: tool_calls\[0\]: expected .*non-empty name"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [CALL]},
      {"role": "tool", "content": {"value": 1}}, {"role": "assistant", "content": "a"}],
     None, r"\[2\]: content: expected a non-empty string, got dict; json.dumps"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "not json",
     "field 'tools': a string that is not JSON"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], {"name": "calc"},
     "field 'tools': expected a list of function schema objects"),
])
def test_malformed_tool_records_are_refused_naming_the_field(tmp_path, messages, tools, message):
    record = {"messages": messages, **({"tools": tools} if tools is not None else {})}
    with pytest.raises(DataError, match=message):
        read_sft(write_records(tmp_path / "bad.jsonl", [record]))
