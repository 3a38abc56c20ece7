"""Chat templates: `messages` records rendered the way the model's tokenizer renders them, and
the tokens the loss trains on.

A template is a Jinja string (the one in a tokenizer directory's tokenizer_config.json or
chat_template.jinja, or a file named by data.chat_template), rendered as Hugging Face
transformers renders it: a sandboxed environment, trim_blocks/lstrip_blocks, the loop controls,
`raise_exception`, a `tojson` that keeps non-ASCII text, `strftime_now`, and the tokenizer's
special tokens (bos_token, eos_token, ...) as variables. `{% generation %}` blocks are accepted
(their text is rendered as is); the trained tokens come from prefixes instead (below).

Which tokens are trained: for every trained assistant message i, the text between
render(messages[:i], add_generation_prompt=True) and render(messages[:i + 1]) - the assistant
content and the end-of-turn the template writes after it - must be a span of
render(messages); the tokens overlapping such a span are targets. A template that renders
earlier turns differently once later turns follow (some drop the reasoning of past turns) is
refused with the fix (train on the last assistant turn only).

Tool use: assistant `tool_calls` and `tool` messages are rendered by the template like any
message (tool results are context), with the record's `tools` passed as `tools=` (None without
them, as apply_chat_template). The prefix check above is what keeps a template that is not
append-only around tool messages from mis-masking (refused naming tool messages and the fixes),
and a template that does not write an assistant's tool calls is refused.

BOS: the rendered text is tokenized without special tokens (as transformers'
apply_chat_template(tokenize=True) does), so a template that writes the BOS token has it once;
a template that does not, on a tokenizer whose post-processor adds a BOS, gets that BOS
prepended. Never twice.

EOS: every trained sequence ends with the tokenizer's EOS, as generation does (it stops there).
When the last turn, as the template writes it, holds the EOS token (Llama 3's <|eot_id|>, Qwen's
<|im_end|>), the sequence ends right after it (a newline the template writes after it is left
out); otherwise the EOS is appended and trained on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from megatron_rlhf.data.errors import DataError
from megatron_rlhf.data.tokenizers import TokenizerError

# data.chat_template values that are not a file.
AUTO, NONE = "auto", "none"
# data.chat_loss: which assistant turns of a `messages` SFT record the loss trains on.
CHAT_LOSS_TURNS = ("all_assistant", "last_assistant")


class ChatTemplateError(TokenizerError):
    """A template that cannot be read or compiled; the message names where it came from."""


def load_chat_template(setting: str, tokenizer, chat_loss: str = CHAT_LOSS_TURNS[0],
                       max_seq_length: int | None = None) -> ChatTemplate | None:
    """The template data.chat_template=`setting` names for `tokenizer`: none; auto (the
    tokenizer directory's, or none when it has none); or a Jinja file. `chat_loss`
    (data.chat_loss): the assistant turns of an SFT conversation the loss trains on.
    `max_seq_length` (model.max_seq_length) sizes its render budget (data/template_budget.py)."""
    if setting == NONE:
        return None
    if setting == AUTO:
        directory = getattr(tokenizer, "directory", None)
        found = tokenizer_directory_template(Path(directory)) if directory is not None else None
        if found is None:
            return None
        source, origin = found
    else:
        path = Path(setting)
        if not path.is_file():
            raise ChatTemplateError(f"data.chat_template={setting}: file not found; use auto (the tokenizer "
                                    "directory's template), none, or the path of a Jinja template file")
        origin = f"data.chat_template={setting}"
        source = _read_text(path, origin)
    from megatron_rlhf.data.template_budget import RenderBudget  # imports jinja2: only when a template is used

    budget = RenderBudget() if max_seq_length is None else RenderBudget(max_seq_length=max_seq_length)
    return ChatTemplate(source, origin, tokenizer.special_tokens(), chat_loss == "last_assistant", budget)


class ChatTemplate:
    """A compiled chat template, the special-token variables it is rendered with, and the budget
    each render stays within (data/template_budget.py)."""

    def __init__(self, source: str, origin: str, special_tokens: Mapping[str, str],
                 last_assistant_only: bool = False, budget=None) -> None:
        from megatron_rlhf.data.template_budget import RenderBudget, RenderBudgetExceeded, render_within

        self.source = source
        self.origin = origin  # where it came from, for errors and notes
        self.special_tokens = dict(special_tokens)
        # data.chat_loss=last_assistant: an SFT conversation trains on its last assistant turn only.
        self.last_assistant_only = last_assistant_only
        self.budget = budget or RenderBudget()
        self._render_within, self._over_budget = render_within, RenderBudgetExceeded
        try:
            self._template = _environment().from_string(source)
        except Exception as exc:  # jinja2.TemplateSyntaxError and friends
            raise ChatTemplateError(f"{origin}: the chat template does not compile ({exc})") from None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, where: str = "",
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The template's text for `messages` (and the record's function schemas `tools`, None
        when it has none, as apply_chat_template(tools=...)); a DataError at `where` when the
        template refuses them or goes past its budget. A signal's exception (a BaseException)
        passes through."""
        try:
            return self._render_within(self._template, self.budget, list(messages),
                                       add_generation_prompt=add_generation_prompt,
                                       tools=None if tools is None else list(tools), documents=None,
                                       **self.special_tokens)
        except self._over_budget as exc:
            raise DataError(f"{where}: the chat template ({self.origin}) {exc}; fix the template, or give "
                            "another (data.chat_template=<file.jinja>)") from None
        except Exception as exc:  # raise_exception in the template, or an undefined value it needs
            raise DataError(f"{where}: the chat template ({self.origin}) refuses this record: {exc}") from None


def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols

    from megatron_rlhf.data.template_budget import BudgetedEnvironment, bounded_filter, json_text

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers): the body as is."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return nodes.Scope(parser.parse_statements(("name:endgeneration",), drop_needle=True))

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which would change the rendered text.
        return json_text(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = bounded_filter("tojson", tojson)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def tokenizer_directory_template(directory: Path) -> tuple[str, str] | None:
    """(template, origin) a Hugging Face tokenizer directory carries, or None."""
    config_file = directory / "tokenizer_config.json"
    if config_file.is_file():
        try:
            config = json.loads(_read_text(config_file, str(config_file)))
        except json.JSONDecodeError as exc:
            raise ChatTemplateError(f"{config_file}: not valid JSON ({exc})") from None
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
        if isinstance(template, str) and template:
            return template, f"{config_file} \"chat_template\""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return _read_text(jinja_file, str(jinja_file)), str(jinja_file)
    return None


def _read_text(path: Path, origin: str) -> str:
    """A template file's text; ChatTemplateError naming `origin` when it is not UTF-8 or cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"{origin}: not UTF-8 text ({exc.reason} at byte {exc.start}); save the template "
                                "as UTF-8") from None
    except OSError as exc:
        raise ChatTemplateError(f"{origin}: cannot read ({exc.strerror or exc})") from None


@dataclass(frozen=True)
class ChatTokens:
    """A rendered conversation's token ids; `targets[i]`: token i is one the loss trains on."""

    ids: list[int]
    targets: list[bool]


def tokenize_chat(tokenizer, messages: Sequence[Mapping[str, Any]], first_trained: int, last_only: bool,
                  where: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ChatTokens:
    """`messages` (ending with an assistant message) rendered with tokenizer.chat_template (and
    the record's `tools`) and tokenized; targets: the assistant messages from index
    `first_trained` on (the last only with `last_only`), each with its end-of-turn (tool calls
    included), and the final EOS (see the module docstring). Tool messages are context."""
    template = _template_of(tokenizer, where)
    text = template.render(messages, add_generation_prompt=False, where=where, tools=tools)
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first_trained]
    if not trained:
        raise DataError(f"{where}: no assistant message to train on")
    if last_only:
        trained = trained[-1:]
    spans = []
    for i in trained:
        start = template.render(messages[:i], add_generation_prompt=True, where=where, tools=tools)
        end = template.render(messages[: i + 1], add_generation_prompt=False, where=where, tools=tools)
        if not (text.startswith(start) and text.startswith(end) and len(start) <= len(end)):
            if any(m["role"] == "tool" or m.get("tool_calls") for m in messages[: i + 2]):
                raise DataError(_not_split_at_tools(template.origin, where, i))
            raise DataError(f"{where}: the chat template ({template.origin}) renders message {i} differently once "
                            "later messages follow, so its tokens cannot be told apart; train on the last "
                            "assistant turn only (data.chat_loss=last_assistant) or give the conversation as "
                            "separate records")
        spans.append((len(start), len(end)))
        _check_calls_written(messages[i], text[len(start):len(end)], template.origin, where, i)
    ids, offsets = _encode(tokenizer, text)
    for i, (span_start, span_end) in zip(trained, spans, strict=True):
        if not any(end > start and start < span_end and end > span_start for start, end in offsets):
            # An empty template (or one that drops assistant turns) would train on the EOS alone.
            raise DataError(f"{where}: the chat template ({template.origin}) writes no token for message {i} (the "
                            "assistant's), so nothing of it would be trained; fix the template so it writes each "
                            "assistant message's content")
    targets = [end > start and any(start < s_end and end > s_start for s_start, s_end in spans)
               for start, end in offsets]
    last_start, last_end = spans[-1]
    in_last_turn = [t for t, (start, end) in enumerate(offsets) if start < last_end and end > last_start]
    eos_in_turn = [t for t in in_last_turn if ids[t] == tokenizer.eos_id]
    if eos_in_turn:  # the template closes the turn with the EOS: the sequence ends there
        cut = eos_in_turn[-1] + 1
        return ChatTokens(ids[:cut], targets[:cut])
    cut = in_last_turn[-1] + 1 if in_last_turn else len(ids)
    return ChatTokens(ids[:cut] + [tokenizer.eos_id], targets[:cut] + [True])


def _not_split_at_tools(origin: str, where: str, i: int) -> str:
    """Why a tool-use conversation's assistant message `i` cannot be told apart, and the fixes."""
    return (f"{where}: the chat template ({origin}) is not append-only around the tool messages before or after "
            f"assistant message {i}: the conversation up to it, rendered with the generation prompt (what the "
            "model sees when it writes that turn), is not how the whole conversation begins (some templates "
            "merge consecutive tool results into one block, or close a block only when another message "
            "follows), so its tokens cannot be told apart; train on the last assistant turn only "
            "(data.chat_loss=last_assistant), split the conversation into one record per assistant turn, or give "
            "a template that renders tool messages append-only (data.chat_template=<file.jinja>)")


def _check_calls_written(message: Mapping[str, Any], turn: str, origin: str, where: str, i: int) -> None:
    """DataError when assistant message `i` calls tools and the template's text of the turn does
    not name them all: a template without a tool-call format would train the turn without its calls."""
    for call in message.get("tool_calls") or ():
        name = call.get("function", call)["name"]
        if name not in turn:
            raise DataError(f"{where}: the chat template ({origin}) does not write message {i}'s tool call {name!r} "
                            "(it has no tool-call format, so the turn would be trained without its call); give a "
                            "template that writes tool_calls (data.chat_template=<file.jinja>), or write the call "
                            "in the message's content as the model should produce it")


def tokenize_chat_prompt(tokenizer, messages: Sequence[Mapping[str, Any]], where: str,
                         tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """`messages` (without the answer; the record's `tools`) rendered with the generation
    prompt: what the policy continues."""
    template = _template_of(tokenizer, where)
    text = template.render(messages, add_generation_prompt=True, where=where, tools=tools)
    if not text.strip():
        raise DataError(f"{where}: the chat template ({template.origin}) writes nothing for this prompt; fix the "
                        "template so it writes the messages")
    ids, _ = _encode(tokenizer, text)
    return ids


def _template_of(tokenizer, where: str) -> ChatTemplate:
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise DataError(f"{where}: a 'messages' record needs a chat template; set data.chat_template=auto with a "
                        "tokenizer directory that has one, or data.chat_template=<file.jinja>")
    return template


def _encode(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    ids, offsets = tokenizer.encode_with_offsets(text)
    bos = tokenizer.bos_id
    if bos is not None and (not ids or ids[0] != bos):
        ids, offsets = [bos, *ids], [(0, 0), *offsets]
    return ids, offsets
