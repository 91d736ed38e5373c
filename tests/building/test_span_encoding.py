"""The direct pipeline sends what the SDK pipeline sends: the same records through both, every span and metric
point compared field by field after the real OTLP exporters' encoding.

Both pipelines get the same sequential id generator, so their span and trace ids are equal where the spans are;
each pipeline's spans are encoded by the OTLP exporters' own `encode_spans` (the direct pipeline's through our
fixed-shape encoder inside it, as `span_encoding.accelerate()` installs it) and decoded with opentelemetry-proto.
Then the same spans travel through the real OTLP/HTTP and OTLP/gRPC exporters to receivers on 127.0.0.1.
"""

import random
import time
from http.server import BaseHTTPRequestHandler

import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState, set_span_in_context
from support import otlp
from support.telemetry import in_memory_metrics
from test_builder import begin_peer, begin_request, call, compute, end_peer, end_request, info, send

from otel_kvtransfer import config, registry, semconv
from otel_kvtransfer.building import span_encoding
from otel_kvtransfer.building.attachment import Attachment, new_builder
from otel_kvtransfer.building.direct_spans import KVSpan


class Sequential(IdGenerator):
    """Ids in creation order, so two pipelines fed the same records give their spans the same ids."""

    def __init__(self):
        self.next = 0x1000

    def generate_span_id(self) -> int:
        self.next += 1
        return self.next

    def generate_trace_id(self) -> int:
        self.next += 1
        return (0xABC << 64) | self.next


def _records():
    """A bit of everything the builder makes: requests with sends (multi-call, failed, framework attributes,
    lists of lengths), compute, peers, raw calls under a remote parent with trace state and under none."""
    remote = set_span_in_context(NonRecordingSpan(SpanContext(
        0x1234, 0x99, True, TraceFlags(TraceFlags.SAMPLED), TraceState([("vendor", "x")]))))
    recs = [begin_request(11, 1_000, attributes={"fw.rid": "r-11", semconv.GEN_AI_REQUEST_MODEL: "tiny"}),
            begin_request(12, 1_500, framework=None, parent=remote)]
    for chunk in range(4):
        recs.append(send(info(11, chunk, last=chunk == 3, attrs={"fw.rid": "r-11"}),
                         [call(2_000 + chunk * 100, 2_050 + chunk * 100, 4096 * (chunk + 1)),
                          call(2_010 + chunk * 100, 2_080 + chunk * 100, [100, 200, 300], descriptors=3)]))
        recs.append(compute([11], 1_900 + chunk * 100, 1_990 + chunk * 100, chunk))
    recs += [
        send(info(12, 0, replica=2, destination=1), [call(3_000, 3_100, 1 << 20, rc=-1, error="transfer_failed")]),
        send(info(12, 0, replica=2, destination=0), [call(3_000, 3_500, 2 << 20)]),  # a peer throughput point
        send(info(12, 1, payload=semconv.PAYLOAD_AUX), [], error="scope_error", scope_span=(3_200, 3_300)),
        send(None, [call(4_000, 4_001, 7, op=semconv.OP_READ, protocol="rdma")], context=remote),
        send(None, [call(4_100, 4_150, 0, extra={"nixl.notification": True})]),
        begin_peer(13, 5_000, attributes={"expected": 123}),
        end_peer(13, 6_000),
        begin_peer(14, 5_000, name=semconv.SPAN_SERVE, role=semconv.ROLE_PREFILL),
        end_peer(14, 5_500, error="peer_failed"),
        end_request(11, 7_000),
        end_request(12, 7_100),
    ]
    return recs


