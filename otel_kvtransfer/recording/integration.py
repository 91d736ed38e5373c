"""The integration API: how a framework package tells what its transfers are for, and how an engine module hands
over the calls it timed.

Every function here is cheap (it appends one tuple to the recorder's queue) and never raises into the caller:
bad input is counted as dropped (`api_error`) and ignored. Times are ints of Unix-epoch nanoseconds, checked as
they enter (`_given_time`: OTLP's range, at most an hour ahead; an interval's end not before its start); the times
of the engine calls handed to `deliver()` are checked by the builder, off the engine's thread.

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

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import weakref
from functools import partial
from operator import index as _integer
from threading import get_ident
from types import TracebackType
from typing import Any, Callable, Final, Iterable, Literal, Optional, ParamSpec

from opentelemetry.context import Context

from otel_kvtransfer import semconv
from otel_kvtransfer.recording import device_clock, records
from otel_kvtransfer.recording.clock import from_wall, now_ns
from otel_kvtransfer.recording.patching import current_context
from otel_kvtransfer.recording.recorder import RECORDER

_logger = logging.getLogger(__name__)


_P = ParamSpec("_P")


def _never_raises(function: Callable[_P, None]) -> Callable[_P, None]:
    """Bad input from a framework is counted as dropped, never raised into the engine."""

    @functools.wraps(function)
    def guarded(*args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            return function(*args, **kwargs)
        except Exception:
            RECORDER.drop("api_error")
            _logger.debug("otel_kvtransfer: %s failed", function.__name__, exc_info=True)
            return None

    return guarded


def _key(key: object) -> records.Key:
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


# A time the API takes is Unix-epoch nanoseconds, an int (one a float cannot hold exactly), as OTLP carries it:
# fixed64, so 0 <= t < 2**64. Brought onto the records' clock (clock.from_wall), it may lie anywhere in the past (a
# replay, a test's synthetic times), but at most FUTURE_SLACK_NS ahead of now: a framework hands over times it has
# already read, and one from further ahead (2**63, a unit slip) would put its span past anything a backend shows
# and end the intervals it bounds before they start.
FUTURE_SLACK_NS = 3600 * 10**9


def _given_time(ns: Any) -> int:
    """A framework's time (`time.time_ns()` or now_ns()) on the records' clock; raises when it is no such time."""
    if type(ns) is not int:
        if isinstance(ns, bool):
            raise TypeError("a time is an int of nanoseconds, not a bool")
        ns = _integer(ns)  # an int of numpy's too; a float or a str raises
    t = from_wall(ns)
    if not 0 <= t <= now_ns() + FUTURE_SLACK_NS:
        raise ValueError(f"a time out of range: {ns}")
    return t


def _time(ns: Any) -> int:
    """Now, or a framework's time on the records' clock. One that is no such time is counted (api_error) and the
    record made with now instead: a request begun or ended at the moment it was said to be is of more use than
    one never begun, or never ended (evicted, as failed, a TTL later)."""
    if ns is None:
        return now_ns()
    try:
        return _given_time(ns)
    except (TypeError, ValueError, OverflowError):
        RECORDER.drop("api_error")
        return now_ns()


def _interval(start_ns: Any, end_ns: Any) -> tuple[int, int]:
    """(start, end) of an interval a framework measured, on the records' clock (an end of None is now); raises when
    either is no time or the end comes before the start: such a record is not made."""
    start = _given_time(start_ns)
    end = now_ns() if end_ns is None else _given_time(end_ns)
    if end < start:
        raise ValueError("an interval that ends before it starts")
    return start, end


# --- what engine modules use -----------------------------------------------------------------------------------

class PerThread(threading.local):
    """Per thread: .scope, the TransferScope the engine calls of this thread belong to; .saved, the scopes it
    hides. The class default makes a thread that never entered a scope read None without a failed lookup."""

    scope: Optional[TransferScope] = None

    def __init__(self) -> None:  # runs once in each thread that uses it
        self.saved: list[_Entry] = []


# This thread's transfer state. Engine wrappers bind it once and read `THREAD.scope` on their hot path (an
# attribute read, no function call); everyone else calls current_scope().
THREAD = PerThread()

# How many entries into transfer scopes, on every thread, have not been left yet (never fewer: an interrupted step
# errs on the side of more). While it is 0 no thread is in a scope, and an engine wrapper that reads it (one list
# item) skips reading THREAD.scope, a thread-local lookup that costs a raw engine call a tenth of its wrapper.
# Changed only under _DEPTH_LOCK: raised before an entry is added to its scope, lowered after it is taken out.
ENTERED = [0]


def current_scope() -> Optional[TransferScope]:
    scope = THREAD.scope
    if scope is not None and scope.after_end:  # its request ended while this thread was in it
        scope = _recover(THREAD)
    return scope


def current_key() -> Optional[records.Key]:
    """The request key of this thread's transfer scope, or None (no scope, or one that names no request)."""
    info = getattr(current_scope(), "info", None)
    return info[records.INFO_KEY] if info else None


