"""The link busy time rule: what each send adds is what it adds to the union of the sends' intervals, whatever
order the sends end in, so the counter's total is the union's length (and its rate() the share of time in use)."""

import random

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode

from otel_kvtransfer import semconv
from otel_kvtransfer.building.kvmetrics import KVMetrics
from otel_kvtransfer.building.metric_rules import BusyTime
from otel_kvtransfer.building.processor import KVTransferMetricsProcessor
from otel_kvtransfer.building.record_metrics import RecordMetrics


def _union_length(intervals) -> int:
    covered, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            covered += end - start
            reach = end
        elif end > reach:
            covered += end - reach
            reach = end
    return covered


@pytest.mark.parametrize("seed", range(20))
def test_the_additions_sum_to_the_union_whatever_the_order_of_ends(seed):
    rng = random.Random(seed)
    busy = BusyTime()
    intervals, added = [], 0.0
    for _ in range(300):
        start = rng.randrange(0, 10_000_000)
        intervals.append((start, start + rng.randrange(1, 400_000)))
    # sends are reported as they end, give or take a few (two threads, two pollers): a local shuffle of end order
    reported = sorted(intervals, key=lambda i: i[1] + rng.randrange(0, 300_000))
    for start, end in reported:
        added += busy.add("peer", start, end)
    assert added == pytest.approx(_union_length(intervals) / 1e9, abs=1e-12)


def test_overlapping_sends_add_their_union_and_series_are_apart():
    busy = BusyTime()
    assert busy.add("a", 100, 300) == pytest.approx(200e-9)
    assert busy.add("a", 200, 250) == 0.0  # inside what is already busy
    assert busy.add("a", 250, 500) == pytest.approx(200e-9)  # only 300..500 is new
    assert busy.add("b", 100, 300) == pytest.approx(200e-9)  # another link: its own union
    assert busy.add("a", 600, 700) == pytest.approx(100e-9)
    assert busy.add("a", 50, 800) == pytest.approx(50e-9 + 100e-9 + 100e-9)  # the gaps 50..100, 500..600, 700..800
    assert busy.add("a", 900, 900) == 0.0  # no duration, no time


def test_a_send_older_than_the_kept_stretches_counts_only_beyond_them():
    busy = BusyTime()
    for i in range(BusyTime.KEPT + 1):  # disjoint stretches: the two oldest are merged into one
        busy.add("a", 1_000 * (i + 1), 1_000 * (i + 1) + 10)
    # the first stretch (1000..1010) is covered still (merged with the next, the gap between them taken as busy):
    # a send over it adds nothing, and one over the merged gap nothing either (the documented bound: never more)
    assert busy.add("a", 1_000, 1_010) == 0.0
    assert busy.add("a", 1_500, 1_600) == 0.0
    # a send over kept stretches only adds its gaps
    assert busy.add("a", 3_000, 4_010) == pytest.approx((1_010 - 20) * 1e-9)


def _send_attrs(port, start, end, nbytes=2 << 20):
    return {semconv.BACKEND: "eng", semconv.ROLE: semconv.ROLE_PREFILL, semconv.PAYLOAD: semconv.PAYLOAD_KV,
            semconv.SERVER_ADDRESS: "127.0.0.1", semconv.SERVER_PORT: port, semconv.BYTES: nbytes,
            semconv.DESCRIPTOR_COUNT: 1, semconv.THROUGHPUT: nbytes / ((end - start) / 1e9)}


SENDS = [(4001, 0, 1_000_000), (4001, 500_000, 1_500_000), (4002, 200_000, 700_000), (4001, 3_000_000, 3_100_000)]


def _busy_points(reader) -> dict:
    found = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name in (semconv.METRIC_PEER_BUSY_TIME, semconv.METRIC_BUSY_TIME):
                    for point in metric.data.data_points:
                        found[(metric.name, tuple(sorted(point.attributes.items())))] = (
                            point.value, metric.data.is_monotonic, metric.unit, list(point.exemplars))
    return found


def _direct(meter_provider):
    tables = KVMetrics()
    assert tables.attach(meter_provider)
    metrics = RecordMetrics(tables)
    for port, start, end in SENDS:
        metrics.send(_send_attrs(port, start, end), start, end, 2 << 20, 1, None, None)


def _sdk(meter_provider):
    processor = KVTransferMetricsProcessor(meter_provider)
    for i, (port, start, end) in enumerate(SENDS):
        processor.on_end(ReadableSpan(
            name=semconv.SPAN_SEND, context=SpanContext(0xABC, i + 1, False), kind=SpanKind.CLIENT,
            attributes=_send_attrs(port, start, end), status=Status(StatusCode.UNSET), start_time=start,
            end_time=end, instrumentation_scope=InstrumentationScope(semconv.INSTRUMENTATION_NAME, "0")))


@pytest.mark.parametrize("pipeline", [_direct, _sdk], ids=["direct", "sdk"])
def test_per_peer_and_per_process_busy_time_in_both_pipelines(pipeline, meter):
    meter_provider, reader = meter
    pipeline(meter_provider)
    peer = lambda port: ((semconv.SERVER_ADDRESS, "127.0.0.1"), (semconv.SERVER_PORT, port))  # noqa: E731
    process = ((semconv.BACKEND, "eng"), (semconv.ROLE, semconv.ROLE_PREFILL))
    assert {key: value[:3] for key, value in _busy_points(reader).items()} == {
        # 4001: 0..1.5 ms and 3.0..3.1 ms; 4002: 0.2..0.7 ms; the process: the union of all, 1.6 ms
        (semconv.METRIC_PEER_BUSY_TIME, peer(4001)): (pytest.approx(1.6e-3), True, "s"),
        (semconv.METRIC_PEER_BUSY_TIME, peer(4002)): (pytest.approx(0.5e-3), True, "s"),
        (semconv.METRIC_BUSY_TIME, process): (pytest.approx(1.6e-3), True, "s"),
    }
    assert all(not value[3] for value in _busy_points(reader).values())  # no one send is a sum's exemplar
