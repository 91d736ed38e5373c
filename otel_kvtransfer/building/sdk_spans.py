"""The SDK path (`OTEL_KVTRANSFER_PIPELINE=sdk`): our spans started and ended through the SDK tracer, as any
instrumentation's are, so every span processor sees them from `on_start` on and views apply to the SDK
instruments of `processor.KVTransferMetricsProcessor`. It costs several times the direct path (docs/cost.md).

The same interface as `direct_spans.DirectSpans`: parents are span contexts (ours, a real parent's, or the
synthetic stitching parent), so the builder never needs to know which path it runs on.
"""

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan


def _context(parent):
    return trace.set_span_in_context(NonRecordingSpan(parent), Context()) if parent is not None else None


class SdkSpans:
    def __init__(self, tracer):
        self.tracer = tracer

    def open(self, name, parent, kind, attributes, start_ns):
        return self.tracer.start_span(name, context=_context(parent), kind=kind, attributes=attributes,
                                      start_time=start_ns)

    @staticmethod
    def close(span, end_ns: int) -> None:
        # A non-recording span (a no-op or disabled SDK) has no start_time: end it all the same.
        span.end(end_time=max(end_ns, getattr(span, "start_time", None) or end_ns))

    def child(self, name, parent, kind, attributes, start_ns, end_ns, status):
        span = self.tracer.start_span(name, context=_context(parent), kind=kind, attributes=attributes,
                                      start_time=start_ns)
        if status.status_code.value:  # not UNSET
            span.set_status(status)
        span.end(end_time=end_ns)
        return span.get_span_context()

    @staticmethod
    def context_of(span):
        return span.get_span_context()
