"""The builder in this process, as the recorder's thread drives it (a `recorder.Sink`): the thread builder, and
the builder process's fallback once no helper can start.

When instrument() ran before any SDK TracerProvider was set globally (a plugin loaded early), each tick looks for
the real provider and, once there, attaches exactly as instrument() does with a provider at hand.
"""

from typing import Callable, Optional

from opentelemetry import trace

from otel_kvtransfer import semconv
from otel_kvtransfer.building.attachment import Attachment
from otel_kvtransfer.building.builder import SpanBuilder
from otel_kvtransfer.recording.sink import Sink
from otel_kvtransfer.version import __version__


class InProcessSink(Sink):
    """`count_drops(reason, n)`: where the recorder's drops are counted (this process's drop counter; none when
    the link counts them). `waiting_for_sdk`: no SDK TracerProvider yet, attach to the first one set."""

    def __init__(self, builder: SpanBuilder, attachment: Attachment,
                 count_drops: Optional[Callable[[str, int], None]] = None, waiting_for_sdk: bool = False):
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
                self._builder.set_spans(self._attachment.spans, self._attachment.metrics)
                self._waiting = False
        elif self._attachment.tick():  # the metric tables came late: the builder takes them now
            self._builder.set_spans(self._attachment.spans, self._attachment.metrics)
        self._builder.evict_stale()

    def end_all(self, on_drop: Callable[[str, int], None]) -> None:
        """uninstrument(): what is still open would never end: ended as evicted, counted."""
        self._builder.end_all(on_drop)

    def detach(self) -> None:
        self._attachment.detach()
