"""Hostile and malformed inputs end in one clear error, fast, in-process: chat templates that would
exhaust memory or time stop at their render budget (data/template_budget.py) with a data error
naming the template and the record; real templates render exactly as before; malformed records
and damaged files through every reader (JSONL, parquet, save_to_disk, the launcher's pre-flight)
give a DataError naming the file, never a traceback; a template that trains on nothing, a
ShareGPT file and a chat template that is not UTF-8 are refused naming the fix."""

from __future__ import annotations

import json
import resource
import signal
import time
from pathlib import Path

import pytest

from megatron_rlhf.config import load_config
from megatron_rlhf.data.chat import (
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    tokenize_chat,
    tokenize_chat_prompt,
)
from megatron_rlhf.data.encode import encode_sft
from megatron_rlhf.data.jsonl import (
    DataError,
    RecordFields,
    SFTExample,
    read_first,
    read_preferences,
    read_prompts,
    read_sft,
)
from megatron_rlhf.data.template_budget import RenderBudget
from megatron_rlhf.data.tokenizers import WordTokenizer
from megatron_rlhf.resilience.preemption import StageInterrupted

MESSAGES = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello you"}]
SPECIALS = {"eos_token": "<eos>", "bos_token": "<bos>"}
# A small budget keeps the templates that only the clock stops quick: 4096 + 8 x 30 characters (the
# messages: roles and contents), 0.5 s.
SMALL = RenderBudget(max_seq_length=128, seconds=0.5)
S = "{% set s = 'x' * 4000 %}"  # a string within the small budget, to grow from