# The context a raw engine call (made outside any scope) is parented to: whatever is current on its thread.
capture_context = current_context


def deliver(call: records.Call, context: Optional[Context] = None) -> None:
    """A finished engine call (records.CALL_*, its times from clock.now_ns()): joins this thread's scope, else it
    is a raw send of its own, parented to `context` (the current one when not given). Nothing is checked here (an
    engine's thread): a send whose times are outside OTLP's range, or end before they start, is counted as
    `api_error` by the builder and not made."""
    scope = THREAD.scope
    if scope is not None:
        scope.calls.append(call)  # list.append is atomic: executor threads may add to one scope at once
    elif RECORDER.active:  # a call that ends after uninstrument must not sit in a queue nobody drains
        RECORDER.record(records.raw_call(call, current_context() if context is None else context))


# --- transfer scopes -------------------------------------------------------------------------------------------

# Guards every scope's list of entries (threads may enter and leave one scope at once). One lock for all: it is
# held for a few bytecodes, and a scope, made per transfer, then allocates none. A forked child gets a fresh one:
# a thread of the parent may have held it at the fork.
_DEPTH_LOCK = threading.Lock()


# The thread signal handlers run on (a forked child's is the thread that forked).
_MAIN_THREAD = threading.main_thread().ident


def _fresh_depth_lock() -> None:
    global _DEPTH_LOCK, _MAIN_THREAD
    _DEPTH_LOCK = threading.Lock()
    _MAIN_THREAD = get_ident()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_depth_lock)


# Leaving a scope must survive an interrupt (KeyboardInterrupt, or any exception raised asynchronously) landing at
# any bytecode of it: a scope left attached to its thread would swallow every later engine call of that thread.
# Each entry of a thread into a scope is one tuple (the scope it was in before, the scope), made for that entry, so
# every step of leaving can tell by identity whether it already happened: the thread's own list of entries (the
# scope goes back first, then the entry), the scope's list of the entries inside it, and the calls taken from it
# (taken before they are queued, so an interrupted exit records its send once or, when it lands between the two,
# not at all, never twice). A retry of those steps is always safe; an interrupted exit retries them before it lets
# the interrupt go on.
ENTRY_PREVIOUS: Final = 0
ENTRY_SCOPE: Final = 1
_Entry = tuple[Optional["TransferScope"], "TransferScope"]


def _index(entries: list[_Entry], entry: _Entry) -> int:
    """The position of `entry` (by identity) in `entries`, searched from the end; -1 when it is not there."""
    for i in range(len(entries) - 1, -1, -1):
        if entries[i] is entry:
            return i
    return -1


def _innermost(saved: list[_Entry], scope: TransferScope) -> Optional[_Entry]:
    """This thread's latest entry into `scope` (None: it is not in it)."""
    if saved and saved[-1][ENTRY_SCOPE] is scope:  # the common case: the scope this thread is in now
        return saved[-1]
    for entry in reversed(saved):
        if entry[ENTRY_SCOPE] is scope:
            return entry
    return None


