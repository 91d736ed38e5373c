"""What the builder builds with, attached to an SDK: the span path (direct or through the SDK tracer), the metric
tables or processor, and the span builder made on them (`new_builder`). `in_process.assemble` puts them
together, the one way for the engine process (instrument()) and the builder process (helper_process).
"""

import logging
from types import ModuleType
from typing import Callable, Iterable, Optional, Tuple, TypeGuard, cast

from opentelemetry import metrics, trace
from opentelemetry.metrics import MeterProvider
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.sampling import Sampler

from otel_kvtransfer import config, sdk_internals, semconv
from otel_kvtransfer.building import span_encoding, stuck
from otel_kvtransfer.building.builder import SpanBuilder
from otel_kvtransfer.building.builder_part import SpanFactory
from otel_kvtransfer.building.direct_spans import DirectSpans
from otel_kvtransfer.building.kvmetrics import KVMetrics, tables_for
from otel_kvtransfer.building.processor import KVTransferMetricsProcessor
from otel_kvtransfer.building.record_metrics import RecordMetrics
from otel_kvtransfer.building.sampler import RecordUnsampledSampler
from otel_kvtransfer.building.sdk_spans import SdkSpans
from otel_kvtransfer.recording.recorder import RECORDER, FlushFirstSpanProcessor
from otel_kvtransfer.version import __version__

_logger = logging.getLogger(__name__)


class Attachment:
    """What instrument() attached to an SDK (sampler, processors), so uninstrument() can detach exactly that."""

    def __init__(self, meter_provider: Optional[MeterProvider], pipeline: str = "direct",
                 max_peers: int = 64) -> None:
        self._meter_provider = meter_provider
        self._pipeline = pipeline
        self._max_peers = max_peers
        self.tracer: Optional[trace.Tracer] = None
        self._provider: Optional[trace.TracerProvider] = None
        self._original_sampler: Optional[Sampler] = None
        self._processors: Tuple[SpanProcessor, ...] = ()
        self._direct = False
        self._accelerated = False  # the OTLP exporters' encoder wrapped (span_encoding)
        self._tables: Optional[KVMetrics] = None  # the direct path's metric tables, once attached
        self.spans: Optional[SpanFactory] = None  # what the builder builds with: DirectSpans or SdkSpans
        self.metrics: Optional[RecordMetrics] = None  # the direct path's (None: a processor derives them)

    def attach(self, tracer: trace.Tracer, provider: trace.TracerProvider, flush_first: bool = True) -> None:
        """`flush_first`: drain this process's recorder when the provider flushes (not in the builder process,
        whose records arrive on a pipe)."""
        self.tracer = tracer
        if not hasattr(provider, "add_span_processor"):
            _logger.warning("otel_kvtransfer: the tracer provider is not the OpenTelemetry SDK's; spans are built "
                            "but no metrics are derived from them")
            self.spans = SdkSpans(tracer)
            return
        self._provider = provider
        if self._pipeline == "direct" and is_sdk_tracer(tracer):
            self.spans = DirectSpans(tracer)
            self._direct = True
            self.attach_metrics()
            ours: Tuple[SpanProcessor, ...] = ()
        else:
            if hasattr(tracer, "sampler") and not isinstance(tracer.sampler, RecordUnsampledSampler):
                self._original_sampler = tracer.sampler
                tracer.sampler = RecordUnsampledSampler(tracer.sampler)
            self.spans = SdkSpans(tracer)
            ours = (KVTransferMetricsProcessor(self._meter_provider, self._max_peers),)
        # Either pipeline: the OTLP exporters' encoder (ours writes our spans; in both, a span it cannot encode
        # costs itself alone, counted, not its whole batch).
        span_encoding.accelerate(drop_counter(self._meter_provider))
        self._accelerated = True
        if self._direct and flush_first:  # this process's drains bound the wait for room in the export queues
            cast(DirectSpans, self.spans).room.drain_deadline = RECORDER.current_deadline  # (direct: DirectSpans)
        if not flush_first:
            self._processors = ours
            for processor in ours:
                provider.add_span_processor(processor)
            return
        drains = FlushFirstSpanProcessor(RECORDER)
        self._processors = (drains,) + ours
        for processor in self._processors:
            provider.add_span_processor(processor)
        # The SDK offers no "insert first" and no "remove": reorder its tuple so draining precedes exporting
        # (tests/project/test_sdk_canary.py checks these private attributes on every SDK release we allow).
        self._replace_processors(lambda current: (drains,) + tuple(p for p in current if p is not drains))

    def attach_flush_only(self, provider: trace.TracerProvider, processor: SpanProcessor) -> None:
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
        if self._accelerated:
            span_encoding.restore()
            self._accelerated = False
        self._direct, self._tables, self.metrics = False, None, None
        if self._processors and self._provider is not None:
            ours = self._processors
            self._replace_processors(lambda current: tuple(p for p in current if p not in ours))
            for processor in ours:
                if isinstance(processor, KVTransferMetricsProcessor):
                    processor.enabled = False
        if self._original_sampler is not None and self.tracer is not None:
            self.tracer.sampler = self._original_sampler  # type: ignore[attr-defined]  # attach() replaced it
        self._processors, self._provider, self._original_sampler, self.tracer = (), None, None, None

    def _replace_processors(self, change: Callable[[Tuple[SpanProcessor, ...]], Tuple[SpanProcessor, ...]]) -> None:
        sdk_internals.replace_span_processors(self._provider, change)



