"""Canaries for the OpenTelemetry internals the package relies on, checked on the installed releases.

Every private name of OpenTelemetry the package reads is read in one module, `otel_kvtransfer/sdk_internals.py`
(the last test here holds every other module to that): these tests run each of its readers against the installed
API, SDK and OTLP exporters, with the behaviour the package needs from it (the flush processor put first by
replacing the provider's processor tuple under its lock, each tracer's replaceable `sampler`, the readers'
collect callback, the batch queue the direct path waits on, ...). None of these is public API: a release that
renames or retypes one would turn a feature off. pyproject.toml bounds the SDK below the next major version.
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
from support.paths import ROOT
from support.telemetry import in_memory_metrics

from otel_kvtransfer import sdk_internals

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
    assert provider.get_tracer("canary").span_processor is multi  # what processors_of() is handed


def test_multi_span_processor_keeps_its_processors_in_a_tuple():
    from opentelemetry import trace

    provider = TracerProvider()
    first, second = _Seen(), _Seen()
    provider.add_span_processor(first)
    provider.add_span_processor(second)
    assert sdk_internals.span_processors(provider) == (first, second)
    assert isinstance(sdk_internals.span_processors(provider), tuple)
    assert sdk_internals.processors_of(provider.get_tracer("canary").span_processor) == (first, second)
    assert sdk_internals.span_processors(trace.NoOpTracerProvider()) is None


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
    sdk_internals.replace_span_processors(provider, lambda current: (ours,) + tuple(
        p for p in current if p is not ours))
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
    assert sdk_internals.context_getter() is not otel_context.get_current
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

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, SpanLimits
    from opentelemetry.trace import SpanContext, SpanKind, Status

    from otel_kvtransfer.building.attachment import is_sdk_tracer

    tracer = TracerProvider(span_limits=SpanLimits(max_attributes=7)).get_tracer("canary", "1")
    assert is_sdk_tracer(tracer)
    assert sdk_internals.instrumentation_scope(tracer).name == "canary"
    assert sdk_internals.span_limits(tracer).max_attributes == 7
    assert sdk_internals.enabled_flag(tracer)() is True  # a callable: the direct path asks it before each span
    assert list(inspect.signature(ReadableSpan.__init__).parameters)[1:14] == [
        "name", "context", "parent", "resource", "attributes", "events", "links", "kind", "instrumentation_info",
        "status", "start_time", "end_time", "instrumentation_scope"]
    context, parent, resource = SpanContext(1, 2, False), SpanContext(1, 3, False), Resource({"r": 1})
    status, scope = Status(), sdk_internals.instrumentation_scope(tracer)
    span = ReadableSpan("n", context, parent, resource, {"a": 1}, (), (), SpanKind.CLIENT, None, status, 1, 2, scope)
    fields = tuple(getattr(span, name) for name in sdk_internals.SPAN_FIELD_NAMES)  # what the encoder reads
    assert fields[:8] == (context, parent, "n", SpanKind.CLIENT, 1, 2, {"a": 1}, status)
    assert fields[8:10] == (resource, scope)
    assert tuple(map(tuple, fields[10:])) == ((), ())


def test_span_context_is_the_tuple_the_encoder_indexes_and_the_builder_unpacks():
    from opentelemetry.trace import INVALID_SPAN_CONTEXT, SpanContext, TraceFlags, TraceState

    from otel_kvtransfer.building import direct_spans, span_encoding

    context = SpanContext(7, 9, True, TraceFlags(1), TraceState([("a", "b")]))
    assert (context[0], context[1], context[2], context[4]) == (7, 9, True, context.trace_state)
    trace_id, span_id, remote, flags, state, valid = context
    assert (trace_id, span_id, remote, flags, state, valid) == (7, 9, True, context.trace_flags, context.trace_state,
                                                                 True)
    assert tuple(INVALID_SPAN_CONTEXT)[5] is False
    assert span_encoding._TUPLE_CONTEXT and direct_spans.TUPLE_CONTEXT


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
    from opentelemetry.sdk.metrics import Counter
    from opentelemetry.sdk.metrics.export import AggregationTemporality

    provider, reader = in_memory_metrics(temporality={Counter: AggregationTemporality.DELTA})
    assert list(sdk_internals.metric_readers(provider)) == [reader]
    assert sdk_internals.meter_config(provider).resource is not None
    assert hasattr(sdk_internals.meter_config(provider), "exemplar_filter")
    assert not sdk_internals.meter_provider_disabled(provider)
    assert sdk_internals.metric_readers(object()) is None
    delta = [cls.__name__ for cls, value in sdk_internals.reader_temporality(reader).items()
             if value is AggregationTemporality.DELTA]
    assert delta and set(delta) <= set(sdk_internals.COUNTER_CLASS_NAMES)  # kvmetrics finds counters by name
    original, calls = sdk_internals.reader_collect(reader), []

    def spy(metric_reader, timeout_millis=10_000, **kwargs):
        calls.append(metric_reader)
        return original(metric_reader, timeout_millis=timeout_millis, **kwargs)

    sdk_internals.set_reader_collect(reader, spy)
    reader.get_metrics_data()
    assert calls == [reader]
    exemplar = sdk_internals.exemplar_class()({}, 1.5, 10, 2, 1)  # positionally, as kvmetrics makes them
    assert (exemplar.value, exemplar.time_unix_nano, exemplar.span_id, exemplar.trace_id) == (1.5, 10, 2, 1)


def test_a_periodic_readers_exporter():
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    exporter = ConsoleMetricExporter()
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=60_000)
    try:
        assert sdk_internals.reader_exporter(reader) is exporter
    finally:
        reader.shutdown()


def test_the_batch_span_processor_queue_the_direct_path_waits_on():
    """DirectSpans waits for room in each BatchSpanProcessor's queue (`_batch_processor._queue`, a deque, and
    `_max_queue_size`) and wakes its worker (`_worker_awaken`): the SDK drops what does not fit."""
    import collections

    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    processor = BatchSpanProcessor(SpanExporter(), max_queue_size=8, max_export_batch_size=4)
    queue, size, inner = sdk_internals.batch_queue(processor)
    assert isinstance(queue, collections.deque) and size == 8
    assert hasattr(sdk_internals.worker_awaken(inner), "set")
    assert sdk_internals.batch_queue(_Seen()) is None
    processor.shutdown()


class _HeldExporter:
    """An exporter whose export waits until released: its batch processor's worker stays inside it."""

    def __init__(self):
        import threading

        self.entered, self.release, self.exported = threading.Event(), threading.Event(), []

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.exported.extend(spans)
        self.entered.set()
        self.release.wait(30)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self.release.set()

    def force_flush(self, timeout_millis=30000):
        return True


