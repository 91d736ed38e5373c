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
`auto` by default), steps 1-3's builder and metrics live there (`offloading/`): this process's
recorder hands it the records, and its TracerProvider gets `HelperFlushProcessor` only; uninstrument() closes the
helper.

Backends are a registry: a new transfer engine is one module in `engines/` and a line in ENGINES, a new serving
framework one package in `frameworks/` and a line in FRAMEWORKS.
"""

import functools
import logging
import multiprocessing
import multiprocessing.util
import os
from typing import Collection

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_kvtransfer import config, registry, semconv
from otel_kvtransfer.building.attachment import Attachment, drop_counter, new_builder, untimed_counter
from otel_kvtransfer.building.in_process import InProcessSink
from otel_kvtransfer.building.sdk_spans import SdkSpans
from otel_kvtransfer.offloading import lifecycle
from otel_kvtransfer.offloading.link import HelperFlushProcessor, HelperLink, register_exit, unregister_exit
from otel_kvtransfer.recording import inflight, untimed
from otel_kvtransfer.recording.recorder import RECORDER
from otel_kvtransfer.version import __version__
from otel_kvtransfer.wiring import builder_choice, startup
from otel_kvtransfer.wiring.package import _instruments

_logger = logging.getLogger(__name__)


class KVTransferInstrumentor(BaseInstrumentor):
    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs):
        self._backends, self._finalizer, self._link = (), None, None
        self._attachment, self._end_open = Attachment(None), lambda: None
        if os.environ.get(lifecycle.HELPER_ENV):
            return  # this is the builder process itself: it builds, it has nothing to patch
        tracer_provider = kwargs.get("tracer_provider") or trace.get_tracer_provider()
        meter_provider = kwargs.get("meter_provider") or metrics.get_meter_provider()
        settings = config.load()
        engines, frameworks = registry.load(registry.ENGINES), registry.load(registry.FRAMEWORKS)
        if builder_choice.choose(settings, tracer_provider, meter_provider,
                                 provider_given=kwargs.get("tracer_provider") is not None) == "process":
            # The helper starts with the first records (none, no helper); drops no helper can carry are counted
            # in instrument()'s own MeterProvider.
            self._link = HelperLink(count_dropped=drop_counter(meter_provider), fallback=builder_choice.
                                    InProcessFallback(settings, tracer_provider, meter_provider, engines))
        if self._link is not None:
            self._instrument_offloaded(settings, tracer_provider, engines, frameworks, meter_provider)
            return

        # 1-2. Sampler and processors (now, or once an SDK appears).
        tracer = trace.get_tracer(semconv.INSTRUMENTATION_NAME, __version__, tracer_provider)
        self._attachment = Attachment(kwargs.get("meter_provider"), settings.pipeline, settings.max_peers)
        waiting_for_sdk = isinstance(tracer_provider, trace.ProxyTracerProvider)
        if not waiting_for_sdk:
            self._attachment.attach(tracer, tracer_provider)
        else:
            self._attachment.spans = SdkSpans(tracer)  # the proxy's no-op spans until an SDK appears

        # 3. The recorder's thread and a fresh builder.
        count_dropped = drop_counter(meter_provider)
        builder = new_builder(self._attachment, settings, engines, on_drop=RECORDER.drop,
                              meter_provider=kwargs.get("meter_provider"))
        sink = InProcessSink(builder, self._attachment, count_dropped, waiting_for_sdk)
        RECORDER.watcher = inflight.Watcher(settings.stuck_s)
        RECORDER.start(settings, sink)
        self._end_open = lambda: sink.end_all(count_dropped)

        self._patch_and_finalize(engines + frameworks, tracer_provider, meter_provider)

    def _instrument_offloaded(self, settings, tracer_provider, engines, frameworks, meter_provider):
        """OTEL_KVTRANSFER_BUILDER=process: records go to the helper; this process builds nothing."""
        link = self._link
        # Close the link after the recorder's exit drain: registered first, so atexit runs it after.
        register_exit(link)
        self._attachment.attach_flush_only(tracer_provider, HelperFlushProcessor(RECORDER, link))
        RECORDER.watcher = inflight.Watcher(settings.stuck_s)
        RECORDER.start(settings, link)
        self._end_open = link.end_open
        self._patch_and_finalize(engines + frameworks, tracer_provider, meter_provider)

    def _patch_and_finalize(self, backends, tracer_provider, meter_provider):
        # 4. Engines, then frameworks (which build on them); an engine call neither timed nor known to move no
        # bytes is counted in this process's MeterProvider.
        untimed.count_with(untimed_counter(meter_provider))
        self._backends = backends
        patched = {}
        for backend in self._backends:
            try:
                patched[backend.__name__] = bool(backend.instrument())
            except Exception:
                _logger.warning("otel_kvtransfer could not instrument %s", backend.__name__, exc_info=True)
        _announce(backends, patched, "process" if self._link is not None else "thread", tracer_provider,
                  meter_provider)

        # A multiprocessing child ends with os._exit and skips atexit: flush what it recorded on its way out. A
        # child forked from this process inherits the instrumentation without running this: the recorder's
        # after-fork hook calls child_exit there, with the providers given here.
        RECORDER.child_exit = functools.partial(_flush_providers, tracer_provider, meter_provider, self._link)
        if multiprocessing.parent_process() is not None:
            self._finalizer = multiprocessing.util.Finalize(
                None, _flush_providers, args=(tracer_provider, meter_provider, self._link), exitpriority=100)

    def _uninstrument(self, **kwargs):
        RECORDER.child_exit = None
        startup.withdraw()
        if self._finalizer is not None:
            self._finalizer.cancel()
        # 4.
        for backend in reversed(self._backends):
            try:
                backend.uninstrument()
            except Exception:
                _logger.warning("otel_kvtransfer could not uninstrument %s", backend.__name__, exc_info=True)
        untimed.count_with(None)
        # 3.
        RECORDER.stop()
        RECORDER.watcher = None
        try:  # what is still open would never end: end it as evicted, counted (before the processors go)
            self._end_open()
        except Exception:
            _logger.warning("otel_kvtransfer could not end the open spans", exc_info=True)
        if self._link is not None:
            unregister_exit(self._link)
            self._link.close()
            self._link = None
        # 1-2.
        self._attachment.detach()


def _announce(backends, patched, builder, tracer_provider, meter_provider) -> None:
    """The start-up line (wiring.startup): now, or once a framework names this process's role and rank."""
    try:
        frameworks, engines = [], []
        for backend in backends:
            on = patched.get(backend.__name__, False)
            if backend.SPEC.version_gate:  # a framework: the release its gate read
                frameworks.append((backend.SPEC.name, backend.HOOKS.installed_version(), on))
            else:
                engines.append((backend, on))
        announcement = startup.Announcement(__version__, frameworks, functools.partial(_engines_found, engines),
                                            builder, tracer_provider, meter_provider)
        announcement.engine_devices = functools.partial(_engine_devices, [backend for backend, _ in engines])
        announcement.untimed = untimed.found
        startup.on_printed(untimed.announced)
        startup.announce(announcement, wait_for_role=any(on for _, _, on in frameworks))
    except Exception:  # the line never stands in the instrumentation's way
        _logger.debug("otel_kvtransfer: no start-up line", exc_info=True)


def _engines_found(engines) -> list:
    """(name, version, on, build) of each engine, read when the line is printed: which build is installed, and
    once the engine is imported, which one it loaded."""
    found = []
    for backend, on in engines:
        build = startup.installed_build(backend.DISTRIBUTIONS, backend.modules())
        version = build[1] if build else None
        found.append((backend.BACKEND, version, on and version is not None, build[0] if build else None))
    return found


def _engine_devices(engines) -> list:
    """(engine, [device, ...]) of the devices each engine was initialised with in this process, when it says."""
    pairs = []
    for backend in engines:
        configured = getattr(backend, "configured_devices", None)
        if configured is not None:
            pairs.append((backend.BACKEND, list(configured())))
    return pairs


def _flush_providers(tracer_provider, meter_provider, link=None):
    RECORDER.final_drain()
    if link is not None:
        link.close()
    for provider in (tracer_provider, meter_provider):
        flush = getattr(provider, "force_flush", None)
        if flush is not None:
            try:
                flush(timeout_millis=5000)
            except Exception:
                _logger.debug("otel_kvtransfer: flush at exit failed", exc_info=True)
