"""The integration API: how a framework package tells what its transfers are for, and how an engine module hands
over the calls it timed.

Every function here is cheap (it appends one tuple to the recorder's queue) and never raises into the caller:
bad input is counted as dropped (`api_error`) and ignored.

    from otel_kvtransfer.recording import integration as kvt

    kvt.begin_request(key, backend="<engine>", framework="<framework>")   # initiator: first enqueue/bootstrap
    scope = kvt.transfer_scope(key, chunk_index=0, payload="kv", destination_index=0, replica_factor=2)
    with scope:                                   # engine calls on this thread now belong to that transfer
        engine.write(...)                         # one or many calls -> one kv_transfer.send span
    kvt.record_compute([key], start_ns, end_ns)   # a forward pass of the request, for the overlap figures
    kvt.end_request(key)                          # success; end_request(key, error_type="...") on failure

    kvt.begin_receive(key, ...); kvt.end_receive(key)   # the peer of a push (decode) waits
    kvt.begin_serve(key, ...);   kvt.end_serve(key)     # the peer of a pull (prefill) waits

    with kvt.payload_scope("encoder_cache", framework="<framework>"):   # bytes that are not a request's KV
        engine.write(...)                         # each call one send, labelled; no request span

The key is what both sides of one request share (an int bootstrap room, a str transfer id). A scope may be
entered on several threads (an executor running per-layer copies enters it too, or uses `scope.bind()`), and
nested: it becomes one send when the last thread leaves it. One engine call that carries blocks of several
requests goes in a `split_transfer_scope`, which makes one send per request with the bytes the framework's own
bookkeeping assigns to it.
"""

import functools
import logging
import math
import os
import threading
from typing import Iterable, Optional

from opentelemetry.context import Context

from otel_kvtransfer import semconv
from otel_kvtransfer.recording import records
from otel_kvtransfer.recording.clock import from_wall, now_ns
from otel_kvtransfer.recording.patching import current_context
from otel_kvtransfer.recording.recorder import RECORDER

_logger = logging.getLogger(__name__)


def _never_raises(function):
    """Bad input from a framework is counted as dropped, never raised into the engine."""

    @functools.wraps(function)
    def guarded(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception:
            RECORDER.drop("api_error")
            _logger.debug("otel_kvtransfer: %s failed", function.__name__, exc_info=True)
            return None

    return guarded


def _key(key):
    """A request key as the builder keeps it: an int, or a bounded str. Anything else raises (-> api_error)."""
    if isinstance(key, bool):
        raise TypeError("a request key is an int or a str")
    if isinstance(key, int):
        return key
    if isinstance(key, str):
        return key[:256]
    if isinstance(key, float) and math.isfinite(key) and key.is_integer():
        return int(key)
    raise TypeError(f"a request key is an int or a str, not {type(key).__name__}")


def _time(ns) -> int:
    """Now, or a framework's `time.time_ns()` value, on the records' clock (clock.py)."""
    return now_ns() if ns is None else from_wall(ns)


# --- what engine modules use -----------------------------------------------------------------------------------

class PerThread(threading.local):
    """Per thread: .scope, the TransferScope the engine calls of this thread belong to; .saved, the scopes it
    hides. The class default makes a thread that never entered a scope read None without a failed lookup."""

    scope = None

    def __init__(self):  # runs once in each thread that uses it
        self.saved = []


# This thread's transfer state. Engine wrappers bind it once and read `THREAD.scope` on their hot path (an
# attribute read, no function call); everyone else calls current_scope().
THREAD = PerThread()


def current_scope():
    return THREAD.scope


def current_key():
    """The request key of this thread's transfer scope, or None (no scope, or one that names no request)."""
    info = getattr(THREAD.scope, "info", None)
    return info[records.INFO_KEY] if info else None


# The context a raw engine call (made outside any scope) is parented to: whatever is current on its thread.
capture_context = current_context


def deliver(call: tuple, context: Optional[Context] = None) -> None:
    """A finished engine call (records.CALL_*, its times from clock.now_ns()): joins this thread's scope, else it
    is a raw send of its own, parented to `context` (the current one when not given)."""
    scope = THREAD.scope
    if scope is not None:
        scope.calls.append(call)  # list.append is atomic: executor threads may add to one scope at once
    elif RECORDER.active:  # a call that ends after uninstrument must not sit in a queue nobody drains
        RECORDER.record(records.raw_call(call, current_context() if context is None else context))


# --- transfer scopes -------------------------------------------------------------------------------------------

# Guards every scope's depth (threads may enter and leave one scope at once). One lock for all: it is held for a
# few bytecodes, and a scope, made per transfer, then allocates none. A forked child gets a fresh one: a thread
# of the parent may have held it at the fork.
_DEPTH_LOCK = threading.Lock()


def _fresh_depth_lock() -> None:
    global _DEPTH_LOCK
    _DEPTH_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_depth_lock)