def test_the_batch_span_processor_emit_the_hand_off_stands_in_for():
    """`batch_handoff` queues a span as the SDK's BatchSpanProcessor.on_end does (`_max_export_batch_size`, the
    worker's wake-up, `_pid`, `_shutdown`) and leaves it to that on_end when the queue is full or the processor is
    shut down; a subclass gets none (its on_end may differ)."""
    import logging
    import os

    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    exporter = _HeldExporter()
    processor = BatchSpanProcessor(exporter, max_queue_size=4, max_export_batch_size=2, schedule_delay_millis=600_000)
    queue, _, inner = sdk_internals.batch_queue(processor)
    hand = sdk_internals.batch_handoff(processor, os.getpid())
    span = TracerProvider().get_tracer("canary").start_span("s")
    span.end()
    try:
        hand(span)
        assert list(queue) == [span] and not sdk_internals.worker_awaken(inner).is_set()
        hand(span)  # a batch waits: the worker is woken, and stays in the exporter with it
        assert exporter.entered.wait(30) and exporter.exported == [span, span]
        queue.extend([span] * 4)  # full, and nothing drains it while the worker is held
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("opentelemetry.sdk._shared_internal").addHandler(handler)
        try:
            hand(span)  # the SDK's own emit takes it, and says it dropped one
        finally:
            logging.getLogger("opentelemetry.sdk._shared_internal").removeHandler(handler)
        assert len(queue) == 4 and any("Queue full" in r.getMessage() for r in records)
    finally:
        exporter.release.set()
        processor.shutdown()
    queue.clear()
    hand(span)  # shut down: the SDK's emit refuses it
    assert not queue
    subclass = type("Sub", (BatchSpanProcessor,), {})(SpanExporter())
    try:
        assert sdk_internals.batch_handoff(subclass, os.getpid()) is None
    finally:
        subclass.shutdown()
    assert sdk_internals.batch_handoff(_Seen(), os.getpid()) is None


