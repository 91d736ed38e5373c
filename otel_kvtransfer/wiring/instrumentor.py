"""`KVTransferInstrumentor`: switches the whole package on and off.

    from otel_kvtransfer import KVTransferInstrumentor
    KVTransferInstrumentor().instrument(tracer_provider=tp, meter_provider=mp)

instrument() takes four named steps and uninstrument() their mirrors, in the reverse order:
- `_attach_builder` / `_detach_builder`: where spans are built (`builder_choice`: OTEL_KVTRANSFER_BUILDER, `auto`
  by default). In a helper process (`offloading/`): this process's recorder hands it the records, and its
  TracerProvider gets `HelperFlushProcessor` only. Else in this process, put together by `in_process.assemble`
  (the direct pipeline's `DirectSpans`, metric tables and OTLP encoder, or the SDK pipeline's sampler and
  processor; `FlushFirstSpanProcessor` in front of the provider's processors), attached to the SDK as soon as
  there is one. / What is still open is ended as evicted and counted, the helper closed, what was attached to the
  SDK detached (the metric tables outlive it, as SDK instruments do);
- `_start_recording` / `_stop_recording`: the recorder's thread starts delivering to that builder / is drained
  (bounded), stopped and joined;
- `_patch_backends` / `_unpatch_backends`: every registered engine module and framework package patches what is
  importable, and the start-up line is printed / every patch is undone, the line withdrawn;
- `_flush_at_child_exit` / `_stop_flushing_at_child_exit`: a multiprocessing child flushes on its way out.

Backends are a registry: a new transfer engine is one module in `engines/` and a line in ENGINES, a new serving
framework one package in `frameworks/` and a line in FRAMEWORKS.
"""

import functools
import logging
import multiprocessing
import multiprocessing.util
import os
from types import ModuleType
from typing import Any, Callable, Collection, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union, cast

from opentelemetry import metrics, trace

# (That module's file opens with a `# type: ignore` of its own: the checker sees no name in it, so none of its types.)
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]  # see above

from otel_kvtransfer import config, registry
from otel_kvtransfer.building import in_process
from otel_kvtransfer.building.attachment import Attachment, drop_counter, untimed_counter
from otel_kvtransfer.offloading import lifecycle
from otel_kvtransfer.offloading.link import HelperFlushProcessor, HelperLink, register_exit, unregister_exit
from otel_kvtransfer.recording import inflight, untimed
from otel_kvtransfer.recording.recorder import RECORDER
from otel_kvtransfer.recording.sink import Sink
from otel_kvtransfer.version import __version__
from otel_kvtransfer.wiring import builder_choice, startup
from otel_kvtransfer.wiring.package import _instruments

_logger = logging.getLogger(__name__)


class _Given(NamedTuple):
    """What instrument() works with."""

    tracer_provider: trace.TracerProvider  # the one given, or the global one
    meter_provider: metrics.MeterProvider  # the one given, or the global one
    meter_provider_given: Optional[metrics.MeterProvider]  # None: the builder reads the global one as it appears
    tracer_provider_given: bool
    settings: config.Settings
    engines: List[ModuleType]
    frameworks: List[ModuleType]


