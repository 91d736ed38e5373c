"""A sampler that records spans without sampling them (RECORD_ONLY): every span processor still sees our spans,
as the SDK hands a recorded span to each processor's `on_end`; only the exporting processors leave them out.

A span-metrics processor, a tail-sampling buffer, a processor that counts: each reads recorded-but-unsampled spans.
The direct pipeline used to build only sampled spans, so processors after the BatchSpanProcessor saw none of ours
(0 of 400) where the `sdk` pipeline gave them all. Real parts: the SDK's TracerProvider, BatchSpanProcessor and
in-memory exporter, the instrumentor and its recorder thread; the engine calls are handed over as engine modules
hand them (`integration.deliver`, no engine).
"""

import pytest
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from support.telemetry import in_memory_metrics, metric_points

from otel_kvtransfer import KVTransferInstrumentor, config, semconv
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import now_ns

REQUESTS = 100  # each a request, a send and a compute span; and one raw engine call: 400 spans
BACKEND = "test-engine"


class RecordOnly(Sampler):
    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None):
        return SamplingResult(Decision.RECORD_ONLY, attributes)

    def get_description(self):
        return "RecordOnly"


class Seen(SpanProcessor):
    """What a processor after the exporting one sees."""

    def __init__(self):
        self.spans = []

    def on_end(self, span):
        self.spans.append(span)


def _call(nbytes):
    now = now_ns()
    return r.call(now, now + 1_000, nbytes, 1, semconv.OP_WRITE, "127.0.0.1:1", "tcp", 0, None, BACKEND)


@pytest.mark.parametrize("pipeline", ["direct", "sdk"])
def test_recorded_unsampled_spans_reach_every_processor_and_no_exporter(pipeline, monkeypatch):
    monkeypatch.setenv(config.PIPELINE, pipeline)
    exporter, seen = InMemorySpanExporter(), Seen()
    meter_provider, reader = in_memory_metrics()
    provider = TracerProvider(sampler=RecordOnly())
    provider.add_span_processor(BatchSpanProcessor(exporter))
    provider.add_span_processor(seen)
    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument(tracer_provider=provider, meter_provider=meter_provider)
    try:
        for key in range(REQUESTS):
            start = now_ns()
            kvt.begin_request(key, backend=BACKEND, framework="test")
            with kvt.transfer_scope(key, chunk_index=0, is_last_chunk=True):
                kvt.deliver(_call(4096))
            kvt.record_compute([key], start, now_ns())
            kvt.end_request(key)
            kvt.deliver(_call(512))  # a raw engine call: a span of its own
        assert provider.force_flush() is True
        points = metric_points(reader)
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
    ours = [s for s in seen.spans if s.name.startswith("kv_transfer.")]
    assert len(ours) == REQUESTS * 4
    assert sorted({s.name for s in ours}) == [semconv.SPAN_COMPUTE, semconv.SPAN_REQUEST, semconv.SPAN_SEND]
    assert not any(s.context.trace_flags.sampled for s in ours)  # recorded, not sampled
    requests = {s.context.span_id: s for s in ours if s.name == semconv.SPAN_REQUEST}
    children = [s for s in ours if s.name in (semconv.SPAN_COMPUTE, semconv.SPAN_SEND) and s.parent is not None
                and s.parent.span_id in requests]
    assert len(children) == REQUESTS * 2  # each request's send and compute under it, as built when sampled
    assert exporter.get_finished_spans() == ()  # the exporting processor drops what is not sampled
    # the metrics count every send (the request's and the raw one), as they do for unsampled ones
    assert sum(point.count for point in points[semconv.METRIC_DURATION]) == REQUESTS * 2
