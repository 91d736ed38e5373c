"""`integration.payload_scope`: engine calls whose bytes are not a request's KV (vLLM's encoder caches, EPLB's
expert weights), through the real instrumentor and recorder with no engine, the calls handed over as engine
modules hand them (`integration.deliver`). The same on vLLM's own classes over the real engines:
tests/frameworks/vllm/test_vllm_payloads.py.
"""

from time import time_ns

import pytest

from otel_kvtransfer import integration as kvt
from otel_kvtransfer import semconv
from otel_kvtransfer.recording import records as r

MIB = 1 << 20


def call(nbytes, extra=None, peer="127.0.0.1:9"):
    now = time_ns()
    return r.call(now, now + 1000, nbytes, 1, semconv.OP_WRITE, peer, "tcp", 0, None, "mooncake", extra)


def points(telemetry, name):
    return [(dict(p.attributes), p) for p in telemetry.metrics().get(name, [])]


def test_each_call_is_a_labelled_send_of_no_request_under_the_span_current_where_the_scope_was_made(telemetry):
    tracer = telemetry.tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("vllm step") as outer:
        scope = kvt.payload_scope(semconv.PAYLOAD_ENCODER_CACHE, framework="vllm")
    with scope:  # entered later, elsewhere: its parent is where it was made
        kvt.deliver(call(2 * MIB))
        kvt.deliver(call(3 * MIB, extra={semconv.NOTIFICATION: "mm-1"}))
    sends = telemetry.spans(semconv.SPAN_SEND)
    assert sorted(s.attributes[semconv.BYTES] for s in sends) == [2 * MIB, 3 * MIB]
    for send in sends:
        assert send.attributes[semconv.PAYLOAD] == "encoder_cache"
        assert send.attributes[semconv.FRAMEWORK] == "vllm"
        assert semconv.REQUEST_KEY not in send.attributes
        assert send.parent.span_id == outer.get_span_context().span_id
    assert [s.attributes.get(semconv.NOTIFICATION) for s in sends if s.attributes[semconv.BYTES] == 3 * MIB] == \
        ["mm-1"]
    assert telemetry.spans(semconv.SPAN_REQUEST) == []
    # per-send histograms keep the label; the per-peer throughput (kv only) and the request metrics see nothing
    sizes = points(telemetry, semconv.METRIC_SIZE)
    assert [(a[semconv.PAYLOAD], p.count) for a, p in sizes] == [("encoder_cache", 2)]
    assert points(telemetry, semconv.METRIC_PEER_THROUGHPUT) == []
    assert points(telemetry, semconv.METRIC_REQUEST_SIZE) == []


def test_a_kv_request_beside_it_counts_only_its_own_send(telemetry):
    kvt.begin_request("t1", backend="mooncake", framework="vllm")
    with kvt.transfer_scope("t1", is_last_chunk=True):
        kvt.deliver(call(2 * MIB))
    with kvt.payload_scope(semconv.PAYLOAD_EXPERT_WEIGHTS, framework="vllm"):
        kvt.deliver(call(4 * MIB))  # the same peer, while the request is open
    kvt.end_request("t1")
    (request,) = telemetry.spans(semconv.SPAN_REQUEST)
    assert request.attributes[semconv.BYTES] == 2 * MIB and request.attributes[semconv.TRANSFER_COUNT] == 1
    ((_, request_size),) = points(telemetry, semconv.METRIC_REQUEST_SIZE)
    assert (request_size.count, request_size.sum) == (1, 2 * MIB)
    ((peer, peer_point),) = points(telemetry, semconv.METRIC_PEER_THROUGHPUT)
    assert peer[semconv.SERVER_PORT] == 9 and peer_point.count == 1
    by_payload = {a[semconv.PAYLOAD]: p.sum for a, p in points(telemetry, semconv.METRIC_SIZE)}
    assert by_payload == {"kv": 2 * MIB, "expert_weights": 4 * MIB}


@pytest.mark.parametrize("payload", ["kv", "aux", "weights", None, 7])
def test_a_payload_that_is_not_one_of_the_non_kv_values_is_counted_and_its_calls_are_raw_sends(telemetry, payload):
    with kvt.payload_scope(payload, framework="vllm"):
        kvt.deliver(call(MIB))
    (send,) = telemetry.spans(semconv.SPAN_SEND)
    assert semconv.PAYLOAD not in send.attributes and semconv.FRAMEWORK not in send.attributes
    assert telemetry.dropped() == {"api_error": 1}


def test_an_exception_passes_through_and_a_scope_without_engine_calls_is_no_send(telemetry):
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with kvt.payload_scope(semconv.PAYLOAD_ENCODER_CACHE, framework="vllm"):
            raise Boom()
    assert telemetry.spans(semconv.SPAN_SEND) == []
    assert kvt.current_scope() is None


def test_a_call_recorded_apart_from_its_scope_keeps_its_description(telemetry):
    """What the NIXL engine module does with a handle made in a scope and posted on a thread outside it."""
    kvt.begin_request("t2", backend="nixl", framework="test", role="decode")
    kv_scope = kvt.transfer_scope("t2", destination_index=1)
    payload = kvt.payload_scope(semconv.PAYLOAD_ENCODER_CACHE, framework="vllm")
    split = kvt.split_transfer_scope([{"key": "t3", "bytes": 3 * MIB, "descriptors": 1},
                                      {"key": "t4", "bytes": 4 * MIB, "descriptors": 1}])
    kv_scope.record_apart(call(MIB))
    payload.record_apart(call(2 * MIB))
    split.record_apart(call(7 * MIB))  # each request its share, as when the call is made inside the scope
    kvt.end_request("t2")
    sends = {s.attributes[semconv.BYTES]: s for s in telemetry.spans(semconv.SPAN_SEND)}
    assert sends[3 * MIB].attributes[semconv.REQUEST_KEY] == "t3"
    assert sends[4 * MIB].attributes[semconv.REQUEST_KEY] == "t4"
    assert sends[MIB].attributes[semconv.REQUEST_KEY] == "t2"
    assert sends[MIB].attributes[semconv.DESTINATION_INDEX] == 1
    assert sends[2 * MIB].attributes[semconv.PAYLOAD] == "encoder_cache"
    assert semconv.REQUEST_KEY not in sends[2 * MIB].attributes
