"""Canaries for the OpenTelemetry SDK internals the instrumentor relies on, checked on the installed SDK.

KVTransferInstrumentor puts its flush processor first by replacing
`TracerProvider._active_span_processor._span_processors` under that object's `_lock`, and wraps each tracer's
`sampler` attribute so unsampled spans still record. None of these is public API: an SDK release that renames or
retypes one would silently turn the instrumentation off. Each test below names one attribute, its expected type,
and the behaviour the instrumentor needs from it; pyproject.toml bounds the SDK below the next major version.
"""

import os
import re
import threading

from opentelemetry.sdk.trace import (
    ConcurrentMultiSpanProcessor, SpanProcessor, SynchronousMultiSpanProcessor, Tracer, TracerProvider)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, Decision, Sampler, SamplingResult

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


class _Seen(SpanProcessor):
    def __init__(self):
        self.started, self.ended = [], []

    def on_start(self, span, parent_context=None):
        self.started.append(span.name)

    def on_end(self, span):
        self.ended.append(span.name)


def test_tracer_provider_has_an_active_multi_span_processor():
    provider = TracerProvider()
    multi = provider._active_span_processor  # pylint: disable=protected-access
    assert isinstance(multi, (SynchronousMultiSpanProcessor, ConcurrentMultiSpanProcessor))


def test_multi_span_processor_keeps_its_processors_in_a_tuple():
    provider = TracerProvider()
    first, second = _Seen(), _Seen()
    provider.add_span_processor(first)
    provider.add_span_processor(second)
    multi = provider._active_span_processor  # pylint: disable=protected-access
    assert isinstance(multi._span_processors, tuple)  # pylint: disable=protected-access
    assert multi._span_processors == (first, second)  # pylint: disable=protected-access


def test_multi_span_processor_lock_is_a_lock():
    multi = TracerProvider()._active_span_processor  # pylint: disable=protected-access
    lock = multi._lock  # pylint: disable=protected-access
    assert isinstance(lock, LOCK_TYPES)
    with lock:  # the instrumentor holds it while it swaps the tuple
        pass


def test_replacing_the_processor_tuple_reorders_delivery():
    """What the instrumentor does: put its processor first by assigning a new tuple under the lock."""
    provider = TracerProvider()
    order = []

    class Named(_Seen):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def on_end(self, span):
            order.append(self.name)

    late, ours = Named("late"), Named("ours")
    provider.add_span_processor(late)
    multi = provider._active_span_processor  # pylint: disable=protected-access
    with multi._lock:  # pylint: disable=protected-access
        multi._span_processors = (ours,) + tuple(  # pylint: disable=protected-access
            p for p in multi._span_processors if p is not ours)  # pylint: disable=protected-access
    provider.get_tracer("canary").start_span("s").end()
    assert order == ["ours", "late"]
    # add_span_processor after the swap still appends behind ours
    after = Named("after")
    provider.add_span_processor(after)
    provider.get_tracer("canary").start_span("t").end()
    assert order[2:] == ["ours", "late", "after"]


def test_tracer_has_a_replaceable_sampler():
    """The SDK Tracer reads `self.sampler` on every start_span: replacing it changes the decision."""
    provider = TracerProvider(sampler=ALWAYS_OFF)
    tracer = provider.get_tracer("canary")
    assert isinstance(tracer, Tracer)
    assert isinstance(tracer.sampler, Sampler)
    assert not tracer.start_span("off").get_span_context().trace_flags.sampled

    class RecordAndSample(Sampler):
        def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                          trace_state=None):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)

        def get_description(self):
            return "canary"

    tracer.sampler = RecordAndSample()
    span = tracer.start_span("on")
    assert span.is_recording() and span.get_span_context().trace_flags.sampled


def test_the_suppress_keys_and_the_context_variable_the_hot_path_reads():
    """patching.active() and the Mooncake wrapper read suppress_instrumentation()'s keys from the context they
    fetch once, through the runtime context's own ContextVar: all private names of the API."""
    from opentelemetry import context as otel_context  # pylint: disable=import-outside-toplevel
    from opentelemetry.instrumentation.utils import suppress_instrumentation  # pylint: disable=C0415

    from otel_kvtransfer import patching  # pylint: disable=import-outside-toplevel

    assert hasattr(otel_context, "_SUPPRESS_INSTRUMENTATION_KEY")
    assert patching.current_context is not otel_context.get_current  # the fast path is in use, not the fallback
    assert patching.current_context() is otel_context.get_current()
    with suppress_instrumentation():
        ctx = patching.current_context()
        assert ctx.get(patching.SUPPRESS_KEY) and ctx.get(patching.SUPPRESS_KEY_PLAIN)


def test_pyproject_bounds_the_sdk_major_version():
    """The internals above may change in any major release: the declared range stops before SDK 2."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as handle:
        text = handle.read()
    for name in ("opentelemetry-api", "opentelemetry-sdk"):
        (spec,) = re.findall(rf'^\s*"{name}\s*([^"]*)"', text, re.M)
        assert re.search(r"<\s*2(\.0)*\s*(,|$)", spec), (name, spec)
