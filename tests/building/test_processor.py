"""KVTransferMetricsProcessor fed ReadableSpans built directly: exact metric points, no engine, no builder.

Each span is constructed with the SDK's own ReadableSpan (name, context, attributes, status, start/end,
instrumentation scope); the points come out of a real MeterProvider through an InMemoryMetricReader.
"""

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from support.telemetry import in_memory_metrics, metric_points

from otel_kvtransfer import semconv
from otel_kvtransfer.building.processor import KVTransferMetricsProcessor

OURS = InstrumentationScope(semconv.INSTRUMENTATION_NAME, "0")

# What the builder puts on spans that must never reach a metric (high cardinality).
HIGH_CARDINALITY = {
    semconv.REQUEST_KEY: "room-42", semconv.BOOTSTRAP_ROOM: 42, semconv.SERVER_ADDRESS: "127.0.0.1",
    semconv.SERVER_PORT: 4242, semconv.CHUNK_INDEX: 3, "vllm.request_id": "rid-1", semconv.RETURN_CODE: -1,
}
LABELS = {semconv.BACKEND: "eng", semconv.FRAMEWORK: "fw", semconv.ROLE: semconv.ROLE_PREFILL,
          semconv.PAYLOAD: semconv.PAYLOAD_KV, semconv.REPLICA_FACTOR: 2, semconv.GEN_AI_REQUEST_MODEL: "tiny"}
PEER = {semconv.SERVER_ADDRESS: "127.0.0.1", semconv.SERVER_PORT: 4242}
PROCESS = {semconv.BACKEND: "eng", semconv.ROLE: semconv.ROLE_PREFILL}


class Setup:
    def __init__(self):
        provider, self.reader = in_memory_metrics()
        self.processor = KVTransferMetricsProcessor(provider)
        self._next_id = 1

    def end(self, name, attributes, start=1_000, end=3_000, error=None, scope=OURS, sampled=True):
        self._next_id += 1
        context = SpanContext(trace_id=0xABC, span_id=self._next_id, is_remote=False,
                              trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT))
        span = ReadableSpan(name=name, context=context, attributes=attributes, kind=SpanKind.INTERNAL,
                            status=Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET),
                            start_time=start, end_time=end, instrumentation_scope=scope)
        self.processor.on_end(span)
        return span

    def points(self):
        """{metric: [(attributes, count or value, sum)]} sorted, for exact comparison."""
        out = {}
        for name, points in metric_points(self.reader).items():
            out[name] = sorted(
                ((dict(p.attributes), getattr(p, "count", None), getattr(p, "sum", getattr(p, "value", None)))
                 for p in points), key=repr)
        return out


def test_a_successful_send_gives_one_point_per_send_metric_with_low_cardinality_labels():
    s = Setup()
    s.end(semconv.SPAN_SEND, {**LABELS, **HIGH_CARDINALITY, semconv.BYTES: 1_000, semconv.DESCRIPTOR_COUNT: 4,
                              semconv.THROUGHPUT: 5e8, semconv.OP: semconv.OP_WRITE})
    assert s.points() == {
        semconv.METRIC_DURATION: [(LABELS, 1, 2_000 / 1e9)],
        semconv.METRIC_SIZE: [(LABELS, 1, 1_000)],
        semconv.METRIC_THROUGHPUT: [(LABELS, 1, 5e8)],
        semconv.METRIC_DESCRIPTORS: [(LABELS, 1, 4)],
        # under 1 MiB: no peer throughput, but its time on the link counts
        semconv.METRIC_PEER_BUSY_TIME: [(PEER, None, 2_000 / 1e9)],
        semconv.METRIC_BUSY_TIME: [(PROCESS, None, 2_000 / 1e9)],
    }


def test_a_failed_send_is_counted_and_has_no_speed():
    s = Setup()
    attrs = {**LABELS, semconv.ERROR_TYPE: "transfer_failed", semconv.BYTES: 1_000, semconv.DESCRIPTOR_COUNT: 1,
             semconv.THROUGHPUT: 5e8}
    s.end(semconv.SPAN_SEND, attrs, error="transfer_failed")
    labels = {**LABELS, semconv.ERROR_TYPE: "transfer_failed"}
    assert s.points() == {
        semconv.METRIC_DURATION: [(labels, 1, 2_000 / 1e9)],
        semconv.METRIC_SIZE: [(labels, 1, 1_000)],
        semconv.METRIC_DESCRIPTORS: [(labels, 1, 1)],
        semconv.METRIC_FAILURES: [(labels, None, 1)],
        semconv.METRIC_BUSY_TIME: [(PROCESS, None, 2_000 / 1e9)],  # it held the engine as long, peer or not
    }


def test_an_empty_send_has_no_speed():
    s = Setup()
    s.end(semconv.SPAN_SEND, {**LABELS, semconv.BYTES: 0, semconv.DESCRIPTOR_COUNT: 0, semconv.THROUGHPUT: 0.0})
    points = s.points()
    assert semconv.METRIC_THROUGHPUT not in points
    assert points[semconv.METRIC_SIZE] == [(LABELS, 1, 0)]


