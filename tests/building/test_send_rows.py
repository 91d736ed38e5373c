"""A successful send's measurements wait as a row and go into the metric tables a column at a time: the points a
reader collects are the ones a record per send gives (counts, buckets, sum, min, max, exemplars), and no row is
lost to a collection, to the builder's own application, or to its shape cache starting over."""

import random
import threading
import time

import pytest
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, AlwaysOnExemplarFilter
from opentelemetry.trace import SpanContext, TraceFlags
from support.telemetry import in_memory_metrics

from otel_kvtransfer import semconv
from otel_kvtransfer.building import metric_rules as rules
from otel_kvtransfer.building import record_metrics
from otel_kvtransfer.building.direct_spans import SendAttributes
from otel_kvtransfer.building.kvmetrics import KVMetrics, series_of
from otel_kvtransfer.building.record_metrics import RecordMetrics

STATIC = {semconv.BACKEND: "mooncake", semconv.ROLE: semconv.ROLE_PREFILL, semconv.PAYLOAD: semconv.PAYLOAD_KV,
          semconv.SERVER_ADDRESS: "127.0.0.1", semconv.SERVER_PORT: 4001}


def _attrs(nbytes, start, end, static=STATIC, post_s=None):
    attrs = SendAttributes()
    attrs[semconv.BYTES] = nbytes
    if end > start:
        attrs[semconv.THROUGHPUT] = nbytes * 1e9 / (end - start)
    if post_s is not None:
        attrs[semconv.POST_S] = post_s
    attrs.dynamic = len(attrs)
    attrs.update(static)
    attrs.static = static
    return attrs


def _sends(count, seed):
    """(attrs, start, end, bytes, descriptors, span context): sizes and durations over many buckets, some empty
    sends and some of no duration (no speed), some with a post duration, some unsampled."""
    rng = random.Random(seed)
    sends, clock = [], 1_000_000
    for i in range(count):
        nbytes = rng.choice((0, 4096, 3 << 20, rng.randrange(1, 1 << 30)))
        duration = rng.choice((0, rng.randrange(1, 50_000_000)))
        start, clock = clock, clock + duration + rng.randrange(0, 10_000)
        post_s = rng.random() * 1e-3 if i % 3 == 0 else None
        flags = TraceFlags(TraceFlags.SAMPLED if rng.random() < 0.8 else TraceFlags.DEFAULT)
        sends.append((_attrs(nbytes, start, start + duration, post_s=post_s), start, start + duration, nbytes,
                      rng.randrange(1, 300), SpanContext(0xABC, i + 1, False, flags)))
    return sends


def _reader(exemplar_filter=None):
    provider, reader = in_memory_metrics(**({} if exemplar_filter is None else {"exemplar_filter": exemplar_filter}))
    tables = KVMetrics()
    assert tables.attach(provider)
    return tables, reader


def _points(reader):
    """(metric, labels) -> (count, buckets, sum, min, max, exemplars as (span id, value)) of every point."""
    found = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    shape = (getattr(point, "count", None), tuple(getattr(point, "bucket_counts", ())),
                             getattr(point, "sum", getattr(point, "value", None)), getattr(point, "min", None),
                             getattr(point, "max", None),
                             sorted((e.span_id, e.value) for e in point.exemplars))
                    found[(metric.name, tuple(sorted(point.attributes.items())))] = shape
    return found


def _one_record_per_send(tables, sends):
    """The reference: each send's measurements recorded as they come, as the SDK instruments would take them."""
    busy = rules.BusyTime()
    peer = rules.PeerSeries(64)
    for attrs, start, end, nbytes, descriptors, context in sends:
        key, labels = series_of(attrs)
        tables.record(key, labels, rules.send(attrs, (end - start) / 1e9, nbytes, descriptors, False), context)
        peer_key, peer_labels = peer.of(attrs)
        tables.record(peer_key, peer_labels, rules.peer_speed(attrs, nbytes, False), context)
        tables.record(peer_key, peer_labels, ((rules.I_PEER_BUSY_TIME, busy.add(peer_key, start, end)),))
        process_key, process_labels = rules.process_series(attrs)
        tables.record(process_key, process_labels, ((rules.I_BUSY_TIME, busy.add(process_key, start, end)),))


def _batched(tables, sends):
    metrics = RecordMetrics(tables)
    for attrs, start, end, nbytes, descriptors, context in sends:
        metrics.send(attrs, start, end, nbytes, descriptors, None, context)
    return metrics


