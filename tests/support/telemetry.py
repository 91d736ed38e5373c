"""The instrumentation under test with in-memory providers, and what it recorded, read back."""

from otel_kvtransfer import semconv


class Telemetry:
    """An SDK TracerProvider with an in-memory exporter and an in-memory metric reader, instrumented."""

    def __init__(self, sampler=None):
        from opentelemetry.test.test_base import TestBase

        from otel_kvtransfer import KVTransferInstrumentor

        # opentelemetry-test-utils' tracer provider (a SimpleSpanProcessor into an in-memory exporter) and the
        # tests' one meter provider. Handed to instrument() explicitly: the global providers stay untouched.
        self.tracer_provider, self.exporter = TestBase.create_tracer_provider(**({"sampler": sampler} if sampler
                                                                                 else {}))
        self.meter_provider, self.reader = in_memory_metrics()
        self.instrumentor = KVTransferInstrumentor()

    def instrument(self):
        self.instrumentor.instrument(tracer_provider=self.tracer_provider, meter_provider=self.meter_provider)
        return self

    def uninstrument(self):
        self.instrumentor.uninstrument()

    def spans(self, name=None):
        self.tracer_provider.force_flush()
        spans = self.exporter.get_finished_spans()
        return [s for s in spans if name is None or s.name == name]

    def metrics(self):
        """{metric name: [data points]} of everything recorded so far."""
        self.tracer_provider.force_flush()
        return metric_points(self.reader)

    def dropped(self) -> dict:
        """{drop reason: count} of what the instrumentation dropped so far."""
        self.tracer_provider.force_flush()
        return dropped_by_reason(self.reader)


def in_memory_metrics(temporality=None, **options):
    """(MeterProvider, InMemoryMetricReader): an SDK meter provider whose one reader keeps what it collects, the one
    way the tests make them. `options` go to the provider (shutdown_on_exit, resource, exemplar_filter, views);
    `temporality` to the reader ({instrument class: AggregationTemporality}; cumulative when not given)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader(preferred_temporality=temporality)
    return MeterProvider(metric_readers=[reader], **options), reader


def metric_points(reader) -> dict:
    """{metric name: [data points]} of one collection by an in-memory metric reader."""
    found = {}
    data = reader.get_metrics_data()
    for resource_metrics in (data.resource_metrics if data else []):
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def dropped_by_reason(reader, points=None) -> dict:
    """{drop reason: count} of kv_transfer.instrumentation.dropped in one collection by `reader` (or in `points`,
    one collection already read)."""
    points = metric_points(reader) if points is None else points
    return {point.attributes[semconv.DROP_REASON]: point.value for point in points.get(semconv.METRIC_DROPPED, [])}


def transfers_in_metrics(reader, points=None) -> int:
    """How many engine calls kv_transfer.duration counted (in one collection by `reader`, or in `points`)."""
    points = metric_points(reader) if points is None else points
    return sum(point.count for point in points.get(semconv.METRIC_DURATION, []))