# Every scope some thread is in (insertion-ordered, used as a set), changed under _DEPTH_LOCK as its first entry
# comes and its last goes: where the end of a request finds the scopes it still has entered (_end_scopes_of).
_OPEN: dict[TransferScope, None] = {}

# How often leaving is tried again when an interrupt lands in the retry itself (a storm of them).
_RETRIES = 8


def _room_for(recs: list[records.Record]) -> list[records.Record]:
    """The records of a scope that fit in the recorder's queue now (under _DEPTH_LOCK); the rest are counted
    (`queue_full`)."""
    room = RECORDER.capacity - len(RECORDER.queue)
    if len(recs) > room:
        RECORDER.drop("queue_full", len(recs) - max(room, 0))
        return recs[:max(room, 0)]
    return recs


def _leave(scope: TransferScope, thread: PerThread, entry: Optional[_Entry],
           exc_type: Optional[type[BaseException]]) -> None:
    """The thread gives `entry`'s scope back and the scope counts the entry out; the last to leave records it.
    Every step may be retried (see above)."""
    if entry is None:  # this thread never entered the scope (its exit called by hand): nothing of it to undo
        return
    saved = thread.saved
    if saved and saved[-1] is entry:  # the common case, without the search
        thread.scope = entry[ENTRY_PREVIOUS]  # the scope first, then the entry: a retry finds the entry still there
        del saved[-1]
    else:
        i = _index(saved, entry)
        if i >= 0:
            thread.scope = entry[ENTRY_PREVIOUS]
            del saved[i:]  # with any entry above it, of a scope whose own exit never ran
    with _DEPTH_LOCK:
        inside = scope._inside
        j = len(inside) - 1 if inside and inside[-1] is entry else _index(inside, entry)
        if j >= 0:
            if exc_type is not None and scope.error_type is None:
                scope.error_type = exc_type.__qualname__
            del inside[j]
            ENTERED[0] -= 1
            if not inside:
                _OPEN.pop(scope, None)
        if inside or not (scope.calls or scope.error_type):
            return
        recs = _room_for(scope._records(scope.calls, scope.error_type, (scope._entered_ns, now_ns()))
                         if RECORDER.active else [])
        queue = RECORDER.queue
        scope.calls, scope.error_type = [], None  # taken: from here to the append below, nothing that runs a
        queue.extend(recs)  # signal handler (one C call: the hand-off Recorder.record makes)
    if recs and RECORDER.idle:  # the recorder's thread sleeps long: wake it, as Recorder.record does
        RECORDER.idle = False
        RECORDER.wake.set()


class _AfterEnd(list):  # type: ignore[type-arg]
    """The calls of a scope whose request ended while a thread was still in it: each engine call added to it is
    recorded at once, a send of its own (late, under its request), so no call waits in a scope that may never be
    left. Engine wrappers add to a scope's calls through `append`."""

    __slots__ = ("scope",)

    def __init__(self, scope: TransferScope) -> None:
        super().__init__()
        self.scope = scope

    def append(self, call: records.Call) -> None:
        try:
            self.scope.record_apart(call)
        except Exception:
            RECORDER.drop("api_error")


def _end_scopes_of(key: records.Key) -> None:
    """The scopes of a request still entered when it ends. Leaving one can be abandoned (an interrupt landing in
    its exit, or in what finishes an interrupted exit), or its thread is still in it (a send late past its
    request). Either way its send is recorded now with what it holds, and every later engine call in it recorded
    at once (_AfterEnd): no scope swallows a thread's calls past its request's end, and nothing is dropped (the two
    cases look alike from here, and the second is an ordinary abort: no drop is counted for either). A thread still
    in it leaves it at its exit, or as soon as it asks for its scope again (current_scope(), entering a scope)."""
    if not _OPEN:
        return
    queued = False
    with _DEPTH_LOCK:
        found = [scope for scope in _OPEN if not scope.after_end and key in scope._keys()]
        for scope in found:
            recs = _room_for(scope._records(scope.calls, scope.error_type, (scope._entered_ns, now_ns()))
                             if scope.calls or scope.error_type else [])
            scope.after_end = True
            scope.calls, scope.error_type = _AfterEnd(scope), None
            RECORDER.queue.extend(recs)
            queued = queued or bool(recs)
    if queued and RECORDER.idle:
        RECORDER.idle = False
        RECORDER.wake.set()


