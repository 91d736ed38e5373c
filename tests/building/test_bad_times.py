"""A time out of range never costs another request's spans, and is never recorded as a duration.

How it was found: one request among 300 whose times came through the integration API out of range (a negative
start, an end past 2**64, an end before its start) lost whole export batches, uncounted: the fast encoder's
struct.error, then the SDK encoder's "Value out of range", failed the batch the span was in, and the span file
beside it lost the same batch. Now each time the API takes is checked where it enters: a bad one is counted
`api_error`; a request or peer wait is still begun or ended, at the moment of the call, and an interval (a compute,
a set-up call, an engine call handed to `deliver()`) is not made. And whatever still reaches the encoders out of
range (a span another instrumentation made, in the same batch as ours) costs that span alone, counted
`span_encoding` (`span_file` in the span file), in both pipelines and through both OTLP exporters.

Real parts: the SDK's BatchSpanProcessor, the real OTLP/HTTP and OTLP/gRPC span exporters sending to receivers on
127.0.0.1 that parse every request with opentelemetry-proto (HTTP answers 400 to what does not parse), and the
span file exporter writing a real file. No engine: the engine calls are handed over as engine modules hand them
(`integration.deliver`).
"""

import json
import time

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from support import otlp
from support.telemetry import dropped_by_reason, metric_points
from test_builder import begin_request, call, end_request, info, send
from test_encoder_validity import _Collector, _spans
from test_span_encoding import Sequential

from otel_kvtransfer import KVTransferInstrumentor, config, registry, semconv
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.building import span_encoding
from otel_kvtransfer.building.attachment import Attachment, new_builder
from otel_kvtransfer.building.direct_spans import KVSpan
from otel_kvtransfer.building.file_exporter import OtlpJsonFileSpanExporter
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import now_ns

REQUESTS = 300
BACKEND = "test-engine"
BAD, BAD_PEER = 77_777, 88_888
S = 1_000_000_000


def _call(nbytes, start, end):
    return r.call(start, end, nbytes, 1, semconv.OP_WRITE, "127.0.0.1:1", "tcp", 0, None, BACKEND)


def _good_request(key):
    start = time.time_ns()
    kvt.begin_request(key, backend=BACKEND, framework="test", start_ns=start)
    with kvt.transfer_scope(key, chunk_index=0, is_last_chunk=True):
        now = now_ns()
        kvt.deliver(_call(4096, now, now + 1_000))
    kvt.record_compute([key], start, time.time_ns())
    kvt.end_request(key)


def _bad_request():
    """Every time the API takes, out of range or out of order; how many of them are counted."""
    now = time.time_ns()
    kvt.begin_request(BAD, backend=BACKEND, framework="test", start_ns=-1)  # begun now, counted
    kvt.record_compute([BAD], 0, 2**70)  # not made
    kvt.record_compute([BAD], now, now - S)  # ends before it starts: not made
    kvt.record_compute([BAD], 1.7e18, 1.8e18)  # floats: not made
    kvt.record_connect("handshake", -5, backend=BACKEND, key=BAD)  # not made
    kvt.record_connect("handshake", now, backend=BACKEND, key=BAD, end_ns=now - 1)  # not made
    with kvt.transfer_scope(BAD, chunk_index=0):
        kvt.deliver(_call(64, now_ns(), 2**64 + 5))  # a delivered call ending past 2**64: its send not made
    start = now_ns()
    kvt.deliver(_call(64, start, start - 3_600 * S))  # a raw call ending an hour before it started: not made
    kvt.deliver(_call(64, -2, 5))  # before the epoch: not made
    kvt.begin_receive(BAD_PEER, backend=BACKEND, framework="test", start_ns=-2**70)  # begun now, counted
    kvt.end_receive(BAD_PEER, end_ns=10**30)  # ended now, counted
    kvt.late_arrival(BAD_PEER, backend=BACKEND, at_ns=2**64)  # now, counted
    kvt.end_request(BAD, end_ns=10**30)  # ended now, counted
    return 13


def _receiver(transport):
    if transport == "http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        _Collector.parsed, _Collector.rejected = [], []
        context = otlp.http_receiver(_Collector)
        port = context.__enter__()
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces", timeout=10)
        return context, exporter, lambda: (_Collector.parsed, _Collector.rejected)
    pytest.importorskip("grpc")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    context = otlp.grpc_receiver()
    port, parsed = context.__enter__()
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=10)
    return context, exporter, lambda: (parsed, [])


def _file_spans(path):
    spans = []
    with open(path) as lines:
        for line in lines:
            for resource in json.loads(line)["resourceSpans"]:
                for scope in resource["scopeSpans"]:
                    spans += scope["spans"]
    return spans


def _key(span_attributes):
    return {kv.key: kv.value.string_value for kv in span_attributes}.get(semconv.REQUEST_KEY)