class TransferScope:
    """One actual transfer: one payload of one chunk to one destination, made of one or more engine calls.

    `info` is the records.INFO_* tuple (None after bad input: the calls are then recorded as raw sends). Entered
    on any number of threads, or nested, it is recorded once, when the last of them leaves it.
    """

    __slots__ = ("info", "calls", "error_type", "_depth", "_entered_ns")

    def __init__(self, info: Optional[tuple]):
        self.info = info
        self.calls: list = []
        self.error_type: Optional[str] = None
        self._depth = 0
        self._entered_ns = None

    def set_error(self, error_type: str) -> None:
        """Mark the transfer failed without (or besides) an engine error, e.g. an unreachable session."""
        if self.error_type is None:
            self.error_type = str(error_type)[:128]

    def bind(self) -> "TransferScope":
        """For `with scope.bind():` on another thread (an executor): the same as entering the scope there."""
        return self

    def __enter__(self) -> "TransferScope":
        # The thread takes the scope last, and gives it back if an interrupt (KeyboardInterrupt) lands half-way:
        # `with` calls __exit__ only after __enter__ returned, so a scope left attached here would swallow every
        # later engine call of this thread.
        thread = THREAD
        previous, saved = thread.scope, thread.saved
        depth, counted = len(saved), False
        try:
            with _DEPTH_LOCK:
                if self._depth == 0:
                    self._entered_ns = now_ns()
                self._depth += 1
                counted = True
            saved.append(previous)
            thread.scope = self
        except BaseException:
            thread.scope = previous
            del saved[depth:]
            if counted:
                with _DEPTH_LOCK:
                    self._depth -= 1
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            thread = THREAD
            saved = thread.saved
            thread.scope = saved.pop() if saved else None
            if exc_type is not None and self.error_type is None:
                self.error_type = exc_type.__qualname__
            with _DEPTH_LOCK:
                self._depth -= 1
                if self._depth > 0:
                    return False
                calls, self.calls = self.calls, []
                error, self.error_type = self.error_type, None
                entered = self._entered_ns
            if (calls or error) and RECORDER.active:
                self._emit(calls, error, (entered, now_ns()))
        except Exception:
            RECORDER.drop("api_error")
        return False  # the engine's exception passes through unchanged

    def _emit(self, calls, error, times) -> None:
        RECORDER.record(records.send(self.info, calls, None, error, times))

    # Where this scope's transfer is recorded from outside it (an engine module that remembered the scope a NIXL
    # handle was made in, and sees the handle posted on a thread that is not in it).
    context = None  # the parent of its sends when it describes no request (a PayloadScope's)

    def label(self, extra: Optional[dict]) -> Optional[dict]:
        """The extra attributes of one of its engine calls (a PayloadScope adds its labels)."""
        return extra

    def record_apart(self, call: tuple) -> None:
        """One engine call of this transfer made where the scope is not entered (posted on another thread): a
        send of its own, described as the scope's sends are."""
        if RECORDER.active:
            self._emit([call], None, None)


# A call's bytes and descriptors are adjacent (test_records.py holds them so): a share replaces both in one slice.
_BYTES, _AFTER_DESCRIPTORS = records.CALL_BYTES, records.CALL_DESCRIPTORS + 1


class SplitTransferScope(TransferScope):
    """Engine calls that carry blocks of several requests: one send per request, with that request's share."""

    __slots__ = ("shares",)

    def __init__(self, shares: list):
        super().__init__(None)
        self.shares = shares  # [(info, bytes, descriptors)]

    def _emit(self, calls, error, times) -> None:
        for info, nbytes, descriptors in self.shares:
            # The share's bytes ride on the first call; every call keeps its own times, peer and outcome.
            share_calls = [call[:_BYTES] + ((nbytes, descriptors) if i == 0 else (0, 0)) + call[_AFTER_DESCRIPTORS:]
                           for i, call in enumerate(calls)]
            RECORDER.record(records.send(info, share_calls, None, error, times))


