"""The sandbox chat templates render in, bounded in time, size and depth: a template is the input's, not qual's.

transformers' sandbox (ImmutableSandboxedEnvironment: no attribute starting with "_", no mutation of lists and
dicts) keeps a template from reaching Python; it does not keep it from running for hours or allocating terabytes.
A timer alone cannot bound that: `'a' * 10**10` is one C call, which no timer interrupts. So every operation that
makes a large value from small ones is checked before it runs, and every step that can repeat counts against a
budget:
- the operators `*`, `**`, `+`, `%` (intercepted by the sandbox) and `~` (concatenation, rewritten into a checked
  call), each refused when its result would be longer than MAX_CHARS (a string, a list) or wider than MAX_INT_BITS
  (an integer);
- every call (a method, a global, a macro) and every filter: an integer argument above MAX_ARGUMENT (a width, a
  count: `center(10**10)`, `tojson(indent=10**12)`, `lipsum(10**7)`) and a format width above it are refused, a
  string method's result is estimated before it runs (`replace`, `join`, `expandtabs`), and every result is checked
  after (nothing grows past MAX_CHARS);
- a value stored on a namespace is checked like a result;
- every loop iteration and every call is a step: MAX_STEPS steps or RENDER_SECONDS seconds end the render (a loop
  nested in a loop over `range(100000)`), and recursion ends at Python's own depth limit (a macro calling itself);
- the rendered text is streamed and cut off at MAX_CHARS (a 110 MB prompt);
- `{% include %}`, `{% import %}` and `{% extends %}` are refused by name: a chat template is one file.
Each refusal is a RenderLimit naming the bound; qual.chat turns it into an exit-2 error naming the request.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

MAX_CHARS = 4 << 20  # a rendered prompt, or any string or list a template builds: 4 Mi characters (items)
MAX_INT_BITS = 1 << 16  # an integer a template computes
MAX_ARGUMENT = 100_000  # an integer argument (a width, a count, an indent): jinja's own bound on range()
MAX_STEPS = 5_000_000  # loop iterations and calls of one render
RENDER_SECONDS = 10.0  # one render's wall time (a real template takes well under a millisecond)
_CLOCK_EVERY = 1024  # steps between looks at the clock
# A format width or precision of 7 digits or more ("%10000000s", "{:>1000000}"): more than MAX_ARGUMENT allows
_WIDE_FORMAT = re.compile(r"%[-+ #0]*\d{6,}|%[-+ #0]*\d*\.\d{6,}|\{[^{}]*:[^{}]*\d{6,}[^{}]*\}")
_GROWING_METHODS = {"ljust", "rjust", "center", "zfill", "expandtabs", "replace", "join", "format", "format_map",
                    "__mul__", "__rmul__", "__add__", "__mod__"}


class RenderLimit(Exception):
    """A chat template went past one of the render's bounds."""


class Budget:
    """One render's steps and deadline."""

    __slots__ = ("steps", "deadline")

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + RENDER_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise RenderLimit(f"more than {MAX_STEPS} loop iterations and calls")
        if self.steps % _CLOCK_EVERY == 0 and time.monotonic() > self.deadline:
            raise RenderLimit(f"longer than {RENDER_SECONDS:g} s")


_CONTAINERS = (list, tuple, dict, set, frozenset)
_SIZED = (str, *_CONTAINERS)
_PLAIN = frozenset({int, float, bool, type(None)})  # what needs no size (an int's width is checked apart)


def size(value: Any, limit: int = MAX_CHARS) -> int:
    """How large a value is for the bound: a string's characters, a container's items plus its items' sizes
    (counted until past `limit`)."""
    kind = type(value)
    if kind is str:
        return len(value)
    if kind in _PLAIN or kind not in _CONTAINERS and not isinstance(value, _SIZED):
        return 0
    if isinstance(value, str):
        return len(value)
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, _CONTAINERS):
            total += len(item)
            stack.extend(item)
    return total


def check_size(value: Any, what: str) -> Any:
    """value, if it is within the bounds (an integer's width, a string's or container's size)."""
    kind = type(value)
    if kind is str:
        if len(value) > MAX_CHARS:
            raise RenderLimit(f"{what}: a value longer than {MAX_CHARS} characters")
        return value
    if kind is int and value.bit_length() > MAX_INT_BITS:
        raise RenderLimit(f"{what}: an integer wider than {MAX_INT_BITS} bits")
    if kind not in _PLAIN and size(value) > MAX_CHARS:
        raise RenderLimit(f"{what}: a value longer than {MAX_CHARS} characters")
    return value


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_arguments(what: str, args: tuple, kwargs: dict) -> None:
    """No integer argument above MAX_ARGUMENT, no format width of it. (Every argument was checked when it was made;
    what a call makes of them is checked when it returns.)"""
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if kind is int and abs(value) > MAX_ARGUMENT:
            raise RenderLimit(f"{what}: an argument of {value} (at most {MAX_ARGUMENT})")
        if kind is str and ("%" in value or "{" in value) and _WIDE_FORMAT.search(value):
            raise RenderLimit(f"{what}: a format width beyond {MAX_ARGUMENT}")


