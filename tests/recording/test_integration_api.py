"""The integration API through the real instrumentor and recorder, with no engine: engine calls are handed over
the way engine modules do it (`integration.deliver` with a records.CALL_* tuple).

Proves: a scope entered on two threads, or nested, is one send (it once made two and doubled the request's
bytes); a split scope gives each request its share; a scope that failed before any engine call keeps its own
time; bad input of every kind is counted as `api_error` and never raised into the caller.
"""

import math
import threading
from time import time_ns

import pytest
from opentelemetry.trace import StatusCode

from otel_kvtransfer import integration as kvt
from otel_kvtransfer import semconv
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import now_ns

ENGINE = "test-engine"


def call(nbytes, start=None, end=None, descriptors=1, error=None):
    now = time_ns()
    fields = {r.CALL_START: start if start is not None else now, r.CALL_END: end if end is not None else now + 1,
              r.CALL_BYTES: nbytes, r.CALL_DESCRIPTORS: descriptors, r.CALL_OP: semconv.OP_WRITE,
              r.CALL_PEER: "127.0.0.1:1", r.CALL_PROTOCOL: "tcp", r.CALL_RETURN_CODE: 0 if error is None else -1,
              r.CALL_ERROR: error, r.CALL_BACKEND: ENGINE, r.CALL_EXTRA: None}
    return tuple(fields[i] for i in range(len(fields)))


def by_key(spans):
    return {s.attributes[semconv.REQUEST_KEY]: s for s in spans}


# --- one scope, one send ----------------------------------------------------------------------------------------

def test_a_scope_entered_on_two_threads_is_one_send(telemetry):
    kvt.begin_request(1, backend=ENGINE)
    scope = kvt.transfer_scope(1, chunk_index=0, payload="kv")
    both_in, errors = threading.Barrier(2), []

    def worker(nbytes):
        try:
            with scope:
                kvt.deliver(call(nbytes))
                both_in.wait(10)  # both threads are inside the scope at once
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in (100, 200)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    kvt.end_request(1)
    assert not errors
    (sent,) = telemetry.spans(semconv.SPAN_SEND)
    (request,) = telemetry.spans(semconv.SPAN_REQUEST)
    assert (sent.attributes[semconv.BYTES], sent.attributes[semconv.ENGINE_CALLS]) == (300, 2)
    assert (request.attributes[semconv.BYTES], request.attributes[semconv.TRANSFER_COUNT]) == (300, 1)


def test_a_scope_entered_and_left_by_many_threads_at_once_is_one_send_with_every_call(telemetry):
    """The scope's depth is shared by every thread: no enter or exit may be lost when they race."""
    kvt.begin_request(11, backend=ENGINE)
    scope = kvt.transfer_scope(11)
    start, errors = threading.Barrier(8), []

    def worker():
        try:
            start.wait(10)
            for _ in range(200):
                with scope:
                    kvt.deliver(call(1))
                    assert kvt.current_scope() is scope
                assert kvt.current_scope() is outer  # each thread gets its own previous scope back
        except Exception as exc:
            errors.append(exc)

    outer = None
    with scope:  # held open by this thread: every worker's calls belong to one send
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert kvt.current_scope() is scope
    assert kvt.current_scope() is None
    kvt.end_request(11)
    assert not errors
    (sent,) = telemetry.spans(semconv.SPAN_SEND)
    assert (sent.attributes[semconv.BYTES], sent.attributes[semconv.ENGINE_CALLS]) == (1600, 1600)


def test_bind_on_an_executor_thread_joins_the_same_send(telemetry):
    kvt.begin_request(2, backend=ENGINE)
    with kvt.transfer_scope(2, chunk_index=0, payload="kv") as scope:
        kvt.deliver(call(10))
        worker = threading.Thread(target=lambda: _bound(scope, 20))
        worker.start()
        worker.join(10)
    kvt.end_request(2)
    (sent,) = telemetry.spans(semconv.SPAN_SEND)
    assert (sent.attributes[semconv.BYTES], sent.attributes[semconv.ENGINE_CALLS]) == (30, 2)
    assert telemetry.spans(semconv.SPAN_REQUEST)[0].attributes[semconv.BYTES] == 30


def _bound(scope, nbytes):
    with scope.bind():
        kvt.deliver(call(nbytes))