def _info(key, chunk_index=0, payload=semconv.PAYLOAD_KV, destination_index=0, replica_factor=1,
          is_last_chunk=False, prefix_early_send=False, attributes=None) -> tuple:
    return records.info(_key(key), int(chunk_index), str(payload)[:32], int(destination_index),
                        max(int(replica_factor), 1), bool(is_last_chunk), bool(prefix_early_send),
                        dict(attributes) if attributes else None)


class PayloadScope(TransferScope):
    """Engine calls that move something other than a request's KV (an encoder cache, expert weights): each call is
    a send of its own, as a raw engine call is, parented to the span current where the scope was made and labelled
    with its payload and framework. It opens no request, so the request figures, the per-peer throughput and the
    tail stay the KV's; the per-send metrics keep the payload label."""

    __slots__ = ("labels", "context")

    def __init__(self, labels: dict, context):
        super().__init__(None)
        self.labels = labels
        self.context = context

    def label(self, extra: Optional[dict]) -> dict:
        return {**extra, **self.labels} if extra else self.labels

    def _labelled(self, call: tuple) -> tuple:
        return call[:records.CALL_EXTRA] + (self.label(call[records.CALL_EXTRA]),)

    def _emit(self, calls, error, times) -> None:
        # Only engine calls are sends here: a scope that failed before making one moved nothing of a request.
        for call in calls:
            RECORDER.record(records.raw_call(self._labelled(call), self.context))


def payload_scope(payload: str, *, framework: str, attributes: Optional[dict] = None) -> TransferScope:
    """A scope for engine calls whose bytes are not a request's KV: `payload` one of semconv.NON_KV_PAYLOADS
    (`encoder_cache`, `expert_weights`), `framework` the caller's (`vllm`); `attributes` go on each send. Another
    payload is bad input (counted, the calls become raw sends). Always returns a usable context manager."""
    try:
        if payload not in semconv.NON_KV_PAYLOADS:
            raise ValueError(f"not a payload of non-KV traffic: {str(payload)[:32]!r}")
        labels = dict(attributes) if attributes else {}
        labels[semconv.PAYLOAD] = payload
        labels[semconv.FRAMEWORK] = str(framework)[:64]
        return PayloadScope(labels, current_context())
    except Exception:
        RECORDER.drop("api_error")
        return TransferScope(None)


def transfer_scope(key=None, **keywords) -> TransferScope:
    """A scope for one transfer of request `key`: keywords chunk_index, payload, destination_index,
    replica_factor, is_last_chunk, prefix_early_send, attributes. Always returns a usable context manager."""
    try:
        return TransferScope(_info(key, **keywords))
    except Exception:
        RECORDER.drop("api_error")
        return TransferScope(None)


def split_transfer_scope(shares: Iterable[dict]) -> TransferScope:
    """A scope for engine calls carrying several requests: each share is a dict with "key", "bytes",
    "descriptors" and optional transfer_scope keywords. Always returns a usable context manager."""
    try:
        parts = []
        for share in shares:
            keywords = dict(share)
            nbytes, descriptors = int(keywords.pop("bytes")), int(keywords.pop("descriptors", 0))
            parts.append((_info(**keywords), nbytes, descriptors))
        return SplitTransferScope(parts)
    except Exception:
        RECORDER.drop("api_error")
        return TransferScope(None)


# --- requests, compute, peers ----------------------------------------------------------------------------------


@_never_raises
def begin_request(key, *, backend: str, framework: Optional[str] = None, role: str = semconv.ROLE_PREFILL,
                  attributes: Optional[dict] = None, parent: Optional[Context] = None,
                  start_ns: Optional[int] = None) -> None:
    """Open the initiator's `kv_transfer.request` of a request (no-op while one is open for it)."""
    if RECORDER.active:
        RECORDER.record(records.begin_request(_key(key), _time(start_ns), str(role), str(backend),
                                              framework and str(framework), dict(attributes) if attributes else None,
                                              parent))


