"""`KVTransferMetricsProcessor`: the DESIGN metrics, derived from ended spans (the SDK pipeline,
`OTEL_KVTRANSFER_PIPELINE=sdk`; the direct pipeline records the same measurements into `kvmetrics` tables).

Metrics come from the spans and never from the engine hooks, so a metric and its span can never disagree.
Histogram points are recorded in the context of the span they come from, so with the SDK's default
trace-based exemplar filter their exemplars point at that (sampled) span. Spans that the sampler kept recording
but did not sample reach `on_end` too, which is how the metrics count every transfer under any sampling ratio.
A failed or empty transfer has no speed, nor has one of no measurable duration (it carries no throughput):
throughput histograms take successful spans with bytes > 0 and a throughput only.
"""

import logging

from opentelemetry import metrics, trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import NonRecordingSpan, StatusCode

from otel_kvtransfer import semconv
from otel_kvtransfer.building import kvmetrics
from otel_kvtransfer.version import __version__

_logger = logging.getLogger(__name__)

class KVTransferMetricsProcessor(SpanProcessor):
    """Turns this package's spans into the DESIGN histograms and counters."""

    def __init__(self, meter_provider=None, max_peers: int = 64):
        meter = metrics.get_meter(semconv.INSTRUMENTATION_NAME, __version__, meter_provider)
        self.enabled = True

        def instrument(row):
            name, unit, description, buckets = row
            if buckets is None:
                return meter.create_counter(name, unit=unit, description=description)
            return meter.create_histogram(name, unit=unit, description=description,
                                          explicit_bucket_boundaries_advisory=list(buckets))

        (self._duration, self._size, self._throughput, self._descriptors, self._failures, self._request_duration,
         self._request_size, self._request_throughput, self._request_overlap, self._receive_duration,
         self._request_tail, self._request_tail_queued, self._peer_throughput, self._post_duration,
         self._late_completions) = (
            instrument(row) for row in kvmetrics.INSTRUMENTS)
        self._peers = kvmetrics.PeerSeries(max_peers)
        if max_peers + 1 > kvmetrics.MAX_SERIES:  # the SDK's instruments keep their reader's cardinality limit
            _logger.warning("otel_kvtransfer: OTEL_KVTRANSFER_MAX_PEERS=%d, but with OTEL_KVTRANSFER_PIPELINE=sdk "
                            "the MeterProvider's cardinality limit (%d series by default; a View's "
                            "aggregation_cardinality_limit raises it) also bounds kv_transfer.peer.throughput",
                            max_peers, kvmetrics.MAX_SERIES)
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
            derive(span, attrs, kvmetrics.metric_labels(attrs),
                   trace.set_span_in_context(NonRecordingSpan(span.context)))
        except Exception:
            _logger.debug("otel_kvtransfer could not derive metrics from a span", exc_info=True)

    def _on_send(self, span, attrs, labels, context) -> None:
        nbytes = attrs.get(semconv.BYTES, 0)
        self._duration.record((span.end_time - span.start_time) / 1e9, labels, context=context)
        self._size.record(nbytes, labels, context=context)
        self._descriptors.record(attrs.get(semconv.DESCRIPTOR_COUNT, 0), labels, context=context)
        if semconv.POST_S in attrs:  # only a send whose engine has a posting call
            self._post_duration.record(attrs[semconv.POST_S], labels, context=context)
        if span.events and any(event.name == semconv.EVENT_LATE_COMPLETION for event in span.events):
            self._late_completions.add(1, labels, context=context)
        if span.status.status_code is StatusCode.ERROR:
            self._failures.add(1, labels, context=context)
        elif nbytes > 0 and semconv.THROUGHPUT in attrs:  # absent: a send of no measurable duration
            self._throughput.record(attrs[semconv.THROUGHPUT], labels, context=context)
            peer = self._peers.of(attrs)
            if peer is not None:
                self._peer_throughput.record(attrs[semconv.THROUGHPUT], peer[1], context=context)

    def _on_request(self, span, attrs, labels, context) -> None:
        nbytes = attrs.get(semconv.BYTES, 0)
        self._request_duration.record((span.end_time - span.start_time) / 1e9, labels, context=context)
        self._request_size.record(nbytes, labels, context=context)
        if span.status.status_code is not StatusCode.ERROR and nbytes > 0 and attrs.get(semconv.BUSY_S, 0) > 0:
            self._request_throughput.record(attrs.get(semconv.THROUGHPUT, 0.0), labels, context=context)
        if semconv.COMPUTE_OVERLAP_RATIO in attrs:
            self._request_overlap.record(attrs[semconv.COMPUTE_OVERLAP_RATIO], labels, context=context)
        if semconv.TAIL_S in attrs:
            self._request_tail.record(attrs[semconv.TAIL_S], labels, context=context)
            self._request_tail_queued.record(attrs[semconv.TAIL_QUEUED_S], labels, context=context)

    def _on_peer(self, span, attrs, labels, context) -> None:
        self._receive_duration.record((span.end_time - span.start_time) / 1e9, labels, context=context)
