"""The builder in this process, as the recorder's thread drives it (a `sink.Sink`), and `assemble`, the one place
it is put together: for the thread builder (instrument()), for the builder process's fallback once no helper can
start (`link.HelperLink`), and in the builder process itself (`helper_process`).

When instrument() ran before any SDK TracerProvider was set globally (a plugin loaded early), each tick looks for
the real provider and, once there, attaches exactly as instrument() does with a provider at hand.
"""

import math
from types import ModuleType
from typing import Callable, Iterable, Optional, Protocol, cast

from opentelemetry import trace
from opentelemetry.metrics import MeterProvider

from otel_kvtransfer import config, semconv
from otel_kvtransfer.building.attachment import Attachment, new_builder
from otel_kvtransfer.building.builder import SpanBuilder
from otel_kvtransfer.building.builder_part import Record, SpanFactory
from otel_kvtransfer.building.sdk_spans import SdkSpans
from otel_kvtransfer.recording.sink import Sink
from otel_kvtransfer.version import __version__


def assemble(settings: config.Settings, engines: Iterable[ModuleType], tracer_provider: trace.TracerProvider,
             meter_provider: Optional[MeterProvider] = None, *,
             on_drop: Callable[[str, int], None], count_drops: Optional[Callable[[str, int], None]] = None,
             builder_process: bool = False) -> "InProcessSink":
    """The span builder on `tracer_provider` (the span path, the metric tables or processor) and `meter_provider`
    (None: the global one, read as it appears), with the settings' bounds and each engine's peer parser.
    `on_drop(reason, n)`: what the builder drops; `count_drops`: where the recorder's drops are counted (None: the
    caller counts them). In the engine process a flush of the provider drains the recorder first, and a provider
    not there yet (no SDK TracerProvider set) is attached to once it is; the builder process reads its records
    from a socket and has its SDK already (`builder_process`)."""
    tracer = trace.get_tracer(semconv.INSTRUMENTATION_NAME, __version__, tracer_provider)
    attachment = Attachment(meter_provider, settings.pipeline, settings.max_peers)
    waiting_for_sdk = not builder_process and isinstance(tracer_provider, trace.ProxyTracerProvider)
    if waiting_for_sdk:
        attachment.spans = SdkSpans(tracer)  # the proxy's no-op spans until an SDK appears
    else:
        attachment.attach(tracer, tracer_provider, flush_first=not builder_process)
    builder = new_builder(attachment, settings, engines, on_drop=on_drop, meter_provider=meter_provider)
    return InProcessSink(builder, attachment, count_drops, waiting_for_sdk)


class _Take(Protocol):
    def __call__(self, rec: Record) -> None: ...


class _EndAtExit(Protocol):
    def __call__(self, deadline: float = math.inf) -> int: ...


class InProcessSink(Sink):
    """`count_drops(reason, n)`: where the recorder's drops are counted (this process's drop counter; none when
    the link counts them). `waiting_for_sdk`: no SDK TracerProvider yet, attach to the first one set."""

    # The sink's steps are the builder's own methods, set on the instance (no call in between, per record).
    take: _Take
    after_fork_in_child: Callable[[], None]
    end_at_exit: _EndAtExit
    release_held: Callable[[], None]
    count_drops: Callable[[str, int], None]  # type: ignore[assignment]  # called positionally, as the recorder does

    def __init__(self, builder: SpanBuilder, attachment: Attachment,
                 count_drops: Optional[Callable[[str, int], None]] = None, waiting_for_sdk: bool = False) -> None:
        self._builder = builder
        self._attachment = attachment
        self._waiting = waiting_for_sdk
        self.take = builder.handle
        if count_drops is not None:
            self.count_drops = count_drops
        self.after_fork_in_child = builder.reset  # the parent's open spans are the parent's to end
        self.end_at_exit = builder.end_at_exit
        self.release_held = builder.release_held

    def export_wait_s(self) -> float:
        return getattr(getattr(self._attachment.spans, "room", None), "waited_s", 0.0)

    def tick(self) -> None:
        if self._waiting:
            provider = trace.get_tracer_provider()
            if not isinstance(provider, trace.ProxyTracerProvider):
                tracer = provider.get_tracer(semconv.INSTRUMENTATION_NAME, __version__)
                self._attachment.attach(tracer, provider)
                self._builder.set_spans(cast(SpanFactory, self._attachment.spans), self._attachment.metrics)
                self._waiting = False
        elif self._attachment.tick():  # the metric tables came late: the builder takes them now
            self._builder.set_spans(cast(SpanFactory, self._attachment.spans), self._attachment.metrics)
        self._builder.evict_stale()

    def end_all(self, on_drop: Callable[[str, int], None]) -> None:
        """uninstrument(): what is still open would never end: ended as evicted, counted."""
        self._builder.end_all(on_drop)

    def detach(self) -> None:
        self._attachment.detach()