def test_the_set_up_and_the_otlp_encoders():
    from opentelemetry.sdk.resources import Resource

    assert callable(getattr(sdk_internals.sdk_configurator_class()(), "configure", None))
    encode_resource, encode_scope = sdk_internals.otlp_resource_and_scope_encoders()
    assert encode_resource(Resource({"k": "v"})).attributes[0].key == "k"
    scope = sdk_internals.instrumentation_scope(TracerProvider().get_tracer("canary", "2"))
    assert (encode_scope(scope).name, encode_scope(scope).version) == ("canary", "2")


def test_the_sdk_tracers_own_span_metrics(monkeypatch):
    """What direct_spans counts our spans with when OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED is on: the tracer's
    own counter (None when it is off, or on a release that has none)."""
    from opentelemetry.sdk.trace.sampling import Decision

    assert sdk_internals.tracer_metrics(TracerProvider().get_tracer("canary")) is None
    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    counted = sdk_internals.tracer_metrics(TracerProvider().get_tracer("canary"))
    try:
        from opentelemetry.sdk.trace import _tracer_metrics  # noqa: F401  the releases that count spans
    except ImportError:
        assert counted is None
        return
    ended = counted.start_span(None, Decision.RECORD_AND_SAMPLE)
    assert callable(ended)
    ended()


# Private names of OpenTelemetry that only sdk_internals may read (distinctive enough to search for).
PRIVATE_NAMES = ("_active_span_processor", "_span_processors", "_instrumentation_scope", "_span_limits",
                 "_is_enabled", "_batch_processor", "_worker_awaken", "_max_queue_size", "_sdk_config",
                 "_metric_readers", "_max_export_batch_size", "inner._pid", "inner._shutdown",
                 "_instrument_class_temporality", "_RUNTIME_CONTEXT", "_current_context",
                 "_SUPPRESS_INSTRUMENTATION_KEY", "_OTelSDKConfigurator", "_encode_resource",
                 "_encode_instrumentation_scope", "._internal", "reader._collect", "\"_collect\"", "\"_exporter\"",
                 "\"_disabled\"", "\"_tracer_metrics\"")


def test_no_other_module_reads_opentelemetrys_private_names():
    """One door: an OpenTelemetry release is checked by reading sdk_internals.py alone."""
    import pathlib

    package = pathlib.Path(ROOT) / "otel_kvtransfer"
    door = package / "sdk_internals.py"
    assert _private_reads(door.read_text()) == sorted(PRIVATE_NAMES)
    encoder = package / "building" / "span_encoding.py"
    field_reads = set(re.findall(r"\bspan\.(_\w+)", encoder.read_text()))
    assert field_reads and field_reads <= set(sdk_internals.SPAN_FIELD_NAMES)  # the encoder's direct reads
    found = [(str(path.relative_to(package)), name) for path in sorted(package.rglob("*.py")) if path != door
             for name in _private_reads(_without_encoder_field_reads(path, encoder))]
    assert not found


def _without_encoder_field_reads(path, encoder) -> str:
    """A module's source; the encoder's without its reads of the span fields the door lists."""
    text = path.read_text()
    if path == encoder:
        text = re.sub(r"\bspan\.(_\w+)", lambda m: "" if m.group(1) in sdk_internals.SPAN_FIELD_NAMES else m.group(0),
                      text)
    return text


def _private_reads(text: str) -> list:
    """The names of PRIVATE_NAMES in `text`, each where it starts a name (not inside a longer one)."""
    return sorted(name for name in PRIVATE_NAMES
                  if re.search((r"(?<![A-Za-z0-9])" if name[0] == "_" else "") + re.escape(name), text))


def test_the_private_names_check_sees_a_read():
    """The check above is not vacuous: a module reading the provider's processors is caught, a name of ours that
    holds one inside it is not."""
    assert _private_reads("multi = getattr(provider, '_active_span_processor', None)\n") == [
        "_active_span_processor"]
    assert _private_reads("sdk_internals.replace_span_processors(provider, change)\n") == []
