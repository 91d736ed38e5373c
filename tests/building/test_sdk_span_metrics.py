"""With the SDK's own metrics on (OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED), our spans are counted as the SDK
counts its own: `otel.sdk.span.started` by parent origin and sampling result, `otel.sdk.span.live` while open.

The direct pipeline builds our spans without the SDK tracer's start_span, so `otel.sdk.span.started` read 200
(the application's own spans) where 600 spans were processed. Both pipelines now give the same points. Real parts:
the SDK's TracerProvider (made with the MeterProvider its metrics go to), BatchSpanProcessor and in-memory exporter,
the instrumentor and its recorder thread; engine calls handed over as engine modules hand them (no engine).
"""

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from support.telemetry import in_memory_metrics, metric_points
from test_span_encoding import Sequential

from otel_kvtransfer import KVTransferInstrumentor, config, semconv
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import now_ns

pytest.importorskip("opentelemetry.sdk.trace._tracer_metrics", reason="an SDK release without its own span metrics")

REQUESTS = 100  # a request, a send and a compute span each, and a raw engine call: 400 spans of ours
OWN = 200  # the application's own spans
BACKEND = "test-engine"
STARTED, LIVE = "otel.sdk.span.started", "otel.sdk.span.live"


def _call(nbytes):
    now = now_ns()
    return r.call(now, now + 1_000, nbytes, 1, semconv.OP_WRITE, "127.0.0.1:1", "tcp", 0, None, BACKEND)


def _points(reader, name) -> dict:
    return {tuple(sorted(p.attributes.items())): p.value for p in metric_points(reader).get(name, [])}


def _run(pipeline, monkeypatch, sampler=None, ids=None):
    monkeypatch.setenv(config.PIPELINE, pipeline)
    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    exporter = InMemorySpanExporter()
    meter_provider, reader = in_memory_metrics()
    provider = TracerProvider(meter_provider=meter_provider, id_generator=ids,
                              **({"sampler": sampler} if sampler else {}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument(tracer_provider=provider, meter_provider=meter_provider)
    app = provider.get_tracer("app")
    try:
        for _ in range(OWN):
            app.start_span("app.work").end()
        kvt.begin_request("open", backend=BACKEND, framework="test")
        for key in range(REQUESTS):
            start = now_ns()
            kvt.begin_request(key, backend=BACKEND, framework="test")
            with kvt.transfer_scope(key, chunk_index=0, is_last_chunk=True):
                kvt.deliver(_call(4096))
            kvt.record_compute([key], start, now_ns())
            kvt.end_request(key)
            kvt.deliver(_call(512))
        assert provider.force_flush() is True
        started, live_open = _points(reader, STARTED), _points(reader, LIVE)
        kvt.end_request("open")
        assert provider.force_flush() is True
        live_after = _points(reader, LIVE)
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
    return started, live_open, live_after, len(exporter.get_finished_spans())


@pytest.mark.parametrize("pipeline", ["direct", "sdk"])
def test_our_spans_are_counted_in_the_sdks_own_span_metrics(pipeline, monkeypatch):
    started, live_open, live_after, exported = _run(pipeline, monkeypatch)
    assert exported == OWN + REQUESTS * 4 + 1  # the open request ended last
    assert sum(started.values()) == exported  # each span counted once, ours as the application's
    sampled = "otel.span.sampling_result"
    origin = "otel.span.parent.origin"
    by = {}
    for attributes, value in started.items():
        attributes = dict(attributes)
        key = (attributes[origin], attributes[sampled])
        by[key] = by.get(key, 0) + value
    # the application's spans and our raw calls are roots; requests sit under the synthetic (remote) parent that
    # stitches both sides of a request; sends and compute under their request
    assert by == {("none", "RECORD_AND_SAMPLE"): OWN + REQUESTS, ("remote", "RECORD_AND_SAMPLE"): REQUESTS + 1,
                  ("local", "RECORD_AND_SAMPLE"): REQUESTS * 2}
    assert sum(live_open.values()) == 1  # the request still open
    assert sum(live_after.values()) == 0


def test_both_pipelines_count_the_same_spans_under_a_ratio_sampler(monkeypatch):
    """Sampled and dropped spans alike, the same ids in both runs: the same spans started, the same sampled. (The
    `sdk` pipeline's own sampler records what the ratio drops, for its metric processor: there our dropped spans
    count as RECORD_ONLY.)"""
    direct = _run("direct", monkeypatch, TraceIdRatioBased(0.5), Sequential())[0]
    sdk = _run("sdk", monkeypatch, TraceIdRatioBased(0.5), Sequential())[0]

    def total(points, *results):
        return sum(v for k, v in points.items() if dict(k)["otel.span.sampling_result"] in results)

    assert total(direct, "RECORD_AND_SAMPLE", "RECORD_ONLY", "DROP") == OWN + REQUESTS * 4 + 1
    assert total(sdk, "RECORD_AND_SAMPLE", "RECORD_ONLY", "DROP") == OWN + REQUESTS * 4 + 1
    assert total(direct, "RECORD_AND_SAMPLE") == total(sdk, "RECORD_AND_SAMPLE") > 0
    assert total(direct, "DROP") > 0
