"""What each part of the builder (`request_spans`, `peer_spans`, `send_spans`, `connect_spans`) builds with, and the
pieces they share: the span factory and the metrics, replaced together when an SDK appears after instrument().
`SpanFactory`, `BuiltSpan` and `BuilderMetrics` say what the builder asks of each (it never asks which one it has).
"""

from typing import Any, Dict, Mapping, Optional, Protocol, Tuple, Union, cast

from opentelemetry.context import Context
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, Tracer

from otel_kvtransfer import semconv
from otel_kvtransfer.building.direct_spans import UNSET_STATUS, span_context_of
from otel_kvtransfer.building.sdk_spans import SdkSpans
from otel_kvtransfer.building.stitching import key_parent_span_context

OK = UNSET_STATUS  # the direct path's own object: a span with it needs no repair
# A send's times are checked here, off the engine's thread: OTLP's fixed64 nanoseconds, the end not before the
# start (an engine call's come from clock.now_ns(); a bad one came through integration.deliver()).
TIME_LIMIT = 1 << 64


Record = Tuple[Any, ...]  # a record (recording.records): the parts read it by its named positions


class BuiltSpan(Protocol):
    """A span the builder opened and ends later (a request's, a peer wait's): `direct_spans.OpenSpan`, or
    `sdk_spans.RepairingSpan` around the SDK's span. What the builder, the stuck reports and the metrics do with it
    until it ends."""

    @property
    def attributes(self) -> Mapping[str, Any]: ...

    @property
    def start_time(self) -> int: ...

    def set_attribute(self, key: str, value: Any, /) -> None: ...

    def set_attributes(self, attributes: Mapping[str, Any], /) -> None: ...

    def set_status(self, status: Status, /) -> None: ...

    def add_event(self, name: str, attributes: Optional[Mapping[str, Any]] = None, timestamp: Optional[int] = None,
                  /) -> None: ...

    def get_span_context(self) -> SpanContext: ...


class SpanFactory(Protocol):
    """What the builder builds spans with: `direct_spans.DirectSpans` or `sdk_spans.SdkSpans`. Parents are span
    contexts; `close` and `context_of` take only a span this factory's `open` returned."""

    def open(self, name: str, parent: Optional[SpanContext], kind: SpanKind, attributes: Dict[str, Any],
             start_ns: int, /) -> BuiltSpan: ...

    def close(self, span: Any, end_ns: int, /) -> None: ...

    def child(self, name: str, parent: Optional[SpanContext], kind: SpanKind, attributes: Dict[str, Any],
              start_ns: int, end_ns: int, status: Status, synthetic: bool = False, /) -> SpanContext: ...

    def context_of(self, span: Any, /) -> SpanContext: ...


class BuilderMetrics(Protocol):
    """Where the builder's figures go as measurements: `record_metrics.RecordMetrics`, or
    `record_metrics.NO_METRICS` (a span processor derives them from the spans). `span` and `state`: the request's
    or peer wait's span (`BuiltSpan`) and open state (`open_spans.OpenRequest`)."""

    def send(self, attrs: Mapping[str, Any], start_ns: int, end_ns: int, nbytes: int, descriptors: int,
             failure: Optional[str], span_context: SpanContext, /) -> None: ...

    def late(self, attrs: Mapping[str, Any], span_context: SpanContext, /) -> None: ...

    def request(self, figures: Dict[str, Any], span: Any, state: Any, end_ns: int, failure: Optional[str],
                /) -> None: ...

    def peer(self, span: Any, end_ns: int, /) -> None: ...

    def connect(self, attrs: Mapping[str, Any], start_ns: int, end_ns: int, span_context: SpanContext,
                /) -> None: ...


def span_factory(spans: Union[SpanFactory, Tracer]) -> SpanFactory:
    """`direct_spans.DirectSpans` or `sdk_spans.SdkSpans` as given; an SDK tracer wrapped in an SdkSpans."""
    # The test is hasattr() (a tracer of any make has no `child`): mypy narrows only its negative branch by it.
    return cast(SpanFactory, spans) if hasattr(spans, "child") else SdkSpans(spans)


def mark_error(span: BuiltSpan, error_type: str) -> None:
    span.set_attribute(semconv.ERROR_TYPE, error_type)
    span.set_status(Status(StatusCode.ERROR, error_type))


class BuilderPart:
    """`spans`: a span factory (`span_factory`). `metrics`: where the figures go as measurements
    (`record_metrics.RecordMetrics`), or `record_metrics.NO_METRICS` when a span processor derives them."""

    def __init__(self, spans: SpanFactory, metrics: BuilderMetrics) -> None:
        self.use(spans, metrics)

    def use(self, spans: SpanFactory, metrics: BuilderMetrics) -> None:
        self._spans = spans
        self._metrics = metrics

    def _start_top(self, name: str, key: Any, role: Optional[str], backend: Optional[str], framework: Optional[str],
                   attributes: Optional[Mapping[str, Any]], parent: Optional[Context], start_ns: int) -> BuiltSpan:
        """A request's or peer's top span: under the real parent given, else under the key's synthetic parent."""
        attrs = {semconv.REQUEST_KEY: str(key), semconv.ROLE: role, semconv.BACKEND: backend}
        if framework:
            attrs[semconv.FRAMEWORK] = framework
        if attributes:
            attrs.update(attributes)
        parent_context = span_context_of(parent)
        return self._spans.open(name, parent_context if parent_context is not None else key_parent_span_context(key),
                                SpanKind.INTERNAL, attrs, start_ns)
