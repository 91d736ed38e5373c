"""Link busy time never counts more than the union of the send intervals, and never counts a moment twice:
whatever order the sends end in (a long send ending after many short ones it covers, more than the stretches a
series keeps), and however many peers the setting allows (at OTEL_KVTRANSFER_MAX_PEERS=65536, the documented
most, every peer's and the process's busy time is still counted once). So utilisation (`rate()`) stays within
0..1.

No engine: the rule itself, and both pipelines' metrics (our own tables, and the SDK's instruments fed spans).
"""

import random

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode
from support.telemetry import in_memory_metrics
from test_busy_time import _union_length

from otel_kvtransfer import semconv
from otel_kvtransfer.building.kvmetrics import KVMetrics
from otel_kvtransfer.building.metric_rules import BusyTime
from otel_kvtransfer.building.processor import KVTransferMetricsProcessor
from otel_kvtransfer.building.record_metrics import RecordMetrics

MS = 1_000_000
# One 200 ms send over 100 disjoint 1 ms sends that end before it does: the union is the 200 ms.
LONG_OVER_SHORT = [(i * 2 * MS, i * 2 * MS + MS) for i in range(100)] + [(0, 200 * MS)]
MOST_PEERS = 1 << 16  # the most OTEL_KVTRANSFER_MAX_PEERS allows


def test_a_long_send_over_many_short_ones_counts_at_most_their_union():
    busy = BusyTime()
    added = sum(busy.add("peer", start, end) for start, end in LONG_OVER_SHORT)
    assert 0.100 <= added <= 0.200  # every short send counted once; the long one adds at most the rest


@pytest.mark.parametrize("seed", range(20))
def test_the_additions_never_exceed_the_union_whatever_the_order(seed):
    rng = random.Random(seed)
    busy = BusyTime()
    # 300 short disjoint sends (more stretches than a series keeps) and 30 long ones over them, ending in any order
    intervals = [(i * 100_000, i * 100_000 + rng.randrange(1, 50_000)) for i in range(300)]
    for _ in range(30):
        start = rng.randrange(0, 30_000_000)
        intervals.append((start, start + rng.randrange(1, 10_000_000)))
    rng.shuffle(intervals)
    total, covered = 0.0, []
    for start, end in intervals:
        total += busy.add("peer", start, end)
        covered.append((start, end))
        assert total <= _union_length(covered) / 1e9 + 1e-12  # at every step, not only at the end


def _attrs(port, nbytes=2 << 20):
    return {semconv.BACKEND: "eng", semconv.ROLE: semconv.ROLE_PREFILL, semconv.PAYLOAD: semconv.PAYLOAD_KV,
            semconv.SERVER_ADDRESS: "10.0.0.1", semconv.SERVER_PORT: port, semconv.BYTES: nbytes,
            semconv.DESCRIPTOR_COUNT: 1}


def _direct(sends, max_peers):
    provider, reader = in_memory_metrics()
    tables = KVMetrics()
    assert tables.attach(provider)
    metrics = RecordMetrics(tables, max_peers=max_peers)
    for port, start, end in sends:
        metrics.send(_attrs(port), start, end, 2 << 20, 1, None, None)
    return reader


def _sdk(sends, max_peers):
    provider, reader = in_memory_metrics()
    processor = KVTransferMetricsProcessor(provider, max_peers=max_peers)
    scope = InstrumentationScope(semconv.INSTRUMENTATION_NAME, "0")
    for i, (port, start, end) in enumerate(sends):
        processor.on_end(ReadableSpan(
            name=semconv.SPAN_SEND, context=SpanContext(0xABC, i + 1, False), kind=SpanKind.CLIENT,
            attributes=_attrs(port), status=Status(StatusCode.UNSET), start_time=start, end_time=end,
            instrumentation_scope=scope))
    return reader


def _busy(reader) -> dict:
    found = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name in (semconv.METRIC_PEER_BUSY_TIME, semconv.METRIC_BUSY_TIME):
                    for point in metric.data.data_points:
                        found[(metric.name, point.attributes.get(semconv.SERVER_PORT),
                               point.attributes.get(semconv.SERVER_ADDRESS))] = point.value
    return found


@pytest.mark.parametrize("pipeline", [_direct, _sdk], ids=["direct", "sdk"])
def test_utilisation_of_a_long_send_over_short_ones_stays_within_one(pipeline):
    points = _busy(pipeline([(4001, start, end) for start, end in LONG_OVER_SHORT], 64))
    window = 0.200  # the 200 ms the sends span: utilisation = busy time / window
    assert 0.5 <= points[(semconv.METRIC_PEER_BUSY_TIME, 4001, "10.0.0.1")] / window <= 1.0
    assert 0.5 <= points[(semconv.METRIC_BUSY_TIME, None, None)] / window <= 1.0


def test_at_the_most_peers_allowed_every_moment_is_counted_once():
    """65,536 peers (the setting's most) and a few past it (`other`), every send over the same millisecond: each
    peer was busy 1 ms, `other` 1 ms, the process 1 ms (not 2: its union is never forgotten). Our own tables; the
    SDK pipeline's instruments stop at the MeterProvider's cardinality limit, and share the rule (below)."""
    sends = [(port, 0, MS) for port in range(MOST_PEERS + 3)]
    sends += [(0, 0, MS), (1, MS // 2, MS)]  # peers seen before, again over the same moment
    points = _busy(_direct(sends, MOST_PEERS))
    assert points.pop((semconv.METRIC_BUSY_TIME, None, None)) == pytest.approx(1e-3)
    assert points.pop((semconv.METRIC_PEER_BUSY_TIME, None, semconv.PEER_OTHER)) == pytest.approx(1e-3)
    assert len(points) == MOST_PEERS and all(value == pytest.approx(1e-3) for value in points.values())


def test_every_series_keeps_its_union_however_many_there_are():
    """The rule both pipelines use, with the series the SDK pipeline makes (one per peer, one per process) and
    more than it may ever make: a series seen again never counts its time twice."""
    busy = BusyTime()
    process = ("busy_time", "eng", "prefill")
    total = 0.0
    for port in range(BusyTime.MAX_SERIES + 10):
        busy.add(("10.0.0.1", port), 0, MS)
        total += busy.add(process, 0, MS)
    assert total == pytest.approx(1e-3)
    assert busy.add(("10.0.0.1", 7), 0, MS) == 0.0  # a peer's union kept all along
    # past the most: one union shared by those series, which holds that moment already
    assert sum(busy.add(("10.0.0.2", port), 0, MS) for port in range(5)) == 0.0
