"""Patching shared by every engine module and framework package: wrap, unwrap, count our own failures.

"Already patched" means patched by us (a marker on our wrapper, and our own list), never "has `__wrapped__`":
any functools.wraps decorator sets that (sglang's `Scheduler.run_batch` has one), and a check on it would
silently skip the patch. Unwrapping puts back the exact class `__dict__` entry that was replaced (a pybind11
instancemethod, a staticmethod, a plain function), so the class is left as it was found.

Every backend (an engine module, a framework package) is declared by one frozen spec (`EngineSpec`,
`FrameworkSpec`: its name, builds, releases and patches) and has the shape `Backend` names; its wrappers are built
with `observe_call` (`safely` for the shapes it does not fit): where an observer's own failure is caught, counted
and logged, so the engine's call, its return value and its exception are never touched. Only an engine's
per-transfer wrappers keep the same guard inline (`own_error`), one Python frame fewer per call.
tests/project/test_backend_contract.py holds every backend in `registry` to all of it.
"""

import importlib
import logging
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, runtime_checkable

import wrapt
from opentelemetry.context import Context

from otel_kvtransfer.recording.recorder import RECORDER
from otel_kvtransfer.sdk_internals import SUPPRESS_KEY as SUPPRESS_KEY  # re-exported: the engines read it here
from otel_kvtransfer.sdk_internals import SUPPRESS_KEY_PLAIN as SUPPRESS_KEY_PLAIN  # as SUPPRESS_KEY
from otel_kvtransfer.sdk_internals import context_getter

_logger = logging.getLogger(__name__)
_MARK = "__otel_kvtransfer__"

# The current context in one C call where the runtime allows; wrappers read suppress_instrumentation()'s two
# keys from it (`is_instrumentation_enabled()` fetches it twice, through six Python frames).
current_context = context_getter()
_NO_CONTEXT = Context()  # what the guard answers when the runtime has no context at all


def recording_context() -> "Optional[Context]":
    """The one guard, "record now?": the current context when the call is to be recorded (instrumented, and not
    inside `suppress_instrumentation()`), else None. Every wrapper asks it but the two per-transfer calls whose
    guard is written out (engines/mooncake's `sync.common` and `submissions.common`, and their compiled twin): one
    Python frame fewer per transfer."""
    if not RECORDER.active:
        return None
    ctx = current_context()
    if ctx and (ctx.get(SUPPRESS_KEY) or ctx.get(SUPPRESS_KEY_PLAIN)):
        return None
    return _NO_CONTEXT if ctx is None else ctx


def active() -> bool:
    """Record now? The same guard as `recording_context`, answered yes or no: the `when` of `observe_call` and the
    NIXL wrappers' test, a body of its own so that each of their calls costs one Python frame, as it did."""
    if not RECORDER.active:
        return False
    ctx = current_context()
    return not (ctx and (ctx.get(SUPPRESS_KEY) or ctx.get(SUPPRESS_KEY_PLAIN)))


# A wrapt wrapper: (the wrapped callable, the instance or None, the call's positional and keyword arguments) -> what
# the call answers.
WraptWrapper = Callable[[Callable[..., Any], Any, Tuple[Any, ...], Dict[str, Any]], Any]


def own_error(what: str) -> None:
    """A failure of a wrapper itself: counted (`wrapper_error` drops), logged at debug, never raised."""
    RECORDER.drop("wrapper_error")
    _logger.debug("otel_kvtransfer could not %s", what, exc_info=True)


def is_ours(entry: Any) -> bool:
    return bool(getattr(entry, _MARK, False) or getattr(getattr(entry, "_self_wrapper", None), _MARK, False))


@dataclass(frozen=True)
class Patch:
    """One patch of a backend: `apply(module)` runs as soon as the library's `module` is imported (at once when it
    already is)."""

    module: str
    apply: Callable[[ModuleType], None]


def deferred(package: str, path: str) -> Callable[..., Any]:
    """The function `<submodule>.<function>` (`path`) of our `package`, imported only when it is called: a framework
    package stays cheap to import (its plugin entry point loads it in every process the framework starts)."""
    submodule, function = path.rsplit(".", 1)

    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(f"{package}.{submodule}"), function)(*args)

    call.__qualname__ = f"{package}.{path}"
    return call


