"""kv_transfer.request aggregates, scopes, compute overlap and stitching, over real Mooncake transfers."""

import threading
import time

from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from otel_kvtransfer import integration as kvt
from otel_kvtransfer import semconv
from otel_kvtransfer.building import aggregate
from otel_kvtransfer.building.stitching import key_span_id, key_trace_id
from otel_kvtransfer.demo.loopback import digest
from otel_kvtransfer.engines.mooncake import BACKEND


def test_scope_aggregates_engine_calls_into_one_send(telemetry, engine, receiver):
    room = 41
    kvt.begin_request(room, backend=BACKEND)
    with kvt.transfer_scope(room, chunk_index=0, payload="kv", destination_index=1, replica_factor=2,
                            prefix_early_send=True):
        assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 1000) == 0
        assert engine.engine.batch_transfer_sync_write(
            receiver.session, [engine.base + 1000, engine.base + 3000],
            [receiver.base_address + 1000, receiver.base_address + 3000], [2000, 500]) == 0
    kvt.end_request(room)
    assert receiver.digest(0, 3500) == digest(engine.source[:3500])
    sends = telemetry.spans(semconv.SPAN_SEND)
    assert len(sends) == 1
    send = sends[0]
    request = telemetry.spans(semconv.SPAN_REQUEST)[0]
    assert send.parent.span_id == request.context.span_id
    assert send.kind is SpanKind.CLIENT
    attrs = dict(send.attributes)
    assert attrs[semconv.BYTES] == 3500
    assert attrs[semconv.ENGINE_CALLS] == 2
    assert attrs[semconv.DESCRIPTOR_COUNT] == 3
    assert {k: attrs[k] for k in (semconv.REQUEST_KEY, semconv.CHUNK_INDEX, semconv.PAYLOAD,
                                  semconv.DESTINATION_INDEX, semconv.REPLICA_FACTOR, semconv.IS_LAST_CHUNK,
                                  semconv.PREFIX_EARLY_SEND)} == {
        semconv.REQUEST_KEY: str(room), semconv.CHUNK_INDEX: 0, semconv.PAYLOAD: "kv",
        semconv.DESTINATION_INDEX: 1, semconv.REPLICA_FACTOR: 2, semconv.IS_LAST_CHUNK: False,
        semconv.PREFIX_EARLY_SEND: True}


