"""Byte and descriptor counts OTLP cannot carry (past int64): counted as `invalid_length` and clamped where they
enter the builder, as negative ones are, so the metric export that carries them as exemplars still encodes.

Where they come from: an engine's unsigned lengths array holding a wrapped -1 (2**64 - 1), a pages table of
float64 read as integers (1.4e21 bytes), any `deliver()` call; and a request whose sends are each in range but
whose total is not. The sends go through the real path (integration API, recorder, builder, metrics) and the
collected metrics through opentelemetry-exporter-otlp's own encoder, as an OTLP metric exporter sends them.
"""

from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from otel_kvtransfer import integration
from otel_kvtransfer import semconv as sc
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import now_ns

MAX = (1 << 63) - 1
PEER = "127.0.0.1:4242"


def _call(nbytes, descriptors):
    now = now_ns()
    return r.call(now, now + 1_000, nbytes, descriptors, sc.OP_WRITE, PEER, "tcp", 0, None, "mooncake")


def _exported(telemetry):
    """One collection, encoded and parsed back as an OTLP receiver would (raises where the export would fail)."""
    telemetry.tracer_provider.force_flush()
    wire = encode_metrics(telemetry.reader.get_metrics_data()).SerializeToString()
    return ExportMetricsServiceRequest.FromString(wire)


def _metrics(message, name):
    return [metric for rm in message.resource_metrics for sm in rm.scope_metrics for metric in sm.metrics
            if metric.name == name]


def _points(message, name):
    return [point for metric in _metrics(message, name) for point in metric.histogram.data_points]


def test_counts_past_int64_are_clamped_counted_and_the_metric_export_encodes(telemetry):
    integration.deliver(_call([2**64 - 1, 4096], 2))  # an unsigned array's -1 beside a real length
    integration.deliver(_call(int(1.4e21), 2**64))  # a float64 pages table read as integers
    integration.deliver(_call(4096, 1))
    integration.begin_request(1, backend="mooncake")
    for chunk in (0, 1):  # each in range; their sum is not
        with integration.transfer_scope(1, chunk_index=chunk):
            integration.deliver(_call(MAX, 1))
    integration.end_request(1)

    message = _exported(telemetry)
    sizes = _points(message, sc.METRIC_SIZE)
    assert sum(p.count for p in sizes) == 5
    assert max(p.max for p in sizes) == float(MAX)
    exemplars = [e for p in sizes for e in p.exemplars]
    assert exemplars and all(0 <= e.as_int <= MAX for e in exemplars)
    assert max(p.max for p in _points(message, sc.METRIC_DESCRIPTORS)) == float(MAX)
    (request_size,) = _points(message, sc.METRIC_REQUEST_SIZE)
    assert request_size.max == float(MAX)
    assert all(e.as_int == MAX for e in request_size.exemplars)

    sends = sorted((s.attributes[sc.BYTES], s.attributes[sc.DESCRIPTOR_COUNT])
                   for s in telemetry.spans(sc.SPAN_SEND))
    assert sends == [(4096, 1), (MAX, 1), (MAX, 1), (MAX, 2), (MAX, MAX)]
    (request,) = telemetry.spans(sc.SPAN_REQUEST)
    assert request.attributes[sc.BYTES] == MAX and request.attributes[sc.LOGICAL_BYTES] == MAX
    dropped = {next(a.value.string_value for a in p.attributes if a.key == sc.DROP_REASON): p.as_int
               for metric in _metrics(message, sc.METRIC_DROPPED) for p in metric.sum.data_points}
    assert dropped == {"invalid_length": 3}  # two sends, and the request whose total went past
