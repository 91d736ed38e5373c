"""Our finished spans handed to the provider's span processors, a BatchSpanProcessor's straight into its queue.

The provider's multi span processor calls each processor's `on_end`; the SDK's BatchSpanProcessor then checks
that the span is sampled (the ones handed here are: one recorded only goes to the processors' own `on_end`, see
direct_spans) and its batch processor's `emit` checks for a shutdown and a fork (a
getpid() system call) before it queues the span: about a tenth of what building one of our spans costs. `plan`
settles once, whenever the provider's processors change, what each one gets: the SDK's own BatchSpanProcessor a
function that queues the span as its `emit` would (`sdk_internals.batch_handoff`, which leaves every span that
needs the SDK's own judgement to `on_end`), any other processor its `on_end`, in the provider's order.
"""

import os
from typing import Callable, Tuple

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, SynchronousMultiSpanProcessor

from otel_kvtransfer import sdk_internals


def plan(multi: SpanProcessor, processors: Tuple[SpanProcessor, ...]) -> Callable[[ReadableSpan], None]:
    """A function span -> None that delivers a span to `processors` (what `multi`, the provider's multi span
    processor, holds now) as `multi.on_end` would; `multi.on_end` itself for any multi processor but the SDK's
    synchronous one (a concurrent one runs them on its own threads)."""
    if type(multi) is not SynchronousMultiSpanProcessor or "on_end" in getattr(multi, "__dict__", ()):
        return multi.on_end
    pid = os.getpid()
    steps = tuple(sdk_internals.batch_handoff(processor, pid) or processor.on_end for processor in processors)
    if len(steps) == 1:  # the distro's own set-up: one BatchSpanProcessor
        return steps[0]

    def hand(span: ReadableSpan) -> None:
        for step in steps:
            step(span)

    return hand
