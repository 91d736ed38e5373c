"""The DESIGN metrics come from the spans: values, exemplars, and counting every transfer under sampling."""

import pytest
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from support.telemetry import Telemetry

from otel_kvtransfer import config, semconv
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.engines.mooncake import BACKEND


def _point(points):
    assert len(points) == 1, points
    return points[0]


def test_send_metrics_equal_span_values(telemetry, engine, receiver):
    lengths = [1000, 250000, 4 << 20]
    for length in lengths:
        assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, length) == 0
    spans = telemetry.spans(semconv.SPAN_SEND)
    metrics = telemetry.metrics()
    size = _point(metrics[semconv.METRIC_SIZE])
    assert (size.count, size.sum) == (3, sum(lengths))
    duration = _point(metrics[semconv.METRIC_DURATION])
    assert duration.count == 3
    assert duration.sum == pytest.approx(sum((s.end_time - s.start_time) / 1e9 for s in spans))
    throughput = _point(metrics[semconv.METRIC_THROUGHPUT])
    expected = [s.attributes[semconv.BYTES] * 1e9 / (s.end_time - s.start_time) for s in spans]
    assert throughput.count == 3
    assert throughput.sum == pytest.approx(sum(expected))
    assert throughput.max == pytest.approx(max(expected))
    assert dict(size.attributes) == {semconv.BACKEND: BACKEND}
    descriptors = _point(metrics[semconv.METRIC_DESCRIPTORS])
    assert (descriptors.count, descriptors.sum) == (3, 3)


def test_failed_and_empty_sends_have_no_speed(telemetry, engine, receiver):
    assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 4096) == 0
    with kvt.transfer_scope(8, chunk_index=0, payload="kv") as scope:
        scope.set_error("session_unreachable")  # a 0-byte failed send
    with kvt.transfer_scope(8, chunk_index=1, payload="aux"):
        # no speed either way
        engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 0)
    kvt.end_request(8, error_type="session_unreachable")
    sends = telemetry.spans(semconv.SPAN_SEND)
    assert len(sends) == 3
    metrics = telemetry.metrics()
    assert sum(p.count for p in metrics[semconv.METRIC_SIZE]) == 3
    assert sum(p.count for p in metrics[semconv.METRIC_THROUGHPUT]) == 1  # only the successful 4096 B send
    assert sum(p.value for p in metrics[semconv.METRIC_FAILURES]) == 1
    assert semconv.METRIC_REQUEST_THROUGHPUT not in metrics  # the failed request has no speed either
    assert sum(p.count for p in metrics[semconv.METRIC_REQUEST_SIZE]) == 1


def test_the_peer_wait_is_a_metric(telemetry):
    kvt.begin_receive(9, backend=BACKEND, framework="fw", start_ns=1_000_000_000)
    kvt.end_receive(9, end_ns=1_250_000_000)
    kvt.begin_serve("r-9", backend=BACKEND, framework="fw", start_ns=2_000_000_000)
    kvt.end_serve("r-9", error_type="expired", end_ns=2_500_000_000)
    points = {dict(p.attributes)[semconv.ROLE]: p for p in telemetry.metrics()[semconv.METRIC_RECEIVE_DURATION]}
    assert {role: (p.count, p.sum) for role, p in points.items()} == {"decode": (1, 0.25), "prefill": (1, 0.5)}
    assert dict(points["prefill"].attributes) == {semconv.BACKEND: BACKEND, semconv.FRAMEWORK: "fw",
                                                  semconv.ROLE: "prefill", semconv.ERROR_TYPE: "expired"}


def test_exemplars_point_at_the_send_span(telemetry, engine, receiver):
    for _ in range(3):
        assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 4096) == 0
    span_ids = {s.context.span_id for s in telemetry.spans(semconv.SPAN_SEND)}
    trace_ids = {s.context.trace_id for s in telemetry.spans(semconv.SPAN_SEND)}
    metrics = telemetry.metrics()  # once: a collection hands out the exemplars gathered since the last one
    for name in (semconv.METRIC_SIZE, semconv.METRIC_DURATION, semconv.METRIC_THROUGHPUT):
        exemplars = [e for p in metrics[name] for e in p.exemplars]
        assert exemplars, name
        assert {e.span_id for e in exemplars} <= span_ids
        assert {e.trace_id for e in exemplars} <= trace_ids


