"""Calls of an engine class that this package neither times nor knows to move no bytes: named, counted, never silent.

Each engine module lists, for its engine class, the calls it times and the calls known not to move bytes (set-up,
registration, queries, notifications). Any other public call found when the class is patched is a call a newer
release added, and it may move bytes that no span or metric would show. Each such call is wrapped only to count
it: the counter `kv_transfer.instrumentation.untimed_calls` (`kv_transfer.backend`, `code.function.name`) and one
WARNING per call name per process on its first use. The start-up line names those found by the time it is
printed; those found later (an engine imported after the line) are named in one WARNING when they are found.
The call itself, its return value and its exception pass through untouched.
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
            own_error(f"wrap {cls.__name__}.{name} to count it")
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
        _logger.warning("otel_kvtransfer: %s calls this package does not time, counted in "
                        "kv_transfer.instrumentation.untimed_calls: %s", backend, ", ".join(new))


def _counting(backend: str, name: str) -> WraptWrapper:
    def untimed(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        try:
            _used(backend, name)
        except Exception:
            own_error(f"count the untimed call {name}")
        return wrapped(*args, **kwargs)

    return untimed


def _used(backend: str, name: str) -> None:
    add = _count["add"]
    if add is not None:
        add(backend, name)
    key = (backend, name)
    if key not in _warned:
        with _lock:
            first = key not in _warned
            _warned.add(key)
        if first:
            _logger.warning("otel_kvtransfer: %s %s() is a call this package does not time: whatever bytes it "
                            "moves are in no span or metric; counted in kv_transfer.instrumentation.untimed_calls "
                            "(logged once per call per process)", backend, name)


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


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _warned.clear()  # one WARNING per call name per process: the child is a process of its own
    _announced["done"] = False  # and prints a start-up line of its own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
