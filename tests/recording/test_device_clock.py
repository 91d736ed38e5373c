"""Compute on the device's clock (recording/device_clock.py), on a STAND-IN device: no GPU here, so a
torch.cuda-shaped stand-in (tests/support/standin_cuda.py) whose streams run their work on threads of their own,
so that its events complete later than the launch that recorded them, on a device clock of its own (offset, and
drifting where a test says so). Everything else is real: the integration API, the recorder, the builder, the
SDK's in-memory exporter and metric reader.

The stand-in stamps each event with the records' clock at the instant it completes: `event.at` is the truth a
span's time is compared with. The device clock promises 50 us (an anchor right to 25 us, drift at most 25 us
between anchors).
"""

import subprocess
import sys
import threading

import pytest
from support.standin_cuda import StandInCuda
from support.waiting import wait_until

from otel_kvtransfer import integration
from otel_kvtransfer import semconv as sc
from otel_kvtransfer.recording import device_clock
from otel_kvtransfer.recording.clock import now_ns

PROMISE_NS = 50_000
KERNEL_S = 0.05


@pytest.fixture
def stand_in():
    """`stand_in(drift_ppm, **clock options)`: the process's CUDA clock on a fresh stand-in device (torch's back
    after the test)."""
    made = []

    def make(drift_ppm=0.0, **options):
        device = StandInCuda(drift_ppm=drift_ppm)
        clock = device_clock.use_device_module(device, **options)
        made.append(device)
        return device, clock

    yield make
    device_clock.use_device_module(None)
    for device in made:
        device.close()


def _compute_spans(telemetry, key):
    return [s for s in telemetry.spans(sc.SPAN_COMPUTE) if s.attributes[sc.REQUEST_KEY] == str(key)]


BOUND_S = 20.0  # the waits below are for states the code under test reaches by itself: it only ends a failing test


def test_a_launch_is_timed_when_its_work_ran_not_when_it_was_enqueued(telemetry, stand_in):
    device, clock = stand_in()
    stream = device.Stream()
    integration.begin_request(1, backend="mooncake")
    before = device.Event(enable_timing=True)
    before.record(stream)  # the stream is idle: done at once, as the bracket's start is
    gate = threading.Event()  # the work runs once the launch has returned (then for KERNEL_S)
    launch_start = now_ns()
    token = clock.begin([stream])
    device.launch(KERNEL_S, stream=stream, gate=gate)
    clock.end(token, [stream], [1])
    truth_end = device.Event(enable_timing=True)
    truth_end.record(stream)  # right behind the bracket's end event: completes at the same instant
    launch_end = now_ns()
    gate.set()
    truth_end.synchronize()
    integration.end_request(1)

    (span,) = _compute_spans(telemetry, 1)
    assert span.attributes[sc.COMPUTE_CLOCK] == sc.CLOCK_DEVICE
    assert abs(span.end_time - truth_end.at) <= PROMISE_NS
    assert before.at - PROMISE_NS <= span.start_time <= launch_end
    # The launch returned long before the work ended: the span is the work's, not the launch's.
    assert span.end_time - launch_end >= KERNEL_S * 1e9 - PROMISE_NS
    assert launch_end - launch_start < span.end_time - span.start_time
    (request,) = telemetry.spans(sc.SPAN_REQUEST)
    assert request.start_time <= span.start_time <= span.end_time <= request.end_time


def test_the_start_waits_for_the_busiest_stream(telemetry, stand_in):
    device, clock = stand_in()
    staging, forward = device.Stream(), device.Stream()
    integration.begin_request(2, backend="mooncake")
    previous = device.launch(KERNEL_S, stream=forward)  # the previous batch's forward still runs
    token = clock.begin([staging, forward])
    truth_start = device.Event(enable_timing=True)
    truth_start.record(forward)  # right behind the bracket's start event on the busy stream
    forward.wait_stream(staging)
    device.launch(0.01, stream=forward)
    clock.end(token, [staging, forward], [2])
    truth_end = device.Event(enable_timing=True)
    truth_end.record(forward)
    truth_end.synchronize()
    integration.end_request(2)

    (span,) = _compute_spans(telemetry, 2)
    assert abs(span.start_time - truth_start.at) <= PROMISE_NS
    assert span.start_time >= previous.ended_at - PROMISE_NS
    assert abs(span.end_time - truth_end.at) <= PROMISE_NS


def test_a_request_that_ends_gets_its_compute_first_without_waiting_for_the_resolver(telemetry, stand_in):
    # The resolver takes its anchor and then sleeps far longer than the test: only the request's end can record
    # the bracket, and it must, before the end record (after it the compute would make no span).
    device, clock = stand_in(poll_s=3600.0)
    stream = device.Stream()
    integration.begin_request(3, backend="mooncake")
    token = clock.begin([stream])
    device.launch(KERNEL_S, stream=stream)
    clock.end(token, [stream], [3])
    truth_end = device.Event(enable_timing=True)
    truth_end.record(stream)
    truth_end.synchronize()
    wait_until(lambda: clock.stats()["anchors"] >= 1, BOUND_S, "the device clock's first anchor", interval_s=0.01)
    integration.end_request(3)

    (span,) = _compute_spans(telemetry, 3)
    assert span.attributes[sc.COMPUTE_CLOCK] == sc.CLOCK_DEVICE
    assert abs(span.end_time - truth_end.at) <= PROMISE_NS
    (request,) = telemetry.spans(sc.SPAN_REQUEST)
    assert request.attributes[sc.COMPUTE_OVERLAP_S] == 0.0  # the request's figures saw the compute
    assert sc.TAIL_S in request.attributes
    assert telemetry.dropped() == {}


