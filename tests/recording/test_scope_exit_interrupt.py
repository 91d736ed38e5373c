"""An interrupt (KeyboardInterrupt, or any exception raised asynchronously) that lands anywhere in a `with` of a
transfer scope, its exit above all, leaves the thread as it was: the scope is not attached to it, so the thread's
later raw engine calls are still exported; the scope's send is recorded at most once, and the scope works again.

Real parts: the Mooncake engine of the test process writing to a receiver process over TCP on 127.0.0.1. The
interrupt is a stand-in for Ctrl-C arriving at one exact point, since a signal cannot be aimed at a bytecode: a
trace function (`sys.settrace`, opcode events on) raises KeyboardInterrupt at the k-th point where CPython runs
signal handlers (a function's start, the instruction after a call or a backward jump) in the code the `with` runs
(its exit's lookup, `__enter__`, the body's `deliver()`, the exit and everything they call), for every k until a
`with` runs through with no point left to interrupt.
"""

import inspect
import sys
import threading

import pytest
from support.interrupt_seam import Seam

from otel_kvtransfer import integration as kvt
from otel_kvtransfer import semconv
from otel_kvtransfer.demo.loopback import digest
from otel_kvtransfer.recording import integration
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import now_ns

RAW = 777  # the raw engine call each round makes after the interrupt
IN_SCOPE = 55  # the call each scope carries
AGAIN = 33  # its call when entered again
FIRST_KEY = 9_100_000


def _call(nbytes):
    now = now_ns()
    return r.call(now, now + 1_000, nbytes, 1, semconv.OP_WRITE, "127.0.0.1:1", "tcp", 0, None, "test-engine")


def _write(engine, receiver, nbytes):
    assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, nbytes) == 0
    assert receiver.digest(0, nbytes) == digest(engine.source[:nbytes])


def _lines_of(function, *statements):
    """The line numbers of the lines of `function` that hold one of `statements`."""
    source, first = inspect.getsourcelines(function)
    return {first + i for i, line in enumerate(source) if any(statement in line for statement in statements)}


def _taken():
    """Where an interrupt may cost the scope its send (never the thread its state): after the calls were taken
    from the scope and before they are queued. No signal handler can run there (no call starts in between)."""
    return _lines_of(integration._leave, "scope.calls, scope.error_type = [], None", "queue.extend(recs)")


def _rounds(engine, receiver, skip=None):
    """One round per point: a scope, its `with` interrupted at that point, a raw write, then the same scope entered
    again around one call. Returns where each round's interrupt landed (None for the last: nothing left)."""
    fired = []
    for k in range(100_000):
        key = FIRST_KEY + k
        scope = kvt.transfer_scope(key, chunk_index=0, is_last_chunk=True)
        seam = Seam(k, None if skip is None else lambda frame, event: not skip(frame, event))
        try:
            sys.settrace(seam)
            with scope:
                kvt.deliver(_call(IN_SCOPE))
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        fired.append(seam.fired)
        assert integration.current_scope() is None, seam.fired
        assert integration.THREAD.saved == [], seam.fired
        _write(engine, receiver, RAW)
        with scope:  # counted out, so entered again it records (once, at this exit)
            kvt.deliver(_call(AGAIN))
        assert integration.current_scope() is None, seam.fired
        if seam.fired is None:
            return fired
    raise AssertionError("the seam never ran out of points")


def _check(telemetry, fired):
    sends = telemetry.spans(semconv.SPAN_SEND)
    raw = [s for s in sends if semconv.REQUEST_KEY not in s.attributes]
    assert len(raw) == len(fired) and {s.attributes[semconv.BYTES] for s in raw} == {RAW}  # every raw call
    by_key = {}
    for s in sends:
        if semconv.REQUEST_KEY in s.attributes:
            by_key.setdefault(int(s.attributes[semconv.REQUEST_KEY]), []).append(s.attributes)
    assert set(by_key) == {FIRST_KEY + k for k in range(len(fired))}
    for k, where in enumerate(fired):
        again = [a for a in by_key[FIRST_KEY + k] if a[semconv.BYTES] == AGAIN]
        first = [a for a in by_key[FIRST_KEY + k] if a[semconv.BYTES] != AGAIN]
        assert len(again) == 1 and len(first) <= 1, where  # never twice, nothing left over in the scope
        if first:  # its call, or none when the interrupt came first (in the body): a failure
            assert first[0][semconv.BYTES] == IN_SCOPE or (
                first[0][semconv.BYTES] == 0 and first[0][semconv.ERROR_TYPE] == "KeyboardInterrupt"), where
        else:  # the interrupt landed before __enter__ completed, or between taking the calls and queueing them
            assert where is not None and (where[0] != "_leave" or where[2] in _taken()), where


def test_an_interrupt_at_any_point_of_a_scopes_with_on_the_main_thread_leaves_no_scope_behind(
        telemetry, engine, receiver):
    fired = _rounds(engine, receiver)
    # It ran through the exit's own first point (before any bytecode of it: where a signal handler runs as a
    # function starts) and every point of leaving.
    assert ("_guarded_exit", "call", integration._guarded_exit.__code__.co_firstlineno) in fired
    assert any(where is not None and where[0] == "_leave" for where in fired)
    assert len(fired) > 20
    _check(telemetry, fired)


def test_an_interrupt_inside_the_exit_on_another_thread_leaves_no_scope_behind(telemetry, engine, receiver):
    """Off the main thread only PyThreadState_SetAsyncExc raises asynchronously (no signal handler runs there), and
    the plain exit is used; every point from its first bytecode on is covered. The point before it (the call of
    the exit itself) is the one no code of the exit can see: on the main thread, where signals land, the guarded
    exit covers it (above)."""

    def before_the_exits_first_bytecode(frame, event):
        return event == "call" and frame.f_code is integration.TransferScope.__exit__.__code__

    result, failure = [], []

    def worker():
        try:
            result.extend(_rounds(engine, receiver, before_the_exits_first_bytecode))
        except BaseException as exc:  # noqa: BLE001 - the assertion is re-raised on the test's thread
            failure.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(300)
    if failure:
        raise failure[0]
    assert any(where is not None and where[0] == "__exit__" for where in result)
    _check(telemetry, result)


@pytest.fixture(autouse=True)
def _no_trace_left():
    yield
    sys.settrace(None)
