"""`KVTransferMetricsProcessor`: the package's metrics (docs/telemetry.md), derived from ended spans (the SDK pipeline,
`OTEL_KVTRANSFER_PIPELINE=sdk`; the direct pipeline records the same measurements into `kvmetrics` tables).

Metrics come from the spans and never from the engine hooks, so a metric and its span can never disagree.
Histogram points are recorded in the context of the span they come from, so with the SDK's default
trace-based exemplar filter their exemplars point at that (sampled) span. Spans that the sampler kept recording
but did not sample reach `on_end` too, which is how the metrics count every transfer under any sampling ratio.
A failed or empty transfer has no speed, nor has one of no measurable duration (it carries no throughput):
throughput histograms take successful spans with bytes > 0 and a throughput only.
"""

import logging
from typing import Any, Callable, Dict, Mapping, Optional

from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.metrics import MeterProvider
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import NonRecordingSpan, StatusCode

from otel_kvtransfer import semconv
from otel_kvtransfer.building import kvmetrics
from otel_kvtransfer.building import metric_rules as rules
from otel_kvtransfer.version import __version__

_logger = logging.getLogger(__name__)
_NO_SPAN = Context()  # a measurement no span stands for: no exemplar, whatever span is current


class KVTransferMetricsProcessor(SpanProcessor):
    """Turns this package's spans into its histograms and counters, by the rules of `metric_rules`."""

    def __init__(self, meter_provider: Optional[MeterProvider] = None, max_peers: int = 64) -> None:
        meter = metrics.get_meter(semconv.INSTRUMENTATION_NAME, __version__, meter_provider)
        self.enabled = True

        def into(row: rules.Instrument) -> Callable[..., None]:  # where one instrument's measurements go
            name, unit, description, buckets = row
            if buckets is None:
                return meter.create_counter(name, unit=unit, description=description).add
            return meter.create_histogram(name, unit=unit, description=description,
                                          explicit_bucket_boundaries_advisory=list(buckets)).record

        self._into = [into(row) for row in rules.INSTRUMENTS]
        self._peers = rules.PeerSeries(max_peers)
        self._busy = rules.BusyTime()
        if max_peers + 1 > kvmetrics.MAX_SERIES:  # the SDK's instruments keep their reader's cardinality limit
            _logger.warning("otel_kvtransfer: OTEL_KVTRANSFER_MAX_PEERS=%d, but with OTEL_KVTRANSFER_PIPELINE=sdk "
                            "the MeterProvider's cardinality limit (%d series by default; a View's "
                            "aggregation_cardinality_limit raises it) also bounds kv_transfer.peer.*",
                            max_peers, kvmetrics.MAX_SERIES)
        # span name -> what derives its measurements from the span (ended: its times are set, which the SDK's
        # ReadableSpan, typed for any span, cannot say: Any), its attributes, metric labels and context
        self._on_end: Dict[str, Callable[[Any, Mapping[str, Any], Dict[str, Any], Context], None]] = {
            semconv.SPAN_SEND: self._on_send,
            semconv.SPAN_REQUEST: self._on_request,
            semconv.SPAN_RECEIVE: self._on_peer,
            semconv.SPAN_SERVE: self._on_peer,
            semconv.SPAN_CONNECT: self._on_connect,
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
            derive(span, attrs, rules.metric_labels(attrs),
                   trace.set_span_in_context(NonRecordingSpan(span.context)))
        except Exception:
            _logger.debug("otel_kvtransfer could not derive metrics from a span", exc_info=True)

    def _measure(self, measured: rules.Measurements, labels: Mapping[str, Any], context: Context) -> None:
        into = self._into
        for index, value in measured:
            into[index](value, labels, context=context)

    def _on_send(self, span: Any, attrs: Mapping[str, Any], labels: Dict[str, Any], context: Context) -> None:
        nbytes = attrs.get(semconv.BYTES, 0)
        failed = span.status.status_code is StatusCode.ERROR
        start, end = span.start_time, span.end_time
        self._measure(rules.send(attrs, (end - start) / 1e9, nbytes, attrs.get(semconv.DESCRIPTOR_COUNT, 0), failed),
                      labels, context)
        if failed:  # its own series: the NIC it went out on, where known
            _key, failure_labels, measured = rules.failure(attrs, (), labels)
            self._measure(measured, failure_labels, context)
        if span.events and any(event.name == semconv.EVENT_LATE_COMPLETION for event in span.events):
            self._measure(rules.late_send(), labels, context)
        peer = self._peers.of(attrs)
        if peer is not None:
            self._measure(rules.peer_speed(attrs, nbytes, failed), peer[1], context)
            # busy time sums many sends: no one send is its exemplar
            self._measure(((rules.I_PEER_BUSY_TIME, self._busy.add(peer[0], start, end)),), peer[1], _NO_SPAN)
        key, process_labels = rules.process_series(attrs)
        self._measure(((rules.I_BUSY_TIME, self._busy.add(key, start, end)),), process_labels, _NO_SPAN)

    def _on_request(self, span: Any, attrs: Mapping[str, Any], labels: Dict[str, Any],
                    context: Context) -> None:
        failed = span.status.status_code is StatusCode.ERROR
        self._measure(rules.request(attrs, (span.end_time - span.start_time) / 1e9, failed), labels, context)

    def _on_peer(self, span: Any, attrs: Mapping[str, Any], labels: Dict[str, Any], context: Context) -> None:
        self._measure(rules.peer_wait((span.end_time - span.start_time) / 1e9), labels, context)
        self._measure(rules.peer_outcomes(attrs), rules.framework_series(attrs)[1], context)
        if span.events and any(event.name == semconv.EVENT_LATE_COMPLETION for event in span.events):
            self._measure(rules.late_send(), labels, context)

    def _on_connect(self, span: Any, attrs: Mapping[str, Any], labels: Dict[str, Any],
                    context: Context) -> None:
        self._measure(rules.connect((span.end_time - span.start_time) / 1e9), rules.connect_series(attrs)[1],
                      context)