def drop_counter(meter_provider: Optional[MeterProvider]) -> Callable[[str, int], None]:
    """`count(reason, n)`: adds to kv_transfer.instrumentation.dropped (here, and in the builder process)."""
    counter = metrics.get_meter(semconv.INSTRUMENTATION_NAME, __version__, meter_provider).create_counter(
        semconv.METRIC_DROPPED, unit="{record}", description=semconv.DROPPED_DESCRIPTION)
    return lambda reason, n: counter.add(n, {semconv.DROP_REASON: reason})


def untimed_counter(meter_provider: Optional[MeterProvider]) -> Callable[[str, str], None]:
    """`count(backend, call)`: adds one to kv_transfer.instrumentation.untimed_calls (in the engine process)."""
    counter = metrics.get_meter(semconv.INSTRUMENTATION_NAME, __version__, meter_provider).create_counter(
        semconv.METRIC_UNTIMED_CALLS, unit="{call}", description=semconv.UNTIMED_CALLS_DESCRIPTION)
    return lambda backend, call: counter.add(1, {semconv.BACKEND: backend, semconv.CODE_FUNCTION_NAME: call})


def new_builder(attachment: "Attachment", settings: config.Settings, engines: Iterable[ModuleType],
                on_drop: Callable[[str, int], None], meter_provider: Optional[MeterProvider] = None) -> SpanBuilder:
    """The span builder as both builders run it: what the attachment builds with, the settings' bounds, each
    engine's peer parser, the stuck watch on the MeterProvider's instruments."""
    # (the attachment's spans are set by now: attached, or an SdkSpans until an SDK appears)
    return SpanBuilder(cast(SpanFactory, attachment.spans), settings.request_ttl_s, settings.max_open_requests,
                       peer_parsers={engine.BACKEND: engine.peer_attributes for engine in engines},
                       setup_in_first_call={engine.BACKEND for engine in engines
                                            if getattr(engine, "SETUP_IN_FIRST_CALL", False)},
                       on_drop=on_drop, metrics=attachment.metrics,
                       watch=stuck.OpenWatch(stuck.reporter_for(meter_provider), settings.stuck_s),
                       late_watch_s=settings.late_watch_s)


def is_sdk_tracer(tracer: object) -> TypeGuard[sdk_trace.Tracer]:
    """An SDK tracer that is not switched off: what the direct path reads from it is there."""
    return all(hasattr(tracer, name) for name in sdk_internals.SDK_TRACER_ATTRIBUTES)