def _recover(thread: PerThread) -> Optional[TransferScope]:
    """This thread leaves the scopes it is in (innermost first) whose request has ended (_end_scopes_of); returns
    the scope it is in after."""
    try:
        saved = thread.saved
        while saved and saved[-1][ENTRY_SCOPE].after_end:
            entry = saved[-1]
            _leave(entry[ENTRY_SCOPE], thread, entry, None)
        scope = thread.scope
        if scope is not None and scope.after_end:  # its entry already gone (a leaving cut short)
            thread.scope = saved[-1][ENTRY_SCOPE] if saved else None
    except Exception:
        RECORDER.drop("api_error")
    return thread.scope


class TransferScope:
    """One actual transfer: one payload of one chunk to one destination, made of one or more engine calls.

    `info` is the records.INFO_* tuple (None after bad input: the calls are then recorded as raw sends). Entered
    on any number of threads, or nested, it is recorded once, when the last of them leaves it.
    """

    __slots__ = ("info", "calls", "error_type", "after_end", "_inside", "_entered_ns")

    def __init__(self, info: Optional[records.Info]) -> None:
        self.info = info
        self.calls: list[records.Call] = []
        self.error_type: Optional[str] = None
        self.after_end = False  # its request ended while a thread was in it (_end_scopes_of)
        self._inside: list[_Entry] = []  # the entries (of every thread) into it not left yet
        self._entered_ns: Optional[int] = None

    def _keys(self) -> tuple[records.Key, ...]:
        """The requests its sends belong to."""
        return (self.info[records.INFO_KEY],) if self.info else ()

    def set_error(self, error_type: str) -> None:
        """Mark the transfer failed without (or besides) an engine error, e.g. an unreachable session."""
        if self.error_type is None:
            self.error_type = str(error_type)[:128]

    def bind(self) -> TransferScope:
        """For `with scope.bind():` on another thread (an executor): the same as entering the scope there."""
        return self

    def __enter__(self) -> TransferScope:
        # The thread takes the scope last, and gives it back if an interrupt lands half-way: `with` calls
        # __exit__ only after __enter__ returned.
        thread = THREAD
        if thread.scope is not None and thread.scope.after_end:
            _recover(thread)
        previous, saved = thread.scope, thread.saved
        depth, entry = len(saved), (thread.scope, self)
        try:
            with _DEPTH_LOCK:
                if not self._inside:
                    self._entered_ns = now_ns()
                    _OPEN[self] = None
                ENTERED[0] += 1  # first: counted before any thread can be in it
                self._inside.append(entry)
            saved.append(entry)
            thread.scope = self
        except BaseException:
            thread.scope = previous
            del saved[depth:]
            with _DEPTH_LOCK:
                j = _index(self._inside, entry)
                if j >= 0:
                    del self._inside[j]
                    ENTERED[0] -= 1
                if not self._inside:
                    _OPEN.pop(self, None)
            raise
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> Literal[False]:
        try:
            entry = None
            saved = THREAD.saved
            entry = saved[-1] if saved and saved[-1][ENTRY_SCOPE] is self else _innermost(saved, self)
            _leave(self, THREAD, entry, exc_type)
        except BaseException as failure:
            # Half-way out (an interrupt, or a failure of ours): the rest of leaving, then the interrupt goes on.
            # Another interrupt landing in that rest is the first one's: leaving is tried again, not given up.
            for _ in range(_RETRIES):
                try:
                    found = locals().get("entry")  # unset when the interrupt came first
                    _leave(self, THREAD, found if found is not None else _innermost(THREAD.saved, self), exc_type)
                    break
                except Exception:
                    break
                except BaseException:  # the first interrupt is raised below
                    continue
            if not isinstance(failure, Exception):
                raise
            RECORDER.drop("api_error")
        return False  # the engine's exception passes through unchanged

    def _records(self, calls: list[records.Call], error: Optional[str],
                 times: Optional[records.ScopeTimes]) -> list[records.Record]:
        """The records of its send (a list: a split scope makes one per request)."""
        return [records.send(self.info, calls, None, error, times)]

    def _emit(self, calls: list[records.Call], error: Optional[str], times: Optional[records.ScopeTimes]) -> None:
        for rec in self._records(calls, error, times):
            RECORDER.record(rec)

    # Where this scope's transfer is recorded from outside it (an engine module that remembered the scope a NIXL
    # handle was made in, and sees the handle posted on a thread that is not in it).
    context: Optional[Context] = None  # the parent of its sends when it describes no request (a PayloadScope's)

    def label(self, extra: Optional[records.Attributes]) -> Optional[records.Attributes]:
        """The extra attributes of one of its engine calls (a PayloadScope adds its labels)."""
        return extra

    def record_apart(self, call: records.Call) -> None:
        """One engine call of this transfer made where the scope is not entered (posted on another thread): a
        send of its own, described as the scope's sends are."""
        if RECORDER.active:
            self._emit([call], None, None)