def _nothing() -> None:
    """A hook the backend leaves unset."""


def _always() -> bool:
    return True


def _no_peer(_peer: Any) -> Dict[str, Any]:
    return {}


def _no_targets() -> Mapping[str, Sequence[Any]]:
    return {}


@dataclass(frozen=True)
class BackendSpec:
    """One backend, declared once: its name, the builds and releases it covers, what it patches.

    Every engine module and framework package sets `SPEC` to one of these (an `EngineSpec` or a `FrameworkSpec`),
    patches through `wiring.lazy_patcher.LazyPatcher(SPEC, patcher)` (its `HOOKS`), and keeps its module-level names
    as views of it (`DISTRIBUTIONS`, `SUPPORTED`, `modules()`, ...). The fields with a default are hooks, each
    saying what a backend may add: a backend sets the ones it needs, and the defaults do nothing.
    """

    name: str  # kv_transfer.backend of an engine, kv_transfer.framework of a framework
    distributions: Tuple[str, ...]  # every published build; any one installed switches the package on
    supported: str  # the releases it was tested on, a PEP 440 range; its lower bound is what instruments-any asks
    patches: Tuple[Patch, ...]  # in order; each runs when its module is imported
    modules: Tuple[str, ...] = ()  # the library's modules patched (the contract test snapshots their classes);
    # by default those the patches name
    available: Callable[[], bool] = _always  # is the library installed? (asked by instrument(), never imports it)
    prepare: Callable[[], None] = _nothing  # on each instrument(), before anything is patched
    forget: Callable[[], None] = _nothing  # on uninstrument(), once every patch is undone: the backend's own state
    targets: Callable[[], Mapping[str, Sequence[Any]]] = _no_targets  # module -> what its wrappers need from it
    # (wiring.targets.Target), checked before that module is patched: a miss leaves nothing of the backend patched
    version_gate: ClassVar[bool] = False  # releases below `supported` refused (frameworks)

    def __post_init__(self) -> None:
        if not self.modules:
            object.__setattr__(self, "modules", tuple(dict.fromkeys(patch.module for patch in self.patches)))


@dataclass(frozen=True)
class EngineSpec(BackendSpec):
    """A transfer engine (registry.ENGINES). Its releases are not gated: each call it times is patched where the
    build has it. `peer_attributes(peer) -> dict` reads the engine's peer names into span attributes (on the
    builder's side); `setup_in_first_call`: its first transfer to a peer also sets the connection up (Mooncake
    opens the peer's segment inside that call; NIXL's set-up calls are calls of their own)."""

    setup_in_first_call: bool = False
    peer_attributes: Callable[[Any], Dict[str, Any]] = _no_peer


@dataclass(frozen=True)
class FrameworkSpec(BackendSpec):
    """A serving framework (registry.FRAMEWORKS). Its releases are gated (wiring.lazy_patcher.LazyPatcher): below
    `supported`, one warning and nothing patched; past it, patched where every target checks out (one warning)."""

    version_gate: ClassVar[bool] = True


@runtime_checkable
class Backend(Protocol):
    """What every engine module (registry.ENGINES) and framework package (registry.FRAMEWORKS) exposes: its `SPEC`,
    and the views of it the rest of the package and its docs use.

    `instrument()` is the gate and the patch: False when the backend's library is absent, the version gate says no
    or a module lacked what its wrappers need; True when it patched now or will patch as its modules are imported.
    `uninstrument()` undoes every patch (a no-op when there is none). `modules()` names the modules it patches,
    and `patcher` holds the patches, so anyone can see what the backend touched. `DISTRIBUTIONS` and `SUPPORTED`
    are its spec's `distributions` and `supported`.
    """

    SPEC: BackendSpec
    patcher: "Patcher"
    DISTRIBUTIONS: Tuple[str, ...]
    SUPPORTED: str

    def modules(self) -> Tuple[str, ...]: ...

    def instrument(self) -> bool: ...

    def uninstrument(self) -> None: ...


