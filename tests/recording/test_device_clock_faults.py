"""A device that fails, answers slowly or misreads its clock (recording/device_clock.py): the request's end is
never delayed or lost, and its compute keeps the launch's host times, counted.

The device is a STAND-IN (no GPU here), shaped as much of torch.cuda as the device clock uses: its events
complete when recorded, on a device clock that reads the records' clock plus a stream's `offset_ns`, and its
`query()` does what the test says (raise, take its time, hang on a gate). The rest is real: the integration API,
the recorder, the builder and the SDK's in-memory exporter and metric reader.
"""

import threading
from collections import Counter

import pytest
from opentelemetry.trace import StatusCode
from support.waiting import wait_until

from otel_kvtransfer import integration
from otel_kvtransfer import semconv as sc
from otel_kvtransfer.recording import device_clock
from otel_kvtransfer.recording.clock import now_ns

RESOLVER = "otel-kvtransfer-device-clock"  # the device clock's own thread
BOUND_S = 20.0  # the waits are for states the code reaches by itself: the bound only ends a failing test


class _Stream:
    device_index = 0

    def __init__(self, offset_ns=0):
        self.offset_ns = offset_ns  # this stream's device clock against the records' clock


class _Event:
    def __init__(self, device):
        self.device = device
        self.stream = None
        self.at = None

    def record(self, stream):
        self.stream = stream
        self.at = now_ns() + stream.offset_ns

    def query(self):
        return self.device.query(self)

    def elapsed_time(self, end):
        return (end.at - self.at) / 1e6


class StandInDevice:
    """A STAND-IN for torch.cuda. `work` is the stream the test launches on; `query_on_work(event)` decides what a
    query of an event recorded on it does (the anchors' own streams always answer at once)."""

    def __init__(self, query_on_work=None, failing=False):
        self.work = _Stream()
        self.failing = failing  # every query raises, the anchors' included
        self.query_on_work = query_on_work
        self.queries = Counter()  # thread ident -> queries of events on `work`

    def is_available(self):
        return True

    def current_stream(self):
        return self.work

    def Stream(self, device=None, priority=0):  # noqa: N802 - torch.cuda's name
        return _Stream()

    def Event(self, enable_timing=False, **_):  # noqa: N802
        return _Event(self)

    def query(self, event):
        if self.failing:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if event.stream is not self.work:
            return True
        self.queries[threading.get_ident()] += 1
        return self.query_on_work(event) if self.query_on_work else True


@pytest.fixture
def stand_in():
    def make(device, **options):
        return device_clock.use_device_module(device, **options)

    yield make
    device_clock.use_device_module(None)


def _launch(clock, device, keys):
    """One forward: its bracket on the work stream; returns its host times."""
    token = clock.begin([device.work])
    clock.end(token, [device.work], keys)
    return token[0], now_ns()


def _computes(telemetry, key):
    return [s for s in telemetry.spans(sc.SPAN_COMPUTE) if s.attributes[sc.REQUEST_KEY] == str(key)]


def _request_ended(telemetry, key):
    (span,) = [s for s in telemetry.spans(sc.SPAN_REQUEST) if s.attributes[sc.REQUEST_KEY] == str(key)]
    assert sc.ERROR_TYPE not in span.attributes, dict(span.attributes)  # not `evicted`: its end was recorded
    assert span.status.status_code is not StatusCode.ERROR
    return span


def test_a_device_whose_query_raises_loses_no_request_end(telemetry, stand_in):
    device = StandInDevice(failing=True)
    clock = stand_in(device)
    launches = {}
    for key in (1, 2, 3):
        integration.begin_request(key, backend="mooncake")
        launches[key] = _launch(clock, device, [key])
    # The resolver lets a bracket it cannot read go with its host times, at once: it does not retry the same one.
    wait_until(lambda: clock.stats()["pending"] == 0, BOUND_S, "the resolver to let the brackets go",
               interval_s=0.01)
    integration.begin_request(4, backend="mooncake")
    launches[4] = _launch(clock, device, [4])  # ended at once: its own end reads it (or the resolver, first)
    for key in (1, 2, 3, 4):
        integration.end_request(key)

    for key, (start, end) in launches.items():
        _request_ended(telemetry, key)
        (span,) = _computes(telemetry, key)
        assert span.attributes[sc.COMPUTE_CLOCK] == sc.CLOCK_HOST
        assert start <= span.start_time <= span.end_time <= end
    assert telemetry.dropped() == {device_clock.UNRESOLVED: 4}  # once each: no wrapper_error per pass
    assert clock.stats()["anchorings_failed"] >= 1


