"""Rendering a chat template within a budget. A template is code from a download (a tokenizer
directory's tokenizer_config.json): Jinja's sandbox keeps it away from Python's internals, but not
from the machine's memory and time (`{{ 'x' * 10 ** 10 }}`, two nested `range(100000)` loops).

One render (one record, or a prefix of it) may
- write at most `RenderBudget.chars` characters: CHARS_PER_TOKEN per token of
  model.max_seq_length, plus CHARS_PER_INPUT_CHAR per character of the messages (a record longer
  than a sequence is rendered whole and cut after tokenizing);
- build no value larger than that: a string, a macro's or `{% set %}` block's output, or a
  list/dict/namespace counted with everything it holds, each time it holds it (so nesting one
  list in another over and over counts what printing it would write);
- build ALLOCATION_MULTIPLE times that in all (what a deep macro recursion keeps alive), and no
  integer of more than MAX_INT_BITS bits;
- run RenderBudget.seconds, looked at on every loop start, call, filter and macro write.
Past any of these, RenderBudgetExceeded, which data/chat.py reports as a data error naming the
template and the record.

How: BudgetedEnvironment checks a size before anything larger than what the template was given is
made: the operators + * ** % and ~ (`+` and `~` only where no side is a constant string: adding a
constant grows a value by the source's length per run), calls (str methods such as replace,
join, format; lipsum; an integer argument larger than the budget), filters (replace, join,
indent, center, format, wordwrap, urlize estimated; tojson and pprint counted as they write),
list/tuple/dict literals holding variables, namespace attributes, and macros' and blocks'
output. The output is counted as it streams. Anything else a template does reads values already
within the budget, so it costs at most a few times their size. The hooks rely on Jinja 3.1's
compiler (CodeGenerator.buffer, the sandbox's call, call_binop and filters).
"""
from __future__ import annotations

import functools
import json
import pprint
import threading
import time
from dataclasses import dataclass
from types import BuiltinMethodType, FunctionType
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import Namespace, generate_lorem_ipsum

from megatron_rlhf.data.template_sizes import (
    FILTER_SIZES,
    GROWING_TEXT_METHODS,
    REPR_FACTOR,
    allocated,
    binop_size,
    call_arguments,
    lipsum_size,
    measure,
    messages_size,
    text_method_size,
)

# Rendered characters per token of model.max_seq_length (room for what a template adds: system
# prompts, tool descriptions), and per character of the messages rendered (each written a few times).
CHARS_PER_TOKEN = 32
CHARS_PER_INPUT_CHAR = 8
# Characters a render may build in all, as a multiple of the above: a template that accumulates
# text across 500 messages (quadratic) stays within it, a recursion that keeps copies does not.
ALLOCATION_MULTIPLE = 32
RENDER_SECONDS = 10.0
MAX_INT_BITS = 1 << 16  # ~20,000 digits; Python refuses to print ints over 4300 digits anyway
# When ChatTemplate is built without a sequence length (tests, tools); stages pass model.max_seq_length.
DEFAULT_MAX_SEQ_LENGTH = 4096


class RenderBudgetExceeded(Exception):
    """A render went past its budget; the message says which part and by what."""


@dataclass(frozen=True)
class RenderBudget:
    """What one render of a chat template may write and take (see the module docstring)."""

    max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH  # model.max_seq_length
    seconds: float = RENDER_SECONDS

    def chars(self, input_chars: int) -> int:
        """The characters a render of messages holding `input_chars` characters may write."""
        return CHARS_PER_TOKEN * self.max_seq_length + CHARS_PER_INPUT_CHAR * input_chars

    def describe(self, input_chars: int) -> str:
        return (f"{self.chars(input_chars)} characters ({CHARS_PER_TOKEN} per token of model.max_seq_length="
                f"{self.max_seq_length} and {CHARS_PER_INPUT_CHAR} per character of the {input_chars} in the "
                f"messages), {self.seconds:g} s")


def render_within(template, budget: RenderBudget, messages: list, **variables: Any) -> str:
    """`template` (compiled by a BudgetedEnvironment) rendered with `messages` and `variables`
    within `budget`; RenderBudgetExceeded past it (its message ends with the budget)."""
    render = _Render(budget, messages)
    previous, _local.render = _local.render, render
    # root_render_func, not generate(): one generator less per chunk; generate() would only
    # rewrite the traceback of an error, which the caller reports as a message. No clock here:
    # output comes from loops and calls, which look at it.
    chunks = template.root_render_func(template.new_context({"messages": messages, **variables}))
    try:
        parts, written, limit = [], 0, render.limit
        for chunk in chunks:
            written += len(chunk)
            if written > limit:
                if render.past(written):
                    raise RenderBudgetExceeded(f"writes more than {render.limit} characters")
                limit = render.limit
            parts.append(chunk)
        return "".join(parts)
    except RenderBudgetExceeded as exc:
        render.widen()
        raise RenderBudgetExceeded(f"{exc} (budget per render: {budget.describe(render.input_chars)})") from None
    finally:
        chunks.close()
        _local.render = previous