class KVTransferInstrumentor(BaseInstrumentor):  # type: ignore[misc]  # its base has no type to the checker
    # Set by instrument(): where spans are built (the builder in this process, or the link to the helper's), what
    # ends what is still open, the backends patched, a child's flush at exit.
    _sink: Optional[Union[in_process.InProcessSink, HelperLink]]
    _link: Optional[HelperLink]
    _end_open: Optional[Callable[[], None]]
    _backends: Sequence[ModuleType]
    _finalizer: Optional[multiprocessing.util.Finalize]
    _flush_only: Attachment

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        self._sink, self._link, self._end_open, self._backends, self._finalizer = None, None, None, (), None
        if os.environ.get(lifecycle.HELPER_ENV):
            return  # this is the builder process itself: it builds, it has nothing to patch
        given = _Given(tracer_provider=kwargs.get("tracer_provider") or trace.get_tracer_provider(),
                       meter_provider=kwargs.get("meter_provider") or metrics.get_meter_provider(),
                       meter_provider_given=kwargs.get("meter_provider"),
                       tracer_provider_given=kwargs.get("tracer_provider") is not None, settings=config.load(),
                       engines=registry.load(registry.ENGINES), frameworks=registry.load(registry.FRAMEWORKS))
        self._attach_builder(given)
        self._start_recording(given)
        self._patch_backends(given)
        self._flush_at_child_exit(given)

    def _uninstrument(self, **kwargs: Any) -> None:
        self._stop_flushing_at_child_exit()
        self._unpatch_backends()
        self._stop_recording()
        self._detach_builder()

    # --- where spans are built ---------------------------------------------------------------------------------
    def _attach_builder(self, given: _Given) -> None:
        settings, tracer_provider = given.settings, given.tracer_provider
        # Drops no builder can count (the recorder's, a helper's that never came) go to this MeterProvider.
        count_dropped = drop_counter(given.meter_provider)
        assemble = functools.partial(in_process.assemble, settings, given.engines, tracer_provider,
                                     given.meter_provider_given, on_drop=RECORDER.drop)
        if builder_choice.choose(settings, tracer_provider, given.meter_provider,
                                 provider_given=given.tracer_provider_given) == "process":
            # The helper starts with the first records (none, no helper); if none can ever start, the link builds
            # here after all, assembled as the thread builder is.
            self._link = self._sink = HelperLink(count_dropped=count_dropped, fallback=assemble)
            register_exit(self._link)  # closed after the recorder's exit drain: registered first, atexit runs it after
            self._flush_only = Attachment(None)
            self._flush_only.attach_flush_only(tracer_provider, HelperFlushProcessor(RECORDER, self._link))
            self._end_open = self._link.end_open
        else:
            self._sink = assemble(count_drops=count_dropped)
            self._end_open = functools.partial(self._sink.end_all, count_dropped)

    def _detach_builder(self) -> None:
        if self._sink is None:
            return
        try:  # what is still open would never end: end it as evicted, counted (before the processors go)
            cast(Callable[[], None], self._end_open)()  # set with the sink
        except Exception:
            _logger.warning("otel_kvtransfer could not end the open spans", exc_info=True)
        if self._link is not None:
            unregister_exit(self._link)
            self._link.close()
            self._flush_only.detach()
        else:
            cast(in_process.InProcessSink, self._sink).detach()  # no link: the builder is in this process
        self._sink, self._link, self._end_open = None, None, None

    # --- the recorder's thread ---------------------------------------------------------------------------------
    def _start_recording(self, given: _Given) -> None:
        RECORDER.watcher = inflight.Watcher(given.settings.stuck_s)
        RECORDER.start(given.settings, cast(Sink, self._sink))  # set by _attach_builder

    def _stop_recording(self) -> None:
        if self._sink is None:
            return
        RECORDER.stop()
        RECORDER.watcher = None

    # --- the backends ------------------------------------------------------------------------------------------
    def _patch_backends(self, given: _Given) -> None:
        # Engines, then frameworks (which build on them); an engine call neither timed nor known to move no bytes
        # is counted in this process's MeterProvider.
        untimed.count_with(untimed_counter(given.meter_provider))
        self._backends = given.engines + given.frameworks
        patched: Dict[str, bool] = {}
        for backend in self._backends:
            try:
                patched[backend.__name__] = bool(backend.instrument())
            except Exception:
                _logger.warning("otel_kvtransfer could not instrument %s", backend.__name__, exc_info=True)
        _announce(self._backends, patched, "process" if self._link is not None else "thread", given.tracer_provider,
                  given.meter_provider)

    def _unpatch_backends(self) -> None:
        startup.withdraw()
        for backend in reversed(self._backends):
            try:
                backend.uninstrument()
            except Exception:
                _logger.warning("otel_kvtransfer could not uninstrument %s", backend.__name__, exc_info=True)
        untimed.count_with(None)
        self._backends = ()

    # --- a child's exit ----------------------------------------------------------------------------------------
    def _flush_at_child_exit(self, given: _Given) -> None:
        # A multiprocessing child ends with os._exit and skips atexit: flush what it recorded on its way out. A
        # child forked from this process inherits the instrumentation without running this: the recorder's
        # after-fork hook calls child_exit there, with the providers given here.
        flush = (given.tracer_provider, given.meter_provider, self._link)
        RECORDER.child_exit = functools.partial(_flush_providers, *flush)
        if multiprocessing.parent_process() is not None:
            self._finalizer = multiprocessing.util.Finalize(None, _flush_providers, args=flush, exitpriority=100)

    def _stop_flushing_at_child_exit(self) -> None:
        RECORDER.child_exit = None
        if self._finalizer is not None:
            self._finalizer.cancel()
            self._finalizer = None


def _announce(backends: Sequence[ModuleType], patched: Dict[str, bool], builder: str,
              tracer_provider: trace.TracerProvider, meter_provider: metrics.MeterProvider) -> None:
    """The start-up line (wiring.startup): now, or once a framework names this process's role and rank."""
    try:
        frameworks: List[Tuple[str, Optional[str], bool]] = []
        engines: List[Tuple[ModuleType, bool]] = []
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


def _engines_found(engines: Sequence[Tuple[ModuleType, bool]]) -> List[Tuple[str, Optional[str], bool, Optional[str]]]:
    """(name, version, on, build) of each engine, read when the line is printed: which build is installed, and
    once the engine is imported, which one it loaded."""
    found = []
    for backend, on in engines:
        build = startup.installed_build(backend.DISTRIBUTIONS, backend.modules())
        version = build[1] if build else None
        found.append((backend.BACKEND, version, on and version is not None, build[0] if build else None))
    return found


def _engine_devices(engines: Sequence[ModuleType]) -> List[Tuple[str, List[str]]]:
    """(engine, [device, ...]) of the devices each engine was initialised with in this process, when it says."""
    pairs = []
    for backend in engines:
        configured = getattr(backend, "configured_devices", None)
        if configured is not None:
            pairs.append((backend.BACKEND, list(configured())))
    return pairs


def _flush_providers(tracer_provider: object, meter_provider: object, link: Optional[HelperLink] = None) -> None:
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