def test_a_request_end_waits_neither_for_a_hung_query_nor_for_many_slow_ones(telemetry, stand_in):
    gate = threading.Event()  # the resolver's query hangs until the test opens it
    in_query = threading.Event()

    def query(event):
        if threading.current_thread().name == RESOLVER:
            in_query.set()
            gate.wait(3 * BOUND_S)  # longer than the test waits for the end: the test opens it when it is done
            return True
        return bool(gate.wait(0.02))  # slow elsewhere (20 ms, not done): the elapsed time IS the fault

    device = StandInDevice(query_on_work=query)
    clock = stand_in(device)
    integration.begin_request(1, backend="mooncake")
    launches = [_launch(clock, device, [1]) for _ in range(40)]
    wait_until(in_query.is_set, BOUND_S, "the resolver inside a query", interval_s=0.01)

    ended = threading.Event()

    def end():
        integration.end_request(1)
        ended.set()

    thread = threading.Thread(target=end)  # on a thread of its own so that a wait on the lock fails, not hangs
    thread.start()
    try:
        assert ended.wait(BOUND_S), "end_request waited for the resolver's query"
        assert not gate.is_set()  # it returned while the resolver's query still hung
        assert device.queries[thread.ident] <= device_clock.SETTLE_QUERIES
        spans = _computes(telemetry, 1)
        assert len(spans) == 40
        host = [s for s in spans if s.attributes[sc.COMPUTE_CLOCK] == sc.CLOCK_HOST]
        assert len(host) >= 40 - device_clock.SETTLE_QUERIES
        assert telemetry.dropped() == {device_clock.UNRESOLVED: len(host)}
        _request_ended(telemetry, 1)
        first, last = launches[0][0], launches[-1][1]
        assert all(first <= s.start_time <= s.end_time <= last for s in host)
    finally:
        gate.set()
        thread.join(BOUND_S)
    wait_until(lambda: clock.stats()["pending"] == 0, BOUND_S, "nothing pending", interval_s=0.01)
    assert len(_computes(telemetry, 1)) == 40  # the resolver made none of them twice


@pytest.mark.parametrize("offset_s", [-1_000_000.0, 3_600.0], ids=["backwards", "ahead"])
def test_device_times_far_outside_the_launch_keep_the_host_times(telemetry, stand_in, offset_s):
    device = StandInDevice()
    clock = stand_in(device)
    integration.begin_request(1, backend="mooncake")
    _launch(clock, device, [1])  # starts the resolver, which anchors on a clock of its own stream
    wait_until(lambda: clock.stats()["anchors"] >= 1, BOUND_S, "the device clock's first anchor", interval_s=0.01)
    integration.end_request(1)
    (good,) = _computes(telemetry, 1)
    assert good.attributes[sc.COMPUTE_CLOCK] == sc.CLOCK_DEVICE  # the same device, its clock read right

    device.work.offset_ns = int(offset_s * 1e9)  # the work stream's clock jumps (11.6 days back, an hour ahead)
    integration.begin_request(2, backend="mooncake")
    start, end = _launch(clock, device, [2])
    integration.end_request(2)
    (span,) = _computes(telemetry, 2)
    assert span.attributes[sc.COMPUTE_CLOCK] == sc.CLOCK_HOST
    assert start <= span.start_time <= span.end_time <= end
    request = _request_ended(telemetry, 2)
    assert request.start_time <= span.start_time
    assert telemetry.dropped() == {device_clock.UNRESOLVED: 1}