@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize("pipeline", ["direct", "sdk"])
def test_one_request_with_bad_times_among_300_is_counted_and_loses_no_other_span(pipeline, transport, tmp_path,
                                                                                  monkeypatch, meter):
    monkeypatch.setenv(config.PIPELINE, pipeline)
    meter_provider, reader = meter
    provider = TracerProvider()
    context, exporter, received = _receiver(transport)
    instrumentor = KVTransferInstrumentor()
    try:
        with otlp.accelerated():
            provider.add_span_processor(BatchSpanProcessor(exporter, max_export_batch_size=512))
            path = tmp_path / "spans.jsonl"
            provider.add_span_processor(BatchSpanProcessor(OtlpJsonFileSpanExporter(str(path), meter_provider)))
            instrumentor.instrument(tracer_provider=provider, meter_provider=meter_provider)
            for key in range(REQUESTS // 2):
                _good_request(key)
            counted = _bad_request()
            for key in range(REQUESTS // 2, REQUESTS):
                _good_request(key)
            assert provider.force_flush() is True
            points = metric_points(reader)
            instrumentor.uninstrument()
    finally:
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
        provider.shutdown()
        context.__exit__(None, None, None)
    parsed, rejected = received()
    assert rejected == []
    spans = _spans(parsed)
    # every good request's request, send and compute span; the bad request's span and its peer's, begun and ended
    # at the calls (nothing else of it: its intervals were not made)
    assert len(spans) == REQUESTS * 3 + 2
    keys = [_key(s.attributes) for s in spans]
    assert {k for k in keys if k not in (str(BAD), str(BAD_PEER))} == {str(n) for n in range(REQUESTS)}
    assert sorted(s.name for s in spans if _key(s.attributes) in (str(BAD), str(BAD_PEER))) == [
        semconv.SPAN_RECEIVE, semconv.SPAN_REQUEST]
    assert all(0 < s.start_time_unix_nano <= s.end_time_unix_nano < 2**64 for s in spans)
    assert dropped_by_reason(None, points) == {"api_error": counted}
    (duration,) = points[semconv.METRIC_DURATION]  # no send of the bad request's; nothing negative
    assert duration.count == REQUESTS and duration.min >= 0
    assert len(_file_spans(path)) == REQUESTS * 3 + 2  # the span file beside it lost nothing either


# --- what still reaches the encoders out of range ------------------------------------------------------------

def _records():
    recs = []
    for n in range(REQUESTS):
        at = 1_000_000 + n * 1_000
        recs += [begin_request(n, at), send(info(n, 0), [call(at + 10, at + 20, 4096)]), end_request(n, at + 30)]
    return recs


@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize("pipeline", ["direct", "sdk"])
def test_a_span_out_of_range_in_an_export_batch_costs_itself_alone(pipeline, transport, tmp_path, meter):
    meter_provider, reader = meter
    provider = TracerProvider(id_generator=Sequential())
    context, exporter, received = _receiver(transport)
    path = tmp_path / "spans.jsonl"
    attachment = Attachment(meter_provider, pipeline)
    try:
        with otlp.accelerated():
            processors = [BatchSpanProcessor(exporter, max_export_batch_size=1024, schedule_delay_millis=60_000),
                          BatchSpanProcessor(OtlpJsonFileSpanExporter(str(path), meter_provider),
                                             max_export_batch_size=1024, schedule_delay_millis=60_000)]
            for processor in processors:
                provider.add_span_processor(processor)
            attachment.attach(provider.get_tracer(semconv.INSTRUMENTATION_NAME, "0.1.0"), provider,
                              flush_first=False)
            drops = []
            builder = new_builder(attachment, config.Settings(), registry.load(registry.ENGINES),
                                  on_drop=lambda reason, n: drops.append(reason))
            recs = _records()
            for rec in recs[:len(recs) // 2]:
                builder.handle(rec)
            # Another instrumentation's spans in the same batch: one starting before the epoch, one ending past
            # 2**64 (the SDK lets either be made).
            app = provider.get_tracer("app")
            app.start_span("app.before_epoch", start_time=-1).end(end_time=5)
            app.start_span("app.past_2_64", start_time=10).end(end_time=2**64 + 5)
            if pipeline == "direct":  # and one of ours built out of range (the builder's checks prevent that):
                # the fast encoder's own guard
                good = app.start_span("app.template", start_time=10)
                good.end(end_time=20)
                ours = KVSpan("kv_transfer.send", good.get_span_context(), None, provider.resource, {}, (), (),
                              good.kind, None, good.status, 10, 2**64 + 7, good.instrumentation_scope)
                for processor in processors:
                    processor.on_end(ours)
            for rec in recs[len(recs) // 2:]:
                builder.handle(rec)
            assert provider.force_flush() is True
            attachment.detach()
    finally:
        provider.shutdown()
        context.__exit__(None, None, None)
    assert drops == []
    parsed, rejected = received()
    assert rejected == []
    spans = _spans(parsed)
    names = sorted({s.name for s in spans})
    assert len(spans) == REQUESTS * 2 + (1 if pipeline == "direct" else 0), names  # + the good template
    assert {_key(s.attributes) for s in spans if s.name.startswith("kv_transfer.")} == {
        str(n) for n in range(REQUESTS)}
    bad = 3 if pipeline == "direct" else 2
    assert dropped_by_reason(reader) == {"span_encoding": bad, "span_file": bad}
    assert len(_file_spans(path)) == len(spans)


def test_the_original_encoder_alone_fails_the_whole_batch_on_one_such_span():
    """Why: what the SDK's encoder does with one span out of range (the behaviour the wrapper turns into a loss of
    that span alone)."""
    provider = TracerProvider()
    app = provider.get_tracer("app")
    app.start_span("ok").end()
    span = app.start_span("bad", start_time=-1)
    span.end(end_time=5)
    with pytest.raises(ValueError):
        encode_spans([span])
    wrapped = span_encoding.AcceleratedEncoder(encode_spans, as_message=True)
    assert len(wrapped([span]).resource_spans) == 0