def test_calls_from_an_executor_thread_join_the_scope(telemetry, engine, receiver):
    room = 42
    scope = kvt.transfer_scope(room, chunk_index=0, payload="kv")

    def per_layer(offset):
        with scope.bind():
            assert engine.engine.transfer_sync_write(
                receiver.session, engine.base + offset, receiver.base_address + offset, 256) == 0

    with scope:
        threads = [threading.Thread(target=per_layer, args=(i * 256,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    kvt.end_request(room)
    sends = telemetry.spans(semconv.SPAN_SEND)
    assert [(s.attributes[semconv.BYTES], s.attributes[semconv.ENGINE_CALLS]) for s in sends] == [(1024, 4)]


def test_request_aggregates_busy_union_throughput_and_overlap(telemetry, engine, receiver):
    room = 43
    kvt.begin_request(room, backend=BACKEND)
    compute_start = time.time_ns()
    for chunk, (offset, length) in enumerate([(0, 4 << 20), (4 << 20, 2 << 20), (6 << 20, 1 << 20)]):
        for dest in range(2):
            with kvt.transfer_scope(room, chunk_index=chunk, payload="kv", destination_index=dest,
                                    replica_factor=2, is_last_chunk=chunk == 2):
                assert engine.engine.transfer_sync_write(
                    receiver.session, engine.base + offset, receiver.base_address + offset, length) == 0
        time.sleep(0.01)  # a gap between chunks: it must not count as busy time
    compute_end = time.time_ns()
    kvt.record_compute([room], compute_start, compute_end, chunk_index=0)
    with kvt.transfer_scope(room, chunk_index=2, payload="aux", is_last_chunk=True, replica_factor=2):
        assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 100) == 0
    kvt.end_request(room)
    sends = telemetry.spans(semconv.SPAN_SEND)
    (request,) = telemetry.spans(semconv.SPAN_REQUEST)
    (compute,) = telemetry.spans(semconv.SPAN_COMPUTE)
    wire = sum(s.attributes[semconv.BYTES] for s in sends)
    assert wire == 2 * (7 << 20) + 100
    busy = aggregate.union((s.start_time, s.end_time) for s in sends)
    busy_ns = aggregate.length(busy)
    overlap_ns = aggregate.intersection_length(busy, [(compute_start, compute_end)])
    attrs = dict(request.attributes)
    assert attrs[semconv.BYTES] == wire
    assert attrs[semconv.LOGICAL_BYTES] == (7 << 20) + 50
    assert attrs[semconv.TRANSFER_COUNT] == 7
    assert attrs[semconv.CHUNK_COUNT] == 3
    assert attrs[semconv.REPLICA_FACTOR] == 2
    assert attrs[semconv.BUSY_S] == busy_ns / 1e9
    assert attrs[semconv.BUSY_S] < (request.end_time - request.start_time) / 1e9  # gaps excluded
    assert attrs[semconv.THROUGHPUT] == wire * 1e9 / busy_ns
    assert attrs[semconv.COMPUTE_OVERLAP_S] == overlap_ns / 1e9
    assert attrs[semconv.COMPUTE_OVERLAP_RATIO] == overlap_ns / busy_ns
    assert compute.parent.span_id == request.context.span_id
    assert (compute.start_time, compute.end_time) == (compute_start, compute_end)


def test_request_without_parent_is_stitched_to_the_key(telemetry):
    for key, peer in ((0x1234_5678_9ABC, semconv.SPAN_RECEIVE), ("xfer-7f3a", semconv.SPAN_SERVE)):
        kvt.begin_request(key, backend=BACKEND, framework="fw")
        kvt.end_request(key)
        if peer == semconv.SPAN_RECEIVE:
            kvt.begin_receive(key, backend=BACKEND, framework="fw", expected_bytes=99)
            kvt.end_receive(key)
        else:
            kvt.begin_serve(key, backend=BACKEND, framework="fw", expected_bytes=99)
            kvt.end_serve(key)
        (request,) = [s for s in telemetry.spans(semconv.SPAN_REQUEST)
                      if s.attributes[semconv.REQUEST_KEY] == str(key)]
        (waiting,) = telemetry.spans(peer)
        for span in (request, waiting):
            assert span.context.trace_id == key_trace_id(key)
            assert span.parent.span_id == key_span_id(key)
            assert span.parent.is_remote
        assert waiting.kind is SpanKind.INTERNAL
        assert dict(waiting.attributes) == {
            semconv.REQUEST_KEY: str(key), semconv.BACKEND: BACKEND, semconv.FRAMEWORK: "fw",
            semconv.ROLE: semconv.ROLE_DECODE if peer == semconv.SPAN_RECEIVE else semconv.ROLE_PREFILL,
            semconv.EXPECTED_BYTES: 99}


def test_explicit_parent_wins_over_stitching(telemetry):
    tracer = telemetry.tracer_provider.get_tracer("engine")
    with tracer.start_as_current_span("engine request") as parent:
        kvt.begin_request(7, backend=BACKEND, parent=trace.set_span_in_context(parent),
                          attributes={"engine.rid": "rid-7"})
    kvt.end_request(7)
    request = telemetry.spans(semconv.SPAN_REQUEST)[0]
    assert request.parent.span_id == parent.get_span_context().span_id
    assert request.context.trace_id == parent.get_span_context().trace_id
    assert request.attributes["engine.rid"] == "rid-7"


def test_failed_request_and_scope_error(telemetry):
    room = 44
    kvt.begin_request(room, backend=BACKEND)
    with kvt.transfer_scope(room, chunk_index=0, payload="kv") as scope:
        scope.set_error("session_unreachable")
    with kvt.transfer_scope(room, chunk_index=1, payload="kv"):
        pass  # no engine call and no error: no span (a dummy destination)
    kvt.end_request(room, error_type="session_unreachable")
    (send,) = telemetry.spans(semconv.SPAN_SEND)
    (request,) = telemetry.spans(semconv.SPAN_REQUEST)
    assert send.status.status_code is StatusCode.ERROR
    assert send.attributes[semconv.ERROR_TYPE] == "session_unreachable"
    assert send.attributes[semconv.BYTES] == 0
    assert request.status.status_code is StatusCode.ERROR
    assert request.attributes[semconv.ERROR_TYPE] == "session_unreachable"
    failures = telemetry.metrics()[semconv.METRIC_FAILURES]
    assert [(dict(p.attributes)[semconv.ERROR_TYPE], p.value) for p in failures] == [("session_unreachable", 1)]


def test_reused_room_starts_a_fresh_request(telemetry, engine, receiver):
    room = 45
    for length in (100, 200):
        kvt.begin_request(room, backend=BACKEND)
        with kvt.transfer_scope(room, chunk_index=0, payload="kv"):
            assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, length) == 0
        kvt.end_request(room)
    requests = telemetry.spans(semconv.SPAN_REQUEST)
    assert [r.attributes[semconv.BYTES] for r in requests] == [100, 200]
    assert requests[0].context.span_id != requests[1].context.span_id


def test_bad_input_to_the_api_is_counted_never_raised(telemetry, engine, receiver):
    kvt.begin_request(object(), backend=BACKEND)
    kvt.end_request(None)
    kvt.record_compute([object()], 0, 1)
    with kvt.transfer_scope("x", chunk_index="y", payload="kv"):
        assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 16) == 0
    (send,) = telemetry.spans(semconv.SPAN_SEND)
    assert send.attributes[semconv.BYTES] == 16  # the transfer itself is still recorded
    assert telemetry.dropped() == {"api_error": 4}