class _Leaving:
    """One `with` of a scope on the main thread, the one thread signal handlers run on: the thread's depth in
    scopes when the `with` began, and the exception its body raised."""

    __slots__ = ("scope", "thread", "depth", "exc_type", "entry", "armed")
    exc_type: Optional[type[BaseException]]
    entry: Optional[_Entry]
    armed: Optional[weakref.ref[Callable[..., bool]]]

    def __init__(self, scope: TransferScope, thread: PerThread) -> None:
        if thread.scope is not None and thread.scope.after_end:  # as __enter__ will: the depth is the one after
            _recover(thread)
        self.scope, self.thread, self.depth = scope, thread, len(thread.saved)
        self.exc_type = self.entry = self.armed = None

    def own_entry(self) -> Optional[_Entry]:
        """The entry this `with` made (at its depth, into its scope), or None: __enter__ never completed."""
        if self.entry is None:
            saved = self.thread.saved
            if len(saved) > self.depth and saved[self.depth][ENTRY_SCOPE] is self.scope:
                self.entry = saved[self.depth]
        return self.entry

    def finish(self, _ref: object = None) -> None:
        """The rest of leaving, once the `with` let go of its exit: runs only when the exit did not complete. An
        interrupt landing here would be printed and ignored (a weak reference's callback): leaving is tried again
        instead. One landing before this runs at all is the request's end's to find (_end_scopes_of)."""
        for _ in range(_RETRIES):
            try:
                _leave(self.scope, self.thread, self.own_entry(), self.exc_type)
                return
            except Exception:
                RECORDER.drop("api_error")
                return
            except BaseException:  # raised here it would only be ignored
                continue


def _guarded_exit(leaving: _Leaving, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                  tb: Optional[TracebackType]) -> bool:
    try:
        leaving.exc_type = exc_type
        entry = leaving.own_entry()
        if entry is None:  # called by hand after a hand-made __enter__: its exit was looked up inside the scope
            entry = _innermost(leaving.thread.saved, leaving.scope)
        _leave(leaving.scope, leaving.thread, entry, exc_type)
    except Exception:  # a failure of ours: counted, never raised into the engine
        RECORDER.drop("api_error")
    leaving.armed = None  # done: the `with` letting go of its exit now runs nothing (an interrupt skips this)
    return False


class _GuardedExit:
    """`__exit__` of a scope made on the main thread. A Python exit can be interrupted before its first bytecode
    runs (CPython runs signal handlers as a function starts), where no code of its own can catch it: so each `with`
    gets an exit of its own (a C partial whose frame holds only its `_Leaving`), and a weak reference to it that,
    unless the exit completed, finishes leaving as soon as the `with` lets go of it: before any later bytecode of
    the thread, even when the interrupt propagates and is kept."""

    def __get__(self, scope: Optional[TransferScope], owner: Optional[type] = None) -> Callable[..., bool]:
        if scope is None:  # read on the class (contextlib.ExitStack): the plain exit
            return TransferScope.__exit__
        leaving = _Leaving(scope, THREAD)
        exit_call = partial(_guarded_exit, leaving)
        leaving.armed = weakref.ref(exit_call, leaving.finish)
        return exit_call


