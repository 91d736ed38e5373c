"""Nothing recorded is lost silently: flush and shutdown deliver it, drops are counted, forks keep working,
rooms that never conclude are evicted and counted, uninstrument restores the engine exactly."""

import os
import time

import pytest
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.trace import StatusCode
from support.telemetry import Telemetry
from support.waiting import wait_until

from otel_kvtransfer import config, semconv
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.recording.recorder import RECORDER
from otel_kvtransfer.recording.records import INFLIGHT, INFLIGHT_AT, INFLIGHT_STUCK


def test_force_flush_delivers_every_recorded_transfer(monkeypatch, engine, receiver):
    monkeypatch.setenv(config.FLUSH_INTERVAL_MS, "60000")  # the background thread will not help
    telemetry = Telemetry().instrument()
    try:
        for _ in range(300):
            assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 8) == 0
        assert RECORDER.pending() > 0
        telemetry.tracer_provider.force_flush()
        assert RECORDER.pending() == 0
        assert len(telemetry.exporter.get_finished_spans()) == 300
    finally:
        telemetry.uninstrument()


def test_shutdown_delivers_every_recorded_transfer(monkeypatch, engine, receiver):
    monkeypatch.setenv(config.FLUSH_INTERVAL_MS, "60000")
    telemetry = Telemetry().instrument()
    try:
        for _ in range(50):
            assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 8) == 0
        telemetry.tracer_provider.shutdown()
        assert len(telemetry.exporter.get_finished_spans()) == 50
    finally:
        telemetry.uninstrument()


def test_full_queue_drops_are_counted(monkeypatch, engine, receiver):
    monkeypatch.setenv(config.QUEUE_SIZE, "10")
    monkeypatch.setenv(config.FLUSH_INTERVAL_MS, "60000")
    telemetry = Telemetry().instrument()
    try:
        for _ in range(25):
            assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 8) == 0
        assert len(telemetry.spans(semconv.SPAN_SEND)) == 10
        assert telemetry.dropped() == {"queue_full": 15}
    finally:
        telemetry.uninstrument()


class _ListSink:
    """A sink that keeps what it is handed; `pause` s per record, `during` run once at the first one (what the
    recorder's thread may do while another thread's drain is handing records over)."""

    batched = False

    def __init__(self):
        self.taken, self.drops, self.pause, self.during = [], {}, 0.0, None

    def take(self, rec):
        self.taken.append(rec)
        during, self.during = self.during, None
        if during is not None:
            during()
        time.sleep(self.pause)

    def tick(self):
        pass

    def count_drops(self, reason, count):
        self.drops[reason] = self.drops.get(reason, 0) + count


class _Scans:
    """A watcher whose every scan finds something in flight (the recorder's slot is what is under test)."""

    def __init__(self):
        self.made = 0

    def due(self):
        return True

    def scan(self):
        from otel_kvtransfer.recording import records

        self.made += 1  # each scan finds one more call stuck, reported in that scan alone (as the watcher does)
        return records.inflight(self.made, 1, self.made, [("stuck", self.made)])


