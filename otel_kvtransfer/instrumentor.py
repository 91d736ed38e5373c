"""`KVTransferInstrumentor`: switches the whole package on and off.

    from otel_kvtransfer import KVTransferInstrumentor
    KVTransferInstrumentor().instrument(tracer_provider=tp, meter_provider=mp)

instrument() and uninstrument() mirror each other step for step:
1. the direct pipeline (the default): the builder gets `DirectSpans` for the package's SDK tracer, the
   MeterProvider's readers get the metric tables (`kvmetrics`; they outlive uninstrument(), as SDK instruments
   do), and the OTLP exporters' `encode_spans` our fixed-shape encoder (`span_encoding`) / the encoder is
   restored. With OTEL_KVTRANSFER_PIPELINE=sdk instead: the package's tracer gets `RecordUnsampledSampler`
   (metrics count what sampling leaves out) and the provider `KVTransferMetricsProcessor` / both are detached;
2. the SDK TracerProvider gets `FlushFirstSpanProcessor` in front (flush and shutdown deliver every recorded
   transfer) / it is detached;
3. the recorder's thread starts with a fresh `SpanBuilder` / is drained (bounded), stopped and joined, and the
   spans the builder still holds open are ended as evicted and counted;
4. every registered engine module and framework package patches what is importable / undoes every patch.
When instrument() runs before any SDK TracerProvider exists (a plugin loaded early), steps 1-2 happen on the
recorder's thread as soon as one is set. When a helper process builds (`builder_choice`: OTEL_KVTRANSFER_BUILDER,
`auto` by default), steps 1-3's builder and metrics live there (`offload`, `helper_process`): this process's
recorder hands it the records, and its TracerProvider gets `HelperFlushProcessor` only; uninstrument() closes the
helper.

Backends are a registry: a new transfer engine is one module in `engines/` and a line in ENGINES, a new serving
framework one package in `frameworks/` and a line in FRAMEWORKS.
"""

import functools
import importlib
import logging
import multiprocessing
import multiprocessing.util
import os
from typing import Callable, Collection

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_kvtransfer import builder_choice, config, inflight, offload, semconv, span_encoding, stuck
from otel_kvtransfer.builder import SpanBuilder
from otel_kvtransfer.direct_spans import DirectSpans
from otel_kvtransfer.kvmetrics import RecordMetrics, tables_for
from otel_kvtransfer.sdk_spans import SdkSpans
from otel_kvtransfer.package import _instruments
from otel_kvtransfer.processor import KVTransferMetricsProcessor
from otel_kvtransfer.recorder import RECORDER, FlushFirstSpanProcessor
from otel_kvtransfer.sampler import RecordUnsampledSampler
from otel_kvtransfer.version import __version__

_logger = logging.getLogger(__name__)

# The registry. Each engine module exposes BACKEND, instrument() -> bool, uninstrument(), peer_attributes(peer);
# each framework package FRAMEWORK, instrument() -> bool, uninstrument().
ENGINES = ("otel_kvtransfer.engines.mooncake", "otel_kvtransfer.engines.nixl")
FRAMEWORKS = ("otel_kvtransfer.frameworks.sglang", "otel_kvtransfer.frameworks.vllm")


def _load(names):
    loaded = []
    for name in names:
        try:
            loaded.append(importlib.import_module(name))
        except Exception:  # pylint: disable=broad-except
            _logger.warning("otel_kvtransfer: could not load %s", name, exc_info=True)
    return loaded


