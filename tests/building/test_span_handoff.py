"""Our spans reach the provider's span processors exactly as the SDK's own delivery would bring them, now that a
BatchSpanProcessor of the SDK's gets them straight into its queue: real Mooncake writes on 127.0.0.1, the builder
in this process, the SDK's processors with in-memory exporters.

What each test guards: the worker is woken once a batch waits (else the spans sit until the schedule); every
processor gets every span, in the provider's order; a processor somebody wrapped, a shut-down one and one in a
forked child get each span through their own `on_end`, as the SDK would hand it.
"""

import os

import wrapt
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.waiting import wait_until

from otel_kvtransfer import KVTransferInstrumentor, sdk_internals, semconv
from otel_kvtransfer.recording.recorder import RECORDER

SCHEDULE_MS = 600_000  # the batch processors' own schedule: never reached within a test


class _Instrumented:
    """A TracerProvider with the given span processors, instrumented (the builder in this process)."""

    def __init__(self, *processors):
        self.provider = TracerProvider(shutdown_on_exit=False)
        for processor in processors:
            self.provider.add_span_processor(processor)
        self.instrumentor = KVTransferInstrumentor()
        self.instrumentor.instrument(tracer_provider=self.provider)

    def close(self):
        self.instrumentor.uninstrument()
        self.provider.shutdown()


def _writes(engine, receiver, n: int) -> None:
    for i in range(n):
        assert engine.engine.transfer_sync_write(receiver.session, engine.base + 8 * i,
                                                 receiver.base_address + 8 * i, 8) == 0
    RECORDER.drain()


def _sends(exporter) -> list:
    return [span for span in exporter.get_finished_spans() if span.name == semconv.SPAN_SEND]


def test_a_full_batch_wakes_the_export_worker(engine, receiver):
    """Two batches of spans are exported at once, not at the processor's (ten-minute) schedule: the hand-off
    wakes the worker as the SDK's own does once a batch waits."""
    exporter = InMemorySpanExporter()
    setup = _Instrumented(BatchSpanProcessor(exporter, max_export_batch_size=8, schedule_delay_millis=SCHEDULE_MS))
    try:
        _writes(engine, receiver, 16)
        wait_until(lambda: len(_sends(exporter)) == 16, 30, what="two batches exported without a flush")
        sizes = [s.attributes[semconv.BYTES] for s in _sends(exporter)]
        assert sizes == [8] * 16
    finally:
        setup.close()


class _Order(SpanProcessor):
    """Notes, for each send span, how many spans the batch processor after it held when this one got it."""

    def __init__(self, batch):
        self._queue = sdk_internals.batch_queue(batch)[0]
        self.seen = []

    def on_end(self, span):
        if span.name == semconv.SPAN_SEND:
            self.seen.append((span.context.span_id, len(self._queue)))


def test_every_processor_gets_every_span_in_the_providers_order(engine, receiver):
    """A processor in front of the batch processor and one behind it get the same spans, in the order built; the
    one in front sees each before the batch processor has it, the one behind after."""
    batch_exporter, simple_exporter = InMemorySpanExporter(), InMemorySpanExporter()
    batch = BatchSpanProcessor(batch_exporter, max_export_batch_size=512, schedule_delay_millis=SCHEDULE_MS)
    front = _Order(batch)
    setup = _Instrumented(front, batch, SimpleSpanProcessor(simple_exporter))
    try:
        _writes(engine, receiver, 20)
        behind = [s.context.span_id for s in _sends(simple_exporter)]
        assert len(behind) == 20
        assert [span_id for span_id, _ in front.seen] == behind
        queued = [held for _, held in front.seen]
        assert [b - a for a, b in zip(queued, queued[1:])] == [1] * 19  # the batch processor got each in between
        batch.force_flush()
        assert [s.context.span_id for s in _sends(batch_exporter)] == behind
    finally:
        setup.close()


def test_a_wrapped_batch_processor_gets_every_span_through_its_on_end(engine, receiver):
    """Another instrumentation wrapping BatchSpanProcessor.on_end (as wrapt does) sees each of our spans."""
    seen = []

    def observe(wrapped, instance, args, kwargs):
        seen.append(args[0].name)
        return wrapped(*args, **kwargs)

    original = BatchSpanProcessor.on_end
    wrapt.wrap_function_wrapper(BatchSpanProcessor, "on_end", observe)
    exporter = InMemorySpanExporter()
    try:
        setup = _Instrumented(BatchSpanProcessor(exporter, schedule_delay_millis=SCHEDULE_MS))
        try:
            _writes(engine, receiver, 10)
            assert seen.count(semconv.SPAN_SEND) == 10
        finally:
            setup.close()
    finally:
        BatchSpanProcessor.on_end = original
    assert len(_sends(exporter)) == 10


def test_a_shut_down_batch_processor_queues_nothing(engine, receiver):
    """Spans built after the batch processor shut down are judged by the SDK (it queues none), not left in a queue
    no worker empties."""
    exporter = InMemorySpanExporter()
    batch = BatchSpanProcessor(exporter, schedule_delay_millis=SCHEDULE_MS)
    setup = _Instrumented(batch)
    try:
        _writes(engine, receiver, 3)
        batch.shutdown()
        assert len(_sends(exporter)) == 3
        _writes(engine, receiver, 5)
        assert len(sdk_internals.batch_queue(batch)[0]) == 0
        assert len(_sends(exporter)) == 3
    finally:
        setup.close()


def test_a_forked_child_hands_its_spans_to_its_own_batch_worker():
    """After a fork, the SDK gives the child's batch processor a new worker and wake-up; a hand-off settled in the
    parent leaves the child's spans to the processor's own on_end, which wakes that new worker (a real fork;
    spans made by the SDK tracer, handed as the builder hands its own)."""
    from otel_kvtransfer.building import span_handoff

    exporter = InMemorySpanExporter()
    batch = BatchSpanProcessor(exporter, max_export_batch_size=4, schedule_delay_millis=SCHEDULE_MS)
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(batch)
    multi = provider.get_tracer("fork-test").span_processor  # the provider's multi processor, as the builder holds it
    hand = span_handoff.plan(multi, sdk_internals.processors_of(multi))
    spans = []
    for i in range(4):
        span = provider.get_tracer("fork-test").start_span(f"s{i}")
        span.end()
        spans.append(span)
    batch.force_flush()
    exporter.clear()
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: hand four spans, wait a bounded time for its own worker to export them
        try:
            os.close(reader)
            for span in spans:
                hand(span)
            wait_until(lambda: len(exporter.get_finished_spans()) == 4, 20, what="the child's worker exporting")
            os.write(writer, b"%d" % len(exporter.get_finished_spans()))
        finally:
            os._exit(0)
    os.close(writer)
    try:
        assert os.read(reader, 16) == b"4"
    finally:
        os.close(reader)
        os.waitpid(pid, 0)
        provider.shutdown()
