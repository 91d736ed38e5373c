"""Every private name of OpenTelemetry (API, SDK, OTLP exporters) that this package reads, behind one door.

None of these is public API. Each is read defensively here: a name an OpenTelemetry release renamed turns off
the one feature that needs it (a fallback, or nothing), never raises in an engine. tests/project/test_sdk_canary.py runs
every function and constant below against the installed releases, and parses the package to hold it to the
allowlist at the end of this file (`PRIVATE_NAMES`): the names read here are exactly those, and no other module
reads one of OpenTelemetry's but what `READ_ELSEWHERE` grants it. A new OpenTelemetry release is this one file to
read.
"""

import contextvars
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

from opentelemetry import context as otel_context
from opentelemetry.instrumentation import utils as otel_utils

# --- the API's context: what the hot path reads -------------------------------------------------------------------

# The two keys `is_instrumentation_enabled()` reads: wrappers read them from the one context they fetch per call
# (that function fetches it twice, through six Python frames).
SUPPRESS_KEY = getattr(otel_context, "_SUPPRESS_INSTRUMENTATION_KEY", "suppress_instrumentation")
SUPPRESS_KEY_PLAIN = getattr(otel_utils, "_SUPPRESS_INSTRUMENTATION_KEY_PLAIN", "suppress_instrumentation")


def context_getter() -> Callable[[], Any]:
    """`get_current`, or with the default runtime context its ContextVar's own `get` (C, no Python frame)."""
    runtime = getattr(otel_context, "_RUNTIME_CONTEXT", None)
    var = getattr(runtime, "_current_context", None)
    if type(runtime).__name__ == "ContextVarsRuntimeContext" and isinstance(var, contextvars.ContextVar):
        return var.get
    return otel_context.get_current


# --- TracerProvider and Tracer ------------------------------------------------------------------------------------

def span_processors(tracer_provider: object) -> Optional[Tuple[Any, ...]]:
    """The SDK provider's span processors in delivery order; None for any other provider."""
    return processors_of(getattr(tracer_provider, "_active_span_processor", None))


# Where the provider's multi span processor (`Tracer.span_processor`, public) keeps its processors: read as
# getattr(multi, PROCESSORS_ATTRIBUTE, ()) on the builder's path for every span (one C call, no Python frame).
PROCESSORS_ATTRIBUTE = "_span_processors"


def processors_of(multi: object) -> Optional[Tuple[Any, ...]]:
    """The processors of the provider's multi span processor, or None."""
    return getattr(multi, PROCESSORS_ATTRIBUTE, None)


def replace_span_processors(tracer_provider: Any, change: Callable[[Tuple[Any, ...]], Tuple[Any, ...]]) -> None:
    """The provider's processors become `change(them)`, under the lock its add_span_processor takes: the only
    way to put a processor in front (flush and shutdown reach ours first)."""
    multi = tracer_provider._active_span_processor
    with multi._lock:
        multi._span_processors = change(multi._span_processors)


# What the direct path reads from an SDK tracer (a tracer the provider switched off lacks some).
SDK_TRACER_ATTRIBUTES = ("sampler", "id_generator", "span_processor", "resource", "_instrumentation_scope")


def instrumentation_scope(tracer: Any) -> Any:
    return tracer._instrumentation_scope


def span_limits(tracer: object) -> Any:
    """The span limits the tracer's provider resolved from OTEL_* when it was made, or None."""
    return getattr(tracer, "_span_limits", None)


def enabled_flag(tracer: object) -> Any:
    """The tracer's switch (OTEL_SDK_DISABLED, its configurator), or None on a release without one."""
    return getattr(tracer, "_is_enabled", None)


def tracer_metrics(tracer: object) -> Any:
    """The SDK's own span metrics of an SDK tracer (`otel.sdk.span.started`, `otel.sdk.span.live`: on with
    OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED when the tracer was made): an object whose `start_span(parent span
    context or None, sampling Decision)` counts a span started and returns what counts it ended. None when they are
    off, or the release has none."""
    found = getattr(tracer, "_tracer_metrics", None)
    if found is None or type(found).__name__.startswith("NoOp") or not callable(getattr(found, "start_span", None)):
        return None
    return found


