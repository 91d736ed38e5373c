"""A backwards step of the wall clock while a transfer is in the engine: durations stay monotonic measures, never
negative, in both pipelines, and a framework's `time.time_ns()` times taken across the step stay in order.

Real parts: the Mooncake engine of the test process writing 48 MiB to a receiver process over TCP on 127.0.0.1;
the receiver is frozen with SIGSTOP so that the write is known to be inside the engine when the clock steps, then
let go. Stand-in: this machine's clock cannot be stepped by a test, so the test process's wall clock is made to
jump instead: `time.time_ns`, `time.time` and every name in the package bound to them return the real wall time
minus 3,600 s from the step on (the monotonic clock, which a real step leaves alone, is left alone too).
"""

import os
import signal
import sys
import threading
import time

import pytest
from support.telemetry import Telemetry
from support.waiting import wait_until

from otel_kvtransfer import config, semconv
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.demo.loopback import digest

ROOM = 990001
SIZE = 48 << 20
STEP_NS = -3600 * 10**9


class WallClock:
    """The process's wall clock, stepped by `step_ns` once `step()` is called."""

    def __init__(self, monkeypatch):
        self._real_ns, self._real = time.time_ns, time.time
        self.offset_ns = 0
        monkeypatch.setattr(time, "time_ns", self.time_ns)
        monkeypatch.setattr(time, "time", self.time)
        for name, module in list(sys.modules.items()):  # `from time import time_ns` copies, in the package
            if name.startswith("otel_kvtransfer") and module is not None:
                for attribute, value in list(vars(module).items()):
                    if value is self._real_ns:
                        monkeypatch.setattr(module, attribute, self.time_ns)
                    elif value is self._real:
                        monkeypatch.setattr(module, attribute, self.time)

    def time_ns(self) -> int:
        return self._real_ns() + self.offset_ns

    def time(self) -> float:
        return self._real() + self.offset_ns / 1e9

    def step(self, step_ns: int) -> None:
        self.offset_ns += step_ns


def _inside_the_engine(thread: threading.Thread) -> bool:
    """The write thread's frames show the Mooncake wrapper past its start: the call is in the engine."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "transfer" and "start" in frame.f_locals and "mooncake" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _write_across_a_step(engine, receiver, wall: WallClock) -> int:
    """One 48 MiB write in request ROOM's scope, the wall clock stepping back while it is in the engine; the
    monotonic time around the whole write."""
    result = {}

    def write():
        with kvt.transfer_scope(ROOM, chunk_index=0, is_last_chunk=True):
            result["rc"] = engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address,
                                                             SIZE)

    thread = threading.Thread(target=write)
    os.kill(receiver.process.pid, signal.SIGSTOP)
    try:
        outer_start = time.monotonic_ns()
        thread.start()
        wait_until(lambda: _inside_the_engine(thread) or not thread.is_alive(), 30, "the write inside the engine")
        assert thread.is_alive(), "the write ended before the clock could step inside it"
        wall.step(STEP_NS)
    finally:
        os.kill(receiver.process.pid, signal.SIGCONT)
    thread.join(60)
    outer = time.monotonic_ns() - outer_start
    assert result.get("rc") == 0
    assert receiver.digest(0, SIZE) == digest(engine.source[:SIZE])
    return outer


@pytest.mark.parametrize("pipeline", ["direct", "sdk"])
def test_a_wall_clock_step_during_a_call_leaves_durations_monotonic(engine, receiver, monkeypatch, pipeline):
    monkeypatch.setenv(config.PIPELINE, pipeline)
    telemetry = Telemetry().instrument()
    try:
        wall = WallClock(monkeypatch)
        kvt.begin_request(ROOM, backend="mooncake", framework="test")
        outer = _write_across_a_step(engine, receiver, wall)
        kvt.end_request(ROOM)
        (send,) = telemetry.spans(semconv.SPAN_SEND)
        (request,) = telemetry.spans(semconv.SPAN_REQUEST)
        metrics = telemetry.metrics()
    finally:
        telemetry.uninstrument()
    took = send.end_time - send.start_time
    assert 0 < took <= outer  # the engine's own monotonic measure lies inside the test's
    assert send.attributes[semconv.BYTES] == SIZE
    assert send.attributes[semconv.THROUGHPUT] == pytest.approx(SIZE * 1e9 / took)
    assert request.start_time <= send.start_time and send.end_time <= request.end_time
    assert request.attributes[semconv.BUSY_S] == pytest.approx(took / 1e9)
    (duration,) = metrics[semconv.METRIC_DURATION]
    assert (duration.count, duration.min) == (1, pytest.approx(took / 1e9))
    (request_duration,) = metrics[semconv.METRIC_REQUEST_DURATION]
    assert request_duration.min == pytest.approx((request.end_time - request.start_time) / 1e9)
    assert 0 < request_duration.min < 600


def test_framework_times_taken_across_a_step_stay_in_order(telemetry, engine, receiver, monkeypatch):
    """A framework that passes `time.time_ns()` as start_ns / end_ns: read before and after the step, they still
    make a request that ends after it starts, around its send."""
    wall = WallClock(monkeypatch)
    outer_start = time.monotonic_ns()
    kvt.begin_request(ROOM, backend="mooncake", framework="test", start_ns=time.time_ns())
    compute_start = time.time_ns()
    _write_across_a_step(engine, receiver, wall)
    kvt.record_compute([ROOM], compute_start, time.time_ns())
    kvt.end_request(ROOM, end_ns=time.time_ns())
    outer = time.monotonic_ns() - outer_start
    (send,) = telemetry.spans(semconv.SPAN_SEND)
    (request,) = telemetry.spans(semconv.SPAN_REQUEST)
    (compute,) = telemetry.spans(semconv.SPAN_COMPUTE)
    assert request.start_time <= send.start_time < send.end_time <= request.end_time
    # within a millisecond of the monotonic window: the step is measured to STEP_NS (clock.py), and the test's
    # own time.time_ns() reads are two clock reads from the package's
    assert 0 < request.end_time - request.start_time < outer + 10**6
    assert 0 < compute.end_time - compute.start_time < outer + 10**6
    assert request.attributes[semconv.BUSY_S] == pytest.approx((send.end_time - send.start_time) / 1e9)