_GUARDED: dict[type[TransferScope], type[TransferScope]] = {}  # scope class -> its subclass with the guarded exit


def _guarded(cls: type[TransferScope]) -> type[TransferScope]:
    guarded = _GUARDED.get(cls)
    if guarded is None:
        guarded = _GUARDED[cls] = type(cls.__name__, (cls,), {"__slots__": (), "__exit__": _GuardedExit(),
                                                               "__module__": cls.__module__})
    return guarded


def _new(cls: type[TransferScope], *args: Any) -> TransferScope:
    """A scope, its exit guarded against interrupts when made on the main thread (where signals are handled)."""
    return (_guarded(cls) if get_ident() == _MAIN_THREAD else cls)(*args)


# A call's bytes and descriptors are adjacent (test_records.py holds them so): a share replaces both in one slice.
_BYTES, _AFTER_DESCRIPTORS = records.CALL_BYTES, records.CALL_DESCRIPTORS + 1


class SplitTransferScope(TransferScope):
    """Engine calls that carry blocks of several requests: one send per request, with that request's share."""

    __slots__ = ("shares",)

    def __init__(self, shares: list[tuple[records.Info, int, int]]) -> None:
        super().__init__(None)
        self.shares = shares  # [(info, bytes, descriptors)]

    def _keys(self) -> tuple[records.Key, ...]:
        return tuple(info[records.INFO_KEY] for info, _, _ in self.shares)

    def _records(self, calls: list[records.Call], error: Optional[str],
                 times: Optional[records.ScopeTimes]) -> list[records.Record]:
        recs = []
        for info, nbytes, descriptors in self.shares:
            # The share's bytes ride on the first call; every call keeps its own times, peer and outcome.
            share_calls = [call[:_BYTES] + ((nbytes, descriptors) if i == 0 else (0, 0)) + call[_AFTER_DESCRIPTORS:]
                           for i, call in enumerate(calls)]
            recs.append(records.send(info, share_calls, None, error, times))
        return recs


def _info(key: object, chunk_index: int = 0, payload: str = semconv.PAYLOAD_KV, destination_index: int = 0,
          replica_factor: int = 1, is_last_chunk: bool = False, prefix_early_send: bool = False,
          attributes: Optional[dict[str, Any]] = None) -> records.Info:
    return records.info(_key(key), int(chunk_index), str(payload)[:32], int(destination_index),
                        max(int(replica_factor), 1), bool(is_last_chunk), bool(prefix_early_send),
                        dict(attributes) if attributes else None)


class PayloadScope(TransferScope):
    """Engine calls that move something other than a request's KV (an encoder cache, expert weights): each call is
    a send of its own, as a raw engine call is, parented to the span current where the scope was made and labelled
    with its payload and framework. It opens no request, so the request figures, the per-peer throughput and the
    tail stay the KV's; the per-send metrics keep the payload label."""

    __slots__ = ("labels", "context")

    def __init__(self, labels: records.Attributes, context: Optional[Context]) -> None:
        super().__init__(None)
        self.labels = labels
        self.context = context

    def label(self, extra: Optional[records.Attributes]) -> records.Attributes:
        return {**extra, **self.labels} if extra else self.labels

    def _labelled(self, call: records.Call) -> records.Call:
        return call[:records.CALL_EXTRA] + (self.label(call[records.CALL_EXTRA]),)

    def _records(self, calls: list[records.Call], error: Optional[str],
                 times: Optional[records.ScopeTimes]) -> list[records.Record]:
        # Only engine calls are sends here: a scope that failed before making one moved nothing of a request.
        return [records.raw_call(self._labelled(call), self.context) for call in calls]