def batch_queue(processor: object) -> Optional[Tuple[Any, int, Any]]:
    """(the export queue, its bound, the inner processor) of a BatchSpanProcessor, or None for another kind."""
    inner = getattr(processor, "_batch_processor", None)
    queue, size = getattr(inner, "_queue", None), getattr(inner, "_max_queue_size", None)
    if queue is None or not isinstance(size, int):
        return None
    return queue, size, inner


def worker_awaken(inner: object) -> Any:
    """The event that makes a batch processor's worker export now instead of at its next schedule, or None."""
    return getattr(inner, "_worker_awaken", None)


def _sdk_own(function: object) -> bool:
    """A function of the SDK's that nobody wrapped (functools.wraps and wrapt both leave `__wrapped__`)."""
    return getattr(function, "__module__", "").startswith("opentelemetry.sdk.") and not hasattr(function,
                                                                                                 "__wrapped__")


def batch_handoff(processor: object, pid: int) -> Optional[Callable[[Any], None]]:
    """For the SDK's own BatchSpanProcessor: a function that queues a sampled span exactly as its `on_end` does
    (appended to the export queue, the worker woken once a batch waits) without that path's checks per span
    (three calls, a getpid() system call); the processor's own `on_end` takes every span it must judge itself (its
    queue full, shut down, or a fork since `pid` was read: it counts, logs or re-initialises as it always does).
    None for any other processor, a subclass, or one whose `on_end` or emit was replaced (it is called as such)."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    inner = getattr(processor, "_batch_processor", None)
    if (type(processor) is not BatchSpanProcessor or inner is None or "on_end" in getattr(processor, "__dict__", ())
            or "emit" in getattr(inner, "__dict__", ()) or not _sdk_own(BatchSpanProcessor.on_end)
            or not _sdk_own(getattr(type(inner), "emit", None))):
        return None
    found = batch_queue(processor)
    batch, awaken = getattr(inner, "_max_export_batch_size", None), worker_awaken(inner)
    if found is None or not isinstance(batch, int) or not hasattr(awaken, "is_set") or not hasattr(inner, "_pid") \
            or not hasattr(inner, "_shutdown"):
        return None
    queue, size, _ = found
    on_end, appendleft, is_set, wake = processor.on_end, queue.appendleft, awaken.is_set, awaken.set

    def hand(span: Any) -> None:
        if len(queue) < size and inner._pid == pid and not inner._shutdown:
            appendleft(span)
            if len(queue) >= batch and not is_set():
                wake()
        else:
            on_end(span)

    return hand


# The ReadableSpan fields the span encoder (building/span_encoding.py) reads from spans this package built:
# `span._context` and the rest directly, there, because a slot read is the cheapest access Python has (a getter
# called per span cost ~0.15 us more per span). The canary checks each name on the installed SDK, and that the
# encoder reads no other.
SPAN_FIELD_NAMES = ("_context", "_parent", "_name", "_kind", "_start_time", "_end_time", "_attributes", "_status",
                    "_resource", "_instrumentation_scope", "_events", "_links")


# --- samplers -----------------------------------------------------------------------------------------------------

def parent_based_root(sampler: object) -> Any:
    """The sampler a ParentBased asks about a root span (its `root`), or None on a release that keeps it
    elsewhere (the direct path then asks the ParentBased itself)."""
    return getattr(sampler, "_root", None)


def parent_based_local_parents(sampler: object) -> Tuple[Any, Any]:
    """The samplers a ParentBased asks about a child of a local parent: (sampled parent, unsampled parent); Nones
    on a release that keeps them elsewhere (the direct path then asks the ParentBased for every child)."""
    return getattr(sampler, "_local_parent_sampled", None), getattr(sampler, "_local_parent_not_sampled", None)


def otlp_resource_and_scope_encoders() -> Tuple[Callable[..., Any], Callable[..., Any]]:
    """The OTLP exporters' own encoders of a resource and an instrumentation scope."""
    from opentelemetry.exporter.otlp.proto.common._internal import _encode_instrumentation_scope, _encode_resource

    return _encode_resource, _encode_instrumentation_scope


