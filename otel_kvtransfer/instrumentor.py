"""`KVTransferInstrumentor`: switches the whole package on and off.

    from otel_kvtransfer import KVTransferInstrumentor
    KVTransferInstrumentor().instrument(tracer_provider=tp, meter_provider=mp)

On instrument it wraps the engines that are importable (Mooncake; sglang through its own module), starts the
recorder's background thread, and attaches to an SDK TracerProvider the two processors this package needs:
`FlushFirstSpanProcessor` in front (so `force_flush()`/`shutdown()` deliver every recorded transfer) and
`KVTransferMetricsProcessor` (metrics from spans). The package's own tracer gets `RecordUnsampledSampler`, so
metrics count transfers that trace sampling leaves out. `uninstrument()` restores the original methods; the
processors stay attached (the SDK cannot detach them) but go quiet, and a later instrument() reuses them.
"""

import logging
import multiprocessing
import multiprocessing.util
import weakref
from typing import Collection

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_kvtransfer import config, mooncake, semconv
from otel_kvtransfer.package import _instruments
from otel_kvtransfer.processor import KVTransferMetricsProcessor
from otel_kvtransfer.recorder import RECORDER, FlushFirstSpanProcessor
from otel_kvtransfer.sampler import RecordUnsampledSampler
from otel_kvtransfer.spans import SpanBuilder
from otel_kvtransfer.version import __version__

_logger = logging.getLogger(__name__)

# provider -> its metrics processor, so instrument/uninstrument cycles never attach a second one.
_attached = weakref.WeakKeyDictionary()


def _attach_processors(tracer_provider, meter_provider):
    if not hasattr(tracer_provider, "add_span_processor"):
        _logger.warning(
            "otel_kvtransfer: the tracer provider is not the OpenTelemetry SDK's; spans are built but no metrics "
            "are derived from them")
        return None
    processor = _attached.get(tracer_provider)
    if processor is not None:
        processor.enabled = True
        return processor
    flush_first = FlushFirstSpanProcessor(RECORDER)
    processor = KVTransferMetricsProcessor(meter_provider)
    tracer_provider.add_span_processor(flush_first)
    tracer_provider.add_span_processor(processor)
    _move_to_front(tracer_provider, flush_first)
    _attached[tracer_provider] = processor
    return processor


def _move_to_front(tracer_provider, processor):
    # The SDK offers no "insert first"; reorder its tuple of processors so draining precedes exporting.
    multi = getattr(tracer_provider, "_active_span_processor", None)
    with getattr(multi, "_lock"):
        current = getattr(multi, "_span_processors", None)
        if isinstance(current, tuple):
            multi._span_processors = (processor,) + tuple(p for p in current if p is not processor)


def _attach(tracer, tracer_provider, meter_provider):
    _record_unsampled(tracer)
    try:
        _attach_processors(tracer_provider, meter_provider)
    except Exception:  # pylint: disable=broad-except
        _logger.warning("otel_kvtransfer could not attach its span processors", exc_info=True)


class _LateAttach:
    """The recorder's tick while instrument() ran before any SDK TracerProvider was set globally.

    Each tick (on the background thread) looks for the real provider; once there, the builder gets a tracer
    from it and the processors are attached, exactly as instrument() does with a provider at hand.
    """

    def __init__(self, builder, meter_provider):
        self._builder = builder
        self._meter_provider = meter_provider
        self._attached = False

    def __call__(self):
        if not self._attached:
            provider = trace.get_tracer_provider()
            if not isinstance(provider, trace.ProxyTracerProvider):
                tracer = provider.get_tracer(semconv.INSTRUMENTATION_NAME, __version__)
                _attach(tracer, provider, self._meter_provider)
                self._builder.set_tracer(tracer)
                self._attached = True
        self._builder.evict_stale()


def _record_unsampled(tracer):
    if hasattr(tracer, "sampler") and not isinstance(tracer.sampler, RecordUnsampledSampler):
        tracer.sampler = RecordUnsampledSampler(tracer.sampler)


class KVTransferInstrumentor(BaseInstrumentor):
    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs):
        tracer_provider = kwargs.get("tracer_provider") or trace.get_tracer_provider()
        meter_provider = kwargs.get("meter_provider") or metrics.get_meter_provider()
        settings = config.load()
        tracer = trace.get_tracer(semconv.INSTRUMENTATION_NAME, __version__, tracer_provider)
        # No SDK yet (a plugin or an engine that sets its provider later): attach once one appears.
        waiting_for_sdk = isinstance(tracer_provider, trace.ProxyTracerProvider)
        if not waiting_for_sdk:
            _attach(tracer, tracer_provider, meter_provider)
        meter = metrics.get_meter(semconv.INSTRUMENTATION_NAME, __version__, meter_provider)
        dropped = meter.create_counter(
            semconv.METRIC_DROPPED, unit="{record}",
            description="Records the instrumentation had to drop (queue full, evicted rooms, own errors)")
        builder = SpanBuilder(
            tracer, settings.request_ttl_s,
            on_evicted=lambda reason, n: RECORDER.drop(reason, n),
            on_error=lambda n: RECORDER.drop("builder_error", n))
        tick = builder.evict_stale
        if waiting_for_sdk:
            tick = _LateAttach(builder, meter_provider)
        RECORDER.start(
            settings,
            sink=builder.consume,
            tick=tick,
            on_drops=lambda reason, n: dropped.add(n, {semconv.DROP_REASON: reason}),
            on_fork=builder.reset,
        )
        self._builder = builder
        mooncake.instrument()
        _sglang("instrument")
        # A multiprocessing child ends with os._exit and skips atexit: flush what it recorded on its way out.
        # (The main process has the providers' own atexit shutdown.)
        self._finalizer = None
        if multiprocessing.parent_process() is not None:
            self._finalizer = multiprocessing.util.Finalize(
                None, _flush_providers, args=(tracer_provider, meter_provider), exitpriority=100)

    def _uninstrument(self, **kwargs):
        _sglang("uninstrument")
        mooncake.uninstrument()
        RECORDER.stop()
        for processor in list(_attached.values()):
            processor.enabled = False
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.cancel()


def _flush_providers(tracer_provider, meter_provider):
    RECORDER.final_drain()
    for provider in (tracer_provider, meter_provider):
        flush = getattr(provider, "force_flush", None)
        if flush is not None:
            try:
                flush(timeout_millis=5000)
            except Exception:  # pylint: disable=broad-except
                _logger.debug("otel_kvtransfer: flush at exit failed", exc_info=True)


def _sglang(action: str):
    """Run instrument/uninstrument of the sglang module when it is part of this install."""
    try:
        from otel_kvtransfer import sglang as sglang_integration  # pylint: disable=import-outside-toplevel
    except ImportError:
        return
    try:
        getattr(sglang_integration, action)()
    except Exception:  # pylint: disable=broad-except
        _logger.warning("otel_kvtransfer could not %s sglang", action, exc_info=True)
