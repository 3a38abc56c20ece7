"""Sizes, estimated before a chat template makes something (data/template_budget.py checks them
against the render's budget): what a value holds, what an operator, a str method or a filter would
write. Upper bounds, within a small factor; an argument of the wrong type gives a rough number
and the operation itself then raises the template's error."""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from string import Formatter
from typing import Any

from jinja2.utils import Namespace

# str() of a value writes at most this many characters per character `measure` counts
# (quotes, separators, escapes such as \U000e0001).
REPR_FACTOR = 10
_OTHER_SIZE = 32  # what measure counts for an object that is neither text, number nor container
_TEXT = {str}


def measure(value: Any, limit: int = sys.maxsize) -> int:
    """About the characters str(value) writes, an upper bound up to REPR_FACTOR: a string's
    length; a container's items counted each time they appear (a list holding one list twice
    counts it twice). Stops counting once past `limit`."""
    kind = type(value)
    if kind is str:
        return len(value)
    if (kind is list or kind is tuple) and _all_text(value):  # str.split's, a list of names
        return 2 + 4 * len(value) + sum(map(len, value))
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        kind = type(item)  # the common types first, by identity: this runs on every record
        if kind is str:
            total += len(item) + 2
        elif kind is dict:
            total += 2 + 4 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif kind is list or kind is tuple:
            total += 2 + 2 * len(item)
            stack.extend(item)
        elif kind is bool or item is None:
            total += 5
        elif kind is int:
            total += item.bit_length() // 3 + 2
        else:
            total += _measure_other(item, stack)
        if total > limit:
            return total
    return total


def _measure_other(item: Any, stack: list) -> int:
    """measure's count for `item` itself; what it holds is pushed on `stack`."""
    if isinstance(item, Namespace):
        stack.append(object.__getattribute__(item, "_Namespace__attrs"))
        return 12
    if isinstance(item, (str, bytes)):
        return len(item) + 2
    if isinstance(item, bool) or item is None:
        return 5
    if isinstance(item, int):
        return item.bit_length() // 3 + 2
    if isinstance(item, (list, tuple, set, frozenset)):
        stack.extend(item)
        return 2 + 2 * len(item)
    if isinstance(item, (dict, Mapping)):  # dict first: Mapping's check is slow
        stack.extend(item.keys())
        stack.extend(item.values())
        return 2 + 4 * len(item)
    return _OTHER_SIZE


def _all_text(items: list | tuple) -> bool:
    return {*map(type, items)} <= _TEXT


def messages_size(messages: list) -> int:
    """The characters of the messages a template renders (measure's count, quicker for {role, content}
    dicts: this runs on every render)."""
    total = 0
    for message in messages:
        if type(message) is not dict:
            total += measure(message)
            continue
        for value in message.values():
            total += len(value) if type(value) is str else measure(value)
    return total


def call_arguments(kwargs: dict) -> dict:
    """A call's keyword arguments, without the loop's and block's variables Jinja passes along
    (Context.call takes them out before calling)."""
    return {key: value for key, value in kwargs.items() if key not in ("_loop_vars", "_block_vars")}


def allocated(value: Any) -> int:
    """What building `value` allocated, about: a new container's slots and the strings directly
    in it (what it holds further down was counted when that was built)."""
    kind = type(value)
    if kind is str or kind is bytes:
        return len(value)
    if (kind is list or kind is tuple) and _all_text(value):
        return len(value) + sum(map(len, value))
    if kind is dict:
        value = value.values()
    elif not isinstance(value, (list, tuple, set, frozenset)):
        if not isinstance(value, Mapping) or isinstance(value, Namespace):
            return 1
        value = value.values()
    return sum(len(item) + 1 if isinstance(item, (str, bytes)) else 1 for item in value)


def binop_size(operator: str, left: Any, right: Any) -> tuple[int, int]:
    """(about the size of `left <operator> right`, 0 when nothing grows; the bits of the
    integer it makes, 0 when it makes none), before computing it."""
    sequences = (str, bytes, list, tuple)
    both_ints = isinstance(left, int) and isinstance(right, int)
    if operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
        return measure(left) + measure(right), 0
    if operator == "*" and both_ints:
        return 0, left.bit_length() + right.bit_length()
    if operator == "*":
        sequence, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(sequence, sequences) and isinstance(times, int):
            return measure(sequence) * max(times, 0), 0
    if operator == "**" and both_ints and right > 0 and abs(left) > 1:
        return 0, left.bit_length() * right
    if operator == "%" and isinstance(left, str):
        return percent_size(left, right), 0
    return 0, 0


_CONVERSION = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?.", re.DOTALL)


def percent_size(text: str, args: Any) -> int:
    """About the size of `text % args`: each conversion writes the largest argument, padded to
    its width and precision."""
    values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
    star = max((abs(v) for v in values if isinstance(v, int)), default=0)
    size, largest = len(text), max((_printed(v) for v in values), default=0)
    for width, precision in _CONVERSION.findall(text):
        size += largest + sum(star if n == "*" else _number(n) for n in (width, precision) if n)
    return size