HOSTILE = {
    # the issue's two: memory, with no clock needed to stop them
    "repetition": "{{ 'x' * (10 ** 10) }}",
    "nested_ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
    # growing without writing
    "power": "{{ 2 ** (10 ** 9) }}",
    "squaring": "{% set ns = namespace(n=7) %}{% for i in range(99) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "tilde_doubling": "{% set ns = namespace(s='x') %}{% for i in range(99) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "plus_doubling": "{% set ns = namespace(s='x') %}{% for i in range(99) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "list_doubling": "{% set ns = namespace(l=[1]) %}{% for i in range(99) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
    "list_repetition": "{{ [1, 2] * 10 ** 9 }}",
    "constant_growth": "{% set ns = namespace(s='') %}{% for i in range(100000) %}{% set ns.s = ns.s + 'abc' %}"
                       "{% endfor %}",
    # values that nest themselves: printing or comparing them is exponential
    "nested_literals": "{% set a0 = ['x'] %}" + "".join(f"{{% set a{i} = [a{i - 1}, a{i - 1}] %}}"
                                                        for i in range(1, 60)) + "{{ a59 }}",
    "namespace_nesting": "{% set ns = namespace(l='x') %}{% for i in range(80) %}{% set ns.l = [ns.l, ns.l] %}"
                         "{% endfor %}{{ ns.l }}",
    "nested_comparison": "{% set ns = namespace(a=1, b=1) %}{% for i in range(80) %}{% set ns.a = [ns.a, ns.a] %}"
                         "{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}",
    "dict_nesting": "{% set ns = namespace(d={}) %}{% for i in range(80) %}{% set ns.d = {'a': ns.d, 'b': ns.d} %}"
                    "{% endfor %}{{ ns.d|tojson }}",
    "recursive_loop_nesting": "{% for x in [['x']] recursive %}{{ loop([[x, x]]) if loop.depth < 200 else '' }}"
                              "{% endfor %}",
    "macro_argument_nesting": "{% macro f(x, n) %}{{ f([x, x], n - 1) if n else x|length }}{% endmacro %}"
                              "{{ f('x', 200) }}",
    # output held back in macros and blocks
    "macro_output": "{% macro f() %}{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}"
                    "{% endfor %}{% endmacro %}{% set x = f() %}",
    "set_block": "{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}xx{% endfor %}{% endfor %}"
                 "{% endset %}",
    "copies_kept_by_recursion": "{% macro f(s, n) %}{% set t = s ~ '' ~ s[:1] %}{{ f(t, n - 1) if n else '' }}"
                                "{% endmacro %}{{ f('x' * 4000, 900) }}",
    # str methods and filters that write more than they are given
    "center": "{{ 'x'|center(10 ** 9) }}",
    "ljust": "{{ 'x'.ljust(10 ** 9) }}",
    "format_width": "{{ '{:>999999999}'.format(1) }}",
    "format_fields": S + "{{ ('{0}{0}{0}').format(s) }}",
    "percent_width": "{{ '%0999999999d' % 1 }}",
    "format_filter": "{{ '%999999999s'|format('a') }}",
    "replace": S + "{{ s.replace('', s) }}",
    "replace_filter": S + "{{ s|replace('x', s) }}",
    "join": S + "{{ s.join(s) }}",
    "join_filter": "{% set l = range(3000)|list %}{{ l|join('x' * 3000) }}",
    "indent": "{% set s = 'x\\n' * 2000 %}{{ s|indent(s) }}",
    "wordwrap": "{% set s = 'x ' * 2000 %}{{ s|wordwrap(1, wrapstring=s) }}",
    "tojson_indent": "{{ messages|tojson(indent=4000) }}",
    "pprint": "{% set ns = namespace(l='ab') %}{% for i in range(9) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
              "{{ ns.l|pprint }}",
    "to_bytes": "{{ (1).to_bytes(10 ** 9, 'big') }}",
    "lipsum": "{{ lipsum(4000, max=4000) }}",
    "expandtabs": "{% set s = '\\t' * 4000 %}{{ s.expandtabs(4000) }}",
    "translate": S + "{{ s.translate({120: s}) }}",
    "batch_fill": "{{ range(4000)|batch(4000, 'x' * 4000)|list }}",
    "slice": "{{ range(10)|slice(10 ** 9)|list }}",
    # only the clock stops these
    "empty_nested_ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "exponential_macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    # not the budget: Python's recursion limit, reported the same way
    "infinite_recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_stops_at_its_budget_with_one_data_error(name):
    template = ChatTemplate(HOSTILE[name], f"hostile/{name}.jinja", SPECIALS, budget=SMALL)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(DataError) as refused:
        template.render(MESSAGES, add_generation_prompt=False, where="sft.jsonl:7")
    elapsed = time.monotonic() - start
    message = str(refused.value)
    assert message.startswith(f"sft.jsonl:7: the chat template (hostile/{name}.jinja) ") and "\n" not in message
    if name != "infinite_recursion":
        assert "(budget per render: 4336 characters (32 per token of model.max_seq_length=128" in message, message
        assert message.endswith("; fix the template, or give another (data.chat_template=<file.jinja>)")
    assert elapsed < 2.5, f"{name}: {elapsed:.1f} s"  # the clock's 0.5 s, and one innermost loop past it
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert grown_mb < 200, f"{name}: the process grew by {grown_mb:.0f} MB"


@pytest.mark.parametrize("name", ["repetition", "nested_ranges"])
def test_the_issues_templates_stop_in_milliseconds_at_the_default_budget(name):
    """{{ 'x' * 10 ** 10 }} reached 10.4 GB, two nested range(100000) loops 16.5 GB: both stop
    before growing, long before the 10 s clock, at the default budget of a 4096-token model."""
    template = ChatTemplate(HOSTILE[name], "tokenizer_config.json \"chat_template\"", SPECIALS,
                            budget=RenderBudget(max_seq_length=4096))
    start = time.monotonic()
    with pytest.raises(DataError, match="131312 characters"):
        template.render(MESSAGES, add_generation_prompt=False, where="example 0")
    assert time.monotonic() - start < 1.0


def test_a_signal_during_a_render_ends_it_with_its_own_exception():
    """StageInterrupted (a BaseException a signal handler raises) is not turned into a data error."""
    template = ChatTemplate(HOSTILE["empty_nested_ranges"], "slow.jinja", SPECIALS, budget=RenderBudget(seconds=30))

    def interrupt(signum, frame):
        raise StageInterrupted("SIGALRM", "a template render")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        start = time.monotonic()
        with pytest.raises(StageInterrupted):
            template.render(MESSAGES, add_generation_prompt=False, where="example 0")
        assert time.monotonic() - start < 5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # and the thread's render state is back: the next render works
    assert ChatTemplate("{{ messages[0].content }}", "t", SPECIALS).render(MESSAGES, False) == "hi there"


# Templates a tokenizer directory really holds do: Qwen-style tool and reasoning handling, Llama-style
# headers, a macro, {% set %} blocks, filters, formatting, loop controls.
REAL_LIKE = {
    "chatml": ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "llama": ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' ~ m.role ~ '<|end_header_id|>\\n\\n' }}"
              "{{ m['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
    "reasoning_and_tools": (
        "{%- set ns = namespace(last_user=messages|length - 1, seen=[]) %}"
        "{%- for m in messages[::-1] %}{% if m.role == 'user' and ns.last_user == messages|length - 1 %}"
        "{% set ns.last_user = messages|length - 1 - loop.index0 %}{% endif %}{% endfor %}"
        "{%- macro header(role) %}<|im_start|>{{ role }}\n{% endmacro %}"
        "{%- if tools %}{{ header('system') }}{% for t in tools %}{{ t | tojson(indent=2) }}\n{% endfor %}{% endif %}"
        "{%- for m in messages %}"
        "{%- set content = m.content %}{% set reasoning = '' %}"
        "{%- if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() %}"
        "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
        "{%- set ns.seen = ns.seen + [m.role] %}"
        "{{ header(m.role) }}{% if reasoning and loop.index0 > ns.last_user %}<think>\n{{ reasoning }}\n</think>\n\n"
        "{% endif %}{{ content }}<|im_end|>\n"
        "{%- if loop.last %}{% set roles %}{{ ns.seen | unique | join(',') }}{% endset %}"
        "<!-- {{ '%d messages, %s' % (loop.length, roles) }} {{ '{}/{}'.format(loop.index, loop.length) }}"
        " {{ messages | map(attribute='role') | select('equalto', 'user') | list | length }} -->"
        "{% endif %}{% endfor %}"
        "{%- for i in range(3) %}{% if i == 1 %}{% break %}{% endif %}{{ i }}{% endfor %}"
        "{%- if add_generation_prompt %}{{ header('assistant') | replace('\\n', '\\n') }}{% endif %}"),
}
CONVERSATIONS = [
    MESSAGES,
    [{"role": "system", "content": "Be terse. Café."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}, {"role": "user", "content": "and 3+3?"},
     {"role": "assistant", "content": "<think>again</think>6"}],
    [{"role": "user", "content": "x" * 30000}],  # longer than the sequence: rendered whole
]


@pytest.mark.parametrize("name", list(REAL_LIKE))
def test_real_templates_render_exactly_as_without_a_budget(name):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    plain.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    budgeted = ChatTemplate(REAL_LIKE[name], name, SPECIALS, budget=SMALL)
    tools = [{"name": "calc", "parameters": {"type": "object", "properties": {"x": {"type": "number"}}}}]
    for messages in CONVERSATIONS:
        for generation_prompt in (False, True):
            want = plain.from_string(REAL_LIKE[name]).render(messages=messages, add_generation_prompt=generation_prompt,
                                                             tools=None, documents=None, **SPECIALS)
            assert budgeted.render(messages, generation_prompt) == want
    with_tools = plain.from_string(REAL_LIKE[name]).render(messages=MESSAGES, add_generation_prompt=True, tools=tools,
                                                           **SPECIALS)
    budgeted_tools = budgeted._render_within(budgeted._template, SMALL, MESSAGES, add_generation_prompt=True,
                                             tools=tools, **SPECIALS)
    assert budgeted_tools == with_tools


def word_tokenizer(template: str, origin: str = "data.chat_template=t.jinja") -> WordTokenizer:
    tokenizer = WordTokenizer(["hi", "there", "hello", "you", "user", "assistant"])
    tokenizer.chat_template = ChatTemplate(template, origin, tokenizer.special_tokens())
    return tokenizer


DROPS_ASSISTANT_TURNS = ("{% for m in messages %}{% if m.role != 'assistant' %}{{ m.role }} {{ m.content }} {% endif %}"
                         "{% endfor %}")


@pytest.mark.parametrize("template", ["", DROPS_ASSISTANT_TURNS])
def test_a_template_that_writes_no_assistant_token_is_refused_not_trained_on(template):
    """An empty template file trained on the EOS alone, with rc 0 (loss 0, grad norm 0)."""
    tokenizer = word_tokenizer(template)
    refused = r"example 0: the chat template \(data.chat_template=t.jinja\) writes no token for message 1"
    with pytest.raises(DataError, match=refused):
        encode_sft([SFTExample("hi there", "hello you", tuple(MESSAGES), 0)], tokenizer, 64, "truncate")
    with pytest.raises(DataError, match="writes nothing for this prompt"):
        tokenize_chat_prompt(word_tokenizer(""), MESSAGES[:1], "example 0")
    assert tokenize_chat(word_tokenizer("{% for m in messages %}{{ m.content }} {% endfor %}"), MESSAGES, 0, False,
                         "example 0").targets == [False, False, True, True, True]


def test_a_chat_template_that_is_not_utf8_is_refused_naming_its_file(tmp_path):
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes("{{ 'café' }}".encode("latin-1"))
    with pytest.raises(ChatTemplateError, match=rf"data.chat_template={latin1}: not UTF-8 text .*save the template"):
        load_chat_template(str(latin1), WordTokenizer(["a"]))

    class DirectoryTokenizer:  # what load_chat_template reads of a tokenizer directory's tokenizer
        directory = tmp_path

        def special_tokens(self):
            return SPECIALS

    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ChatTemplateError, match="chat_template.jinja: not UTF-8 text"):
        load_chat_template("auto", DirectoryTokenizer())
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": ')
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json: not valid JSON"):
        load_chat_template("auto", DirectoryTokenizer())


SHAREGPT = [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello you"}]
ANY_READER = [  # (JSON line, what the error says): every way a line can be malformed, for every reader
    ('{"prompt": ' + "[" * 100000 + "]" * 100000 + "}", "JSON nested too deeply to read"),
    ('{"prompt": "p", "x": ' + "[" * 150 + "]" * 150 + "}", "nested more than 100 levels deep"),
    ('{"prompt": ' + "1" * 5000 + "}", "an integer of more than 4300 digits"),
    ('{"prompt": "a\\ud800b", "response": "r", "chosen": "c", "rejected": "d"}', "lone UTF-16 surrogate"),
    (b'{"prompt": "\xff"}', "invalid UTF-8"),
    ('{"prompt": "p"', "invalid JSON"),
    ("[1, 2]", "line is not a JSON object"),
    (json.dumps({"conversations": SHAREGPT}),
     "a ShareGPT record ({from, value} messages); convert it to 'messages' of {role, content}: from human -> role user"),
]
MALFORMED_LINES = [
    *[(reader, line, said) for reader in (read_sft, read_preferences, read_prompts) for line, said in ANY_READER],
    (read_sft, json.dumps({"messages": [{"role": "user", "content": {"a": 1}}]}), "content: expected a non-empty"),
    (read_prompts, json.dumps({"messages": [{"role": "bot", "content": "x"}]}), "role 'bot': expected one of"),
    (read_preferences, json.dumps({"prompt": "p", "chosen": {"from": "gpt", "value": "a"}, "rejected": "b"}),
     "a ShareGPT message ({from, value}), not {role, content}"),
]


@pytest.mark.parametrize("reader, line, said", MALFORMED_LINES)
def test_a_malformed_line_is_one_data_error_naming_file_and_line(tmp_path, reader, line, said):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "fine", "response": "r", "chosen": "c", "rejected": "d"}\n'
                     + (line if isinstance(line, bytes) else line.encode()) + b"\n")
    for read in (reader, lambda p: read_first_of(p, reader)):
        with pytest.raises(DataError) as refused:
            read(path)
        message = str(refused.value)
        assert message.startswith(f"{path}:2: ") and said in message and "\n" not in message


def read_first_of(path: Path, reader) -> None:
    """read_first (the pre-flight's look) of the line that is malformed: the file's second."""
    kind = {read_sft: "sft", read_preferences: "preference", read_prompts: "prompts"}[reader]
    rest = path.with_name("second.jsonl")
    rest.write_bytes(path.read_bytes().split(b"\n", 1)[1])
    try:
        read_first(rest, kind)
    except DataError as err:
        raise DataError(str(err).replace(f"{rest}:1: ", f"{path}:2: ")) from None


def test_sharegpt_messages_under_a_mapped_column_name_the_format(tmp_path):
    path = tmp_path / "sharegpt.jsonl"
    path.write_text(json.dumps({"conversations": SHAREGPT}) + "\n")
    with pytest.raises(DataError, match=r"field 'conversations'\[0\]: a ShareGPT message \(\{from, value\}\)"):
        read_sft(path, RecordFields(messages="conversations"))


def test_the_launchers_preflight_reports_a_deeply_nested_first_record(tmp_path):
    from megatron_rlhf.torchrun import check

    path = tmp_path / "sft.jsonl"
    path.write_text('{"prompt": ' + "[" * 100000 + "]" * 100000 + "}\n")
    cfg = load_config(None, [f"checkpoint.root={tmp_path}", f"data.sft_train={path}", f"data.sft_eval={path}"])
    message = check(cfg, "sft", None)
    assert message == f"data error: {path}:1: JSON nested too deeply to read (more levels than Python's recursion " \
                      "limit, 1000); flatten the record"


def arrow_dataset(directory: Path, rows: int = 500) -> Path:
    """A save_to_disk-style directory: state.json naming one Arrow IPC stream."""
    pytest.importorskip("pyarrow")
    import pyarrow
    import pyarrow.ipc

    directory.mkdir()
    table = pyarrow.Table.from_pylist([{"prompt": f"p{i} " * 20, "response": f"r{i}"} for i in range(rows)])
    with pyarrow.ipc.new_stream(str(directory / "data-00000-of-00001.arrow"), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=100):
            writer.write_batch(batch)
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return directory


DAMAGES = {  # what is done to a good save_to_disk directory or parquet file, and what the error says
    "truncated_arrow_shard": (lambda d: cut(d / "data-00000-of-00001.arrow", 0.6), "truncated or damaged Arrow stream"),
    "arrow_shard_cut_in_its_schema": (lambda d: cut(d / "data-00000-of-00001.arrow", 0.002), "not an Arrow IPC stream"),
    "state_json_not_json": (lambda d: (d / "state.json").write_text("{'_data_files'"), "state.json: not valid JSON"),
    "state_json_not_utf8": (lambda d: (d / "state.json").write_bytes(b"\xff{}"), "state.json: not valid JSON"),
    "state_json_bad_name": (lambda d: (d / "state.json").write_text('{"_data_files": [{"filename": 3}]}'),
                            "names a file that is not a file name"),
    "dataset_dict_not_json": (lambda d: (d / "dataset_dict.json").write_text('{"splits": ['),
                              "dataset_dict.json: not valid JSON, so not the DatasetDict's split names"),
    "truncated_parquet": (lambda d: cut(parquet_of(d), 0.5), "not a readable parquet file"),
    "damaged_parquet_pages": (lambda d: zero_middle(parquet_of(d)), "damaged parquet data"),
}


def cut(path: Path, keep: float) -> Path:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])
    return path