def test_request_metrics(telemetry, engine, receiver):
    kvt.begin_request(5, backend=BACKEND, attributes={semconv.GEN_AI_REQUEST_MODEL: "tiny-llama"})
    with kvt.transfer_scope(5, chunk_index=0, payload="kv", replica_factor=1):
        assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 8192) == 0
    kvt.record_compute([5], 0, 1)
    kvt.end_request(5)
    (request,) = telemetry.spans(semconv.SPAN_REQUEST)
    metrics = telemetry.metrics()
    size = _point(metrics[semconv.METRIC_REQUEST_SIZE])
    assert (size.count, size.sum) == (1, 8192)
    assert _point(metrics[semconv.METRIC_REQUEST_THROUGHPUT]).sum == request.attributes[semconv.THROUGHPUT]
    assert _point(metrics[semconv.METRIC_REQUEST_COMPUTE_OVERLAP]).sum == 0.0
    assert _point(metrics[semconv.METRIC_REQUEST_DURATION]).sum == (request.end_time - request.start_time) / 1e9
    assert dict(size.attributes) == {semconv.BACKEND: "mooncake", semconv.ROLE: "prefill",
                                     semconv.REPLICA_FACTOR: 1, semconv.GEN_AI_REQUEST_MODEL: "tiny-llama"}
    (send_size,) = metrics[semconv.METRIC_SIZE]  # the send carries the request's model and role too
    assert dict(send_size.attributes) == {semconv.BACKEND: "mooncake", semconv.ROLE: "prefill",
                                          semconv.PAYLOAD: "kv", semconv.REPLICA_FACTOR: 1,
                                          semconv.GEN_AI_REQUEST_MODEL: "tiny-llama"}


class _SeeAll(SpanProcessor):
    def __init__(self):
        self.ended = []

    def on_end(self, span):
        self.ended.append(span)


@pytest.mark.parametrize("pipeline", ["direct", "sdk"])
def test_sampling_exports_the_share_but_metrics_count_every_transfer(engine, receiver, monkeypatch, pipeline):
    """The metrics count every transfer under any ratio. The SDK pipeline records the unsampled spans too (every
    processor's on_end sees all 200); the direct pipeline never builds a span the sampler drops."""
    monkeypatch.setenv(config.PIPELINE, pipeline)
    ratio = TraceIdRatioBased(0.1)
    telemetry = Telemetry(sampler=ratio)
    seen = _SeeAll()
    telemetry.tracer_provider.add_span_processor(seen)
    telemetry.instrument()
    try:
        total = 200
        for _ in range(total):
            assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 64) == 0
        exported = telemetry.spans(semconv.SPAN_SEND)
        size = _point(telemetry.metrics()[semconv.METRIC_SIZE])
    finally:
        telemetry.uninstrument()
    assert (size.count, size.sum) == (total, total * 64)
    assert len(seen.ended) == (total if pipeline == "sdk" else len(exported))
    sampled = [s for s in seen.ended if s.context.trace_flags.sampled]
    bound = ratio.bound
    # Exactly the spans whose trace id the ratio sampler keeps are exported; the others were only recorded.
    assert all((s.context.trace_id & TraceIdRatioBased.TRACE_ID_LIMIT) < bound for s in sampled)
    assert all((s.context.trace_id & TraceIdRatioBased.TRACE_ID_LIMIT) >= bound
               for s in seen.ended if not s.context.trace_flags.sampled)
    assert {s.context.span_id for s in exported} == {s.context.span_id for s in sampled}
    assert 0 < len(exported) < total // 2
    # Exemplars only ever point at exported spans.
    exemplar_ids = {e.span_id for e in size.exemplars}
    assert exemplar_ids <= {s.context.span_id for s in exported}


