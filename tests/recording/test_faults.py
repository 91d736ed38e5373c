"""Faults around the instrumentation never reach the engine: real Mooncake engine, TCP on 127.0.0.1.

Complements test_recorder_delivery.py (garbage settings, eviction, fork, uninstrument cycles, failing builder) and
test_mooncake_engine.py (receiver killed mid-transfer, unreachable peers). Here: exporters that raise or hang
(collector down), span processors that raise, garbage in every OTEL_KVTRANSFER_* variable at once, 8 threads
reusing bootstrap rooms, a queue that never drains, async submissions whose completion is never observed,
instrument/uninstrument while transfers are in flight, bad arguments to the integration API, and process exit
with a hung exporter. For each: the engine's return values are unchanged, no exception comes from the
instrumentation, and every transfer is either in the spans/metrics or counted as dropped. docs/faults.md lists
them all.
"""

import socket
import threading
import time

import pytest
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from support.telemetry import dropped_by_reason, in_memory_metrics, metric_points, transfers_in_metrics
from support.waiting import exited, wait_until

from otel_kvtransfer import KVTransferInstrumentor, config, sdk_internals, semconv
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.demo.loopback import digest
from otel_kvtransfer.recording.recorder import RECORDER


class _Setup:
    """A TracerProvider with the given span processors, an in-memory metric reader, instrumented."""

    def __init__(self, *processors):
        self.tracer_provider = TracerProvider(shutdown_on_exit=False)
        for processor in processors:
            self.tracer_provider.add_span_processor(processor)
        self.meter_provider, self.reader = in_memory_metrics(shutdown_on_exit=False)
        self.instrumentor = KVTransferInstrumentor()
        self.instrumentor.instrument(tracer_provider=self.tracer_provider, meter_provider=self.meter_provider)

    def metric_points(self):
        """{metric name: [points]}, after draining the recorder (without flushing the span processors)."""
        RECORDER.drain()
        return metric_points(self.reader)

    def transfers_in_metrics(self) -> int:
        return transfers_in_metrics(self.reader, self.metric_points())

    def dropped(self) -> dict:
        return dropped_by_reason(self.reader, self.metric_points())

    def close(self):
        self.instrumentor.uninstrument()
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


class _RaisingExporter(SpanExporter):
    def __init__(self):
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        raise ConnectionError("collector down")

    def shutdown(self):
        pass


