"""The recorder's own paths, with no engine: drain under contention, process exit with a hung exporter,
stop()/join, instrument/uninstrument as exact mirrors, fork.

Transfers are handed over the way engine modules do it (`integration.deliver` with a records.CALL_* tuple).
"""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags
from support.telemetry import Telemetry, dropped_by_reason, in_memory_metrics, metric_points
from support.waiting import wait_until

from otel_kvtransfer import KVTransferInstrumentor, RecordUnsampledSampler, config, semconv
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.recording.recorder import RECORDER
from otel_kvtransfer.version import __version__

THREAD_NAME = "otel-kvtransfer-recorder"
CALL = (1, 2, 8, 1, semconv.OP_WRITE, None, "tcp", 0, None, "test-engine", None)  # records.CALL_* order


def recorder_threads():
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


def dropped(reader):
    RECORDER.drain()
    return dropped_by_reason(reader)


class _Hanging(SpanExporter):
    """export() blocks until released: a collector that accepts the connection and never answers."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()
        self.exported = 0

    def export(self, spans):
        self.entered.set()
        self.release.wait(60)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self.release.set()


# --- drain ----------------------------------------------------------------------------------------------------------

def test_a_drain_blocked_by_a_hung_exporter_gives_up_in_time_and_loses_nothing(monkeypatch):
    monkeypatch.setenv(config.FLUSH_INTERVAL_MS, "60000")  # only explicit drains deliver
    exporter = _Hanging()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider, reader = in_memory_metrics()
    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument(tracer_provider=provider, meter_provider=meter_provider)
    try:
        kvt.deliver(CALL)
        stuck = threading.Thread(target=RECORDER.drain)
        stuck.start()  # this drain hangs in the exporter, holding the builder
        assert exporter.entered.wait(10)
        for _ in range(10):
            kvt.deliver(CALL)
        assert RECORDER.drain(timeout_s=0.05) is False  # the other drain did not let go
        assert provider.force_flush(timeout_millis=50) is False
        assert RECORDER.pending() == 10  # still queued, not lost
        exporter.release.set()
        stuck.join(10)
        assert RECORDER.drain() is True
        assert RECORDER.pending() == 0
        assert exporter.exported == 11
        assert sum(p.count for p in metric_points(reader)[semconv.METRIC_DURATION]) == 11
        assert dropped(reader) == {}
    finally:
        exporter.release.set()
        instrumentor.uninstrument()


def test_the_background_thread_delivers_without_any_flush(monkeypatch):
    monkeypatch.setenv(config.FLUSH_INTERVAL_MS, "5")
    telemetry = Telemetry().instrument()
    try:
        for _ in range(20):
            kvt.deliver(CALL)
        wait_until(lambda: len(telemetry.exporter.get_finished_spans()) >= 20, 30,
                   "20 spans from the recorder's thread", interval_s=0.01)
        assert len(telemetry.exporter.get_finished_spans()) == 20
    finally:
        telemetry.uninstrument()


# --- process exit with a hung exporter -----------------------------------------------------------------------------

_EXIT = r"""
import atexit, json, os, threading
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from otel_kvtransfer import KVTransferInstrumentor, semconv
from otel_kvtransfer import integration as kvt

TRANSFERS, HANG_AT = 5000, 2500
state = {"exports": 0}
hung = threading.Event()
reader = InMemoryMetricReader()

def report():  # registered first, so it runs last: after the package's exit drain and the providers' shutdown
    points = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                points.setdefault(m.name, []).extend(m.data.data_points)
    print(json.dumps({
        "completed_exports": state["exports"] - 1,
        "in_metrics": sum(p.count for p in points.get(semconv.METRIC_DURATION, [])),
        "dropped": {dict(p.attributes)[semconv.DROP_REASON]: p.value
                    for p in points.get(semconv.METRIC_DROPPED, [])},
    }), flush=True)

atexit.register(report)

class Hung(SpanExporter):
    def export(self, spans):
        state["exports"] += 1
        if state["exports"] == HANG_AT:
            hung.set()
            threading.Event().wait()  # a collector that never answers, from here on
        return SpanExportResult.SUCCESS
    def shutdown(self):
        pass

os.environ["OTEL_KVTRANSFER_FLUSH_INTERVAL_MS"] = "10"
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(Hung()))
meter_provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
KVTransferInstrumentor().instrument(tracer_provider=provider, meter_provider=meter_provider)
for _ in range(TRANSFERS):
    kvt.deliver((1, 2, 8, 1, "write", None, "tcp", 0, None, "test-engine", None))