def test_a_nested_scope_is_one_send(telemetry):
    kvt.begin_request(3, backend=ENGINE)
    scope = kvt.transfer_scope(3, chunk_index=0, payload="kv")
    with scope:
        kvt.deliver(call(5))
        with scope:
            kvt.deliver(call(7))
        kvt.deliver(call(11))
    kvt.end_request(3)
    (sent,) = telemetry.spans(semconv.SPAN_SEND)
    (request,) = telemetry.spans(semconv.SPAN_REQUEST)
    assert (sent.attributes[semconv.BYTES], sent.attributes[semconv.ENGINE_CALLS]) == (23, 3)
    assert request.attributes[semconv.BYTES] == 23


def test_a_scope_reused_after_exit_is_a_second_send(telemetry):
    scope = kvt.transfer_scope(4, chunk_index=0, payload="kv")
    for nbytes in (1, 2):
        with scope:
            kvt.deliver(call(nbytes))
    kvt.end_request(4)
    assert sorted(s.attributes[semconv.BYTES] for s in telemetry.spans(semconv.SPAN_SEND)) == [1, 2]
    assert telemetry.spans(semconv.SPAN_REQUEST)[0].attributes[semconv.BYTES] == 3


def test_an_inner_scope_of_another_request_takes_only_its_own_calls(telemetry):
    with kvt.transfer_scope(5, chunk_index=0, payload="kv"):
        kvt.deliver(call(100))
        with kvt.transfer_scope(6, chunk_index=0, payload="aux"):
            kvt.deliver(call(1))
        kvt.deliver(call(100))
    kvt.end_request(5)
    kvt.end_request(6)
    sends = by_key(telemetry.spans(semconv.SPAN_SEND))
    assert (sends["5"].attributes[semconv.BYTES], sends["6"].attributes[semconv.BYTES]) == (200, 1)


def test_split_scope_gives_each_request_its_share(telemetry):
    for key in ("a", "b"):
        kvt.begin_request(key, backend=ENGINE)
    shares = [{"key": "a", "bytes": 100, "descriptors": 2, "chunk_index": 0, "payload": "kv"},
              {"key": "b", "bytes": 300, "descriptors": 5, "chunk_index": 4, "payload": "kv", "is_last_chunk": True}]
    start = time_ns()
    with kvt.split_transfer_scope(shares):
        kvt.deliver(call(400, start=start, end=start + 1_000, descriptors=7))  # ONE engine call for both
    for key in ("a", "b"):
        kvt.end_request(key)
    sends = by_key(telemetry.spans(semconv.SPAN_SEND))
    requests = by_key(telemetry.spans(semconv.SPAN_REQUEST))
    assert set(sends) == {"a", "b"}
    for key, nbytes, descriptors, chunk in (("a", 100, 2, 0), ("b", 300, 5, 4)):
        sent = sends[key]
        assert (sent.attributes[semconv.BYTES], sent.attributes[semconv.DESCRIPTOR_COUNT]) == (nbytes, descriptors)
        assert sent.attributes[semconv.CHUNK_INDEX] == chunk
        assert (sent.start_time, sent.end_time) == (start, start + 1_000)  # the engine call's own times
        assert sent.parent.span_id == requests[key].context.span_id
        assert requests[key].attributes[semconv.BYTES] == nbytes
    assert sends["b"].attributes[semconv.IS_LAST_CHUNK] is True


def test_a_failed_engine_call_in_a_split_scope_fails_every_share(telemetry):
    shares = [{"key": k, "bytes": 8, "descriptors": 1} for k in (10, 11)]
    with kvt.split_transfer_scope(shares):
        kvt.deliver(call(16, error="transfer_failed"))
    for key in (10, 11):
        kvt.end_request(key)
    sends = telemetry.spans(semconv.SPAN_SEND)
    assert [s.status.status_code for s in sends] == [StatusCode.ERROR] * 2
    assert [s.status.status_code for s in telemetry.spans(semconv.SPAN_REQUEST)] == [StatusCode.ERROR] * 2


def test_scope_error_without_engine_call_is_stamped_with_the_scope_time(telemetry):
    """It was once stamped with the builder's clock at drain time, after the scope (and maybe its request)
    had ended."""
    kvt.begin_request(20, backend=ENGINE)
    before = now_ns()  # the records' clock: the wall clock may drift from it by microseconds (NTP slews it)
    with kvt.transfer_scope(20, chunk_index=0, payload="kv") as scope:
        scope.set_error("session_unreachable")
    after = now_ns()
    kvt.end_request(20, error_type="session_unreachable")
    (sent,) = telemetry.spans(semconv.SPAN_SEND)  # drained only now
    (request,) = telemetry.spans(semconv.SPAN_REQUEST)
    assert before <= sent.start_time <= sent.end_time <= after
    assert sent.end_time <= request.end_time
    assert sent.attributes[semconv.ERROR_TYPE] == "session_unreachable"