def test_an_in_flight_scan_is_never_a_dropped_record_and_one_at_most_waits():
    """The recorder's scan of what is in flight waits in one slot beside the queue: a full queue never drops it (a
    `queue_full` drop is always a record an engine or a framework made, so spans + drops == calls under overload),
    the next drain hands it over after what was queued, and one a drain's deadline left waits again unless a newer
    scan took its place (what is in flight now supersedes what was, and carries the stuck reports of the scan it
    replaced: each is made once)."""
    from otel_kvtransfer.recording.recorder import Recorder

    recorder, sink, scans = Recorder(config.Settings(queue_size=3)), _ListSink(), _Scans()
    recorder.sink, recorder.watcher = sink, scans
    for name in ("a", "b", "c", "d"):
        recorder.record((name,))
    recorder._watch_inflight()  # the queue is full
    recorder.report_drops()
    assert sink.drops == {"queue_full": 1}  # "d" alone
    assert recorder.drain()
    assert [rec[0] for rec in sink.taken] == ["a", "b", "c", INFLIGHT] and sink.taken[-1][INFLIGHT_AT] == 1
    # A drain its deadline stops after one record: the rest queued again, in order, the scan back in its slot.
    sink.taken.clear()
    recorder.record(("e",))
    recorder.record(("f",))
    recorder._watch_inflight()
    sink.pause = 0.2
    assert not recorder.drain(timeout_s=0.05)
    assert [rec[0] for rec in sink.taken] == ["e"] and list(recorder.queue) == [("f",)]
    assert recorder.snapshot[INFLIGHT_AT] == 2
    # The recorder's thread scans again while another drain is stopped: the newer scan is the one that waits.
    sink.taken.clear()
    recorder.record(("g",))
    sink.during = recorder._watch_inflight
    assert not recorder.drain(timeout_s=0.05)
    assert [rec[0] for rec in sink.taken] == ["f"] and list(recorder.queue) == [("g",)]
    assert recorder.snapshot[INFLIGHT_AT] == 3
    sink.taken.clear()
    sink.pause = 0.0
    assert recorder.drain()
    assert [rec[0] for rec in sink.taken] == ["g", INFLIGHT] and sink.taken[-1][INFLIGHT_AT] == 3
    assert sink.taken[-1][INFLIGHT_STUCK] == [("stuck", 2), ("stuck", 3)]  # the replaced scan's report kept
    assert recorder.snapshot is None and not recorder.queue
    recorder.report_drops()
    assert sink.drops == {"queue_full": 1}


def test_rooms_that_never_conclude_are_evicted_and_counted(monkeypatch):
    monkeypatch.setenv(config.REQUEST_TTL_S, "0.05")
    monkeypatch.setenv(config.FLUSH_INTERVAL_MS, "10")
    telemetry = Telemetry().instrument()
    try:
        kvt.begin_request(91, backend="test")
        kvt.begin_receive(92, backend="test")
        wait_until(lambda: len(telemetry.exporter.get_finished_spans()) >= 2, 10, "both evicted spans",
                   interval_s=0.02)
        spans = {s.name: s for s in telemetry.spans()}
        assert set(spans) == {semconv.SPAN_REQUEST, semconv.SPAN_RECEIVE}
        for span in spans.values():
            assert span.status.status_code is StatusCode.ERROR
            assert span.attributes[semconv.EVICTED] is True
            assert span.attributes[semconv.ERROR_TYPE] == "evicted"
        assert telemetry.dropped() == {"request_evicted": 1, "peer_evicted": 1}
    finally:
        telemetry.uninstrument()


@pytest.mark.parametrize("name", [config.QUEUE_SIZE, config.FLUSH_INTERVAL_MS, config.REQUEST_TTL_S,
                                  config.MAX_OPEN_REQUESTS, config.MAX_PENDING_ASYNC, config.HOT_PATH])
@pytest.mark.parametrize("garbage", ["", "abc", "-5", "0", "1e999", "nan", "9" * 40, "\x01\u00fc", "12abc"])
def test_garbage_settings_fall_back_to_defaults(monkeypatch, name, garbage):
    monkeypatch.delenv(config.HOT_PATH, raising=False)  # CI's pass with the Python wrappers sets it
    monkeypatch.setenv(name, garbage)
    assert config.load() == config.Settings()


def test_uninstrument_restores_the_engine_exactly_and_cycles_work(engine, receiver):
    from mooncake.engine import TransferEngine

    names = ["transfer_sync_write", "batch_transfer_sync_write", "transfer_submit_write", "transfer_check_status",
             "get_batch_transfer_status", "initialize"]
    originals = {n: TransferEngine.__dict__[n] for n in names}
    for _ in range(3):
        telemetry = Telemetry().instrument()
        assert all(TransferEngine.__dict__[n] is not originals[n] for n in names)
        assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 8) == 0
        assert len(telemetry.spans(semconv.SPAN_SEND)) == 1
        telemetry.uninstrument()
        assert all(TransferEngine.__dict__[n] is originals[n] for n in names)
        assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 8) == 0
        assert len(telemetry.spans(semconv.SPAN_SEND)) == 1  # nothing recorded while uninstrumented


