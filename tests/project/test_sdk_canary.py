"""Canaries for the OpenTelemetry internals the package relies on, checked on the installed releases.

Every private name of OpenTelemetry the package reads is read in one module, `otel_kvtransfer/sdk_internals.py`
(the last tests here parse the package and hold it to that module's allowlist): these tests run each of its
readers against the installed API, SDK and OTLP exporters, with the behaviour the package needs from it (the
flush processor put first by replacing the provider's processor tuple under its lock, each tracer's replaceable
`sampler`, the readers' collect callback, the batch queue the direct path waits on, ...). None of these is public
API: a release that renames or retypes one would turn a feature off. pyproject.toml bounds the SDK below the next
major version.
"""

import os
import pathlib
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
from support import private_reads
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


def test_the_parent_based_samplers_the_direct_path_reads():
    """The direct path decides a root span and a child of its own spans itself under the standard samplers: it reads
    what a ParentBased asks about a root and about a child of a local (un)sampled parent."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased

    ratio, first, second = TraceIdRatioBased(0.25), _Named("sampled"), _Named("not sampled")
    assert sdk_internals.parent_based_root(ParentBased(ratio)) is ratio
    assert sdk_internals.parent_based_local_parents(ParentBased(ALWAYS_ON)) == (ALWAYS_ON, ALWAYS_OFF)
    custom = ParentBased(ALWAYS_ON, local_parent_sampled=first, local_parent_not_sampled=second)
    assert sdk_internals.parent_based_local_parents(custom) == (first, second)
    assert sdk_internals.parent_based_root(ALWAYS_ON) is None  # not a ParentBased: nothing to read


class _Named(Sampler):
    def __init__(self, name):
        self.name = name

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None):
        return SamplingResult(Decision.DROP)

    def get_description(self):
        return self.name


# --- one door: the package parsed ---------------------------------------------------------------------------------

DOOR = "sdk_internals"
ALLOWLISTS = ("PRIVATE_NAMES", "READ_ELSEWHERE", "NOT_OPENTELEMETRY")  # the door's lists themselves, not reads


def _opentelemetry_names() -> frozenset:
    """Every private identifier in the installed OpenTelemetry's source (API, SDK, exporters, instrumentation)."""
    import opentelemetry

    names = set()
    for base in opentelemetry.__path__:
        for path in pathlib.Path(base).rglob("*.py"):
            names.update(re.findall(r"(?<![\w])_[A-Za-z]\w*", path.read_text(encoding="utf-8", errors="replace")))
    return frozenset(names)


OPENTELEMETRY_NAMES = _opentelemetry_names()


def _opentelemetry_reads(module: str, source: str) -> list:
    """The private names of OpenTelemetry `module` reads: from a value of an OpenTelemetry module, or from a value
    the source does not place (one passed in) by a name OpenTelemetry's own source uses; never our own."""
    return sorted({read.name for read in private_reads.reads(module, source) if not read.ours() and (
        (read.owner or "").split(".")[0] == "opentelemetry"
        or (read.owner is None and read.name in OPENTELEMETRY_NAMES))})


def _declared(source: str) -> set:
    """The private names the door declares for reading (string constants), its own allowlists left out."""
    import ast

    tree = ast.parse(source)
    tree.body = [node for node in tree.body if not (isinstance(node, ast.Assign) and any(
        isinstance(target, ast.Name) and target.id in ALLOWLISTS for target in node.targets))]
    return set(private_reads.private_strings(ast.unparse(tree)))


def test_the_door_reads_exactly_its_allowlist():
    """What sdk_internals reads (attributes, getattr names, imports) and declares (SPAN_FIELD_NAMES, ...) is its
    PRIVATE_NAMES, both ways: a read the list lacks, or a name it keeps that nothing reads, fails here."""
    source = private_reads.modules()[DOOR].read_text(encoding="utf-8")
    read = {r.name for r in private_reads.reads(DOOR, source) if not r.ours()} | _declared(source)
    assert read == sdk_internals.PRIVATE_NAMES, (sorted(read - sdk_internals.PRIVATE_NAMES),
                                                 sorted(sdk_internals.PRIVATE_NAMES - read))


def test_no_other_module_reads_opentelemetrys_private_names():
    """One door: an OpenTelemetry release is checked by reading sdk_internals.py alone. Another module reads only
    what the door grants it (READ_ELSEWHERE), each grant in use."""
    granted = {**{m: set(n) for m, n in sdk_internals.READ_ELSEWHERE.items()}}
    for module, names in sdk_internals.NOT_OPENTELEMETRY.items():
        granted.setdefault(module, set()).update(names)
    found, used = [], set()
    for module, path in private_reads.modules().items():
        if module == DOOR:
            continue
        for name in _opentelemetry_reads(module, path.read_text(encoding="utf-8")):
            if name in granted.get(module, ()):
                used.add((module, name))
            else:
                found.append(f"{module}: {name}")
    assert not found, "read OpenTelemetry's private names outside sdk_internals: " + ", ".join(found)
    assert used == {(module, name) for module, names in granted.items() for name in names}  # no stale grant
    assert set(sdk_internals.READ_ELSEWHERE.get("building.span_encoding", ())) <= sdk_internals.PRIVATE_NAMES


def test_the_parse_sees_a_private_read():
    """The check is not vacuous: a read through a value passed in, a getattr name, an import from a private module
    are caught, under any variable name; our own objects' privates and other libraries' are not."""
    caught = _opentelemetry_reads("building.example", (
        "from opentelemetry.sdk._configuration import _OTelSDKConfigurator\n"
        "from otel_kvtransfer.recording.recorder import RECORDER\n"
        "import os\n"
        "class Mine:\n"
        "    def __init__(self, sampler):\n"
        "        self._root = sampler._root\n"  # a parameter's: OpenTelemetry's name
        "        self._root()\n"  # our own attribute, of the same name
        "def f(provider, x):\n"
        "    getattr(provider, '_active_span_processor', None)\n"
        "    recorder = RECORDER\n"
        "    recorder._queue.append(x)\n"  # ours, through a local name
        "    os._exit(0)\n"))  # the interpreter's, not OpenTelemetry's
    assert caught == ["_OTelSDKConfigurator", "_active_span_processor", "_configuration", "_root"]
    assert _opentelemetry_reads("wiring.example", "sdk_internals.replace_span_processors(provider, change)\n") == []
