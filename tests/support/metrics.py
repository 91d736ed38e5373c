"""What the instrumentation counted, read back from an in-memory metric reader."""

from otel_kvtransfer import semconv


def dropped_by_reason(reader) -> dict:
    """{drop reason: count} of kv_transfer.instrumentation.dropped in one collection by `reader`."""
    out = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == semconv.METRIC_DROPPED:
                    for point in metric.data.data_points:
                        out[point.attributes[semconv.DROP_REASON]] = point.value
    return out