def _estimate(method: str, text: str, args: tuple, kwargs: dict) -> int:
    """An upper bound of the length of str.<method>(*args) where it can grow past its input, else 0."""
    if method in ("ljust", "rjust", "center", "zfill") and args and _int(args[0]):
        return max(len(text), args[0])
    if method == "expandtabs":
        tab = args[0] if args and _int(args[0]) else kwargs.get("tabsize", 8)
        return len(text) + text.count("\t") * (tab if _int(tab) else 8)
    if method == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = text.count(args[0]) if args[0] else len(text) + 1
        return len(text) + count * max(0, len(args[1]) - len(args[0]))
    if method == "join" and args:
        items = list(args[0])  # a one-pass iterable was read into a list before (settled)
        return size(items) + len(text) * max(0, len(items) - 1)
    if method in ("format", "format_map", "__mod__"):
        return len(text) + size(list(args)) + size(list(kwargs.values()))
    return 0


def settled(obj: Any, args: tuple) -> tuple:
    """A call's arguments with a one-pass iterable handed to str.join read into a list once, so that the bound's
    estimate and the join see the same items (a generator read by the estimate leaves the join nothing)."""
    if getattr(obj, "__name__", None) == "join" and isinstance(getattr(obj, "__self__", None), str) and args \
            and not isinstance(args[0], (str, list, tuple)):
        return (list(args[0]), *args[1:])
    return args


def check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    """Before a call: its arguments, and a string method's result where it can grow."""
    name = getattr(obj, "__name__", type(obj).__name__)
    check_arguments(f"{name}()" if name.isidentifier() else name, args, kwargs)
    owner = getattr(obj, "__self__", None)
    if isinstance(owner, str) and name in _GROWING_METHODS:
        if name in ("format", "format_map") and _WIDE_FORMAT.search(owner):
            raise RenderLimit(f"{name}(): a format width beyond {MAX_ARGUMENT}")
        if _estimate(name, owner, args, kwargs) > MAX_CHARS:
            raise RenderLimit(f"{name}(): a result longer than {MAX_CHARS} characters")


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Before an operator runs: its result stays within the bounds."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and _int(n) and size(seq) * max(n, 0) > MAX_CHARS:
                raise RenderLimit(f"'*': a result longer than {MAX_CHARS} characters")
        if _int(left) and _int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise RenderLimit(f"'*': an integer wider than {MAX_INT_BITS} bits")
    elif operator == "**":
        if _int(left) and _int(right) and abs(left) > 1 and right > 0 and \
                right * left.bit_length() > MAX_INT_BITS:
            raise RenderLimit(f"'**': an integer wider than {MAX_INT_BITS} bits")
    elif operator == "+":
        if isinstance(left, (str, list, tuple)) and size(left) + size(right) > MAX_CHARS:
            raise RenderLimit(f"'+': a result longer than {MAX_CHARS} characters")
    elif operator == "%" and isinstance(left, str):
        if _WIDE_FORMAT.search(left):
            raise RenderLimit(f"'%': a format width beyond {MAX_ARGUMENT}")
        if len(left) + size(right if isinstance(right, (tuple, list, dict)) else [right]) > MAX_CHARS:
            raise RenderLimit(f"'%': a result longer than {MAX_CHARS} characters")


def bounded_filter(name: str, function):
    """A filter whose arguments are checked before it runs and whose result after (jinja calls filters directly,
    not through the sandbox's call)."""
    from functools import wraps

    @wraps(function)
    def checked(*args, **kwargs):
        check_arguments(f"filter {name}", args[1:] if args else args, kwargs)  # the first is the filtered value
        if name == "indent" and args and isinstance(args[0], str):
            width = args[1] if len(args) > 1 else kwargs.get("width", 4)
            if isinstance(width, str):
                width = len(width)
            if _int(width) and len(args[0]) + (args[0].count("\n") + 1) * width > MAX_CHARS:
                raise RenderLimit(f"filter indent: a result longer than {MAX_CHARS} characters")
        return check_size(function(*args, **kwargs), f"filter {name}")

    return checked


class Steps:
    """The budget of the render running in this thread (one per environment: renders of one template in several
    threads each count their own)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def start(self) -> Budget:
        self._local.budget = Budget()
        return self._local.budget

    def stop(self) -> None:
        self._local.budget = None

    def step(self) -> None:
        budget = getattr(self._local, "budget", None)
        if budget is not None:
            budget.step()


class Counted:
    """A loop's iterable that counts each iteration as a step (and keeps its length for `loop.length`)."""

    __slots__ = ("_items", "_steps")

    def __init__(self, items, steps: Steps):
        self._items, self._steps = items, steps

    def __iter__(self):
        step = self._steps.step
        for item in self._items:
            step()
            yield item

    def __len__(self) -> int:
        return len(self._items)