def format_size(text: str, args: tuple, kwargs: Mapping) -> int:
    """About the size of `text.format(*args, **kwargs)`: each field writes the largest argument
    (or anything reached from it), padded to the numbers in its format spec."""
    values = [*args, *kwargs.values()]
    largest = max((_printed(v) for v in values), default=0)
    star = max((abs(v) for v in values if isinstance(v, int)), default=0)
    size = 0
    try:
        for literal, field, spec, _ in Formatter().parse(text):
            size += len(literal)
            if field is not None:
                spec = spec or ""
                size += largest + sum(_number(n) for n in re.findall(r"\d+", spec)) + (star if "{" in spec else 0)
    except ValueError:  # a malformed format: the call raises it
        return len(text)
    return size


def _printed(value: Any) -> int:
    return len(value) if isinstance(value, str) else REPR_FACTOR * measure(value)


def _number(digits: str) -> int:
    return int(digits) if len(digits) < 19 else 10**19


def argument(args: tuple, kwargs: dict, position: int, name: str, default: Any) -> Any:
    return args[position] if len(args) > position else kwargs.get(name, default)


# The str (and bytes) methods that can write more than their string (the others write at most a
# few times it: upper, split, strip, ...).
GROWING_TEXT_METHODS = frozenset({"replace", "join", "format", "format_map", "expandtabs", "translate"})


def text_method_size(text: str | bytes, name: str, args: tuple, kwargs: dict) -> tuple[int, tuple]:
    """(about the size of what str (or bytes) method `name` of `text` writes, 0 for one that
    writes no more than its string; the arguments to call it with: join's iterable, read once)."""
    if name == "replace" and len(args) >= 2:
        return replace_size(text, args[0], args[1], argument(args, kwargs, 2, "count", -1)), args
    if name == "join" and args:
        items = list(args[0])
        return sum(_printed(item) for item in items) + len(text) * len(items), (items, *args[1:])
    if name in ("format", "format_map"):
        mapping = args[0] if name == "format_map" and args and isinstance(args[0], Mapping) else {}
        return format_size(text, () if mapping else args, mapping or kwargs), args
    if name == "expandtabs":
        tab = "\t" if isinstance(text, str) else b"\t"
        return len(text) + text.count(tab) * argument(args, kwargs, 0, "tabsize", 8), args
    if name == "translate" and args and isinstance(args[0], Mapping):
        return len(text) * max((measure(v) for v in args[0].values()), default=1), args
    return 0, args


def lipsum_size(args: tuple, kwargs: dict) -> int:
    """About the size of lipsum(n, html, min, max): n paragraphs of up to max words."""
    return 16 * argument(args, kwargs, 0, "n", 5) * argument(args, kwargs, 3, "max", 100)


def replace_size(text: Any, old: Any, new: Any, count: Any) -> int:
    text, old, new = (x if isinstance(x, (str, bytes)) else str(x) for x in (text, old, new))
    found = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(text) + found * max(len(new) - len(old), 0)


def _filter_replace(value, args, kwargs):
    old, new = argument(args, kwargs, 0, "old", ""), argument(args, kwargs, 1, "new", "")
    return replace_size(value, old, new, argument(args, kwargs, 2, "count", None)), value


def _filter_join(value, args, kwargs):
    # measure, not _printed: an item joined by attribute is part of it (str() of a list item
    # may write up to REPR_FACTOR times more; the result is refused after, once)
    items = list(value)
    separator = str(argument(args, kwargs, 0, "d", ""))
    return sum(measure(item) for item in items) + len(separator) * len(items), items


def _filter_indent(value, args, kwargs):
    text = str(value)
    width = argument(args, kwargs, 0, "width", 4)
    return len(text) + (text.count("\n") + 1) * (width if isinstance(width, int) else len(str(width))), value


def _filter_wordwrap(value, args, kwargs):
    text, wrap = str(value), argument(args, kwargs, 2, "wrapstring", None)
    return len(text) + (len(text) + 1) * len(str(wrap or "\n")), value


def _filter_urlize(value, args, kwargs):
    text = str(value)
    extra = sum(len(str(argument(args, kwargs, i, name, None) or "")) for i, name in ((2, "target"), (3, "rel")))
    return 3 * len(text) + (len(text) // 4 + 1) * (64 + extra), value


# Filters that can write more than they are given, and how much at most: (estimate, the value to pass on).
FILTER_SIZES = {
    "replace": _filter_replace,
    "join": _filter_join,
    "indent": _filter_indent,
    "center": lambda value, args, kwargs: (max(len(str(value)), argument(args, kwargs, 0, "width", 80)), value),
    "format": lambda value, args, kwargs: (percent_size(str(value), kwargs or args), value),
    "wordwrap": _filter_wordwrap,
    "urlize": _filter_urlize,
}