@pytest.mark.parametrize("pipeline", ["direct", "sdk"])
def test_peer_throughput_per_peer_up_to_the_cap_then_other(monkeypatch, caplog, pipeline):
    """kv_transfer.peer.throughput: successful kv sends of >= 1 MiB, one series per (server.address,
    server.port), at most OTEL_KVTRANSFER_MAX_PEERS of them; the rest `other`, said once. No engine: the
    records name three peers (a real link test lives with the alert rule)."""
    from test_builder import begin_request, call, end_request, info, send

    monkeypatch.setenv(config.PIPELINE, pipeline)
    monkeypatch.setenv(config.MAX_PEERS, "2")
    telemetry = Telemetry().instrument()
    try:
        from otel_kvtransfer.recording.recorder import RECORDER

        RECORDER.record(begin_request(1, 0))
        for n, peer in enumerate(["10.0.0.1:7001", "10.0.0.2:7002", "10.0.0.3:7003", "10.0.0.1:7001"]):
            RECORDER.record(send(info(1, n), [call(1_000 * n, 1_000 * n + 500, 2 << 20, peer=peer, backend=BACKEND)]))
        too_small = call(9_000, 9_500, (1 << 20) - 1, peer="10.0.0.9:1", backend=BACKEND)
        RECORDER.record(send(info(1, 9), [too_small]))
        not_kv = call(9_600, 9_900, 2 << 20, peer="10.0.0.8:1", backend=BACKEND)
        RECORDER.record(send(info(1, 9, payload=semconv.PAYLOAD_AUX), [not_kv]))
        RECORDER.record(end_request(1, 20_000))
        points = telemetry.metrics()[semconv.METRIC_PEER_THROUGHPUT]
    finally:
        telemetry.uninstrument()
    # the Mooncake engine's own peer names ("host:port") parsed by its module
    by_peer = {(dict(p.attributes)[semconv.SERVER_ADDRESS], dict(p.attributes).get(semconv.SERVER_PORT)): p.count
               for p in points}
    assert by_peer == {("10.0.0.1", 7001): 2, ("10.0.0.2", 7002): 1, (semconv.PEER_OTHER, None): 1}
    assert all(set(dict(p.attributes)) <= {semconv.SERVER_ADDRESS, semconv.SERVER_PORT} for p in points)
    assert sum("OTEL_KVTRANSFER_MAX_PEERS" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("pipeline", ["direct", "sdk"])
def test_kv_read_after_its_serve_expired_is_late_on_the_serve_span_and_counted(monkeypatch, pipeline):
    """The peer side of a late completion through the API a framework calls: a serve ended `expired` is held for
    late KV; a late arrival puts the event on it and counts it (role prefill); a flush exports a held one that got
    none; a serve ended in time gets no event from KV that comes later."""
    from otel_kvtransfer.recording.clock import now_ns

    monkeypatch.setenv(config.PIPELINE, pipeline)
    telemetry = Telemetry().instrument()
    try:
        end = now_ns()
        for key, error in (("late", "expired"), ("quiet", "expired"), ("in-time", None)):
            kvt.begin_serve(key, backend=BACKEND, framework="fw", start_ns=None)
            kvt.end_serve(key, error_type=error)
        kvt.late_arrival("late", backend=BACKEND)
        kvt.late_arrival("in-time", backend=BACKEND)
        serves = {s.attributes[semconv.REQUEST_KEY]: s for s in telemetry.spans(semconv.SPAN_SERVE)}
        assert sorted(serves) == ["in-time", "late", "quiet"]
        late = [[e for e in s.events if e.name == semconv.EVENT_LATE_COMPLETION] for s in
                (serves["late"], serves["quiet"], serves["in-time"])]
        assert [len(events) for events in late] == [1, 0, 0]
        assert late[0][0].timestamp >= serves["late"].end_time >= end
        point = _point(telemetry.metrics()[semconv.METRIC_LATE_COMPLETIONS])
        assert point.value == 1 and dict(point.attributes)[semconv.ROLE] == semconv.ROLE_PREFILL
    finally:
        telemetry.uninstrument()