@_never_raises
def record_connect(operation: str, start_ns: int, *, backend: str, framework: Optional[str] = None,
                   address: Optional[str] = None, port: Optional[int] = None, error_type: Optional[str] = None,
                   end_ns: Optional[int] = None, key=None, attributes: Optional[dict] = None) -> None:
    """One set-up step towards a peer that the framework makes (a handshake, a bootstrap query), from `start_ns`
    (now_ns() or time.time_ns()) to `end_ns` (now when None): a `kv_transfer.connect` span of its own, under the
    request `key` names (by default the one whose transfer scope this thread is in; a key with no request open
    here puts it in that request's stitched trace); `attributes` as on the framework's other spans (its rank)."""
    if RECORDER.active:
        attrs = dict(attributes) if attributes else {}
        if framework:
            attrs[semconv.FRAMEWORK] = str(framework)[:64]
        if address is not None:
            attrs[semconv.SERVER_ADDRESS] = str(address)[:256]
        if isinstance(port, int) and not isinstance(port, bool) and 0 <= port < 65536:
            attrs[semconv.SERVER_PORT] = port
        key = current_key() if key is None else _key(key)
        RECORDER.record(records.connect(_time(start_ns), _time(end_ns), str(backend)[:64], str(operation)[:128],
                                        None, error_type and str(error_type)[:128], key,
                                        None if key is not None else current_context(), attrs or None))


@_never_raises
def end_request(key, *, error_type: Optional[str] = None, end_ns: Optional[int] = None) -> None:
    """Conclude the request: success, or failure with `error_type`."""
    if RECORDER.active:
        RECORDER.record(records.end_request(_key(key), _time(end_ns), error_type and str(error_type)[:128]))


@_never_raises
def record_compute(keys: Iterable, start_ns: int, end_ns: int, *, chunk_index: Optional[int] = None) -> None:
    """A compute interval that served these requests: times from time.time_ns() or now_ns() (clock.py)."""
    if RECORDER.active:
        RECORDER.record(records.compute(tuple(_key(k) for k in keys), from_wall(start_ns), from_wall(end_ns),
                                        None if chunk_index is None else int(chunk_index)))


def _begin_peer(name, role, key, backend, framework, expected_bytes, attributes, parent, start_ns) -> None:
    if RECORDER.active:
        attrs = dict(attributes) if attributes else {}
        if expected_bytes is not None:
            attrs[semconv.EXPECTED_BYTES] = max(int(expected_bytes), 0)
        RECORDER.record(records.begin_peer(_key(key), _time(start_ns), name, role, str(backend),
                                           framework and str(framework), attrs or None, parent))


def _end_peer(key, error_type, end_ns) -> None:
    if RECORDER.active:
        RECORDER.record(records.end_peer(_key(key), _time(end_ns), error_type and str(error_type)[:128]))


@_never_raises
def begin_receive(key, *, backend: str, framework: Optional[str] = None, expected_bytes: Optional[int] = None,
                  attributes: Optional[dict] = None, parent: Optional[Context] = None,
                  start_ns: Optional[int] = None) -> None:
    """Open the `kv_transfer.receive` of the peer of a push (decode): no-op while one is open for the key."""
    _begin_peer(semconv.SPAN_RECEIVE, semconv.ROLE_DECODE, key, backend, framework, expected_bytes, attributes,
                parent, start_ns)


@_never_raises
def end_receive(key, *, error_type: Optional[str] = None, end_ns: Optional[int] = None) -> None:
    _end_peer(key, error_type, end_ns)


@_never_raises
def begin_serve(key, *, backend: str, framework: Optional[str] = None, expected_bytes: Optional[int] = None,
                attributes: Optional[dict] = None, parent: Optional[Context] = None,
                start_ns: Optional[int] = None) -> None:
    """Open the `kv_transfer.serve` of the peer of a pull (prefill), from the KV being ready to be read."""
    _begin_peer(semconv.SPAN_SERVE, semconv.ROLE_PREFILL, key, backend, framework, expected_bytes, attributes,
                parent, start_ns)


@_never_raises
def end_serve(key, *, error_type: Optional[str] = None, end_ns: Optional[int] = None) -> None:
    _end_peer(key, error_type, end_ns)


@_never_raises
def late_arrival(key, *, backend: str, at_ns: Optional[int] = None) -> None:
    """The peer saw KV of this key arrive, or be read, after its receive or serve had ended (its memory freed):
    the peer span, when still held (OTEL_KVTRANSFER_LATE_WATCH_S), gets `kv_transfer.late_completion`."""
    if RECORDER.active:
        RECORDER.record(records.late_arrival(_key(key), _time(at_ns), str(backend)))