def test_an_exception_in_the_scope_passes_through_and_marks_the_send(telemetry):
    with pytest.raises(KeyError):
        with kvt.transfer_scope(21, chunk_index=0, payload="kv"):
            kvt.deliver(call(9))
            raise KeyError("engine bug")
    kvt.end_request(21)
    (sent,) = telemetry.spans(semconv.SPAN_SEND)
    assert sent.attributes[semconv.ERROR_TYPE] == "KeyError"
    assert sent.attributes[semconv.BYTES] == 9


# --- bad input: never raised, always counted --------------------------------------------------------------------

HUGE = "x" * 10_000_000


@pytest.mark.parametrize("make", [
    lambda: kvt.transfer_scope(float("inf"), chunk_index=0, payload="kv"),
    lambda: kvt.transfer_scope(float("nan"), chunk_index=0, payload="kv"),
    lambda: kvt.transfer_scope(1, chunk_index=float("inf"), payload="kv"),
    lambda: kvt.transfer_scope(1, chunk_index=float("nan"), payload="kv"),
    lambda: kvt.transfer_scope(1, chunk_index=0, replica_factor=float("inf")),
    lambda: kvt.transfer_scope(1, chunk_index="zero"),
    lambda: kvt.transfer_scope(1, chunk=0),  # a wrong keyword
    lambda: kvt.transfer_scope(),  # no key at all
    lambda: kvt.transfer_scope(None, chunk_index=0),
    lambda: kvt.transfer_scope(object(), chunk_index=0),
    lambda: kvt.transfer_scope(True, chunk_index=0),
    lambda: kvt.transfer_scope(b"bytes", chunk_index=0),
    lambda: kvt.transfer_scope(1, chunk_index=0, attributes=42),
    lambda: kvt.split_transfer_scope([{"key": 1}]),  # no bytes
    lambda: kvt.split_transfer_scope([{"key": float("inf"), "bytes": 1}]),
    lambda: kvt.split_transfer_scope([{"key": 1, "bytes": float("nan")}]),
    lambda: kvt.split_transfer_scope(None),
    lambda: kvt.split_transfer_scope([None]),
], ids=lambda _: "")
def test_a_bad_scope_is_counted_and_still_usable(telemetry, make):
    scope = make()
    with scope:
        kvt.deliver(call(55))  # still recorded, as a raw engine call
    (sent,) = telemetry.spans(semconv.SPAN_SEND)
    assert sent.attributes[semconv.BYTES] == 55
    assert semconv.REQUEST_KEY not in sent.attributes
    assert telemetry.dropped() == {"api_error": 1}


BAD_KEYS = [None, object(), [1], b"room", True, float("inf"), float("nan"), -math.inf, 1.5, {"k": 1}]


@pytest.mark.parametrize("bad", BAD_KEYS, ids=repr)
def test_begin_and_end_with_bad_keys_never_raise(telemetry, bad):
    kvt.begin_request(bad, backend=ENGINE)
    kvt.end_request(bad)
    kvt.record_compute([bad], 1, 2)
    kvt.begin_receive(bad, backend=ENGINE)
    kvt.end_receive(bad)
    kvt.begin_serve(bad, backend=ENGINE)
    kvt.end_serve(bad)
    assert telemetry.spans() == []
    assert telemetry.dropped() == {"api_error": 7}


def test_missing_and_wrong_keyword_arguments_never_raise(telemetry):
    kvt.begin_request(1)  # no backend
    kvt.begin_request(1, backend=ENGINE, colour="red")
    kvt.begin_receive(2)
    kvt.end_request(1, error="x")
    kvt.record_compute([1], 0)  # no end
    kvt.record_compute(None, 0, 1)
    kvt.record_compute([1], "a", "b")
    kvt.begin_serve(3, backend=ENGINE, expected_bytes="many")
    kvt.end_serve(3, end_ns=float("inf"))
    kvt.begin_request(4, backend=ENGINE, start_ns=float("nan"))
    assert telemetry.spans() == []
    assert telemetry.dropped() == {"api_error": 10}


