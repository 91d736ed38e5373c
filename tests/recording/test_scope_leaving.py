"""Leaving a transfer scope: by hand as by `with`; never past its request's end, whatever interrupt lands in it;
and on a full queue, every send queued or counted.

- A scope entered and left by hand (`scope.__enter__()` ... `scope.__exit__(None, None, None)`, as wrappers without
  `with` do) is left, on the main thread (whose scopes have the interrupt-guarded exit) as on any other.
- Leaving can be abandoned (an interrupt landing as the exit starts, or as what finishes an abandoned exit starts):
  a trace function raises KeyboardInterrupt at one point where CPython runs signal handlers (a function's start,
  after a call or a backward jump) per round, for every point. A scope left attached to its thread is found when
  its request ends: its send recorded (nothing dropped), and the thread out of it as soon as
  it asks for its scope again; its calls in between are sends of their own, not swallowed.
- A scope's leave on a full queue queues what fits and counts the rest as `queue_full`: spans + drops = sends.
"""

import sys
import threading

import pytest
from support.interrupt_seam import Seam

from otel_kvtransfer import config, semconv
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.recording import integration
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import now_ns

IN_SCOPE = 55  # the call each scope carries
RAW = 777  # a call made outside any scope
LATE = 99  # a call made in a scope left attached to its thread, after its request ended


def _call(nbytes):
    now = now_ns()
    return r.call(now, now + 1_000, nbytes, 1, semconv.OP_WRITE, "127.0.0.1:1", "tcp", 0, None, "test-engine")


def _sends(telemetry):
    """[(bytes, request key or None)] of the send spans, in the order they ended."""
    return [(s.attributes[semconv.BYTES], s.attributes.get(semconv.REQUEST_KEY))
            for s in telemetry.spans(semconv.SPAN_SEND)]


def _entered():
    """Entries into scopes not left yet (every thread), and the scopes they are in."""
    return integration.ENTERED[0], list(integration._OPEN)


def _not_in_any_scope():
    assert integration.current_scope() is None
    assert integration.THREAD.saved == []


# --- by hand ---------------------------------------------------------------------------------------------------

def _by_hand(key):
    scope = kvt.transfer_scope(key, chunk_index=0, is_last_chunk=True)
    scope.__enter__()
    kvt.deliver(_call(IN_SCOPE))
    assert integration.current_scope() is scope
    assert scope.__exit__(None, None, None) is False
    _not_in_any_scope()
    kvt.deliver(_call(RAW))  # a raw call after it: a send of its own
    with scope:  # and the scope works again
        kvt.deliver(_call(IN_SCOPE + 1))
    _not_in_any_scope()


def test_a_scope_entered_and_left_by_hand_on_the_main_thread_is_left(telemetry):
    assert threading.get_ident() == integration._MAIN_THREAD  # where scopes get the interrupt-guarded exit
    _by_hand(4_100_001)
    assert _sends(telemetry) == [(IN_SCOPE, "4100001"), (RAW, None), (IN_SCOPE + 1, "4100001")]
    assert telemetry.dropped() == {}


def test_a_scope_entered_and_left_by_hand_on_another_thread_is_left(telemetry):
    failure = []

    def worker():
        try:
            _by_hand(4_100_002)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            failure.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(60)
    if failure:
        raise failure[0]
    assert _sends(telemetry) == [(IN_SCOPE, "4100002"), (RAW, None), (IN_SCOPE + 1, "4100002")]


def test_an_exit_looked_up_inside_nested_scopes_by_hand_leaves_its_own(telemetry):
    outer = kvt.transfer_scope(4_100_003, chunk_index=0)
    inner = kvt.transfer_scope(4_100_004, chunk_index=0)
    outer.__enter__()
    inner.__enter__()
    kvt.deliver(_call(IN_SCOPE))
    inner.__exit__(None, None, None)
    assert integration.current_scope() is outer
    kvt.deliver(_call(IN_SCOPE + 1))
    outer.__exit__(None, None, None)
    _not_in_any_scope()
    assert _sends(telemetry) == [(IN_SCOPE, "4100004"), (IN_SCOPE + 1, "4100003")]


# --- interrupts where leaving is abandoned ---------------------------------------------------------------------

def _interrupted_rounds(first_key, leave, where):
    """One round per point: a request, a scope of it entered and its body run, `leave(scope)` interrupted at that
    point (of the frames `where` admits), the request's end, then the thread asks for its scope (as framework hooks
    do) and makes a raw call. Returns, per round, whether the scope was left attached to the thread before its
    request ended, and where the interrupt landed (None: nothing left to interrupt)."""
    rounds = []
    for k in range(100_000):
        key = first_key + k
        kvt.begin_request(key, backend="test-engine")
        scope = kvt.transfer_scope(key, chunk_index=0, is_last_chunk=True)
        seam = Seam(k, lambda frame, event: where(frame))
        leave(scope, seam)
        left_attached = integration.THREAD.scope is scope
        if left_attached:
            kvt.deliver(_call(LATE))  # before its request ends: one more call of its send
        kvt.end_request(key)
        if left_attached:
            kvt.deliver(_call(LATE))  # after: a send of its own at once, under its (ended) request
        _not_in_any_scope()  # current_scope(), as a framework hook asks, lets the ended scope go
        kvt.deliver(_call(RAW))
        rounds.append((left_attached, seam.fired))
        if seam.fired is None:
            return rounds
    raise AssertionError("the seam never ran out of points")


