"""`KVTransferMetricsProcessor`: the DESIGN metrics, derived from ended spans.

Metrics come from the spans and never from the engine hooks, so a metric and its span can never disagree.
Histogram points are recorded in the context of the span they come from, so with the SDK's default
trace-based exemplar filter their exemplars point at that (sampled) span. Spans that the sampler kept recording
but did not sample reach `on_end` too, which is how the metrics count every transfer under any sampling ratio.
A failed or empty transfer has no speed: throughput histograms take successful spans with bytes > 0 only.
"""

import logging

from opentelemetry import metrics, trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import NonRecordingSpan, StatusCode

from otel_kvtransfer import semconv
from otel_kvtransfer.version import __version__

_logger = logging.getLogger(__name__)

# Bucket boundaries that fit KV transfers: a few KiB to tens of GiB, microseconds to minutes, MB/s to TB/s.
_SECONDS_BUCKETS = [1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0, 60.0]
_BYTES_BUCKETS = [float(1 << n) for n in range(10, 36, 2)]  # 1 KiB .. 16 GiB, x4 steps
_RATE_BUCKETS = [x * 10.0 ** e for e in range(6, 13) for x in (1.0, 2.5, 5.0)]  # 1 MB/s .. 5 TB/s
_RATIO_BUCKETS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
_COUNT_BUCKETS = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0]


def _metric_attributes(attributes) -> dict:
    return {key: attributes[key] for key in semconv.METRIC_ATTRIBUTES if key in attributes}


class KVTransferMetricsProcessor(SpanProcessor):
    """Turns this package's spans into the DESIGN histograms and counters."""

    def __init__(self, meter_provider=None):
        meter = metrics.get_meter(semconv.INSTRUMENTATION_NAME, __version__, meter_provider)
        self.enabled = True

        def histogram(name, unit, description, buckets):
            return meter.create_histogram(name, unit=unit, description=description,
                                          explicit_bucket_boundaries_advisory=buckets)

        self._duration = histogram(semconv.METRIC_DURATION, "s", "Duration of one KV transfer", _SECONDS_BUCKETS)
        self._size = histogram(semconv.METRIC_SIZE, "By", "Bytes moved by one KV transfer", _BYTES_BUCKETS)
        self._throughput = histogram(semconv.METRIC_THROUGHPUT, "By/s",
                                     "Bytes of one successful KV transfer over its own duration", _RATE_BUCKETS)
        self._descriptors = histogram(semconv.METRIC_DESCRIPTORS, "{descriptor}",
                                      "Memory descriptors (contiguous pieces) in one KV transfer", _COUNT_BUCKETS)
        self._failures = meter.create_counter(semconv.METRIC_FAILURES, unit="{transfer}",
                                              description="KV transfers that failed")
        self._request_duration = histogram(semconv.METRIC_REQUEST_DURATION, "s",
                                           "From a request's first transfer enqueue to its conclusion",
                                           _SECONDS_BUCKETS)
        self._request_size = histogram(semconv.METRIC_REQUEST_SIZE, "By", "Wire bytes of one request's KV transfers",
                                       _BYTES_BUCKETS)
        self._request_throughput = histogram(
            semconv.METRIC_REQUEST_THROUGHPUT, "By/s",
            "A successful request's wire bytes over its busy time (union of its transfer intervals)", _RATE_BUCKETS)
        self._request_overlap = histogram(semconv.METRIC_REQUEST_COMPUTE_OVERLAP, "1",
                                          "Share of a request's busy transfer time that overlapped its compute",
                                          _RATIO_BUCKETS)
        self._receive_duration = histogram(semconv.METRIC_RECEIVE_DURATION, "s",
                                           "The peer's wait for a request's KV (receive or serve span)",
                                           _SECONDS_BUCKETS)
        self._on_end = {
            semconv.SPAN_SEND: self._on_send,
            semconv.SPAN_REQUEST: self._on_request,
            semconv.SPAN_RECEIVE: self._on_peer,
            semconv.SPAN_SERVE: self._on_peer,
        }

    def on_end(self, span: ReadableSpan) -> None:
        if not self.enabled:
            return
        scope = span.instrumentation_scope
        if scope is None or scope.name != semconv.INSTRUMENTATION_NAME:
            return
        derive = self._on_end.get(span.name)
        if derive is None:
            return
        try:
            attrs = span.attributes or {}
            derive(span, attrs, _metric_attributes(attrs),
                   trace.set_span_in_context(NonRecordingSpan(span.context)))
        except Exception:  # pylint: disable=broad-except
            _logger.debug("otel_kvtransfer could not derive metrics from a span", exc_info=True)

    def _on_send(self, span, attrs, labels, context) -> None:
        nbytes = attrs.get(semconv.BYTES, 0)
        self._duration.record((span.end_time - span.start_time) / 1e9, labels, context=context)
        self._size.record(nbytes, labels, context=context)
        self._descriptors.record(attrs.get(semconv.DESCRIPTOR_COUNT, 0), labels, context=context)
        if span.status.status_code is StatusCode.ERROR:
            self._failures.add(1, labels, context=context)
        elif nbytes > 0:
            self._throughput.record(attrs.get(semconv.THROUGHPUT, 0.0), labels, context=context)

    def _on_request(self, span, attrs, labels, context) -> None:
        nbytes = attrs.get(semconv.BYTES, 0)
        self._request_duration.record((span.end_time - span.start_time) / 1e9, labels, context=context)
        self._request_size.record(nbytes, labels, context=context)
        if span.status.status_code is not StatusCode.ERROR and nbytes > 0:
            self._request_throughput.record(attrs.get(semconv.THROUGHPUT, 0.0), labels, context=context)
        if semconv.COMPUTE_OVERLAP_RATIO in attrs:
            self._request_overlap.record(attrs[semconv.COMPUTE_OVERLAP_RATIO], labels, context=context)

    def _on_peer(self, span, attrs, labels, context) -> None:
        self._receive_duration.record((span.end_time - span.start_time) / 1e9, labels, context=context)
