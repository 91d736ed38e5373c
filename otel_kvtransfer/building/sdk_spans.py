"""The SDK path (`OTEL_KVTRANSFER_PIPELINE=sdk`): our spans started and ended through the SDK tracer, as any
instrumentation's are, so every span processor sees them from `on_start` on and views apply to the SDK
instruments of `processor.KVTransferMetricsProcessor`. It costs several times the direct path (docs/cost.md).

The same interface as `direct_spans.DirectSpans`: parents are span contexts (ours, a real parent's, or the
synthetic stitching parent), so the builder never needs to know which path it runs on. Values go into the SDK's
spans repaired as the direct path repairs them (attribute_values), so both send the same valid strings; the SDK's
span applies the provider's limits itself.
"""

from typing import Any, Dict, Mapping, Optional, Union

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status

from otel_kvtransfer.building.attribute_values import repaired, repaired_status, repaired_value
from otel_kvtransfer.building.direct_spans import SendAttributes


def _context(parent: Optional[SpanContext]) -> Optional[Context]:
    return trace.set_span_in_context(NonRecordingSpan(parent), Context()) if parent is not None else None


class RepairingSpan:
    """An open SDK span (a request's, a peer's) whose later values are repaired on their way in: the builder and
    the stuck reports set them as they set them on the direct path's OpenSpan."""

    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def set_attribute(self, key: str, value: Any) -> None:
        self.span.set_attribute(repaired_value(key), repaired_value(value))

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.span.set_attributes(repaired(attributes))

    def set_status(self, status: Status, description: Optional[str] = None) -> None:  # a Status, as OpenSpan takes
        if description is None and hasattr(status, "status_code"):
            self.span.set_status(repaired_status(status))
        else:
            self.span.set_status(status, repaired_value(description))

    def add_event(self, name: str, attributes: Optional[Mapping[str, Any]] = None,
                  timestamp: Optional[int] = None) -> None:
        self.span.add_event(name, repaired(attributes), timestamp)

    def get_span_context(self) -> SpanContext:
        return self.span.get_span_context()

    def __getattr__(self, name: str) -> Any:  # anything else read from the span (attributes, start_time, ...)
        return getattr(self.span, name)


class SdkSpans:
    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    def open(self, name: str, parent: Optional[SpanContext], kind: SpanKind, attributes: Dict[str, Any],
             start_ns: int) -> RepairingSpan:
        return RepairingSpan(self.tracer.start_span(name, context=_context(parent), kind=kind,
                                                    attributes=repaired(attributes), start_time=start_ns))

    @staticmethod
    def close(span: Union[RepairingSpan, Span], end_ns: int) -> None:
        span = span.span if type(span) is RepairingSpan else span
        # A non-recording span (a no-op or disabled SDK) has no start_time: end it all the same.
        span.end(end_time=max(end_ns, getattr(span, "start_time", None) or end_ns))

    def child(self, name: str, parent: Optional[SpanContext], kind: SpanKind, attributes: Dict[str, Any],
              start_ns: int, end_ns: int, status: Status, synthetic: bool = False) -> SpanContext:
        # `synthetic` needs nothing here: the provider's sampler sees the stitching parent's marker itself
        if type(attributes) is not SendAttributes:  # a send's were made valid where they were made
            attributes = repaired(attributes)
        span = self.tracer.start_span(name, context=_context(parent), kind=kind, attributes=attributes,
                                      start_time=start_ns)
        if status.status_code.value:  # not UNSET
            span.set_status(repaired_status(status))
        span.end(end_time=end_ns)
        return span.get_span_context()

    @staticmethod
    def context_of(span: RepairingSpan) -> SpanContext:
        return span.get_span_context()