def payload_scope(payload: str, *, framework: str, attributes: Optional[dict[str, Any]] = None) -> TransferScope:
    """A scope for engine calls whose bytes are not a request's KV: `payload` one of semconv.NON_KV_PAYLOADS
    (`encoder_cache`, `expert_weights`), `framework` the caller's (`vllm`); `attributes` go on each send. Another
    payload is bad input (counted, the calls become raw sends). Always returns a usable context manager."""
    try:
        if payload not in semconv.NON_KV_PAYLOADS:
            raise ValueError(f"not a payload of non-KV traffic: {str(payload)[:32]!r}")
        labels = dict(attributes) if attributes else {}
        labels[semconv.PAYLOAD] = payload
        labels[semconv.FRAMEWORK] = str(framework)[:64]
        return _new(PayloadScope, labels, current_context())
    except Exception:
        RECORDER.drop("api_error")
        return _new(TransferScope, None)


def transfer_scope(key: Optional[records.Key] = None, **keywords: Any) -> TransferScope:
    """A scope for one transfer of request `key`: keywords chunk_index, payload, destination_index,
    replica_factor, is_last_chunk, prefix_early_send, attributes. Always returns a usable context manager."""
    try:
        return _new(TransferScope, _info(key, **keywords))
    except Exception:
        RECORDER.drop("api_error")
        return _new(TransferScope, None)


def split_transfer_scope(shares: Iterable[dict[str, Any]]) -> TransferScope:
    """A scope for engine calls carrying several requests: each share is a dict with "key", "bytes",
    "descriptors" and optional transfer_scope keywords. Always returns a usable context manager."""
    try:
        parts = []
        for share in shares:
            keywords = dict(share)
            nbytes, descriptors = int(keywords.pop("bytes")), int(keywords.pop("descriptors", 0))
            parts.append((_info(**keywords), nbytes, descriptors))
        return _new(SplitTransferScope, parts)
    except Exception:
        RECORDER.drop("api_error")
        return _new(TransferScope, None)


# --- requests, compute, peers ----------------------------------------------------------------------------------


@_never_raises
def begin_request(key: records.Key, *, backend: str, framework: Optional[str] = None,
                  role: str = semconv.ROLE_PREFILL, attributes: Optional[dict[str, Any]] = None,
                  parent: Optional[Context] = None, start_ns: Optional[int] = None) -> None:
    """Open the initiator's `kv_transfer.request` of a request (no-op while one is open for it)."""
    if RECORDER.active:
        RECORDER.record(records.begin_request(_key(key), _time(start_ns), str(role), str(backend),
                                              framework and str(framework), dict(attributes) if attributes else None,
                                              parent))


@_never_raises
def record_connect(operation: str, start_ns: int, *, backend: str, framework: Optional[str] = None,
                   address: Optional[str] = None, port: Optional[int] = None, error_type: Optional[str] = None,
                   end_ns: Optional[int] = None, key: Optional[records.Key] = None,
                   attributes: Optional[dict[str, Any]] = None) -> None:
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
        start, end = _interval(start_ns, end_ns)
        RECORDER.record(records.connect(start, end, str(backend)[:64], str(operation)[:128],
                                        None, error_type and str(error_type)[:128], key,
                                        None if key is not None else current_context(), attrs or None))


@_never_raises
def end_request(key: records.Key, *, error_type: Optional[str] = None, end_ns: Optional[int] = None) -> None:
    """Conclude the request: success, or failure with `error_type`."""
    if RECORDER.active:
        key = _key(key)
        _end_scopes_of(key)  # its sends before its end
        device_clock.settle(key)  # its compute still on the device's clock goes first: after the end, no span
        RECORDER.record(records.end_request(key, _time(end_ns), error_type and str(error_type)[:128]))


@_never_raises
def record_compute(keys: Iterable[records.Key], start_ns: int, end_ns: int, *,
                   chunk_index: Optional[int] = None) -> None:
    """A compute interval that served these requests: times from time.time_ns() or now_ns() (clock.py)."""
    if RECORDER.active:
        start, end = _interval(start_ns, end_ns)
        RECORDER.record(records.compute(tuple(_key(k) for k in keys), start, end,
                                        None if chunk_index is None else int(chunk_index)))


