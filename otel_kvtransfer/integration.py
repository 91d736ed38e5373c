"""The engine-integration API: how an engine module (sglang, ...) tells what its transfers are for.

Every function here is cheap (it appends one tuple to the recorder's queue) and never raises into the engine.

    from otel_kvtransfer import integration as kvt

    kvt.begin_request(room)                       # prefill: the request's first enqueue or bootstrap
    scope = kvt.transfer_scope(room, chunk_index=0, payload="kv", destination_index=0, replica_factor=2)
    with scope:                                   # engine calls on this thread now belong to that transfer
        engine.batch_transfer_sync_write(...)     # one or many calls -> one kv_transfer.send span
    kvt.record_compute([room], start_ns, end_ns)  # a forward pass of the room, for the overlap figures
    kvt.end_request(room)                         # Success; end_request(room, error_type="...") on failure

    kvt.begin_receive(room); ...; kvt.end_receive(room)   # decode side

Engine calls made on another thread (an executor running per-layer copies) join a scope through
`with scope.bind():` inside the function that runs there.
"""

import functools
import logging
import threading
from time import time_ns
from typing import Iterable, Optional

from opentelemetry.context import Context, get_current

from otel_kvtransfer import semconv
from otel_kvtransfer.recorder import (
    BEGIN_RECEIVE,
    BEGIN_REQUEST,
    COMPUTE,
    END_RECEIVE,
    END_REQUEST,
    RECORDER,
    SEND,
)

_logger = logging.getLogger(__name__)


def _never_raises(function):
    """Bad input from an engine module is counted as dropped, never raised into the engine."""

    @functools.wraps(function)
    def guarded(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception:  # pylint: disable=broad-except
            RECORDER.drop("api_error")
            _logger.debug("otel_kvtransfer: %s failed", function.__name__, exc_info=True)
            return None

    return guarded


# Which TransferScope the engine calls of this thread belong to (read by the engine wrappers).
_thread = threading.local()


def current_scope():
    return getattr(_thread, "scope", None)


# The context a raw engine call (made outside any scope) is parented to: whatever is current on its thread.
capture_context = get_current


def is_active() -> bool:
    return RECORDER.active


class TransferScope:
    """One actual transfer: one payload of one chunk to one destination, made of one or more engine calls.

    `info` is (room, chunk_index, payload, destination_index, replica_factor, is_last_chunk, prefix_early_send,
    backend); `calls` collects one tuple per engine call, appended from any bound thread (list.append is atomic).
    """

    __slots__ = ("info", "calls", "error_type", "_previous")

    def __init__(self, info: tuple):
        self.info = info
        self.calls: list = []
        self.error_type: Optional[str] = None
        self._previous = None

    def set_error(self, error_type: str) -> None:
        """Mark the transfer failed without (or besides) an engine error, e.g. an unreachable session."""
        if self.error_type is None:
            self.error_type = str(error_type)

    def __enter__(self) -> "TransferScope":
        self._previous = getattr(_thread, "scope", None)
        _thread.scope = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        _thread.scope = self._previous
        self._previous = None
        if exc_type is not None and self.error_type is None:
            self.error_type = exc_type.__qualname__
        if (self.calls or self.error_type) and RECORDER.active:
            RECORDER.record((SEND, self.info, self.calls, None, self.error_type))
        return False  # the engine's exception passes through unchanged

    def bind(self) -> "_Binding":
        """Attach this scope to the current (other) thread for the duration of a `with` block."""
        return _Binding(self)


class _Binding:
    __slots__ = ("_scope", "_previous")

    def __init__(self, scope: TransferScope):
        self._scope = scope
        self._previous = None

    def __enter__(self) -> TransferScope:
        self._previous = getattr(_thread, "scope", None)
        _thread.scope = self._scope
        return self._scope

    def __exit__(self, exc_type, exc, tb) -> bool:
        _thread.scope = self._previous
        return False


def transfer_scope(
    room,
    *,
    chunk_index: int,
    payload: str,
    destination_index: int = 0,
    replica_factor: int = 1,
    is_last_chunk: bool = False,
    prefix_early_send: bool = False,
    backend: str = semconv.BACKEND_MOONCAKE,
) -> TransferScope:
    try:
        info = (int(room), int(chunk_index), str(payload), int(destination_index), int(replica_factor),
                bool(is_last_chunk), bool(prefix_early_send), str(backend))
    except (TypeError, ValueError):
        RECORDER.drop("api_error")
        info = None  # still a usable context manager; its calls are recorded as raw engine calls
    return TransferScope(info)


@_never_raises
def begin_request(
    room: int,
    *,
    backend: str = semconv.BACKEND_MOONCAKE,
    rid: Optional[str] = None,
    parent: Optional[Context] = None,
    start_ns: Optional[int] = None,
    attributes: Optional[dict] = None,
) -> None:
    """Open the prefill-side `kv_transfer.request` of a room (no-op while one is open for it)."""
    if RECORDER.active:
        RECORDER.record((BEGIN_REQUEST, int(room), start_ns or time_ns(), backend, rid, parent, attributes))


@_never_raises
def end_request(room: int, *, error_type: Optional[str] = None, end_ns: Optional[int] = None) -> None:
    """Conclude the room's request: success, or failure with `error_type`."""
    if RECORDER.active:
        RECORDER.record((END_REQUEST, int(room), end_ns or time_ns(), error_type))


@_never_raises
def record_compute(rooms: Iterable[int], start_ns: int, end_ns: int, *, chunk_index: Optional[int] = None) -> None:
    """A compute interval (time.time_ns clock) that served these rooms."""
    if RECORDER.active:
        RECORDER.record((COMPUTE, tuple(int(r) for r in rooms), int(start_ns), int(end_ns), chunk_index))


@_never_raises
def begin_receive(
    room: int,
    *,
    backend: str = semconv.BACKEND_MOONCAKE,
    expected_bytes: Optional[int] = None,
    parent: Optional[Context] = None,
    start_ns: Optional[int] = None,
    attributes: Optional[dict] = None,
) -> None:
    """Open the decode-side `kv_transfer.receive` of a room (no-op while one is open for it)."""
    if RECORDER.active:
        RECORDER.record((BEGIN_RECEIVE, int(room), start_ns or time_ns(), backend, expected_bytes, parent, attributes))


@_never_raises
def end_receive(room: int, *, error_type: Optional[str] = None, end_ns: Optional[int] = None) -> None:
    if RECORDER.active:
        RECORDER.record((END_RECEIVE, int(room), end_ns or time_ns(), error_type))