# --- MeterProvider and its readers --------------------------------------------------------------------------------

def meter_config(meter_provider: object) -> Any:
    """An SDK MeterProvider's configuration (resource, exemplar filter), or None for any other provider."""
    return getattr(meter_provider, "_sdk_config", None)


def metric_readers(meter_provider: object) -> Optional[List[Any]]:
    """An SDK MeterProvider's readers (on the provider since SDK 1.43, on its configuration before), or None."""
    readers = getattr(meter_provider, "_metric_readers", None)
    if readers is None:
        readers = getattr(meter_config(meter_provider), "metric_readers", None)
    return readers


def meter_provider_disabled(meter_provider: object) -> bool:
    """OTEL_SDK_DISABLED: the provider records nothing."""
    return bool(getattr(meter_provider, "_disabled", False))


def reader_exporter(reader: object) -> Any:
    """A periodic reader's exporter, or None."""
    return getattr(reader, "_exporter", None)


def reader_collect(reader: object) -> Any:
    """The callback a reader's collect() calls to gather every point (None on a release without it)."""
    return getattr(reader, "_collect", None)


def set_reader_collect(reader: Any, collect: Callable[..., Any]) -> None:
    reader._collect = collect


def reader_temporality(reader: object) -> Dict[type, Any]:
    """{instrument class: AggregationTemporality} the reader was made with."""
    return getattr(reader, "_instrument_class_temporality", {})


COUNTER_CLASS_NAMES = ("_Counter", "Counter")  # the SDK's counter classes, as a reader's temporality table keys them


def exemplar_class() -> Type[Any]:
    from opentelemetry.sdk.metrics._internal.exemplar import Exemplar

    return Exemplar


# --- set-up -------------------------------------------------------------------------------------------------------

def sdk_configurator_class() -> Type[Any]:
    """The SDK's own configurator (what opentelemetry-distro's wraps), reading OTEL_*."""
    from opentelemetry.sdk._configuration import _OTelSDKConfigurator

    return _OTelSDKConfigurator


# --- the allowlist ------------------------------------------------------------------------------------------------
# Every private name of OpenTelemetry the package reads. tests/project/test_sdk_canary.py finds them by parsing the
# package (attributes, getattr names, imports, and the names this module declares for others to read) and holds
# them here: a new read is a line below first.
PRIVATE_NAMES = frozenset({
    # the API's context and the instrumentation utilities
    "_SUPPRESS_INSTRUMENTATION_KEY", "_SUPPRESS_INSTRUMENTATION_KEY_PLAIN", "_RUNTIME_CONTEXT", "_current_context",
    # TracerProvider, Tracer and the span processors
    "_active_span_processor", "_span_processors", "_lock", "_instrumentation_scope", "_span_limits", "_is_enabled",
    "_tracer_metrics", "_batch_processor", "_queue", "_max_queue_size", "_worker_awaken", "_max_export_batch_size",
    "_pid", "_shutdown",
    # ParentBased
    "_root", "_local_parent_sampled", "_local_parent_not_sampled",
    # ReadableSpan's fields (SPAN_FIELD_NAMES)
    "_context", "_parent", "_name", "_kind", "_start_time", "_end_time", "_attributes", "_status", "_resource",
    "_events", "_links",
    # the OTLP encoders, the MeterProvider and its readers, the SDK's configurator
    "_internal", "_encode_resource", "_encode_instrumentation_scope", "_sdk_config", "_metric_readers", "_disabled",
    "_exporter", "_collect", "_instrument_class_temporality", "_Counter", "_configuration", "_OTelSDKConfigurator",
})
# Reads another module makes itself, by module (relative to the package): the span encoder reads the span fields
# directly (see SPAN_FIELD_NAMES).
READ_ELSEWHERE = {"building.span_encoding": SPAN_FIELD_NAMES}
# Reads the parse would take for OpenTelemetry's (a value passed in, a name OpenTelemetry also uses) that are another
# library's: NIXL's transfer handle keeps its agent's handle as `_handle`, a name of the SDK's error handlers too.
NOT_OPENTELEMETRY = {"engines.nixl": ("_handle",)}