def test_huge_strings_are_bounded_not_raised(telemetry):
    kvt.begin_request(HUGE, backend=ENGINE, framework=HUGE[:1000])
    with kvt.transfer_scope(HUGE, chunk_index=0, payload=HUGE) as scope:
        scope.set_error(HUGE)
    kvt.end_request(HUGE, error_type=HUGE)
    (sent,) = telemetry.spans(semconv.SPAN_SEND)
    (request,) = telemetry.spans(semconv.SPAN_REQUEST)
    assert len(sent.attributes[semconv.REQUEST_KEY]) <= 256
    assert request.attributes[semconv.REQUEST_KEY] == sent.attributes[semconv.REQUEST_KEY]  # one request
    assert len(sent.attributes[semconv.PAYLOAD]) <= 32
    assert len(sent.attributes[semconv.ERROR_TYPE]) <= 128
    assert len(request.attributes[semconv.ERROR_TYPE]) <= 128
    assert telemetry.dropped() == {}


def test_a_framework_set_up_step_is_a_connect_span_bounded_and_never_raises(telemetry):
    start = time_ns()
    kvt.record_connect("handshake", start, backend=ENGINE, framework="fw", address="10.0.0.7", port=5600)
    kvt.begin_request("r", backend=ENGINE, framework="fw")
    with kvt.transfer_scope("r"):
        kvt.record_connect(HUGE, start, backend=HUGE, framework=HUGE, address=HUGE, port=70000, error_type=HUGE)
    kvt.end_request("r")
    kvt.record_connect("handshake", "soon", backend=ENGINE)  # a start that is no time: counted, not raised
    raw, scoped = sorted(telemetry.spans(semconv.SPAN_CONNECT), key=lambda s: s.status.status_code.value)
    (request,) = telemetry.spans(semconv.SPAN_REQUEST)
    assert raw.parent is None and dict(raw.attributes) == {
        semconv.BACKEND: ENGINE, semconv.CONNECT_OPERATION: "handshake", semconv.CONNECT_OUTCOME: semconv.OUTCOME_OK,
        semconv.FRAMEWORK: "fw", semconv.SERVER_ADDRESS: "10.0.0.7", semconv.SERVER_PORT: 5600}
    assert raw.end_time >= raw.start_time
    assert scoped.parent.span_id == request.context.span_id and scoped.status.status_code is StatusCode.ERROR
    assert scoped.attributes[semconv.REQUEST_KEY] == "r"
    assert semconv.SERVER_PORT not in scoped.attributes  # not a port
    assert all(len(str(scoped.attributes[k])) <= 256 for k in (semconv.CONNECT_OPERATION, semconv.BACKEND,
                                                               semconv.FRAMEWORK, semconv.SERVER_ADDRESS,
                                                               semconv.ERROR_TYPE))
    assert telemetry.dropped() == {"api_error": 1}


def test_a_set_up_step_for_a_request_not_open_here_joins_its_stitched_trace(telemetry):
    """A decode's set-up for a request it has not begun to receive yet (sglang's bootstrap): in the trace both
    sides of that request share, with its key and the framework's own attributes."""
    from otel_kvtransfer.building.stitching import key_parent_span_context

    kvt.record_connect("register", time_ns(), backend=ENGINE, framework="fw", key=4242,
                       attributes={semconv.TP_RANK: 1})
    kvt.begin_receive(4242, backend=ENGINE, framework="fw")
    kvt.end_receive(4242)
    (connect,) = telemetry.spans(semconv.SPAN_CONNECT)
    (receive,) = telemetry.spans(semconv.SPAN_RECEIVE)
    synthetic = key_parent_span_context(4242)
    assert connect.context.trace_id == receive.context.trace_id == synthetic.trace_id
    assert connect.parent.span_id == synthetic.span_id
    assert connect.attributes[semconv.REQUEST_KEY] == "4242" and connect.attributes[semconv.TP_RANK] == 1
    assert telemetry.dropped() == {}


def test_the_api_is_a_no_op_when_not_instrumented():
    from otel_kvtransfer.recording.recorder import RECORDER

    assert not RECORDER.active
    before = RECORDER.pending()
    kvt.begin_request(1, backend=ENGINE)
    with kvt.transfer_scope(1, chunk_index=0) as scope:
        scope.set_error("x")
    kvt.end_request(1)
    assert RECORDER.pending() == before