def _abandon_the_exit(scope, seam):
    """A `with` on the main thread whose guarded exit was let go uncalled (an interrupt as it starts), so what
    finishes leaving runs (a weak reference's callback): interrupted at each of its points."""
    exit_call = scope.__exit__  # looked up first, as `with` does
    scope.__enter__()
    kvt.deliver(_call(IN_SCOPE))
    sys.settrace(seam)
    try:
        del exit_call  # the callback runs here; an interrupt escaping it is printed and ignored
    finally:
        sys.settrace(None)


def _interrupt_the_exit(scope, seam):
    """A `with` whose exit is interrupted at each of its points, its very start included."""
    try:
        with scope:
            kvt.deliver(_call(IN_SCOPE))
            sys.settrace(seam)
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)


def _check_rounds(telemetry, rounds, first_key, before):
    leaked = sum(1 for left_attached, _ in rounds if left_attached)
    assert leaked, "no interrupt left a scope attached: the test did not reach what it checks"
    assert telemetry.dropped() == {}  # a scope left open loses nothing: its send is recorded at its request's end
    assert (integration.ENTERED[0], list(integration._OPEN)) == before
    sends = _sends(telemetry)
    assert [s for s in sends if s[1] is None] == [(RAW, None)] * len(rounds)  # no raw call swallowed
    for k, (left_attached, fired) in enumerate(rounds):
        mine = sorted(nbytes for nbytes, key in sends if key == str(first_key + k))
        if left_attached:  # its send (its call, if the body ran, and the one before its end), the late call alone
            assert mine in ([LATE, LATE], [LATE, IN_SCOPE + LATE]), fired
        else:  # left: its send once, or none when the interrupt hit before the body or between taking and queueing
            assert mine in ([IN_SCOPE], [0], []), fired


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupt_in_what_finishes_an_abandoned_exit_leaves_no_scope_past_its_request(telemetry):
    assert threading.get_ident() == integration._MAIN_THREAD  # where scopes get the interrupt-guarded exit
    before = _entered()
    rounds = _interrupted_rounds(4_200_000, _abandon_the_exit, lambda frame: True)
    assert any(fired and fired[0] == "finish" for _, fired in rounds)
    _check_rounds(telemetry, rounds, 4_200_000, before)


def test_an_interrupt_as_the_exit_starts_on_another_thread_leaves_no_scope_past_its_request(telemetry):
    """Off the main thread only PyThreadState_SetAsyncExc raises asynchronously, and the plain exit is used: an
    interrupt as it starts, before any bytecode of it, leaves the scope attached, which its request's end finds."""
    result, failure, before = [], [], _entered()

    def worker():
        try:
            result.extend(_interrupted_rounds(4_300_000, _interrupt_the_exit, lambda frame: True))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            failure.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(300)
    if failure:
        raise failure[0]
    assert result[0][1][:2] == ("__exit__", "call")
    _check_rounds(telemetry, result, 4_300_000, before)


def test_a_request_ended_while_another_thread_is_in_its_scope_records_what_it_has(telemetry):
    """The same end on a thread still legitimately in the scope (a request aborted while a send runs): what the
    scope holds is its send, each later call a send of its own, and the thread leaves as its `with` ends."""
    key, before = 4_400_000, _entered()
    kvt.begin_request(key, backend="test-engine")
    scope = kvt.transfer_scope(key, chunk_index=0)
    inside, ended, failure = threading.Event(), threading.Event(), []

    def worker():
        try:
            with scope:
                kvt.deliver(_call(IN_SCOPE))
                inside.set()
                assert ended.wait(30)
                kvt.deliver(_call(LATE))
            _not_in_any_scope()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            failure.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    assert inside.wait(30)
    kvt.end_request(key)
    ended.set()
    thread.join(30)
    if failure:
        raise failure[0]
    assert sorted(_sends(telemetry)) == [(IN_SCOPE, str(key)), (LATE, str(key))]
    assert telemetry.dropped() == {}  # an ordinary abort: nothing lost, nothing counted as dropped
    assert _entered() == before


# --- a full queue ----------------------------------------------------------------------------------------------

@pytest.fixture
def small_queue(monkeypatch):
    """The recorder's queue holds 10 records, and its thread sleeps the whole test: only a flush drains it."""
    from support.telemetry import Telemetry

    monkeypatch.setenv(config.QUEUE_SIZE, "10")
    monkeypatch.setenv(config.FLUSH_INTERVAL_MS, "60000")
    telemetry = Telemetry().instrument()
    yield telemetry
    telemetry.uninstrument()


def test_scoped_sends_into_a_full_queue_are_queued_or_counted(small_queue):
    for i in range(25):
        with kvt.transfer_scope(4_500_000 + i, chunk_index=0):
            kvt.deliver(_call(IN_SCOPE))
    assert len(small_queue.spans(semconv.SPAN_SEND)) == 10
    assert small_queue.dropped() == {"queue_full": 15}  # 10 spans + 15 counted = 25 scoped sends


def test_a_split_scope_into_a_full_queue_counts_the_requests_it_could_not_queue(small_queue):
    shares = [{"key": 4_600_000 + i, "bytes": 8, "descriptors": 1} for i in range(25)]
    with kvt.split_transfer_scope(shares):
        kvt.deliver(_call(200))
    assert len(small_queue.spans(semconv.SPAN_SEND)) == 10
    assert small_queue.dropped() == {"queue_full": 15}


@pytest.fixture(autouse=True)
def _no_trace_left():
    yield
    sys.settrace(None)