class _Attachment:
    """What instrument() attached to an SDK (sampler, processors), so uninstrument() can detach exactly that."""

    def __init__(self, meter_provider, pipeline: str = "direct", max_peers: int = 64):
        self._meter_provider = meter_provider
        self._pipeline = pipeline
        self._max_peers = max_peers
        self.tracer = None
        self._provider = None
        self._original_sampler = None
        self._processors = ()
        self._direct = False
        self._tables = None  # the direct path's metric tables (KVMetrics), once attached
        self.spans = None  # what the builder builds with: DirectSpans or SdkSpans
        self.metrics = None  # the direct path's RecordMetrics (None: a processor derives them)

    def attach(self, tracer, provider, flush_first: bool = True) -> None:
        """`flush_first`: drain this process's recorder when the provider flushes (not in the builder process,
        whose records arrive on a pipe)."""
        self.tracer = tracer
        if not hasattr(provider, "add_span_processor"):
            _logger.warning("otel_kvtransfer: the tracer provider is not the OpenTelemetry SDK's; spans are built "
                            "but no metrics are derived from them")
            self.spans = SdkSpans(tracer)
            return
        self._provider = provider
        if self._pipeline == "direct" and _is_sdk_tracer(tracer):
            self.spans = DirectSpans(tracer)
            self._direct = True
            self.attach_metrics()
            span_encoding.accelerate()
            ours = ()
        else:
            if hasattr(tracer, "sampler") and not isinstance(tracer.sampler, RecordUnsampledSampler):
                self._original_sampler = tracer.sampler
                tracer.sampler = RecordUnsampledSampler(tracer.sampler)
            self.spans = SdkSpans(tracer)
            ours = (KVTransferMetricsProcessor(self._meter_provider, self._max_peers),)
        if not flush_first:
            self._processors = ours
            for processor in ours:
                provider.add_span_processor(processor)
            return
        flush_first = FlushFirstSpanProcessor(RECORDER)
        self._processors = (flush_first,) + ours
        for processor in self._processors:
            provider.add_span_processor(processor)
        # The SDK offers no "insert first" and no "remove": reorder its tuple so draining precedes exporting
        # (tests/test_sdk_canary.py checks these private attributes on every SDK release we allow).
        self._replace_processors(lambda current: (flush_first,) + tuple(p for p in current if p is not flush_first))

    def attach_flush_only(self, provider, processor) -> None:
        """The builder-process mode: this provider only needs its flush and shutdown to reach the helper."""
        if hasattr(provider, "add_span_processor"):
            self._provider = provider
            self._processors = (processor,)
            provider.add_span_processor(processor)

    def attach_metrics(self) -> bool:
        """The direct path's metric tables onto the MeterProvider's readers; False while there is no SDK
        MeterProvider yet (retried on every tick)."""
        if not self._direct or self._tables is not None:
            return True
        self._tables = tables_for(self._meter_provider or metrics.get_meter_provider())
        if self._tables is not None:
            self.metrics = RecordMetrics(self._tables, self._max_peers)
            return True
        return False

    def tick(self) -> bool:
        """True when the metric tables just got attached (the builder should take the new metrics)."""
        return self._direct and self._tables is None and self.attach_metrics()

    def detach(self) -> None:
        if self._direct:
            span_encoding.restore()
        self._direct, self._tables, self.metrics = False, None, None
        if self._processors and self._provider is not None:
            ours = self._processors
            self._replace_processors(lambda current: tuple(p for p in current if p not in ours))
            for processor in ours:
                if isinstance(processor, KVTransferMetricsProcessor):
                    processor.enabled = False
        if self._original_sampler is not None and self.tracer is not None:
            self.tracer.sampler = self._original_sampler
        self._processors, self._provider, self._original_sampler, self.tracer = (), None, None, None

    def _replace_processors(self, change) -> None:
        multi = self._provider._active_span_processor  # pylint: disable=protected-access
        with multi._lock:  # pylint: disable=protected-access
            multi._span_processors = change(multi._span_processors)  # pylint: disable=protected-access


class _LateAttach:
    """The recorder's tick while instrument() ran before any SDK TracerProvider was set globally: each tick looks
    for the real provider and, once there, attaches exactly as instrument() does with a provider at hand."""

    def __init__(self, builder, attachment, done=False):
        self._builder = builder
        self._attachment = attachment
        self._done = done

    def __call__(self):
        if not self._done:
            provider = trace.get_tracer_provider()
            if not isinstance(provider, trace.ProxyTracerProvider):
                tracer = provider.get_tracer(semconv.INSTRUMENTATION_NAME, __version__)
                self._attachment.attach(tracer, provider)
                self._builder.set_spans(self._attachment.spans, self._attachment.metrics)
                self._done = True
        elif self._attachment.tick():
            self._builder.set_spans(self._attachment.spans, self._attachment.metrics)
        self._builder.evict_stale()