@pytest.mark.parametrize("count", [1, 7, record_metrics.PENDING_ROWS * 2 + 5])
@pytest.mark.parametrize("exemplar_filter", [None, "always_on", "always_off"])
def test_batched_rows_collect_as_one_record_per_send(count, exemplar_filter):
    filters = {None: None, "always_on": AlwaysOnExemplarFilter(), "always_off": AlwaysOffExemplarFilter()}
    sends = _sends(count, seed=count)
    reference_tables, reference = _reader(filters[exemplar_filter])
    _one_record_per_send(reference_tables, sends)
    tables, reader = _reader(filters[exemplar_filter])
    _batched(tables, sends)
    expected, got = _points(reference), _points(reader)
    # the busy time: the same union, summed per collection rather than per send
    for name in (semconv.METRIC_BUSY_TIME, semconv.METRIC_PEER_BUSY_TIME):
        assert [v[2] for k, v in got.items() if k[0] == name] == \
            pytest.approx([v[2] for k, v in expected.items() if k[0] == name], rel=1e-12)
    strip = lambda points: {k: v for k, v in points.items()  # noqa: E731
                            if k[0] not in (semconv.METRIC_BUSY_TIME, semconv.METRIC_PEER_BUSY_TIME)}
    assert strip(got) == strip(expected)
    names = {k[0] for k in got}
    assert {semconv.METRIC_DURATION, semconv.METRIC_SIZE, semconv.METRIC_DESCRIPTORS} <= names
    if count > 100:  # sends of every kind among them
        assert {semconv.METRIC_THROUGHPUT, semconv.METRIC_POST_DURATION, semconv.METRIC_PEER_THROUGHPUT} <= names
        exemplars = [e for v in got.values() for e in v[5]]
        assert bool(exemplars) == (exemplar_filter != "always_off")


def test_exemplars_keep_the_time_of_their_send_not_of_the_collection():
    tables, reader = _reader()
    _batched(tables, _sends(3, seed=1))  # held as rows: the collection below applies them
    sent_by = time.time_ns()
    time.sleep(0.01)
    data = reader.get_metrics_data()
    times = [e.time_unix_nano for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
             for p in m.data.data_points for e in p.exemplars]
    assert times and max(times) <= sent_by


def test_a_collection_takes_every_row_held_and_the_next_one_only_the_new():
    tables, reader = _reader()
    metrics = RecordMetrics(tables)
    sends = _sends(10, seed=2)
    for attrs, start, end, nbytes, descriptors, context in sends[:4]:
        metrics.send(attrs, start, end, nbytes, descriptors, None, context)
    first = _points(reader)
    for attrs, start, end, nbytes, descriptors, context in sends[4:]:
        metrics.send(attrs, start, end, nbytes, descriptors, None, context)
    second = _points(reader)  # cumulative: the first four and the six after them
    key = (semconv.METRIC_DURATION, tuple(sorted(series_of(sends[0][0])[1].items())))
    assert first[key][0] == 4 and second[key][0] == 10


def test_the_shape_cache_starting_over_loses_no_row(monkeypatch):
    monkeypatch.setattr(record_metrics, "MAX_SHAPES", 3)
    tables, reader = _reader()
    metrics = RecordMetrics(tables)
    for i in range(10):  # ten shapes: the cache starts over three times
        static = dict(STATIC, **{semconv.SERVER_PORT: 5000 + i})
        metrics.send(_attrs(4096, 0, 1000, static=static), i * 2000, i * 2000 + 1000, 4096, 1, None, None)
    points = _points(reader)
    assert sum(v[0] for k, v in points.items() if k[0] == semconv.METRIC_SIZE) == 10
    assert len(tables._pending) <= 3  # the shapes let go of are forgotten once applied


def test_rows_appended_while_readers_collect_are_all_counted():
    tables, reader = _reader()
    metrics = RecordMetrics(tables)
    sends = _sends(20_000, seed=3)
    stop = threading.Event()

    def collect():
        while not stop.is_set():
            reader.get_metrics_data()

    collector = threading.Thread(target=collect)
    collector.start()
    try:
        for attrs, start, end, nbytes, descriptors, context in sends:
            metrics.send(attrs, start, end, nbytes, descriptors, None, context)
    finally:
        stop.set()
        collector.join()
    points = _points(reader)
    assert sum(v[0] for k, v in points.items() if k[0] == semconv.METRIC_DURATION) == len(sends)
    assert sum(v[2] for k, v in points.items() if k[0] == semconv.METRIC_SIZE) == sum(s[3] for s in sends)