class _HangingExporter(SpanExporter):
    """export() blocks until released, like a collector that accepts the connection and never answers."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.exported = []

    def export(self, spans):
        self.entered.set()
        self.release.wait(60)
        self.exported.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self.release.set()


class _Attempts(SpanExporter):
    """A real exporter whose every export() is seen: how many spans it was given, and what it answered."""

    def __init__(self, exporter):
        self._exporter = exporter
        self._lock = threading.Lock()
        self._tried, self._results = 0, set()

    def export(self, spans):
        try:
            result = self._exporter.export(spans)
        except Exception as exc:
            # An export that raised was tried all the same: the oldest OTLP exporter we allow raises ValueError
            # when its retry wait overshoots its own deadline (it hands requests a negative timeout).
            self._count(spans, type(exc).__name__)
            raise
        self._count(spans, result)
        return result

    def _count(self, spans, result) -> None:
        with self._lock:
            self._tried += len(spans)
            self._results.add(result)

    def spans_tried(self) -> int:
        with self._lock:
            return self._tried

    def results(self) -> set:
        with self._lock:
            return set(self._results)

    def force_flush(self, timeout_millis=30000):
        return self._exporter.force_flush(timeout_millis)

    def shutdown(self):
        self._exporter.shutdown()


class _RaisingProcessor(SpanProcessor):
    """A third-party span processor with a bug: raises in on_start/on_end (for every span, or when `poison`)."""

    def __init__(self, where="end", poison=None):
        self.where, self.poison = where, poison
        self.raised = 0

    def _maybe_raise(self, span):
        if self.poison is None or (span.attributes or {}).get(semconv.BYTES) == self.poison:
            self.raised += 1
            raise RuntimeError("bug in a span processor")

    def on_start(self, span, parent_context=None):
        if self.where == "start":
            self._maybe_raise(span)

    def on_end(self, span):
        if self.where == "end":
            self._maybe_raise(span)


def _write(engine, receiver, nbytes=8, offset=0):
    return engine.engine.transfer_sync_write(
        receiver.session, engine.base + offset, receiver.base_address + offset, nbytes)


BACKEND = "test"  # requests opened through the integration API in these tests


# --- exporters --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("processor_class", [SimpleSpanProcessor, BatchSpanProcessor])
def test_exporter_that_raises_leaves_engine_and_metrics_intact(engine, receiver, processor_class):
    exporter = _RaisingExporter()
    setup = _Setup(processor_class(exporter))
    try:
        for n in range(40):
            assert _write(engine, receiver, 8 + n) == 0
        RECORDER.drain()
        setup.tracer_provider.force_flush()
        assert exporter.calls >= 1  # the exporter was called, raised, and the SDK logged it
        assert setup.transfers_in_metrics() == 40  # metrics come from the spans, not the export
        assert setup.dropped() == {}
    finally:
        setup.close()


class _ReleaseWhenFull(SpanProcessor):
    """Put in front of a batch processor whose exporter hangs: the first span handed on while that processor's
    queue is full releases the exporter and waits for the room it makes, before the batch processor's turn. So a
    span counted as lost to a full queue meets a queue with room: the widest the window between the count and the
    hand-off can be, made certain instead of rare."""

    def __init__(self, exporter, batch):
        self._exporter = exporter
        self._queue, self._size, _ = sdk_internals.batch_queue(batch)  # the queue the builder looks at
        self.released_at = None  # the name of the span whose hand-off released the exporter

    def on_end(self, span):
        if self.released_at is None and len(self._queue) >= self._size:
            self.released_at = span.name
            self._exporter.release.set()
            wait_until(lambda: len(self._queue) < self._size, 10, what="the released exporter making room")


def test_a_span_counted_for_a_full_export_queue_is_not_exported_as_well(engine, receiver, monkeypatch):
    """A span the export queue could not take (its exporter hung past the wait) is counted, and the processor it
    was counted for never gets it, even when the exporter makes room before the hand-off: every transfer is
    exported or counted, never both."""
    from otel_kvtransfer.building import direct_spans

    monkeypatch.setattr(direct_spans._QueueRoom, "WAIT_S", 0.2)  # the hung exporter's wait, shortened
    exporter = _HangingExporter()
    batch = BatchSpanProcessor(exporter, max_queue_size=8, max_export_batch_size=8, schedule_delay_millis=5)
    releaser = _ReleaseWhenFull(exporter, batch)
    setup = _Setup(releaser, batch)
    try:
        assert _write(engine, receiver) == 0
        RECORDER.drain()
        assert exporter.entered.wait(10)  # the exporter is now stuck inside export() with the first span
        assert [_write(engine, receiver) for _ in range(12)] == [0] * 12
        RECORDER.drain()  # 8 fill the queue; the 9th waits, is counted, and meets the room the releaser made
        assert releaser.released_at == semconv.SPAN_SEND
        assert setup.dropped() == {"export_queue_full": 1}
        batch.force_flush()
        sends = [s for s in exporter.exported if s.name == semconv.SPAN_SEND]
        assert len(sends) == 12  # 13 transfers: 12 exported, 1 counted, none both
        assert len({s.context.span_id for s in sends}) == 12
        assert setup.transfers_in_metrics() == 13
    finally:
        exporter.release.set()
        setup.close()


def test_collector_down_with_the_real_otlp_exporter(engine, receiver):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter,
    )

    # A port bound on 127.0.0.1 and never listened on: every connection to it is refused, and no other process
    # can take it meanwhile.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed_port:
        closed_port.bind(("127.0.0.1", 0))
        endpoint = "http://127.0.0.1:%d/v1/traces" % closed_port.getsockname()[1]
        exporter = _Attempts(OTLPSpanExporter(endpoint=endpoint, timeout=1))
        setup = _Setup(BatchSpanProcessor(exporter, schedule_delay_millis=50))
        try:
            for _ in range(100):
                assert _write(engine, receiver) == 0
            RECORDER.drain()  # every span is with the batch processor now
            wait_until(lambda: exporter.spans_tried() >= 100, 60, what="the exporter trying every span")
            # every export failed: refused, or (that oldest exporter) raised past its deadline
            assert exporter.spans_tried() == 100
            assert exporter.results() and exporter.results() <= {SpanExportResult.FAILURE, "ValueError"}
            assert setup.transfers_in_metrics() == 100
            assert setup.dropped() == {}
        finally:
            setup.close()


def test_hung_exporter_behind_batch_processor_never_blocks_the_engine(engine, receiver):
    """While the exporter is stuck, every engine call returns, the builder keeps building, and every transfer is
    accounted for. (Its cost per call is a benchmark figure, bench/pipeline.py, never a pass/fail criterion.)"""
    exporter = _HangingExporter()
    batch = BatchSpanProcessor(exporter, max_queue_size=64, max_export_batch_size=8, schedule_delay_millis=5)
    setup = _Setup(batch)
    try:
        assert _write(engine, receiver) == 0
        RECORDER.drain()
        assert exporter.entered.wait(10)  # the exporter is now stuck inside export()
        assert [_write(engine, receiver) for _ in range(400)] == [0] * 400  # each call returned, unchanged
        assert not exporter.release.is_set() and exporter.exported == []  # ... all while the export was stuck
        drained = threading.Thread(target=RECORDER.drain)
        drained.start()
        drained.join(10)
        assert not drained.is_alive()  # the span builder does not wait on the exporter either
        # The SDK's queue overflowed; metrics still count every transfer, and what the queue could not hold is
        # counted (the builder waited once for room, then counts without waiting while the exporter hangs).
        assert setup.transfers_in_metrics() == 401
        dropped = setup.dropped()
        assert set(dropped) == {"export_queue_full"} and 0 < dropped["export_queue_full"] < 401
        exporter.release.set()
        batch.force_flush()
        assert len(exporter.exported) + dropped["export_queue_full"] == 401  # every span exported or counted
    finally:
        exporter.release.set()
        setup.close()


def test_hung_exporter_on_the_builder_thread_fills_the_queue_and_counts_drops(monkeypatch, engine, receiver):
    # The worst case: a synchronous processor whose exporter hangs stalls the span builder itself. The queue
    # never drains; the engine keeps its speed, the queue stays at its bound, and every record past it is counted.
    capacity = 16
    monkeypatch.setenv(config.QUEUE_SIZE, str(capacity))
    monkeypatch.setenv(config.FLUSH_INTERVAL_MS, "5")
    exporter = _HangingExporter()
    setup = _Setup(SimpleSpanProcessor(exporter))
    try:
        assert _write(engine, receiver) == 0
        assert exporter.entered.wait(10)  # the builder thread is stuck exporting the first span
        for _ in range(2000):
            assert _write(engine, receiver) == 0
            assert RECORDER.pending() <= capacity
        assert RECORDER.pending() == capacity
        exporter.release.set()
        wait_until(lambda: not RECORDER.pending(), 10, "the recorder's queue to empty", interval_s=0.01)
        dropped = setup.dropped()
        assert len(exporter.exported) == 1 + capacity
        assert dropped == {"queue_full": 2000 - capacity}
        assert setup.transfers_in_metrics() + dropped["queue_full"] == 2001
    finally:
        exporter.release.set()
        setup.close()


# --- span processors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["start", "end"])
def test_processor_that_raises_on_every_span_is_counted_not_raised(monkeypatch, engine, receiver, where):
    if where == "start":  # only the SDK pipeline calls on_start: the direct one builds spans after they ended
        monkeypatch.setenv(config.PIPELINE, "sdk")
    monkeypatch.setenv(config.FLUSH_INTERVAL_MS, "60000")
    exporter = InMemorySpanExporter()
    bad = _RaisingProcessor(where)
    setup = _Setup(bad, SimpleSpanProcessor(exporter))
    try:
        for n in range(20):
            assert _write(engine, receiver, 100 + n) == 0
        kvt.begin_request(5, backend=BACKEND)
        kvt.end_request(5)
        RECORDER.drain()
        assert bad.raised >= 1
        # Every record is accounted for: derived into metrics, or counted as lost to the builder error.
        dropped = setup.dropped()
        assert set(dropped) <= {"builder_error"}
        assert setup.transfers_in_metrics() + dropped.get("builder_error", 0) >= 20
        # The engine still works after the faulty processor is gone, with nothing stale left behind.
        setup.close()
        exporter = InMemorySpanExporter()  # the old one was shut down with its provider
        setup = _Setup(SimpleSpanProcessor(exporter))
        assert _write(engine, receiver, 4242) == 0
        RECORDER.drain()
        assert [s.attributes[semconv.BYTES] for s in exporter.get_finished_spans()] == [4242]
    finally:
        setup.close()


def test_one_poisoned_span_loses_only_itself(monkeypatch, engine, receiver):
    monkeypatch.setenv(config.FLUSH_INTERVAL_MS, "60000")
    exporter = InMemorySpanExporter()
    setup = _Setup(SimpleSpanProcessor(exporter), _RaisingProcessor("end", poison=13))
    try:
        for nbytes in range(10, 20):
            assert _write(engine, receiver, nbytes) == 0
        RECORDER.drain()
        assert sorted(s.attributes[semconv.BYTES] for s in exporter.get_finished_spans()) == list(range(10, 20))
        assert setup.dropped().get("builder_error", 0) <= 1
    finally:
        setup.close()


# --- settings -----------------------------------------------------------------------------------------------------

def test_garbage_in_every_setting_at_once_still_records(monkeypatch, engine, receiver):
    for name, garbage in [(config.QUEUE_SIZE, "-1"), (config.FLUSH_INTERVAL_MS, "nan"),
                          (config.REQUEST_TTL_S, "\x01\u00fc"), (config.MAX_PENDING_ASYNC, "9" * 40),
                          (config.HOT_PATH, "native")]:
        monkeypatch.setenv(name, garbage)
    exporter = InMemorySpanExporter()
    setup = _Setup(SimpleSpanProcessor(exporter))
    try:
        assert RECORDER.settings == config.Settings()
        assert _write(engine, receiver, 777) == 0
        RECORDER.drain()
        assert [s.attributes[semconv.BYTES] for s in exporter.get_finished_spans()] == [777]
    finally:
        setup.close()


# --- concurrency and room reuse -------------------------------------------------------------------------------

THREADS, ROUNDS, CHUNKS = 8, 6, 3
ROOMS = [7000 + i for i in range(THREADS)]


def _size_of(thread_index: int) -> int:
    return 1000 + 97 * thread_index  # distinct per thread, so every span says which thread made it


def test_eight_threads_reusing_rooms_attribute_every_span_to_its_request(engine, receiver):
    """Round r: thread t serves room ROOMS[(t + r) % 8], so every room is reused by a different thread each round;
    thread 0's first request fails, and the room's next use must not inherit that failure."""
    exporter = InMemorySpanExporter()
    setup = _Setup(SimpleSpanProcessor(exporter))
    barrier = threading.Barrier(THREADS)
    rcs, errors = [], []

    def worker(t):
        size = _size_of(t)
        try:
            for r in range(ROUNDS):
                room = ROOMS[(t + r) % THREADS]
                kvt.begin_request(room, backend=BACKEND)
                for chunk in range(CHUNKS):
                    offset = (t * CHUNKS + chunk) * 8192
                    with kvt.transfer_scope(room, chunk_index=chunk, payload="kv", is_last_chunk=chunk == CHUNKS - 1):
                        rcs.append(_write(engine, receiver, size, offset))
                kvt.end_request(room, error_type="transfer_failed" if (t, r) == (0, 0) else None)
                barrier.wait(30)  # a room's next use starts only after its previous one concluded
        except Exception as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors
        assert rcs == [0] * THREADS * ROUNDS * CHUNKS
        for t in range(THREADS):
            for chunk in range(CHUNKS):
                offset = (t * CHUNKS + chunk) * 8192
                assert receiver.digest(offset, _size_of(t)) == digest(engine.source[offset:offset + _size_of(t)])
        RECORDER.drain()
        spans = exporter.get_finished_spans()
    finally:
        setup.close()

    requests = sorted((s for s in spans if s.name == semconv.SPAN_REQUEST),
                      key=lambda s: (int(s.attributes[semconv.REQUEST_KEY]), s.start_time))
    sends = [s for s in spans if s.name == semconv.SPAN_SEND]
    assert len(requests) == THREADS * ROUNDS
    assert len(sends) == THREADS * ROUNDS * CHUNKS
    children = {}
    for send in sends:
        children.setdefault(send.parent.span_id, []).append(send)
    for i, request in enumerate(requests):
        room, r = int(request.attributes[semconv.REQUEST_KEY]), i % ROUNDS
        t = (ROOMS.index(room) - r) % THREADS  # the thread that served this room in round r
        kids = children[request.context.span_id]
        assert sorted(k.attributes[semconv.CHUNK_INDEX] for k in kids) == list(range(CHUNKS))
        assert {k.attributes[semconv.BYTES] for k in kids} == {_size_of(t)}
        assert {k.attributes[semconv.REQUEST_KEY] for k in kids} == {str(room)}
        assert request.attributes[semconv.BYTES] == CHUNKS * _size_of(t)
        assert request.attributes[semconv.TRANSFER_COUNT] == CHUNKS
        assert request.attributes[semconv.CHUNK_COUNT] == CHUNKS
        assert all(request.start_time <= k.start_time and k.end_time <= request.end_time for k in kids)
        failed = (t, r) == (0, 0)
        assert (request.status.status_code is StatusCode.ERROR) is failed
        assert (semconv.ERROR_TYPE in request.attributes) is failed


def test_instrument_and_uninstrument_while_threads_transfer(engine, receiver):
    """Instrument and uninstrument while 4 threads write continuously. Besides every call returning 0 and the
    engine being restored, the test checks its own premise: engine calls were in flight across the switches
    (a call started before an instrument()/uninstrument() returned and ended after it began)."""
    from mooncake.engine import TransferEngine

    original = TransferEngine.__dict__["transfer_sync_write"]
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    stop = threading.Event()
    rcs, errors, calls = [], [], []  # calls: (start_ns, end_ns) of every engine call
    switches = []  # (start_ns, end_ns) of every instrument() / uninstrument()

    def worker(t):
        try:
            while not stop.is_set():
                start = time.time_ns()
                rcs.append(_write(engine, receiver, 300 + t, t * 4096))
                calls.append((start, time.time_ns()))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(20):
            instrumentor = KVTransferInstrumentor()
            before = len(rcs)
            start = time.time_ns()
            instrumentor.instrument(tracer_provider=tracer_provider)
            switches.append((start, time.time_ns()))
            wait_until(lambda n=before: len(rcs) >= n + 8, 30, "8 calls while instrumented",
                       interval_s=0.001)  # some calls run while instrumented
            before = len(rcs)
            start = time.time_ns()
            instrumentor.uninstrument()
            switches.append((start, time.time_ns()))
            wait_until(lambda n=before: len(rcs) >= n + 8, 30, "8 calls while not instrumented",
                       interval_s=0.001)  # and some while not
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not errors
    assert rcs and set(rcs) == {0}
    assert TransferEngine.__dict__["transfer_sync_write"] is original
    overlapping = [s for s in switches if any(c0 < s[1] and c1 > s[0] for c0, c1 in calls)]
    assert overlapping  # the switches really happened with calls in flight
    spans = exporter.get_finished_spans()
    assert 0 < len(spans) < len(rcs)  # calls while instrumented were recorded, calls while not were not
    assert {s.attributes[semconv.BYTES] for s in spans} <= {300 + t for t in range(4)}  # each one whole
    assert all(s.attributes[semconv.ENGINE_CALLS] == 1 for s in spans)
    tracer_provider.shutdown()


# --- bounded memory -------------------------------------------------------------------------------------------

def _complete_all(engine, ids):
    """Observe every completion (the counted ones included); each must be 'done' (1)."""
    deadline = time.monotonic() + 30
    for batch_id in ids:
        status = 0
        while status == 0 and time.monotonic() < deadline:
            status = engine.engine.transfer_check_status(batch_id)
        assert status == 1


def test_async_submissions_never_observed_are_bounded_and_counted(monkeypatch, engine, receiver):
    monkeypatch.setenv(config.MAX_PENDING_ASYNC, "4")
    exporter = InMemorySpanExporter()
    setup = _Setup(SimpleSpanProcessor(exporter))
    try:
        ids = [engine.engine.transfer_submit_write(
            receiver.session, engine.base + i * 4096, receiver.base_address + i * 4096, 4096) for i in range(10)]
        assert all(i > 0 for i in ids)
        assert setup.dropped() == {"async_pending_full": 6}  # 4 kept pending, the rest counted at once
        _complete_all(engine, ids)
        RECORDER.drain()
        assert [s.attributes[semconv.BYTES] for s in exporter.get_finished_spans()] == [4096] * 4
        setup.instrumentor.uninstrument()
        # Nothing was left pending: uninstrument counted no async_uninstrumented.
        assert setup.dropped() == {"async_pending_full": 6}
    finally:
        setup.close()


def test_uninstrument_with_async_submissions_in_flight_counts_them(engine, receiver):
    exporter = InMemorySpanExporter()
    setup = _Setup(SimpleSpanProcessor(exporter))
    ids = []
    try:
        ids = [engine.engine.transfer_submit_write(
            receiver.session, engine.base + i * 4096, receiver.base_address + i * 4096, 4096) for i in range(3)]
        assert all(i > 0 for i in ids)
        setup.instrumentor.uninstrument()
        assert not exporter.get_finished_spans()
        assert setup.dropped() == {"async_uninstrumented": 3}
    finally:
        deadline = time.monotonic() + 30
        for batch_id in ids:  # let the engine finish and free the batches
            while engine.engine.transfer_check_status(batch_id) == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
        setup.close()


def test_ten_thousand_rooms_that_never_conclude_are_all_evicted_and_counted(monkeypatch):
    """No engine. The count bound (max_open 1,000) ends the oldest as evicted while they open; the TTL ends the
    rest. The TTL test on a controlled clock is tests/building/test_builder.py's; here the real recorder thread does
    it."""
    monkeypatch.setenv(config.MAX_OPEN_REQUESTS, "1000")
    monkeypatch.setenv(config.REQUEST_TTL_S, "0.2")
    monkeypatch.setenv(config.FLUSH_INTERVAL_MS, "20")
    exporter = InMemorySpanExporter()
    setup = _Setup(SimpleSpanProcessor(exporter))
    try:
        for room in range(10_000):
            kvt.begin_request(room, backend=BACKEND)
        wait_until(lambda: len(exporter.get_finished_spans()) == 10_000, 120, "10,000 evicted request spans",
                   interval_s=0.001)
        spans = exporter.get_finished_spans()
        assert sorted(int(s.attributes[semconv.REQUEST_KEY]) for s in spans) == list(range(10_000))
        assert all(s.attributes[semconv.EVICTED] is True for s in spans)
        assert all(s.status.status_code is StatusCode.ERROR for s in spans)
        dropped = setup.dropped()
        # Which bound ends which request depends on how fast the builder runs; together they count each once.
        assert set(dropped) <= {"request_limit", "request_evicted"}
        assert sum(dropped.values()) == 10_000
        assert dropped.get("request_limit", 0) <= 9_000
    finally:
        setup.close()


# --- the integration API ----------------------------------------------------------------------------------------

def test_integration_api_never_raises_on_a_bad_room(engine, receiver):
    exporter = InMemorySpanExporter()
    setup = _Setup(SimpleSpanProcessor(exporter))
    try:
        for bad in (None, 1.5, object()):
            kvt.begin_request(bad, backend=BACKEND)
            kvt.record_compute([bad], 1, 2)
            kvt.end_request(bad)
            kvt.begin_receive(bad, backend=BACKEND)
            kvt.end_receive(bad)
            with kvt.transfer_scope(bad, chunk_index=0, payload="kv"):
                assert _write(engine, receiver, 55) == 0  # still recorded, as a raw engine call
        RECORDER.drain()
        assert [s.attributes[semconv.BYTES] for s in exporter.get_finished_spans()] == [55] * 3
        assert setup.dropped() == {"api_error": 18}
    finally:
        setup.close()


# --- process exit -----------------------------------------------------------------------------------------------

_EXIT_WITH_HUNG_EXPORTER = r"""
import threading, time
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from otel_kvtransfer import KVTransferInstrumentor, config
from otel_kvtransfer import integration as kvt

entered = threading.Event()

class Hung(SpanExporter):
    def export(self, spans):
        entered.set()
        threading.Event().wait()  # a collector that never answers
    def shutdown(self):
        pass

provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(Hung()))
KVTransferInstrumentor().instrument(tracer_provider=provider)
kvt.begin_request(1, backend="test")
kvt.end_request(1)
assert entered.wait(10)  # the recorder's thread is now stuck in export()
kvt.begin_request(2, backend="test")     # ... and this record waits in the queue
print("exiting", flush=True)
"""


def test_a_hung_synchronous_exporter_does_not_stop_the_engine_process_from_exiting(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "hung_exit.py"
    script.write_text(_EXIT_WITH_HUNG_EXPORTER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    # The exit drain waits at most 5 s; 60 s only tells a slow machine from a process that never exits.
    out, _ = exited(proc, 60, "the process did not exit after its main thread ended", tail=500)
    assert b"exiting" in out
    assert proc.returncode == 0
