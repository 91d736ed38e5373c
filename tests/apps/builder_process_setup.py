"""OTEL_KVTRANSFER_HELPER_SETUP for tests/offloading/test_builder_process.py: the helper's SDK writes its spans to
$KVT_TEST_SPAN_FILE and, when it ends, its metric totals to $KVT_TEST_METRICS_DIR/<pid>.json (with the request
count when $KVT_TEST_COUNT_REQUESTS is set). While the file
$KVT_TEST_HOLD exists, its span exporter hangs (a collector that does not answer)."""

import atexit
import json
import os
import time

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from otel_kvtransfer import semconv
from otel_kvtransfer.building.file_exporter import OtlpJsonFileSpanExporter


def setup():
    provider = TracerProvider()
    exporter = OtlpJsonFileSpanExporter(os.environ["KVT_TEST_SPAN_FILE"])
    if os.environ.get("KVT_TEST_HOLD"):
        exporter = _Held(exporter, os.environ["KVT_TEST_HOLD"])
    provider.add_span_processor(BatchSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    atexit.register(_write_totals, reader)


def _write_totals(reader):
    totals = {"sizes": 0, "dropped": {}}
    requests = 0
    data = reader.get_metrics_data()
    for resource_metrics in (data.resource_metrics if data else []):
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in metric.data.data_points:
                    if metric.name == semconv.METRIC_SIZE:
                        totals["sizes"] += point.count
                    elif metric.name == semconv.METRIC_REQUEST_DURATION:
                        requests += point.count
                    elif metric.name == semconv.METRIC_DROPPED:
                        reason = point.attributes[semconv.DROP_REASON]
                        totals["dropped"][reason] = totals["dropped"].get(reason, 0) + point.value
    if os.environ.get("KVT_TEST_COUNT_REQUESTS"):  # only where a test counts them: others compare totals whole
        totals["requests"] = requests
    path = os.path.join(os.environ["KVT_TEST_METRICS_DIR"], f"{os.getpid()}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(totals, handle)


class _Held:
    """The exporter, hanging in export() while the hold file exists."""

    def __init__(self, exporter, hold):
        self._exporter = exporter
        self._hold = hold

    def export(self, spans):
        while os.path.exists(self._hold):
            time.sleep(0.01)
        return self._exporter.export(spans)

    def force_flush(self, timeout_millis=30000):
        return self._exporter.force_flush(timeout_millis)

    def shutdown(self):
        self._exporter.shutdown()