class Patcher:
    """The patches of one engine or framework: `wrap` them one by one, `unwrap_all` in reverse order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._patched: List[Tuple[type, str, Any]] = []  # (owner, attribute, the original __dict__ entry)

    def wrap(self, owner: type, attr: str, wrapper: WraptWrapper) -> bool:
        """Wrap `owner.attr` (defined on owner itself) with a wrapt wrapper; False when there is none."""
        current = owner.__dict__.get(attr)
        if current is None:
            return False
        if is_ours(current) or any(o is owner and a == attr for o, a, _ in self._patched):
            return True
        setattr(wrapper, _MARK, True)
        wrapt.wrap_function_wrapper(owner, attr, wrapper)
        self._patched.append((owner, attr, current))
        return True

    def replace(self, owner: type, attr: str, make: Callable[..., Any]) -> bool:
        """Replace `owner.attr` by the plain function `make(original)` that calls `original(self, ...)`.

        For the engine hot path: a plain function binds as cheaply as any method, where a wrapt wrapper builds a
        bound-wrapper object on every call.
        """
        current = owner.__dict__.get(attr)
        if current is None:
            return False
        if is_ours(current) or any(o is owner and a == attr for o, a, _ in self._patched):
            return True
        function = make(getattr(owner, attr))
        setattr(function, _MARK, True)
        setattr(owner, attr, function)
        self._patched.append((owner, attr, current))
        return True

    def patched(self) -> List[Tuple[type, str]]:
        return [(owner, attr) for owner, attr, _ in self._patched]

    def unwrap_all(self) -> None:
        while self._patched:
            owner, attr, original = self._patched.pop()
            try:
                setattr(owner, attr, original)
            except Exception:
                own_error(f"restore {owner.__name__}.{attr}")


def observe_call(what: str, before: Optional[Callable[..., Any]] = None, after: Optional[Callable[..., Any]] = None,
                 *, when: Optional[Callable[[], bool]] = active, on_raise: bool = False) -> WraptWrapper:
    """A wrapt wrapper that shows a call to its observers, which can never change or break it.

    While `when()` is true (by default: recording and not suppressed; None: always), `before(instance, args,
    kwargs)` runs first and what it answers is the token; then the call runs; then `after(instance, args, kwargs,
    token, result, error)`, once it returned (error None), and also when it raised if `on_raise` (result None,
    error the exception). A failure of an observer is counted (`wrapper_error`) and logged at debug as "could
    not <what>", never raised; the call's return value is returned and its exception re-raised as they are (the
    same object, with its traceback).
    """

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if when is not None and not when():
            return wrapped(*args, **kwargs)
        token = None
        if before is not None:
            try:
                token = before(instance, args, kwargs)
            except Exception:
                own_error(what)
        if after is None:
            return wrapped(*args, **kwargs)
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as error:  # also an interrupted call: the observer may count it as failed
            if on_raise:
                try:
                    after(instance, args, kwargs, token, None, error)
                except Exception:
                    own_error(what)
            raise
        try:
            after(instance, args, kwargs, token, result, None)
        except Exception:
            own_error(what)
        return result

    return wrapper


def safely(what: str, function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)`, or None when it raised (counted and logged as `own_error(what)`): for the wrappers whose
    shape `observe_call` does not fit (a scope entered around the call, a coroutine the call returns)."""
    try:
        return function(*args)
    except Exception:
        own_error(what)
        return None


def count_drop(reason: str) -> None:
    """Count what a wrapper had to leave out (a reason of kv_transfer.instrumentation.dropped)."""
    RECORDER.drop(reason)


def remember_argument(tls: threading.local, name: str, position: int, keyword: str) -> WraptWrapper:
    """A wrapper that makes one argument of the call visible as `tls.<name>` for the duration of the call.

    Used where an outer call knows something (the request being served) that an inner, wrapped call needs.
    """

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if not active():
            return wrapped(*args, **kwargs)
        previous = getattr(tls, name, None)
        setattr(tls, name, args[position] if len(args) > position else kwargs.get(keyword))
        try:
            return wrapped(*args, **kwargs)
        finally:
            setattr(tls, name, previous)

    return wrapper