def test_throughput_histogram_takes_only_successful_nonempty_sends():
    s = Setup()
    for nbytes, error in ((100, None), (0, None), (100, "timeout"), (0, "timeout"), (300, None)):
        attrs = {**LABELS, semconv.BYTES: nbytes, semconv.THROUGHPUT: nbytes * 1e6}
        if error:
            attrs[semconv.ERROR_TYPE] = error
        s.end(semconv.SPAN_SEND, attrs, error=error)
    points = s.points()
    assert points[semconv.METRIC_THROUGHPUT] == [(LABELS, 2, 400 * 1e6)]
    assert sum(c for _, c, _ in points[semconv.METRIC_DURATION]) == 5  # every send is still timed
    assert points[semconv.METRIC_FAILURES] == [({**LABELS, semconv.ERROR_TYPE: "timeout"}, None, 2)]


def test_request_metrics():
    s = Setup()
    base = {**LABELS, **HIGH_CARDINALITY, semconv.BYTES: 4_000, semconv.THROUGHPUT: 8e8, semconv.BUSY_S: 5e-6}
    s.end(semconv.SPAN_REQUEST, {**base, semconv.COMPUTE_OVERLAP_RATIO: 0.25}, start=0, end=10_000)
    s.end(semconv.SPAN_REQUEST, base, start=0, end=20_000)  # no compute known: no overlap point
    s.end(semconv.SPAN_REQUEST, {**base, semconv.ERROR_TYPE: "evicted"}, start=0, end=30_000, error="evicted")
    s.end(semconv.SPAN_REQUEST, {**base, semconv.BYTES: 0, semconv.THROUGHPUT: 0.0}, start=0, end=40_000)
    failed = {**LABELS, semconv.ERROR_TYPE: "evicted"}
    assert s.points() == {
        semconv.METRIC_REQUEST_DURATION: sorted(
            [(LABELS, 3, 10_000 / 1e9 + 20_000 / 1e9 + 40_000 / 1e9), (failed, 1, 30_000 / 1e9)], key=repr),
        semconv.METRIC_REQUEST_SIZE: sorted([(LABELS, 3, 8_000), (failed, 1, 4_000)], key=repr),
        semconv.METRIC_REQUEST_THROUGHPUT: [(LABELS, 2, 16e8)],
        semconv.METRIC_REQUEST_COMPUTE_OVERLAP: [(LABELS, 1, 0.25)],
    }


@pytest.mark.parametrize("name, role", [(semconv.SPAN_RECEIVE, semconv.ROLE_DECODE),
                                        (semconv.SPAN_SERVE, semconv.ROLE_PREFILL)])
def test_peer_wait_gives_receive_duration(name, role):
    s = Setup()
    attrs = {semconv.BACKEND: "eng", semconv.FRAMEWORK: "fw", semconv.ROLE: role, semconv.REQUEST_KEY: "k",
             semconv.EXPECTED_BYTES: 10}
    s.end(name, attrs, start=0, end=7_000)
    labels = {semconv.BACKEND: "eng", semconv.FRAMEWORK: "fw", semconv.ROLE: role}
    assert s.points() == {semconv.METRIC_RECEIVE_DURATION: [(labels, 1, 7_000 / 1e9)]}


def test_spans_of_other_scopes_and_other_names_are_ignored():
    s = Setup()
    attrs = {**LABELS, semconv.BYTES: 1, semconv.THROUGHPUT: 1.0}
    s.end(semconv.SPAN_SEND, attrs, scope=InstrumentationScope("someone.else", "1"))
    s.end(semconv.SPAN_SEND, attrs, scope=None)
    s.end(semconv.SPAN_COMPUTE, attrs)
    s.end("GET /", attrs)
    assert s.points() == {}


def test_unsampled_spans_still_count():
    s = Setup()
    for sampled in (True, False):
        s.end(semconv.SPAN_SEND, {**LABELS, semconv.BYTES: 8, semconv.THROUGHPUT: 8.0}, sampled=sampled)
    assert s.points()[semconv.METRIC_SIZE] == [(LABELS, 2, 16)]


def test_points_carry_exemplars_of_the_sampled_span():
    s = Setup()
    span = s.end(semconv.SPAN_SEND, {**LABELS, semconv.BYTES: 8, semconv.THROUGHPUT: 8.0})
    (point,) = metric_points(s.reader)[semconv.METRIC_SIZE]
    assert [(e.trace_id, e.span_id) for e in point.exemplars] == [(span.context.trace_id, span.context.span_id)]


def test_a_disabled_processor_records_nothing():
    s = Setup()
    s.processor.enabled = False  # what uninstrument() does to the processor it detaches
    s.end(semconv.SPAN_SEND, {**LABELS, semconv.BYTES: 8})
    assert s.points() == {}


def test_a_malformed_span_is_skipped_not_raised():
    s = Setup()
    s.end(semconv.SPAN_SEND, {**LABELS, semconv.BYTES: "not a number"})
    s.end(semconv.SPAN_SEND, {**LABELS, semconv.BYTES: 5, semconv.THROUGHPUT: 5.0})
    assert s.points()[semconv.METRIC_THROUGHPUT] == [(LABELS, 1, 5.0)]
