"""`RecordUnsampledSampler`: keeps every span recording, exports only what the wrapped sampler samples.

Where the wrapped sampler says DROP, this one says RECORD_ONLY: the span is built and reaches the span
processors' `on_end` (so the metrics processor counts it), but its sampled flag stays off and the exporting
processors skip it. Applied only to this package's tracer, so the application's own spans are unaffected.
"""

from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult


class RecordUnsampledSampler(Sampler):
    def __init__(self, delegate: Sampler):
        self.delegate = delegate

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None) -> SamplingResult:
        result = self.delegate.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
        if result.decision is Decision.DROP:
            return SamplingResult(Decision.RECORD_ONLY, attributes, result.trace_state)
        return result

    def get_description(self) -> str:
        return f"RecordUnsampled{{{self.delegate.get_description()}}}"