def _begin_peer(name: str, role: str, key: records.Key, backend: str, framework: Optional[str],
                expected_bytes: Optional[int], attributes: Optional[dict[str, Any]], parent: Optional[Context],
                start_ns: Optional[int]) -> None:
    if RECORDER.active:
        attrs = dict(attributes) if attributes else {}
        if expected_bytes is not None:
            attrs[semconv.EXPECTED_BYTES] = max(int(expected_bytes), 0)
        RECORDER.record(records.begin_peer(_key(key), _time(start_ns), name, role, str(backend),
                                           framework and str(framework), attrs or None, parent))


def _end_peer(key: records.Key, error_type: Optional[str], end_ns: Optional[int], pending: bool = False) -> None:
    if RECORDER.active:
        RECORDER.record(records.end_peer(_key(key), _time(end_ns), error_type and str(error_type)[:128],
                                         bool(pending)))


@_never_raises
def begin_receive(key: records.Key, *, backend: str, framework: Optional[str] = None,
                  expected_bytes: Optional[int] = None, attributes: Optional[dict[str, Any]] = None,
                  parent: Optional[Context] = None, start_ns: Optional[int] = None) -> None:
    """Open the `kv_transfer.receive` of the peer of a push (decode): no-op while one is open for the key."""
    _begin_peer(semconv.SPAN_RECEIVE, semconv.ROLE_DECODE, key, backend, framework, expected_bytes, attributes,
                parent, start_ns)


@_never_raises
def end_receive(key: records.Key, *, error_type: Optional[str] = None, end_ns: Optional[int] = None,
                outcome_pending: bool = False) -> None:
    """End the receive; with `outcome_pending`, its span waits for `receive_outcome` before it is exported (at
    most OTEL_KVTRANSFER_REQUEST_TTL_S; a flush or the process's end exports it as it is)."""
    _end_peer(key, error_type, end_ns, outcome_pending)


@_never_raises
def receive_outcome(key: records.Key, *, attributes: Optional[dict[str, Any]] = None,
                    events: Iterable[tuple[str, Optional[dict[str, Any]]]] = (),
                    at_ns: Optional[int] = None) -> None:
    """What the receiver found out about the KV of `key` after its wait ended (sglang verifies its KV checksum
    when the request enters a batch): `attributes` onto the receive span, `events` ((name, attributes) pairs) on
    it at `at_ns` (now when None); a receive ended with `outcome_pending` is then exported. No attributes and no
    events: there is nothing to add, the span goes as it is."""
    if RECORDER.active:
        RECORDER.record(records.peer_outcome(_key(key), _time(at_ns), dict(attributes) if attributes else None,
                                             tuple((str(name)[:128], dict(attrs or {})) for name, attrs in events)
                                             or None))


@_never_raises
def begin_serve(key: records.Key, *, backend: str, framework: Optional[str] = None,
                expected_bytes: Optional[int] = None, attributes: Optional[dict[str, Any]] = None,
                parent: Optional[Context] = None, start_ns: Optional[int] = None) -> None:
    """Open the `kv_transfer.serve` of the peer of a pull (prefill), from the KV being ready to be read."""
    _begin_peer(semconv.SPAN_SERVE, semconv.ROLE_PREFILL, key, backend, framework, expected_bytes, attributes,
                parent, start_ns)


@_never_raises
def end_serve(key: records.Key, *, error_type: Optional[str] = None, end_ns: Optional[int] = None) -> None:
    _end_peer(key, error_type, end_ns)


@_never_raises
def late_arrival(key: records.Key, *, backend: str, at_ns: Optional[int] = None) -> None:
    """The peer saw KV of this key arrive, or be read, after its receive or serve had ended (its memory freed):
    the peer span, when still held (OTEL_KVTRANSFER_LATE_WATCH_S), gets `kv_transfer.late_completion`."""
    if RECORDER.active:
        RECORDER.record(records.late_arrival(_key(key), _time(at_ns), str(backend)))