class _Render:
    """One render's account: its limits, deadline and what it wrote and built so far. `what`
    arguments name the operation for the error: a text, or the object called (named only then).

    The limits start at the sequence length's share: the messages' share is counted only when
    something goes past that (`widen`; most renders never do, and counting costs a walk over them)."""

    __slots__ = ("allocated", "allocation_limit", "budget", "deadline", "input_chars", "limit", "messages")

    def __init__(self, budget: RenderBudget, messages: list) -> None:
        self.budget, self.messages, self.input_chars = budget, messages, None
        self.limit = budget.chars(0)
        self.allocation_limit = ALLOCATION_MULTIPLE * self.limit
        self.allocated = 0
        self.deadline = time.monotonic() + budget.seconds

    def widen(self) -> bool:
        """Add the messages' share to the limits, once; whether they grew."""
        if self.input_chars is not None:
            return False
        self.input_chars = messages_size(self.messages)
        self.limit = self.budget.chars(self.input_chars)
        self.allocation_limit = ALLOCATION_MULTIPLE * self.limit
        return True

    def past(self, size: int) -> bool:
        """Whether `size` is past the limit (the messages' share counted first, when needed)."""
        return size > self.limit and (not self.widen() or size > self.limit)

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderBudgetExceeded(f"runs longer than {self.budget.seconds:g} s")

    def measure(self, value: Any) -> int:
        """measure(value), counted up to the limit (widened when it is reached)."""
        size = measure(value, self.limit)
        if size > self.limit and self.widen():
            size = measure(value, self.limit)
        return size

    def expect(self, size: int, what: Any) -> None:
        """Before `what` builds a value of about `size` characters."""
        if self.past(size):
            raise RenderBudgetExceeded(f"{_label(what)} would build a value of {size} characters, more than "
                                       f"{self.limit}")

    def charge(self, size: int, what: Any) -> None:
        self.allocated += size
        if self.allocated > self.allocation_limit and (not self.widen() or self.allocated > self.allocation_limit):
            raise RenderBudgetExceeded(f"builds more than {self.allocation_limit} characters in all "
                                       f"({ALLOCATION_MULTIPLE} times the budget; last: {_label(what)})")

    def admit(self, value: Any, what: Any, charged: bool = True) -> Any:
        """`value`, which `what` built: refused past the limit, else counted (`charged`) as what
        it allocated (itself, and the strings directly in it)."""
        kind = type(value)
        if kind is str:
            size = built = len(value)
        elif kind is bool or kind is int or value is None:  # ints are bounded where they grow (call_binop)
            return value
        else:
            size, built = self.measure(value), allocated(value)
        if self.past(size):
            raise RenderBudgetExceeded(f"{_label(what)} built a value of more than {self.limit} characters")
        if charged:
            self.charge(built, what)
        return value

    def check_integers(self, args: tuple, kwargs: dict, what: Any) -> None:
        """An integer argument is a width, count or length here: none may exceed the limit."""
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, int) and self.past(abs(arg)):
                raise RenderBudgetExceeded(f"{_label(what)} was given {arg}, more than {self.limit}")


def _label(what: Any) -> str:
    if isinstance(what, str):
        return what
    name = _GLOBAL_NAMES.get(what) or getattr(what, "__name__", None) or getattr(what, "name", None)
    return f"calling {name or type(what).__name__}"


class _RenderInThisThread(threading.local):
    render: _Render | None = None  # the render running in this thread


_local = _RenderInThisThread()


def _current() -> _Render:
    render = _local.render
    if render is None:
        # Jinja folds calls of filters on constants while compiling: refused here, so they are
        # evaluated when rendering, within a budget.
        raise RenderBudgetExceeded("outside a budgeted render")
    return render


class BoundedNamespace(Namespace):
    """namespace(): an attribute set in a loop (`{% set ns.text = ns.text ~ ns.text %}`) stays
    within the budget."""

    def __setitem__(self, name: str, value: Any) -> None:
        _current().admit(value, f"namespace attribute {name!r}", charged=False)  # its maker was charged
        super().__setitem__(name, value)