def zero_middle(path: Path) -> Path:
    data = bytearray(path.read_bytes())
    data[len(data) // 4: len(data) // 2] = bytes(len(data) // 2 - len(data) // 4)
    path.write_bytes(bytes(data))
    return path


def parquet_of(directory: Path) -> Path:
    import pyarrow.ipc
    import pyarrow.parquet

    table = pyarrow.ipc.open_stream(str(directory / "data-00000-of-00001.arrow")).read_all()
    pyarrow.parquet.write_table(table, directory / "sft.parquet", compression="snappy", row_group_size=100)
    return directory / "sft.parquet"


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_dataset_is_one_data_error_naming_the_file(tmp_path, damage):
    directory = arrow_dataset(tmp_path / "sft_dir")
    assert len(read_sft(directory)) == 500
    do, said = DAMAGES[damage]
    damaged = do(directory)
    target = damaged if isinstance(damaged, Path) and damaged.suffix == ".parquet" else directory
    for read in (read_sft, read_prompts):
        with pytest.raises(DataError) as refused:
            read(target)
        message = str(refused.value)
        assert said in message and str(directory) in message and "\n" not in message, message
    try:  # the pre-flight's look at the first record: the damage may lie past it
        read_first(target, "sft")
    except DataError as err:
        assert said in str(err)
