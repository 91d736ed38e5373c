"""Calls of an engine class that this package neither times nor knows to move no bytes: named, counted, never silent.

Each engine module lists, for its engine class, the calls it times and the calls known not to move bytes (set-up,
registration, queries, notifications). Any other public call found when the class is patched is a call a newer
release added, and it may move bytes that no span or metric would show. Each such call is wrapped only to count
it: the counter `kv_transfer.instrumentation.untimed_calls` (`kv_transfer.backend`, `code.function.name`) and one
WARNING per call name per process on its first use. The start-up line names those found by the time it is
printed; those found later (an engine imported after the line) are named in one WARNING when they are found.
The call itself, its return value and its exception pass through untouched.

A call's name comes from the engine's class (any string a class can hold): lines and the counter show it
escaped (one line, no terminal control) and cut to MAX_NAME characters; at most MAX_LINES first-use lines per
backend, then one line saying that the rest are only counted; a line naming calls found late names at most
MAX_LISTED of them.
"""

import logging
import os
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from otel_kvtransfer.recording.patching import Patcher, WraptWrapper, own_error

_logger = logging.getLogger(__name__)

_lock = threading.Lock()
_found: Dict[str, List[str]] = {}  # backend -> the untimed call names found on its engine class, in found order
_warned: Set[Tuple[str, str]] = set()  # (backend, name) whose first use was logged in this process
_count: Dict[str, Optional[Callable[[str, str], None]]] = {"add": None}  # set by the instrumentor
_announced = {"done": False}  # the start-up line went out: later finds get a line of their own
_lines: Dict[str, int] = {}  # backend -> first-use WARNING lines written since it was instrumented

MAX_NAME = 64  # characters of a call name shown in a line or a counter's attribute
MAX_LINES = 32  # first-use WARNING lines per backend; past it one line says the rest are only counted
MAX_LISTED = 16  # names listed in the line naming calls found after the start-up line


def shown(name: str) -> str:
    """A call name for a line or an attribute: non-printable characters escaped (one line, no terminal control),
    at most MAX_NAME characters of it and its length when cut."""
    text = name if type(name) is str else str(name)
    cut = text[:MAX_NAME]
    if not cut.isprintable():
        cut = ascii(cut)[1:-1]  # \\n, \\x1b, \\u2028...: escapes, never the characters
    if len(text) <= MAX_NAME and len(cut) <= MAX_NAME:
        return cut
    return f"{cut[:MAX_NAME]}... ({len(text)} characters)"


def public_calls(cls: type) -> List[str]:
    """The public callables of `cls` and its bases (methods, static and class methods), not nested classes."""
    names = []
    for name in dir(cls):
        if name.startswith("_"):
            continue
        try:
            value = getattr(cls, name)
        except Exception:
            continue
        if callable(value) and not isinstance(value, type):
            names.append(name)
    return names


def unknown_calls(cls: type, timed: Iterable[str], quiet: Iterable[str]) -> List[str]:
    """Public calls of `cls` that are neither timed nor known not to move bytes."""
    known = set(timed) | set(quiet)
    return [name for name in public_calls(cls) if name not in known]


def wrap_unknown(patcher: Patcher, cls: type, backend: str, timed: Iterable[str], quiet: Iterable[str]) -> List[str]:
    """Wrap each unknown public call of `cls` to count it; the names wrapped (also kept for the start-up line)."""
    names = unknown_calls(cls, timed, quiet)
    wrapped = []
    for name in names:
        if name not in cls.__dict__:  # inherited from a base we do not patch: wrap it where it is defined
            owner = next((klass for klass in cls.__mro__ if name in klass.__dict__), None)
        else:
            owner = cls
        if owner is None or owner is object:
            continue
        try:  # wrapt: it binds static, class and pybind11 methods as they were (untimed calls are not hot)
            if patcher.wrap(owner, name, _counting(backend, name)):
                wrapped.append(name)
        except Exception:  # a class that refuses the attribute: say so, never stop the patch
            own_error(f"wrap {shown(cls.__name__)}.{shown(name)} to count it")
    if wrapped:
        _remember(backend, wrapped)
    return wrapped


def _remember(backend: str, names: List[str]) -> None:
    with _lock:
        known = _found.setdefault(backend, [])
        new = [name for name in names if name not in known]
        known.extend(new)
        late = _announced["done"] and new
    if late:
        listed = ", ".join(shown(name) for name in new[:MAX_LISTED])
        more = f" and {len(new) - MAX_LISTED} more" if len(new) > MAX_LISTED else ""
        _logger.warning("otel_kvtransfer: %s calls this package does not time, counted in "
                        "kv_transfer.instrumentation.untimed_calls: %s%s", shown(backend), listed, more)


def _counting(backend: str, name: str) -> WraptWrapper:
    label = shown(name)  # what the counter and the line show of it, made once

    def untimed(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        try:
            _used(backend, name, label)
        except Exception:
            own_error(f"count the untimed call {label}")
        return wrapped(*args, **kwargs)

    return untimed


def _used(backend: str, name: str, label: str) -> None:
    add = _count["add"]
    if add is not None:
        add(backend, label)
    key = (backend, name)
    if key not in _warned:
        with _lock:
            first = key not in _warned
            _warned.add(key)
            line = _lines.get(backend, 0) if first else MAX_LINES + 1
            if first and line <= MAX_LINES:
                _lines[backend] = line + 1
        if line < MAX_LINES:
            _logger.warning("otel_kvtransfer: %s %s() is a call this package does not time: whatever bytes it "
                            "moves are in no span or metric; counted in kv_transfer.instrumentation.untimed_calls "
                            "(logged once per call per process)", backend, label)
        elif line == MAX_LINES:
            _logger.warning("otel_kvtransfer: %s more calls this package does not time are in use (%s() first); "
                            "no more lines name them: they are counted in kv_transfer.instrumentation.untimed_calls",
                            backend, label)


def count_with(add: Optional[Callable[[str, str], None]]) -> None:
    """Where uses are counted: `add(backend, name)` (the instrumentor's counter), or None."""
    _count["add"] = add


def found() -> List[Tuple[str, List[str]]]:
    """(backend, untimed call names) found so far, for the start-up line."""
    with _lock:
        return [(backend, list(names)) for backend, names in _found.items() if names]


def announced() -> None:
    """The start-up line has gone out: calls found from now on are named in a line of their own."""
    with _lock:
        _announced["done"] = True


def forget(backend: str) -> None:
    """uninstrument(): the backend's wrappers are gone."""
    with _lock:
        _found.pop(backend, None)
        _warned.difference_update({key for key in _warned if key[0] == backend})
        _lines.pop(backend, None)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _warned.clear()  # one WARNING per call name per process: the child is a process of its own
    _lines.clear()
    _announced["done"] = False  # and prints a start-up line of its own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