def _run(pipeline, sampler=None, ids=None):
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=ids or Sequential(), **({"sampler": sampler} if sampler else {}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    meters, reader = in_memory_metrics()
    attachment = Attachment(meters, pipeline)
    attachment.attach(provider.get_tracer(semconv.INSTRUMENTATION_NAME, "0.1.0"), provider, flush_first=False)
    builder = new_builder(attachment, config.Settings(), registry.load(registry.ENGINES),
                          on_drop=lambda reason, n: None)
    for rec in _records():
        builder.handle(rec)
    builder.release_held()  # as a flush does: the peer wait that ended in error is exported too
    spans = exporter.get_finished_spans()
    metrics = reader.get_metrics_data()
    attachment.detach()
    return spans, metrics


@pytest.fixture(autouse=True)
def _accelerated():
    with otlp.accelerated():
        yield


def _decoded(message) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest.FromString(message.SerializeToString())


def _sorted_spans(request: ExportTraceServiceRequest):
    return sorted((span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans),
                  key=lambda span: span.span_id)


@pytest.mark.parametrize("sampler", [None, ParentBased(TraceIdRatioBased(0.5))], ids=["always_on", "ratio"])
def test_direct_spans_encode_to_exactly_what_the_sdk_pipeline_sends(sampler):
    direct, _ = _run("direct", sampler)
    sdk, _ = _run("sdk", sampler)
    sampled_sdk = [s for s in sdk if s.context.trace_flags.sampled]  # what the SDK pipeline's exporters send
    assert direct and all(type(s) is KVSpan for s in direct)
    assert len(direct) == len(sampled_sdk)
    if sampler is None:
        assert len(direct) == 17  # 2 requests, 7 sends under them, 2 raw sends, 4 compute, 2 peers
    ours = _sorted_spans(_decoded(span_encoding.AcceleratedEncoder(encode_spans)(direct)))
    reference = _sorted_spans(encode_spans(sampled_sdk))
    assert [span.name for span in ours] == [span.name for span in reference]
    for mine, theirs in zip(ours, reference):
        assert mine == theirs, (mine.name, mine, theirs)  # every field: ids, times, attributes in order, status
    # and the fast encoder really wrote ours: the original encoder of the same KVSpans gives the same bytes
    assert _sorted_spans(encode_spans(direct)) == ours


class AskedRandomIds(RandomIdGenerator):
    """The SDK's random ids, but not of its exact type: the direct pipeline asks it for every id."""


def test_the_sdk_random_ids_drawn_in_place_are_the_generators_own():
    """With the SDK's RandomIdGenerator the direct pipeline draws the ids itself: seeded alike, every span gets the
    id the generator gives when it is asked for each one."""
    random.seed(1234)
    drawn, _ = _run("direct", ids=RandomIdGenerator())
    random.seed(1234)
    asked, _ = _run("direct", ids=AskedRandomIds())
    ids = lambda spans: [(s.name, s.context.trace_id, s.context.span_id) for s in spans]  # noqa: E731
    assert len(drawn) == 17 and ids(drawn) == ids(asked)
    assert all(s.context.is_valid and type(s.context) is SpanContext for s in drawn)


def test_a_drawn_zero_id_is_drawn_again_as_the_generator_does(monkeypatch):
    real, drawn, zeros = random.getrandbits, [], []

    def draws(bits):  # every third draw is the invalid 0
        drawn.append(bits)
        if len(drawn) % 3 == 1:
            zeros.append(bits)
            return 0
        return real(bits)

    monkeypatch.setattr(random, "getrandbits", draws)
    direct, _ = _run("direct", ids=RandomIdGenerator())
    assert len(direct) == 17 and 64 in zeros and 128 in zeros  # both kinds of id drew a 0
    assert all(s.context.span_id and s.context.trace_id and s.context.is_valid for s in direct)
    assert len({s.context.span_id for s in direct}) == 17


def test_the_http_flavour_is_preencoded_bytes_and_the_grpc_flavour_a_message():
    direct, _ = _run("direct")
    http = span_encoding.AcceleratedEncoder(encode_spans, as_message=False)(direct)
    grpc = span_encoding.AcceleratedEncoder(encode_spans, as_message=True)(direct)
    assert isinstance(http, span_encoding.PreEncoded) and isinstance(grpc, ExportTraceServiceRequest)
    assert ExportTraceServiceRequest.FromString(http.SerializePartialToString()) == grpc


def test_a_batch_mixing_other_spans_keeps_them_and_ours():
    direct, _ = _run("direct")
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("the-app").start_as_current_span("app-span", attributes={"a": [1, 2]}):
        pass
    other = exporter.get_finished_spans()[0]
    mixed = list(direct[:3]) + [other] + list(direct[3:])
    out = _decoded(span_encoding.AcceleratedEncoder(encode_spans)(mixed))
    names = sorted(span.name for rs in out.resource_spans for ss in rs.scope_spans for span in ss.spans)
    assert names == sorted(s.name for s in mixed)
    scopes = {ss.scope.name for rs in out.resource_spans for ss in rs.scope_spans}
    assert scopes == {"the-app", semconv.INSTRUMENTATION_NAME}


def _points(data):
    out = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    body = {k: v for k, v in vars(point).items()
                            if k not in ("start_time_unix_nano", "time_unix_nano", "exemplars")}
                    body["attributes"] = dict(point.attributes)
                    body["exemplars"] = sorted((e.span_id, e.trace_id, e.value, dict(e.filtered_attributes or {}))
                                               for e in point.exemplars)
                    out.setdefault(metric.name, []).append(body)
                    out[metric.name].sort(key=repr)
                out.setdefault(metric.name + " meta", (metric.unit, metric.description,
                                                       type(metric.data).__name__,
                                                       getattr(metric.data, "aggregation_temporality", None),
                                                       getattr(metric.data, "is_monotonic", None)))
    return out


def test_direct_metric_points_equal_the_sdk_instruments_points():
    _, direct = _run("direct")
    _, sdk = _run("sdk")
    mine, theirs = _points(direct), _points(sdk)
    assert set(mine) == set(theirs)
    for name in theirs:
        assert mine[name] == theirs[name], name
    # and the OTLP metric encoder takes them as it takes the SDK's
    assert len(encode_metrics(direct).resource_metrics[0].scope_metrics[0].metrics) == \
        len([n for n in theirs if not n.endswith(" meta")])


# --- through the real exporters, to receivers on 127.0.0.1 ---------------------------------------------------------

class _Sink(BaseHTTPRequestHandler):
    received = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        _Sink.received.append(ExportTraceServiceRequest.FromString(body))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_real_http_exporter_sends_our_bytes_to_a_receiver():
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    direct, _ = _run("direct")
    _Sink.received = []
    with otlp.http_receiver(_Sink) as port:
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces", timeout=5)
        assert exporter.export(direct) is SpanExportResult.SUCCESS
        exporter.shutdown()
    (received,) = _Sink.received
    assert _sorted_spans(received) == _sorted_spans(encode_spans(direct))


def test_the_real_grpc_exporter_sends_our_spans_to_a_receiver():
    pytest.importorskip("grpc")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    with otlp.grpc_receiver() as (port, received):
        direct, _ = _run("direct")
        exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=5)
        assert exporter.export(direct) is SpanExportResult.SUCCESS
        exporter.shutdown()
    (request,) = received
    assert _sorted_spans(request) == _sorted_spans(encode_spans(direct))


def test_a_full_export_queue_holds_the_builder_instead_of_losing_spans():
    """The SDK's BatchSpanProcessor drops a span when its queue is full, with a log line only. The direct path
    waits for room (its worker woken at once), so every span of a burst far beyond the queue is exported."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from test_builder import call, send

    class Slow(SpanExporter):
        def __init__(self):
            self.count = 0

        def export(self, spans):
            time.sleep(0.002)  # an exporter slower than the builder
            self.count += len(spans)
            return SpanExportResult.SUCCESS

    exporter = Slow()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=64, max_export_batch_size=16,
                                                   schedule_delay_millis=60_000))
    attachment = Attachment(in_memory_metrics()[0], "direct")
    attachment.attach(provider.get_tracer(semconv.INSTRUMENTATION_NAME, "0.1.0"), provider, flush_first=False)
    drops = []
    builder = new_builder(attachment, config.Settings(), registry.load(registry.ENGINES),
                          on_drop=lambda r, n: drops.append(r))
    for n in range(2_000):
        builder.handle(send(None, [call(n, n + 10, 64)]))
    provider.force_flush()
    assert exporter.count == 2_000 and drops == []
    provider.shutdown()
