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
    ConcurrentMultiSpanProcessor,
    SpanProcessor,
    SynchronousMultiSpanProcessor,
    Tracer,
    TracerProvider,
)
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
    multi = provider._active_span_processor
    assert isinstance(multi, (SynchronousMultiSpanProcessor, ConcurrentMultiSpanProcessor))


def test_multi_span_processor_keeps_its_processors_in_a_tuple():
    provider = TracerProvider()
    first, second = _Seen(), _Seen()
    provider.add_span_processor(first)
    provider.add_span_processor(second)
    multi = provider._active_span_processor
    assert isinstance(multi._span_processors, tuple)
    assert multi._span_processors == (first, second)


def test_multi_span_processor_lock_is_a_lock():
    multi = TracerProvider()._active_span_processor
    lock = multi._lock
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
    multi = provider._active_span_processor
    with multi._lock:
        multi._span_processors = (ours,) + tuple(
            p for p in multi._span_processors if p is not ours)
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
    from opentelemetry import context as otel_context
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    from otel_kvtransfer.recording import patching

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


# --- the direct pipeline ------------------------------------------------------------------------------------------

def test_the_tracer_attributes_direct_spans_read():
    """DirectSpans reads the SDK tracer's sampler, id generator, span processor, resource and scope, and builds
    ReadableSpans positionally: a reordered constructor would put values in the wrong fields."""
    import inspect

    from opentelemetry.sdk.trace import ReadableSpan

    from otel_kvtransfer.building.attachment import is_sdk_tracer

    tracer = TracerProvider().get_tracer("canary", "1")
    assert is_sdk_tracer(tracer)
    assert tracer._instrumentation_scope.name == "canary"
    assert list(inspect.signature(ReadableSpan.__init__).parameters)[1:14] == [
        "name", "context", "parent", "resource", "attributes", "events", "links", "kind", "instrumentation_info",
        "status", "start_time", "end_time", "instrumentation_scope"]
    span = ReadableSpan("n", attributes={"a": 1}, start_time=1, end_time=2)
    assert (span._name, span._attributes, span._start_time, span._end_time) == (
        "n", {"a": 1}, 1, 2)


def test_span_context_is_the_tuple_the_encoder_indexes():
    from opentelemetry.trace import SpanContext, TraceFlags, TraceState

    from otel_kvtransfer.building import span_encoding

    context = SpanContext(7, 9, True, TraceFlags(1), TraceState([("a", "b")]))
    assert (context[0], context[1], context[2], context[4]) == (7, 9, True, context.trace_state)
    assert span_encoding._TUPLE_CONTEXT


def test_the_otlp_exporters_encode_through_their_module_encode_spans():
    """accelerate() replaces `encode_spans` in the exporter modules: each must look it up there at export time,
    and the HTTP one only serialize what it returns."""
    import importlib
    import inspect

    from otel_kvtransfer.building import span_encoding

    for name in span_encoding.EXPORTER_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue  # not installed here (the minimum-versions job has no gRPC exporter)
        assert callable(module.encode_spans)
        source = inspect.getsource(module)
        assert "encode_spans(" in source
        if ".http." in name:  # what PreEncoded offers is all it uses
            uses = set(re.findall(r"encode_spans\([^)]*\)\.(\w+)", source))
            assert uses and uses <= {"SerializeToString", "SerializePartialToString"}, uses


def test_meter_provider_readers_and_their_collect_callback():
    """KVMetrics wraps each reader's `_collect` (set by the MeterProvider) and reads the provider's readers,
    resource and exemplar filter; the reader's collect() must go through `_collect`."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    readers = getattr(provider, "_metric_readers", None)
    if readers is None:
        readers = provider._sdk_config.metric_readers
    assert list(readers) == [reader]
    assert provider._sdk_config.resource is not None
    assert hasattr(provider._sdk_config, "exemplar_filter")
    original, calls = reader._collect, []

    def spy(metric_reader, timeout_millis=10_000, **kwargs):
        calls.append(metric_reader)
        return original(metric_reader, timeout_millis=timeout_millis, **kwargs)

    reader._collect = spy
    reader.get_metrics_data()
    assert calls == [reader]


def test_the_batch_span_processor_queue_the_direct_path_waits_on():
    """DirectSpans waits for room in each BatchSpanProcessor's queue (`_batch_processor._queue`, a deque, and
    `_max_queue_size`) and wakes its worker (`_worker_awaken`): the SDK drops what does not fit."""
    import collections

    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    processor = BatchSpanProcessor(SpanExporter(), max_queue_size=8, max_export_batch_size=4)
    inner = processor._batch_processor
    assert isinstance(inner._queue, collections.deque) and inner._max_queue_size == 8
    assert hasattr(inner._worker_awaken, "set")
    processor.shutdown()