class KVTransferInstrumentor(BaseInstrumentor):
    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs):
        self._backends, self._finalizer, self._link = (), None, None
        self._attachment, self._end_open = _Attachment(None), lambda: None
        if os.environ.get(offload.HELPER_ENV):
            return  # this is the builder process itself: it builds, it has nothing to patch
        tracer_provider = kwargs.get("tracer_provider") or trace.get_tracer_provider()
        meter_provider = kwargs.get("meter_provider") or metrics.get_meter_provider()
        settings = config.load()
        engines, frameworks = _load(ENGINES), _load(FRAMEWORKS)
        if builder_choice.choose(settings, tracer_provider, meter_provider,
                                 provider_given=kwargs.get("tracer_provider") is not None) == "process":
            # The helper starts with the first records (none, no helper); drops no helper can carry are counted
            # in instrument()'s own MeterProvider.
            self._link = offload.HelperLink(count_dropped=drop_counter(meter_provider))
        if self._link is not None:
            self._instrument_offloaded(settings, tracer_provider, engines, frameworks, meter_provider)
            return

        # 1-2. Sampler and processors (now, or once an SDK appears).
        tracer = trace.get_tracer(semconv.INSTRUMENTATION_NAME, __version__, tracer_provider)
        self._attachment = _Attachment(kwargs.get("meter_provider"), settings.pipeline, settings.max_peers)
        waiting_for_sdk = isinstance(tracer_provider, trace.ProxyTracerProvider)
        if not waiting_for_sdk:
            self._attachment.attach(tracer, tracer_provider)
        else:
            self._attachment.spans = SdkSpans(tracer)  # the proxy's no-op spans until an SDK appears

        # 3. The recorder's thread and a fresh builder.
        count_dropped = drop_counter(meter_provider)
        builder = new_builder(self._attachment, settings, engines, on_drop=RECORDER.drop,
                              meter_provider=kwargs.get("meter_provider"))
        tick = _LateAttach(builder, self._attachment, done=not waiting_for_sdk)
        RECORDER.watcher = inflight.Watcher(settings.stuck_s)
        RECORDER.start(settings, handle=builder.handle, tick=tick, on_drops=count_dropped, on_fork=builder.reset)
        self._end_open = lambda: builder.end_all(count_dropped)

        self._patch_and_finalize(engines + frameworks, tracer_provider, meter_provider)

    def _instrument_offloaded(self, settings, tracer_provider, engines, frameworks, meter_provider):
        """OTEL_KVTRANSFER_BUILDER=process: records go to the helper; this process builds nothing."""
        link = self._link
        # Close the link after the recorder's exit drain: registered first, so atexit runs it after.
        offload.register_exit(link)
        self._attachment.attach_flush_only(tracer_provider, offload.HelperFlushProcessor(RECORDER, link))
        RECORDER.watcher = inflight.Watcher(settings.stuck_s)
        RECORDER.start(settings, handle=None, handle_batch=link.send_batch, tick=link.tick,
                       on_drops=link.add_drops, on_fork=link.after_fork_in_child)
        self._end_open = link.end_open
        self._patch_and_finalize(engines + frameworks, tracer_provider, meter_provider)

    def _patch_and_finalize(self, backends, tracer_provider, meter_provider):
        # 4. Engines, then frameworks (which build on them).
        self._backends = backends
        for backend in self._backends:
            try:
                backend.instrument()
            except Exception:  # pylint: disable=broad-except
                _logger.warning("otel_kvtransfer could not instrument %s", backend.__name__, exc_info=True)

        # A multiprocessing child ends with os._exit and skips atexit: flush what it recorded on its way out. A
        # child forked from this process inherits the instrumentation without running this: the recorder's
        # after-fork hook calls child_exit there, with the providers given here.
        RECORDER.child_exit = functools.partial(_flush_providers, tracer_provider, meter_provider, self._link)
        if multiprocessing.parent_process() is not None:
            self._finalizer = multiprocessing.util.Finalize(
                None, _flush_providers, args=(tracer_provider, meter_provider, self._link), exitpriority=100)

    def _uninstrument(self, **kwargs):
        RECORDER.child_exit = None
        if self._finalizer is not None:
            self._finalizer.cancel()
        # 4.
        for backend in reversed(self._backends):
            try:
                backend.uninstrument()
            except Exception:  # pylint: disable=broad-except
                _logger.warning("otel_kvtransfer could not uninstrument %s", backend.__name__, exc_info=True)
        # 3.
        RECORDER.stop()
        RECORDER.watcher = None
        try:  # what is still open would never end: end it as evicted, counted (before the processors go)
            self._end_open()
        except Exception:  # pylint: disable=broad-except
            _logger.warning("otel_kvtransfer could not end the open spans", exc_info=True)
        if self._link is not None:
            offload.unregister_exit(self._link)
            self._link.close()
            self._link = None
        # 1-2.
        self._attachment.detach()


def drop_counter(meter_provider) -> Callable[[str, int], None]:
    """`count(reason, n)`: adds to kv_transfer.instrumentation.dropped (here, and in the builder process)."""
    counter = metrics.get_meter(semconv.INSTRUMENTATION_NAME, __version__, meter_provider).create_counter(
        semconv.METRIC_DROPPED, unit="{record}", description=semconv.DROPPED_DESCRIPTION)
    return lambda reason, n: counter.add(n, {semconv.DROP_REASON: reason})


def new_builder(attachment: "_Attachment", settings: config.Settings, engines,
                on_drop: Callable[[str, int], None], meter_provider=None) -> SpanBuilder:
    """The span builder as both builders run it: what the attachment builds with, the settings' bounds, each
    engine's peer parser, the stuck watch on the MeterProvider's instruments."""
    return SpanBuilder(attachment.spans, settings.request_ttl_s, settings.max_open_requests,
                       peer_parsers={engine.BACKEND: engine.peer_attributes for engine in engines},
                       on_drop=on_drop, metrics=attachment.metrics,
                       watch=stuck.OpenWatch(stuck.reporter_for(meter_provider), settings.stuck_s))


def _is_sdk_tracer(tracer) -> bool:
    """An SDK tracer that is not switched off: what the direct path reads from it is there."""
    return all(hasattr(tracer, name) for name in ("sampler", "id_generator", "span_processor", "resource",
                                                   "_instrumentation_scope"))


def _flush_providers(tracer_provider, meter_provider, link=None):
    RECORDER.final_drain()
    if link is not None:
        link.close()
    for provider in (tracer_provider, meter_provider):
        flush = getattr(provider, "force_flush", None)
        if flush is not None:
            try:
                flush(timeout_millis=5000)
            except Exception:  # pylint: disable=broad-except
                _logger.debug("otel_kvtransfer: flush at exit failed", exc_info=True)