def test_suppress_instrumentation_calls_straight_through(telemetry, engine, receiver):
    with suppress_instrumentation():
        assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 8) == 0
    assert telemetry.spans() == []


class _RaisingOnStart(SpanProcessor):
    """A span processor with a bug: span building raises inside the SDK (on_start on the SDK pipeline; the
    direct pipeline calls only on_end)."""

    def on_start(self, span, parent_context=None):
        raise RuntimeError("bug in a span processor")

    def on_end(self, span):
        raise RuntimeError("bug in a span processor")


def test_a_failing_span_builder_never_reaches_the_engine(telemetry, engine, receiver):
    telemetry.tracer_provider.add_span_processor(_RaisingOnStart())
    assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 8) == 0
    assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 8) == 0
    telemetry.tracer_provider.force_flush()
    assert RECORDER.pending() == 0
    assert telemetry.dropped() == {"builder_error": 2}


def test_forked_child_keeps_recording(telemetry, engine, receiver, tmp_path):
    kvt.begin_request(77, backend="test")  # open in the parent: the child must not end it twice
    pid = os.fork()
    if pid == 0:  # child: new engine connection, same instrumentation
        code = 1
        try:
            import numpy as np

            from otel_kvtransfer.demo.loopback import open_engine

            child_engine = open_engine()
            buf = np.ones(4096, dtype=np.uint8)
            child_engine.register_memory(buf.ctypes.data, buf.nbytes)
            rc = child_engine.transfer_sync_write(receiver.session, buf.ctypes.data, receiver.base_address, 4096)
            telemetry.tracer_provider.force_flush()
            spans = telemetry.exporter.get_finished_spans()
            names = [s.name for s in spans]
            (tmp_path / "child.txt").write_text(f"{rc} {names}")
            code = 0 if rc == 0 and names == [semconv.SPAN_SEND] else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, (tmp_path / "child.txt").read_text()
    kvt.end_request(77)
    assert [s.name for s in telemetry.spans()] == [semconv.SPAN_REQUEST]


_SHORT_LIVED = r"""
import os
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from otel_kvtransfer import KVTransferInstrumentor
from otel_kvtransfer import integration as kvt

os.environ["OTEL_KVTRANSFER_FLUSH_INTERVAL_MS"] = "60000"  # only the exit path can deliver
tracer_provider = TracerProvider()
meter_provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(
    ConsoleMetricExporter(formatter=lambda data: data.to_json(indent=None) + "\n"), export_interval_millis=600000)])
KVTransferInstrumentor().instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
for room in range(25):
    kvt.begin_request(room, backend="test")
    kvt.end_request(room)
"""


def test_a_short_lived_process_delivers_its_metrics_at_exit(tmp_path):
    import json
    import subprocess
    import sys

    script = tmp_path / "short.py"
    script.write_text(_SHORT_LIVED)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True)
    counts = [point["count"]
              for line in out.stdout.splitlines() if line.startswith("{")
              for rm in json.loads(line)["resource_metrics"] for sm in rm["scope_metrics"]
              for metric in sm["metrics"] if metric["name"] == semconv.METRIC_REQUEST_SIZE
              for point in metric["data"]["data_points"]]
    assert counts == [25]


_SDK_SET_AFTER_INSTRUMENT = r"""
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otel_kvtransfer import KVTransferInstrumentor
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.recording.recorder import RECORDER

KVTransferInstrumentor().instrument()  # no SDK yet: only the API's proxy providers exist
exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
RECORDER.drain()  # the tick finds the SDK
for room in range(3):
    kvt.begin_request(room, backend="test")
    kvt.end_request(room)
provider.force_flush()
points = [p for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
          for m in sm.metrics if m.name == "kv_transfer.request.size" for p in m.data.data_points]
print(len(exporter.get_finished_spans()), sum(p.count for p in points))
"""


def test_an_sdk_set_after_instrument_gets_the_processors(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "late_sdk.py"
    script.write_text(_SDK_SET_AFTER_INSTRUMENT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["3", "3"]  # three request spans exported, three requests in the metrics