class _OutputBuffer(list):
    """The output of a macro, a `{% set %}`/`{% filter %}` block or a call block, bounded while
    it is written (a macro's output would otherwise be checked only once it is complete)."""

    __slots__ = ("chars",)

    def __init__(self) -> None:
        super().__init__()
        self.chars = 0

    def append(self, text: str) -> None:
        self._count(len(text))
        super().append(text)

    def extend(self, texts) -> None:
        texts = tuple(texts)
        self._count(sum(len(text) for text in texts))
        super().extend(texts)

    def _count(self, size: int) -> None:
        render = _current()
        render.check_time()
        self.chars += size
        if render.past(self.chars):
            raise RenderBudgetExceeded(f"a macro or block writes more than {render.limit} characters")
        render.charge(size, "a macro or block's output")


# What a template calls these globals (for errors).
_GLOBAL_NAMES = {BoundedNamespace: "namespace", generate_lorem_ipsum: "lipsum", safe_range: "range"}
# The filter a for loop's iterable goes through (added to every loop when parsing; a name no
# template can write).
_ITERATION_FILTER = "bounded iteration"


class _BudgetedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with output buffers, `~` and literals that hold variables going
    through BudgetedEnvironment."""

    def buffer(self, frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.output_buffer()")

    @optimizeconst
    def visit_Add(self, node, frame) -> None:
        """`+` with a constant string on one side grows by that constant each time it runs
        (loops and recursion bound the times, and what the result is kept in is checked):
        Python's own, as fast as without a budget. Any other `+` goes through call_binop."""
        if not (_constant_text(node.left) or _constant_text(node.right)):
            super().visit_Add(node, frame)
            return
        self.write("(")
        self.visit(node.left, frame)
        self.write(" + ")
        self.visit(node.right, frame)
        self.write(")")

    @optimizeconst
    def visit_Concat(self, node, frame) -> None:
        if sum(not _constant_text(part) for part in node.nodes) <= 1:  # grows by constants only, as `+` above
            super().visit_Concat(node, frame)
            return
        self.write("environment.bounded_concat(context, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_List(self, node, frame) -> None:
        self._literal(super().visit_List, node, frame)

    def visit_Tuple(self, node, frame) -> None:
        self._literal(super().visit_Tuple, node, frame)

    def visit_Dict(self, node, frame) -> None:
        self._literal(super().visit_Dict, node, frame)

    def _literal(self, visit, node, frame) -> None:
        """A literal of constants is as large as the source; one with variables in it may nest
        what it holds (`{% set b = [a, a] %}{% set c = [b, b] %}...`): measured when built."""
        if getattr(node, "ctx", "load") != "load" or _constant(node, frame):
            visit(node, frame)
            return
        self.write("environment.bounded_literal(")
        visit(node, frame)
        self.write(")")


def _constant_text(node) -> bool:
    return isinstance(node, nodes.Const) and isinstance(node.value, str)


def _constant(node, frame) -> bool:
    try:
        node.as_const(frame.eval_ctx)
    except Exception:  # noqa: BLE001  (nodes.Impossible: not a constant; anything else is raised when rendering)
        return False
    return True


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every way a template can make something large or loop long
    checked against the render's budget (render templates with `render_within`)."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})
    code_generator_class = _BudgetedCodeGenerator

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals["namespace"] = BoundedNamespace
        self.filters["pprint"] = _pprint
        self.filters = {name: bounded_filter(name, function) for name, function in self.filters.items()}
        self.filters[_ITERATION_FILTER] = self.bounded_iteration

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """The template's syntax tree, every for loop iterating through `bounded_iteration`."""
        template = super()._parse(source, name, filename)
        for loop in list(template.find_all(nodes.For)):
            loop.iter = nodes.Filter(loop.iter, _ITERATION_FILTER, [], [], None, None, lineno=loop.iter.lineno)
        return template

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        render = _local.render or _current()
        if operator == "+" and type(left) is str and type(right) is str:  # the common case, kept short
            size = len(left) + len(right)
            render.allocated += size
            if size > render.limit or render.allocated > render.allocation_limit:
                render.allocated -= size
                render.expect(size, "'+'")
                render.charge(size, "'+'")
            return left + right
        size, bits = binop_size(operator, left, right)
        if bits > MAX_INT_BITS:
            raise RenderBudgetExceeded(f"'{operator}' would build an integer of about {bits} bits, more than "
                                       f"{MAX_INT_BITS}")
        render.expect(size, f"'{operator}'")
        render.charge(size, f"'{operator}'")
        return self.binop_table[operator](left, right)

    def call(self, context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        render = _local.render or _current()
        if time.monotonic() > render.deadline:
            render.check_time()
        kind = type(obj)
        if kind is BuiltinMethodType:  # str.replace, str.join, ... (the type check first: it is cheap)
            if isinstance(obj.__self__, (str, bytes)) and obj.__name__ in GROWING_TEXT_METHODS:
                size, args = text_method_size(obj.__self__, obj.__name__, args, call_arguments(kwargs))
                render.expect(size, obj)
        elif kind is FunctionType and "__wrapped__" in obj.__dict__:  # str.format, wrapped by the sandbox
            owner = getattr(obj.__wrapped__, "__self__", None)
            if isinstance(owner, (str, bytes)):
                size, args = text_method_size(owner, obj.__name__, args, call_arguments(kwargs))
                render.expect(size, obj)
        elif obj is generate_lorem_ipsum:
            render.expect(lipsum_size(args, call_arguments(kwargs)), obj)
        if obj is not safe_range:  # (range: capped by the sandbox, 100000 items)
            for arg in (*args, *kwargs.values()):
                if type(arg) is int and abs(arg) > render.limit:
                    render.check_integers(args, kwargs, obj)
        # The sandbox's own checks (before Jinja 3.1.5 also its str.format handling).
        return _admitted(render, super().call(context, obj, *args, **kwargs), obj)

    def bounded_iteration(self, iterable: Any) -> Any:
        """A for loop's iterable, as is, once the clock is looked at: between two looks runs at
        most one loop without loops or calls in its body (they look again), over a value within
        the budget, the messages, or a range (at most 100000 items)."""
        render = _local.render or _current()
        if time.monotonic() > render.deadline:
            render.check_time()
        return iterable

    def bounded_concat(self, context, parts: tuple) -> str:
        render = _current()
        size = sum(len(part) if isinstance(part, str) else REPR_FACTOR * render.measure(part) for part in parts)
        render.expect(size, "'~'")
        joined = markup_join(parts) if context.eval_ctx.autoescape else str_join(parts)
        render.charge(len(joined), "'~'")
        return joined

    def bounded_literal(self, value: Any) -> Any:
        return _current().admit(value, "a list, tuple or dict literal")

    def output_buffer(self) -> list:
        return _OutputBuffer()


def bounded_filter(name: str, function):
    """Filter `function` checked against the running render's budget: its integer arguments,
    its estimated output (FILTER_SIZES) before it runs, what it returns after."""
    skip = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0  # context, eval_ctx or environment
    size_of = FILTER_SIZES.get(name)
    what = f"the {name} filter"

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        render = _local.render or _current()
        if time.monotonic() > render.deadline:
            render.check_time()
        if len(args) > skip + 1 or kwargs:
            rest = args[skip + 1:]
            render.check_integers(rest, kwargs, what)
            if size_of is not None:
                size, value = size_of(args[skip], rest, kwargs)
                render.expect(size, what)
                args = (*args[:skip], value, *rest)
        return _admitted(render, function(*args, **kwargs), what)

    return bounded


def _admitted(render, result: Any, what: Any) -> Any:
    """A call's or filter's `result`, charged to the render's budget (a str, the common case, in
    a few operations; anything else measured by render.admit)."""
    if type(result) is str:
        render.allocated += len(result)
        if len(result) > render.limit or render.allocated > render.allocation_limit:
            render.allocated -= len(result)
            render.admit(result, what)
        return result
    return render.admit(result, what)


class _CountedText:
    """A stream for json and pprint to write into, counted against the render's budget as it grows."""

    def __init__(self, what: str) -> None:
        self.render, self.what, self.parts, self.size = _current(), what, [], 0

    def write(self, text: str) -> None:
        self.size += len(text)
        if self.render.past(self.size):
            raise RenderBudgetExceeded(f"{self.what} writes more than {self.render.limit} characters")
        self.parts.append(text)
        if len(self.parts) % 256 == 0:
            self.render.check_time()

    def text(self) -> str:
        return "".join(self.parts)


def json_text(value: Any, **options: Any) -> str:
    """json.dumps(value, **options), written piece by piece within the render's budget (an
    `indent` repeats per line and level, so the size is known only while writing)."""
    out = _CountedText("the tojson filter")
    for chunk in json.JSONEncoder(**options).iterencode(value):
        out.write(chunk)
    return out.text()


def _pprint(value: Any) -> str:
    """Jinja's pprint (pprint.pformat), written within the render's budget."""
    out = _CountedText("the pprint filter")
    pprint.PrettyPrinter(stream=out).pprint(value)
    return out.text()[:-1]  # pprint() ends with a newline that pformat leaves out
