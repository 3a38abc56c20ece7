"""Tool-use SFT, then GRPO on the calculator task, with a chat tokenizer (issue 54 item 5d): the
data and the tokenizer of the demonstration in docs/environments.md ("Tool-use SFT first"). Not a
pytest file (a few minutes of CPU); run it, then the two commands the docs give:

    .venv/bin/python tests/tool_use_demo.py /tmp/tooldemo/data

writes into the directory:
  tok/                   a byte-level BPE trained here on the task's rendered conversations, ChatML
                         special tokens, a Qwen 2.5-style chat template (the tools in the system
                         turn, calls as <tool_call> JSON, results as <tool_response> in a user turn)
  sft_train.jsonl        `messages` records: user question -> assistant tool_calls [calc] -> tool
  sft_eval.jsonl         result -> assistant "answer N"; as the built-in agent task, half the
                         demonstrations guess one digit off without the tool instead
  prompts_train.jsonl    `messages` prompts (the user question) with the `answer` the environment
  prompts_eval.jsonl     reads (a prompt record's extra fields reach Environment.reset)

ChatCalculatorEnv (rl.environment.class_path=tests/tool_use_demo.py:ChatCalculatorEnv) is the
built-in CalculatorEnv without its own turn template (the word tokenizer's <obs> markers): the
observations are framed by the chat template's tool turn (envs/chat_turns.py), and the calls are
parsed as JSON, as the template writes them.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from megatron_rlhf.data.tasks.calculator import (
    ANSWER, OPERAND_RANGE, OPERATORS, PROMPT_TEMPLATES, SFT_TOOL_RATE, TOOL_NAME, _near_miss, evaluate, spell,
)
from megatron_rlhf.envs.calculator import CalculatorEnv

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = "<|im_end|>"
# Qwen 2.5 style (tests/test_tool_sft.py checks it against transformers as QWEN_TOOLS)
TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\\n\\n' }}{% endif %}{{ '# Tools\\n<tools>' }}{% for t in tools %}"
    "{{ '\\n' + (t | tojson) }}{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}"
    "{% elif messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% elif m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}{% set f = c['function'] if c['function'] is defined else c %}"
    "{{ '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' + (f['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endgeneration %}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": TOOL_NAME, "description": "Evaluate + - * on integers.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
SIZES = {"sft_train": 4000, "sft_eval": 200, "prompts_train": 2000, "prompts_eval": 64}


class ChatCalculatorEnv(CalculatorEnv):
    """CalculatorEnv framed by the chat template (no turn_template of its own), JSON calls."""
    turn_template = None
    default_tool_parser = "json"
    separator = "\n"


def problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, expression, value), as data/tasks/calculator.py draws them."""
    first, second = rng.choice(OPERAND_RANGE), rng.choice(OPERAND_RANGE)
    expression = f"{spell(first)} {rng.choice(OPERATORS)} {spell(second)}"
    return rng.choice(PROMPT_TEMPLATES).replace("X", expression), expression, evaluate(expression)


def demonstration(rng: random.Random) -> dict:
    question, expression, value = problem(rng)
    user = {"role": "user", "content": question}
    if rng.random() < SFT_TOOL_RATE:
        call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"expression": expression}}}
        messages = [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": TOOL_NAME, "content": spell(value)},
                    {"role": "assistant", "content": f"{ANSWER} {spell(value)}"}]
    else:  # a guess one digit off, without the tool
        messages = [user, {"role": "assistant", "content": f"{ANSWER} {spell(_near_miss(rng, value))}"}]
    return {"messages": messages, "tools": TOOLS}


def prompt_record(rng: random.Random) -> dict:
    question, _, value = problem(rng)
    return {"messages": [{"role": "user", "content": question}], "tools": TOOLS, "answer": str(value)}


def write_tokenizer(directory: Path, conversations: list[dict]) -> Path:
    """A byte-level BPE trained on the rendered conversations, with the template and its EOS."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    env = ImmutableSandboxedEnvironment()
    env.filters["tojson"] = json.dumps  # the corpus only: the run renders with the package's renderer
    plain = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    template = env.from_string(plain)
    corpus = [template.render(messages=c["messages"], tools=c["tools"], add_generation_prompt=False)
              for c in conversations]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": "<|endoftext|>",
              "chat_template": TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def main(out: Path, seed: int = 1234) -> None:
    out.mkdir(parents=True, exist_ok=True)
    records = {}
    for index, (split, count) in enumerate(SIZES.items()):
        rng = random.Random(seed * 100 + index)
        make = demonstration if split.startswith("sft") else prompt_record
        records[split] = [make(rng) for _ in range(count)]
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[split]))
    tok = write_tokenizer(out / "tok", records["sft_train"])
    print(f"wrote {', '.join(f'{k}: {len(v)}' for k, v in records.items())} and {tok}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tool_use_demo.py <out_dir>")
    main(Path(sys.argv[1]))