def test_a_device_that_never_finishes_never_holds_the_engine_thread(telemetry, stand_in):
    device, clock = stand_in(give_up_s=0.3)
    stream = device.Stream()
    gate = threading.Event()  # never opened while the test looks: the kernel hangs
    done = {}

    def engine_thread():
        integration.begin_request(4, backend="mooncake")
        integration.begin_request(5, backend="mooncake")
        token = clock.begin([stream])
        kernel = device.launch(stream=stream, gate=gate)
        clock.end(token, [stream], [4, 5])
        done["launch"] = (token[0], now_ns())
        integration.end_request(4)  # its request ends (an abort) while the work hangs
        done["kernel"] = kernel

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join(10)  # a wait on the device would hang here forever: the bound only ends a failing test
    assert not thread.is_alive()
    kernel = done["kernel"]
    assert not gate.is_set() and kernel.ended_at is None  # every call returned while the work still hung

    # Request 4 ended: its compute went in at once, with the launch's host times, counted.
    (span,) = _compute_spans(telemetry, 4)
    assert span.attributes[sc.COMPUTE_CLOCK] == sc.CLOCK_HOST
    launch_start, launch_end = done["launch"]
    assert launch_start <= span.start_time <= span.end_time <= launch_end
    # Request 5 is still open: past give_up_s the resolver lets the events go and keeps the host times.
    wait_until(lambda: telemetry.dropped().get(device_clock.UNRESOLVED) == 2, BOUND_S, "2 unresolved drops",
               interval_s=0.01)
    integration.end_request(5)
    (span,) = _compute_spans(telemetry, 5)
    assert span.attributes[sc.COMPUTE_CLOCK] == sc.CLOCK_HOST
    assert clock.stats()["pending"] == 0
    gate.set()


def test_brackets_beyond_the_table_keep_their_host_times_and_are_counted(telemetry, stand_in):
    device, clock = stand_in(max_pending=1, poll_s=3600.0)
    stream = device.Stream()
    gate = threading.Event()
    for key in (6, 7):
        integration.begin_request(key, backend="mooncake")
    first = clock.begin([stream])
    device.launch(stream=stream, gate=gate)
    clock.end(first, [stream], [6])
    second = clock.begin([stream])
    clock.end(second, [stream], [7])  # the table is full: recorded now, host times
    gate.set()
    truth_end = device.Event(enable_timing=True)
    truth_end.record(stream)
    truth_end.synchronize()
    wait_until(lambda: clock.stats()["anchors"] >= 1, BOUND_S, "the device clock's first anchor", interval_s=0.01)
    for key in (6, 7):
        integration.end_request(key)
    (six,), (seven,) = _compute_spans(telemetry, 6), _compute_spans(telemetry, 7)
    assert six.attributes[sc.COMPUTE_CLOCK] == sc.CLOCK_DEVICE
    assert seven.attributes[sc.COMPUTE_CLOCK] == sc.CLOCK_HOST
    assert telemetry.dropped() == {device_clock.FULL: 1}


def test_a_drifting_device_clock_stays_within_the_promise(telemetry, stand_in):
    # 300 ppm: 300 us a second; converted through one anchor for a second the error would be six times the promise.
    device, clock = stand_in(drift_ppm=300.0)
    stream = device.Stream()
    truths = []
    for key in range(100, 124):
        integration.begin_request(key, backend="mooncake")
        token = clock.begin([stream])
        device.launch(0.04, stream=stream)
        clock.end(token, [stream], [key])
        truth = device.Event(enable_timing=True)
        truth.record(stream)
        truth.synchronize()
        truths.append((key, truth))
        integration.end_request(key)
    stats = clock.stats()
    assert stats["drift_ppm"] and abs(stats["drift_ppm"][0] - 300.0) < 100.0
    errors = [abs(_compute_spans(telemetry, key)[0].end_time - truth.at) for key, truth in truths]
    assert max(errors) <= PROMISE_NS, errors


def test_no_device_no_clock():
    assert device_clock.for_device("cpu") is None
    assert device_clock.for_device(None) is None
    assert device_clock.for_device("npu") is None  # timing events only where torch.cuda has them


def test_no_torch_is_imported_where_the_engine_did_not():
    code = ("import sys\n"
            "from otel_kvtransfer.recording import device_clock\n"
            "from otel_kvtransfer.frameworks.sglang import prefill\n"
            "assert device_clock.for_device('cuda') is None\n"
            "assert device_clock.for_device('cuda:0') is None\n"
            "assert 'torch' not in sys.modules\n"
            "import torch\n"  # a CPU build here: the engine's torch has no CUDA device
            "assert not torch.cuda.is_available()\n"
            "assert device_clock.for_device('cuda') is None\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