assert hung.wait(120)  # the recorder's thread is stuck inside a batch it took from the queue
"""


def test_at_exit_with_a_hung_exporter_every_transfer_is_delivered_or_counted(tmp_path):
    """Records the builder thread had already taken from the queue were in no span, no metric and no
    drop count (5,000 transfers: 2,499 counted, 2,501 vanished)."""
    script = tmp_path / "exit_hung.py"
    script.write_text(_EXIT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["completed_exports"] == result["in_metrics"] == 2_499
    assert result["dropped"] == {"flush_timeout": 5_000 - 2_499}
    assert result["in_metrics"] + result["dropped"]["flush_timeout"] == 5_000


# --- stop and join; instrument/uninstrument mirror ------------------------------------------------------------------

def test_uninstrument_stops_and_joins_the_recorder_thread():
    assert recorder_threads() == []
    for _ in range(3):
        telemetry = Telemetry().instrument()
        assert len(recorder_threads()) == 1
        kvt.deliver(CALL)
        telemetry.uninstrument()
        assert recorder_threads() == []  # ended and joined, not left evicting in the background
        assert len(telemetry.exporter.get_finished_spans()) == 1  # what was queued was delivered first
        assert not RECORDER.active


def test_the_direct_pipeline_leaves_every_sampler_alone():
    telemetry = Telemetry()
    tracer = telemetry.tracer_provider.get_tracer(semconv.INSTRUMENTATION_NAME, __version__)
    original = tracer.sampler
    telemetry.instrument()
    try:
        assert tracer.sampler is original  # it asks the sampler itself; nothing is wrapped
    finally:
        telemetry.uninstrument()
    assert tracer.sampler is original


def test_uninstrument_restores_the_package_tracers_sampler(monkeypatch):
    monkeypatch.setenv(config.PIPELINE, "sdk")  # the SDK pipeline wraps the package tracer's sampler
    telemetry = Telemetry()
    tracer = telemetry.tracer_provider.get_tracer(semconv.INSTRUMENTATION_NAME, __version__)  # the SDK caches it
    original = tracer.sampler
    telemetry.instrument()
    try:
        assert isinstance(tracer.sampler, RecordUnsampledSampler)
        assert tracer.sampler.delegate is original
    finally:
        telemetry.uninstrument()
    assert tracer.sampler is original
    assert telemetry.tracer_provider.sampler is original  # the provider's own sampler is never touched


def _our_span():
    context = SpanContext(trace_id=1, span_id=2, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return ReadableSpan(name=semconv.SPAN_SEND, context=context, attributes={semconv.BYTES: 8}, start_time=1,
                        end_time=2, instrumentation_scope=InstrumentationScope(semconv.INSTRUMENTATION_NAME, "0"))


def test_after_uninstrument_the_provider_derives_no_metrics_and_flushes_no_recorder(monkeypatch):
    monkeypatch.setenv(config.PIPELINE, "sdk")  # the SDK pipeline's metrics processor, fed spans by hand
    monkeypatch.setenv(config.FLUSH_INTERVAL_MS, "60000")
    telemetry = Telemetry().instrument()
    telemetry.tracer_provider._active_span_processor.on_end(_our_span())
    assert sum(p.count for p in telemetry.metrics()[semconv.METRIC_SIZE]) == 1
    telemetry.uninstrument()
    telemetry.tracer_provider._active_span_processor.on_end(_our_span())
    assert sum(p.count for p in telemetry.metrics()[semconv.METRIC_SIZE]) == 1  # the processor is detached
    exported = len(telemetry.spans())  # the two spans ended by hand above
    kvt.deliver(CALL)  # not recording: nothing queued (it sat in the queue until the next instrument before)
    assert RECORDER.pending() == 0
    assert len(telemetry.spans()) == exported == 2


@pytest.mark.parametrize("pipeline, added", [("direct", 1), ("sdk", 2)])
def test_uninstrument_leaves_exactly_the_span_processors_it_found_private_sdk_attributes(monkeypatch, pipeline,
                                                                                        added):
    """The one test that reads the SDK's private processor tuple (tests/project/test_sdk_canary.py pins it). The direct
    pipeline adds only the flush processor; the SDK pipeline its metrics processor too."""
    monkeypatch.setenv(config.PIPELINE, pipeline)
    telemetry = Telemetry()
    before = telemetry.tracer_provider._active_span_processor._span_processors
    for _ in range(2):
        telemetry.instrument()
        during = telemetry.tracer_provider._active_span_processor._span_processors
        assert len(during) == len(before) + added
        assert type(during[0]).__name__ == "FlushFirstSpanProcessor"  # drains before anything exports
        telemetry.uninstrument()
        after = telemetry.tracer_provider._active_span_processor._span_processors
        assert after == before


# --- fork -------------------------------------------------------------------------------------------------------

def test_a_forked_child_records_with_its_own_thread_and_leaves_the_parents_spans_alone(monkeypatch, tmp_path):
    monkeypatch.setenv(config.FLUSH_INTERVAL_MS, "5")
    telemetry = Telemetry().instrument()
    try:
        kvt.begin_request("parent-open", backend="test-engine")
        for _ in range(5):
            kvt.deliver(CALL)  # queued in the parent: the parent delivers them, never the child
        report = tmp_path / "child.json"
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                kvt.begin_request("child", backend="test-engine")
                kvt.end_request("child")
                deadline = time.monotonic() + 30  # no flush: the child's own thread must deliver
                while time.monotonic() < deadline and not any(
                        s.name == semconv.SPAN_REQUEST for s in telemetry.exporter.get_finished_spans()):
                    time.sleep(0.01)
                report.write_text(json.dumps({
                    "threads": len(recorder_threads()),
                    "spans": [(s.name, s.attributes[semconv.REQUEST_KEY]) if semconv.REQUEST_KEY in s.attributes
                              else (s.name, None) for s in telemetry.exporter.get_finished_spans()]}))
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        child = json.loads(report.read_text())
        assert child["threads"] == 1
        assert [tuple(s) for s in child["spans"] if s[0] == semconv.SPAN_REQUEST] == [(semconv.SPAN_REQUEST, "child")]
        kvt.end_request("parent-open")
        spans = telemetry.spans()
        assert [s.attributes[semconv.REQUEST_KEY] for s in spans if s.name == semconv.SPAN_REQUEST] == ["parent-open"]
        assert len([s for s in spans if s.name == semconv.SPAN_SEND]) == 5
    finally:
        telemetry.uninstrument()


# --- uninstrument with spans still open ---------------------------------------------------------------------------

def test_uninstrument_ends_what_is_still_open_as_evicted_and_counts_it():
    """Requests and peer waits still open at uninstrument used to vanish: no span, no metric, no drop count."""
    telemetry = Telemetry().instrument()
    kvt.begin_request(1, backend="test-engine")
    with kvt.transfer_scope(1, chunk_index=0):
        kvt.deliver(CALL)
    kvt.begin_receive("r", backend="test-engine")
    kvt.begin_serve("s", backend="test-engine")
    telemetry.uninstrument()
    spans = {s.name: s for s in telemetry.exporter.get_finished_spans()}
    assert set(spans) == {semconv.SPAN_REQUEST, semconv.SPAN_SEND, semconv.SPAN_RECEIVE, semconv.SPAN_SERVE}
    for name in (semconv.SPAN_REQUEST, semconv.SPAN_RECEIVE, semconv.SPAN_SERVE):
        assert spans[name].attributes[semconv.EVICTED] is True
        assert spans[name].attributes[semconv.ERROR_TYPE] == semconv.EVICTED_ERROR
    assert spans[semconv.SPAN_REQUEST].attributes[semconv.BYTES] == 8  # its aggregates up to that point
    assert dropped(telemetry.reader) == {"request_evicted": 1, "peer_evicted": 2}
    # The metrics processor saw them before it was detached.
    assert sum(p.count for p in metric_points(telemetry.reader)[semconv.METRIC_REQUEST_SIZE]) == 1
    assert sum(p.count for p in metric_points(telemetry.reader)[semconv.METRIC_RECEIVE_DURATION]) == 2


def test_an_idle_recorder_sleeps_until_the_next_in_flight_scan():
    # While records come in, the thread wakes every flush interval; with none since its last wake, it sleeps
    # until the next scan for hung calls is due (each wake-up costs CPU), never less than the flush interval.
    from otel_kvtransfer.recording.inflight import SCAN_INTERVAL_S, Watcher
    from otel_kvtransfer.recording.recorder import Recorder

    now = [100.0]
    recorder = Recorder(config.Settings(flush_interval_s=0.2))
    assert recorder.next_wait_s(recorded=False) == SCAN_INTERVAL_S  # no watcher yet
    recorder.watcher = Watcher(stuck_s=10, clock=lambda: now[0])
    assert recorder.watcher.due()  # scanned at 100.0: the next scan at 101.0
    now[0] = 100.3
    assert recorder.next_wait_s(recorded=True) == 0.2
    assert recorder.next_wait_s(recorded=False) == pytest.approx(0.7)
    now[0] = 100.95
    assert recorder.next_wait_s(recorded=False) == 0.2  # the scan is nearly due: the flush interval
    slow = Recorder(config.Settings(flush_interval_s=5.0))
    slow.watcher = recorder.watcher
    assert slow.next_wait_s(recorded=False) == 5.0


def test_the_first_record_after_a_quiet_spell_wakes_the_sleeping_recorder():
    from otel_kvtransfer.recording.recorder import Recorder

    recorder = Recorder(config.Settings(flush_interval_s=0.2))
    recorder.record(("a",))
    assert not recorder.wake.is_set()  # while records come in, the thread keeps its own pace
    recorder.idle = True  # as the thread sets it before a sleep past the flush interval
    recorder.record(("b",))
    assert recorder.wake.is_set() and not recorder.idle
    recorder.wake.clear()
    recorder.record(("c",))
    assert not recorder.wake.is_set()  # woken once: the records after it wait for the drain it starts
    assert recorder.pending() == 3
