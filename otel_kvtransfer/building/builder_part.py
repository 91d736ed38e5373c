"""What each part of the builder (`request_spans`, `peer_spans`, `send_spans`, `connect_spans`) builds with, and the
pieces they share: the span factory and the metrics, replaced together when an SDK appears after instrument()."""

from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_kvtransfer import semconv
from otel_kvtransfer.building.direct_spans import UNSET_STATUS, span_context_of
from otel_kvtransfer.building.sdk_spans import SdkSpans
from otel_kvtransfer.building.stitching import key_parent_span_context

OK = UNSET_STATUS  # the direct path's own object: a span with it needs no repair
# A send's times are checked here, off the engine's thread: OTLP's fixed64 nanoseconds, the end not before the
# start (an engine call's come from clock.now_ns(); a bad one came through integration.deliver()).
TIME_LIMIT = 1 << 64


def span_factory(spans):
    """`direct_spans.DirectSpans` or `sdk_spans.SdkSpans` as given; an SDK tracer wrapped in an SdkSpans."""
    return spans if hasattr(spans, "child") else SdkSpans(spans)


def mark_error(span, error_type: str) -> None:
    span.set_attribute(semconv.ERROR_TYPE, error_type)
    span.set_status(Status(StatusCode.ERROR, error_type))


class BuilderPart:
    """`spans`: a span factory (`span_factory`). `metrics`: where the figures go as measurements
    (`record_metrics.RecordMetrics`), or `record_metrics.NO_METRICS` when a span processor derives them."""

    def __init__(self, spans, metrics):
        self.use(spans, metrics)

    def use(self, spans, metrics) -> None:
        self._spans = spans
        self._metrics = metrics

    def _start_top(self, name, key, role, backend, framework, attributes, parent, start_ns):
        """A request's or peer's top span: under the real parent given, else under the key's synthetic parent."""
        attrs = {semconv.REQUEST_KEY: str(key), semconv.ROLE: role, semconv.BACKEND: backend}
        if framework:
            attrs[semconv.FRAMEWORK] = framework
        if attributes:
            attrs.update(attributes)
        parent = span_context_of(parent)
        return self._spans.open(name, parent if parent is not None else key_parent_span_context(key),
                                SpanKind.INTERNAL, attrs, start_ns)
