"""`RecordUnsampledSampler`: keeps every span of this package recording; exports only what the wrapped sampler
samples; and never lets the synthetic stitching parent decide.

- Where the wrapped sampler says DROP, this one says RECORD_ONLY: the span is built and reaches the span
  processors' `on_end` (so the metrics processor counts it), but its sampled flag stays off and the exporting
  processors skip it.
- Under the synthetic parent (`stitching`), the wrapped sampler is asked as for a root span with the same trace
  id: `parentbased_traceidratio(0.01)` then keeps 1% of requests, and prefill and decode, which derive the same
  trace id, agree.
Applied only to this package's tracer, so the application's own spans are unaffected.
"""

from typing import Optional, Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind, TraceState, get_current_span
from opentelemetry.util.types import Attributes

from otel_kvtransfer.building.stitching import is_synthetic

_ROOT = Context()


class RecordUnsampledSampler(Sampler):
    def __init__(self, delegate: Sampler) -> None:
        self.delegate = delegate

    def should_sample(self, parent_context: Optional[Context], trace_id: int, name: str,
                      kind: Optional[SpanKind] = None, attributes: Attributes = None,
                      links: Optional[Sequence[Link]] = None,
                      trace_state: Optional[TraceState] = None) -> SamplingResult:
        if parent_context is not None and is_synthetic(get_current_span(parent_context).get_span_context()):
            parent_context = _ROOT
        result = self.delegate.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
        if result.decision is Decision.DROP:
            return SamplingResult(Decision.RECORD_ONLY, attributes, result.trace_state)
        return result

    def get_description(self) -> str:
        return f"RecordUnsampled{{{self.delegate.get_description()}}}"
