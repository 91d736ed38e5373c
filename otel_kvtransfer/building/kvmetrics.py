"""The package's metrics (docs/telemetry.md) kept in our own fixed-bucket tables, handed to the SDK's metric
readers as finished points.

An SDK histogram `record()` hashes its attributes, finds a series, takes a lock and offers an exemplar, on every
call: about 13 us on this machine, four or more times per transfer. Our series are few and known (the metric
attributes of the telemetry contract, low-cardinality) and our values were computed once by the builder, so a record
here is a bisect and a few additions into a table of the series; a successful send's values wait as one row of its
shape's `SendRows` and go in a column at a time (before every collection, and whenever the builder holds enough).
Each reader of the user's MeterProvider gets our points inside its own collection (its `_collect` callback is
wrapped: the exporter, interval and temporality stay the user's), as the metric data the SDK would have produced
for the same measurements: explicit-bucket histograms with min and max, exemplars pointing at the span (one per
bucket, the latest, under the provider's exemplar filter), monotonic sums for the counters (busy time summed over
the sends and recorded once per collection, with no exemplar), cumulative or delta as the reader prefers.

Views configured on the MeterProvider do not apply to these points (they never pass through the SDK's
instruments); `OTEL_KVTRANSFER_PIPELINE=sdk` gives SDK instruments back (docs/cost.md).
"""

import logging
import threading
import time
import weakref
from bisect import bisect_left
from collections import deque
from functools import reduce
from itertools import compress, repeat
from operator import add
from typing import Any, Callable, Deque, Dict, Iterable, List, Mapping, Optional, Tuple, Union, cast

from opentelemetry.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricReader,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext

from otel_kvtransfer import sdk_internals, semconv
from otel_kvtransfer.building import metric_rules as rules
from otel_kvtransfer.building.metric_rules import INSTRUMENTS, ROW_PEER_SPEED, SEND_ROW, Series, metric_labels
from otel_kvtransfer.version import __version__

_logger = logging.getLogger(__name__)

_BOUNDS = tuple(row[3] for row in INSTRUMENTS)  # None for a counter


def _searched(unit: str, bounds: Optional[Tuple[float, ...]]) -> Optional[Tuple[float, ...]]:
    """The boundaries a value's bucket is searched in: as ints for the instruments whose values are ints (bytes,
    counts), which finds the same bucket at half the cost of comparing an int with floats; as they are for the
    others (a float compared with ints costs as much again)."""
    if unit in _INT_UNITS and bounds and all(float(b).is_integer() and abs(b) < 2 ** 53 for b in bounds):
        return tuple(int(b) for b in bounds)
    return bounds


_INT_UNITS = ("By", "{descriptor}")
_SEARCHED = tuple(_searched(row[1], row[3]) for row in INSTRUMENTS)

# A send row (`SendRows`): metric_rules.send_row's figures, then the busy time the send added to its process's
# and its peer's series, and its exemplar: (time, span context), or None under the exemplar filter.
ROW_BUSY, ROW_PEER_BUSY, ROW_EXEMPLAR = ROW_PEER_SPEED + 1, ROW_PEER_SPEED + 2, ROW_PEER_SPEED + 3
Exemplar = Tuple[int, SpanContext]  # (time_ns, span context) of a measurement's exemplar
# A counter's running sum (`KVMetrics.held`): [index, key, labels, sum since the last collection, measured since].
HeldSum = List[Any]

MAX_SERIES = 2000  # per instrument, as the SDK's default cardinality limit; the rest goes to one overflow series
# kv_transfer.peer.throughput and kv_transfer.peer.busy_time have one series per peer up to
# OTEL_KVTRANSFER_MAX_PEERS (at most 65,536) plus `other`: their limit follows that setting (RecordMetrics raises
# it), so the documented bound holds.
_OVERFLOW_KEY = ("__overflow__",)
_OVERFLOW_ATTRIBUTES = {"otel.metric.overflow": True}

SCOPE = InstrumentationScope(semconv.INSTRUMENTATION_NAME, __version__, None, None)


def series_of(attributes: Mapping[str, Any]) -> Series:
    """(key, labels) of the series a span with these attributes belongs to."""
    labels = metric_labels(attributes)
    return tuple([labels.get(name) for name in semconv.METRIC_ATTRIBUTES]), labels


class _Point:
    """One series of one instrument since `start`: a histogram's buckets (or a counter's sum) and exemplars."""

    __slots__ = ("start", "sum", "min", "max", "buckets", "exemplars")

    def __init__(self, start: int, buckets: int) -> None:
        self.start = start
        self.sum: float = 0
        self.min = float("inf")
        self.max = float("-inf")
        self.buckets = [0] * buckets
        # per bucket: (value, (time_ns, span context)) or None
        self.exemplars: List[Optional[Tuple[float, Exemplar]]] = [None] * buckets


class _Table:
    """One reader's view of every series: cumulative points never reset, delta points reset at each collect."""

    def __init__(self, delta_histograms: bool, delta_counters: bool, limits: List[int]) -> None:
        self.delta = [delta_counters if row[3] is None else delta_histograms for row in INSTRUMENTS]
        self.limits = limits  # per instrument: series before the overflow series (shared, raised by the owner)
        self.series: List[Dict[Tuple[Any, ...], _Point]] = [{} for _ in INSTRUMENTS]
        self.labels: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
        self.interval_start = time.time_ns()  # a delta point starts where the previous collection ended

    def new_point(self, index: int, key: Tuple[Any, ...], labels: Dict[str, Any], now: int) -> _Point:
        """The point of a series seen for the first time (beyond MAX_SERIES: the overflow series)."""
        series = self.series[index]
        if len(series) >= self.limits[index]:
            key, labels = _OVERFLOW_KEY, _OVERFLOW_ATTRIBUTES
            point = series.get(key)
            if point is not None:
                return point
        bounds = _BOUNDS[index]
        point = series[key] = _Point(self.interval_start if self.delta[index] else now,
                                     len(bounds) + 1 if bounds else 1)
        self.labels.setdefault(key, labels)
        return point


class SendRows:
    """The successful sends of one send shape (one series, one peer) not yet in the tables, as rows. The builder
    appends; whoever applies next (the builder once enough are held, every reader just before it collects) takes
    them all under the tables' lock. A deque, never replaced: an append and a take cannot lose a row between
    them, whichever threads they run on."""

    __slots__ = ("key", "labels", "peer", "process_sum", "peer_sum", "rows", "append")

    def __init__(self, key: Tuple[Any, ...], labels: Dict[str, Any], peer: Optional[Series], process_sum: HeldSum,
                 peer_sum: Optional[HeldSum]) -> None:
        self.key, self.labels, self.peer = key, labels, peer  # peer: (key, labels) or None
        self.process_sum, self.peer_sum = process_sum, peer_sum  # running sums from `KVMetrics.held`
        self.rows: Deque[Tuple[Any, ...]] = deque()  # metric_rules.send_row's, and ROW_BUSY .. ROW_EXEMPLAR
        self.append = self.rows.append


_BY_PROVIDER: "weakref.WeakKeyDictionary[MeterProvider, KVMetrics]" = weakref.WeakKeyDictionary()
_BY_PROVIDER_LOCK = threading.Lock()


def tables_for(meter_provider: MeterProvider) -> Optional["KVMetrics"]:
    """The one KVMetrics of an SDK MeterProvider, attached to its readers on first use; None for a provider that
    is not the SDK's (yet). Like SDK instruments, the tables outlive uninstrument(): what was measured is still
    exported, and a later instrument() counts on from there."""
    with _BY_PROVIDER_LOCK:
        try:
            tables = _BY_PROVIDER.get(meter_provider)
        except TypeError:  # not weak-referenceable: not an SDK provider
            return None
        if tables is None:
            tables = KVMetrics()
            if not tables.attach(meter_provider):
                return None
            _BY_PROVIDER[meter_provider] = tables
        return tables


class KVMetrics:
    """Our instruments' tables, fed by the span builder, read by every reader of one MeterProvider."""

    def __init__(self, exemplar_filter: str = "trace_based") -> None:
        self._lock = threading.Lock()
        self._acquire, self._release = self._lock.acquire, self._lock.release
        self._tables: Dict[int, _Table] = {}  # id(reader) -> its table
        self._resource: Optional[Resource] = None
        self._exemplars = exemplar_filter  # "trace_based" | "always_on" | "always_off"
        self._limits = [MAX_SERIES] * len(INSTRUMENTS)
        # Counters summed before they are recorded (busy time: many sends, no exemplar): (index, key) ->
        # [index, key, labels, sum since the last collection, measured since then]; recorded at each collection.
        self._held: Dict[Tuple[int, Tuple[Any, ...]], HeldSum] = {}
        self._pending: List[SendRows] = []  # every shape's rows not yet in the tables
        self.attached = False

    def held(self, index: int, key: Tuple[Any, ...], labels: Dict[str, Any]) -> HeldSum:
        """The running sum of counter `index`'s series `key`: the builder adds to it through `record`'s `sums`,
        every collection records what it gathered since the last one (a series it never saw stays out)."""
        with self._lock:
            return self._held.setdefault((index, key), [index, key, labels, 0, False])

    def _record_held(self) -> None:
        with self._lock:
            due = [tuple(held[:4]) for held in self._held.values() if held[4]]
            for held in self._held.values():
                held[3], held[4] = 0, False
        for index, key, labels, value in due:
            self.record(key, labels, ((index, value),))

    def allow_series(self, index: int, count: int) -> None:
        """Let instrument `index` keep `count` series before its overflow series (never below MAX_SERIES)."""
        with self._lock:
            self._limits[index] = max(self._limits[index], int(count))

    # --- the builder's side -------------------------------------------------------------------------------
    def send_rows(self, key: Tuple[Any, ...], labels: Dict[str, Any], peer: Optional[Series], process_sum: HeldSum,
                  peer_sum: Optional[HeldSum]) -> SendRows:
        """Where the successful sends of one shape wait for `apply_pending` (the builder's shape cache holds it)."""
        rows = SendRows(key, labels, peer, process_sum, peer_sum)
        with self._lock:
            self._pending.append(rows)
        return rows

    def retire(self, retired: List[SendRows]) -> None:
        """Take these rows into the tables and forget them (the builder's shape cache let go of them)."""
        gone = {id(rows) for rows in retired}
        with self._lock:
            self._apply(retired)
            self._pending = [rows for rows in self._pending if id(rows) not in gone]

    def apply_pending(self) -> None:
        """Every row waiting, into every reader's table."""
        with self._lock:
            self._apply(self._pending)

    def _apply(self, pending: List[SendRows]) -> None:
        """Rows into the tables, a column (one instrument) at a time: the lock is held."""
        now = time.time_ns()
        for rows in pending:
            queue = rows.rows
            if not queue:
                continue
            pop = queue.popleft
            columns = list(zip(*[pop() for _ in range(len(queue))]))
            exemplars = columns[ROW_EXEMPLAR]
            for position, index in enumerate(SEND_ROW):
                self._add_column(index, rows.key, rows.labels, columns[position], exemplars, now)
            if rows.peer is not None:
                self._add_column(rules.I_PEER_THROUGHPUT, rows.peer[0], rows.peer[1], columns[ROW_PEER_SPEED],
                                 exemplars, now)
            for held, position in ((rows.process_sum, ROW_BUSY), (rows.peer_sum, ROW_PEER_BUSY)):
                if held is not None:
                    held[3] = reduce(add, columns[position], held[3])  # in order: the sum a send at a time gives
                    held[4] = True

    def _add_column(self, index: int, key: Tuple[Any, ...], labels: Dict[str, Any], values: Tuple[Any, ...],
                    exemplars: Tuple[Any, ...], now: int) -> None:
        """Histogram `index` gets `values` (None: the send has no such measurement), each with its exemplar
        ((time, span context) or None), in order: the same points as one `record` per value."""
        if None in values:
            if values.count(None) == len(values):  # an engine with no post time, sends too small for a peer speed
                return
            values, exemplars = zip(*[(value, exemplar) for value, exemplar in zip(values, exemplars)
                                      if value is not None])
        bounds = _SEARCHED[index]
        slots = list(map(bisect_left, repeat(bounds, len(values)), values)) if bounds else [0] * len(values)
        counts = [(slot, slots.count(slot)) for slot in set(slots)]  # values fall in few buckets
        low, high = min(values), max(values)
        latest = dict(compress(zip(slots, range(len(values))), exemplars)).items()  # per bucket, its last one
        for table in self._tables.values():
            point = table.series[index].get(key)
            if point is None:
                point = table.new_point(index, key, labels, now)
            point.sum = reduce(add, values, point.sum)  # in order, as the additions one at a time
            if low < point.min:
                point.min = low
            if high > point.max:
                point.max = high
            buckets, kept_exemplars = point.buckets, point.exemplars
            for slot, count in counts:
                buckets[slot] += count
            for slot, at in latest:
                kept_exemplars[slot] = (values[at], exemplars[at])

    def exemplar(self, span_context: Optional[SpanContext], now: int) -> Optional[Exemplar]:
        """(time, span context) of a measurement's exemplar under the provider's exemplar filter, or None. Its ids
        are read when collected, not per measurement."""
        if span_context is None:
            return None
        if self._exemplars == "trace_based":
            return (now, span_context) if span_context.trace_flags & 1 else None  # sampled
        return (now, span_context) if self._exemplars == "always_on" else None

    def record(self, key: Tuple[Any, ...], labels: Dict[str, Any], measurements: Iterable[Tuple[int, float]],
               span_context: Optional[SpanContext] = None, sums: Iterable[Tuple[HeldSum, float]] = ()) -> None:
        """`measurements`: (instrument index, value) pairs of one span; `key` and `labels`: its series (from
        `series_of`); `span_context`: that span (the exemplar, under the exemplar filter). `sums`: (running sum
        from `held`, value) pairs added under the same lock (a send's busy time: one lock per send, not two)."""
        now = time.time_ns()
        exemplar = self.exemplar(span_context, now)
        self._acquire()  # not `with`: half the cost, and this runs for every transfer
        try:
            for held, value in sums:
                held[3] += value
                held[4] = True
            bounds_of, bisect = _SEARCHED, bisect_left
            for table in self._tables.values():
                series = table.series
                for index, value in measurements:
                    point = series[index].get(key)
                    if point is None:
                        point = table.new_point(index, key, labels, now)
                    bounds = bounds_of[index]
                    slot = bisect(bounds, value) if bounds else 0
                    point.sum += value  # the count is the buckets' total, summed when collected
                    if value < point.min:
                        point.min = value
                    if value > point.max:
                        point.max = value
                    point.buckets[slot] += 1
                    if exemplar is not None:
                        point.exemplars[slot] = (value, exemplar)
        finally:
            self._release()

    # --- the readers' side --------------------------------------------------------------------------------
    def attach(self, meter_provider: MeterProvider) -> bool:
        """Wrap the collect callback of every reader of an SDK MeterProvider. False when it is not one (the
        API's no-op or proxy provider): nothing is recorded then, as the SDK instruments would record nothing."""
        config = sdk_internals.meter_config(meter_provider)
        readers = sdk_internals.metric_readers(meter_provider)
        if readers is None or config is None:
            return False
        if sdk_internals.meter_provider_disabled(meter_provider):  # OTEL_SDK_DISABLED: the SDK records nothing
            self.attached = True
            return True
        self._resource = config.resource
        self._exemplars = _exemplar_filter_name(getattr(config, "exemplar_filter", None))
        for reader in readers:
            original = sdk_internals.reader_collect(reader)
            if original is None:
                continue
            temporality = sdk_internals.reader_temporality(reader)
            delta_histograms = delta_counters = False
            for cls, value in temporality.items():
                if value is AggregationTemporality.DELTA:
                    if cls.__name__.endswith("Histogram"):
                        delta_histograms = True
                    elif cls.__name__ in sdk_internals.COUNTER_CLASS_NAMES:
                        delta_counters = True
            with self._lock:
                self._tables[id(reader)] = _Table(delta_histograms, delta_counters, self._limits)
            sdk_internals.set_reader_collect(reader, self._collect_hook(reader, original))
        self.attached = True
        return True

    def _collect_hook(self, reader: MetricReader, original: Callable[..., Optional[MetricsData]]
                      ) -> Callable[..., Optional[MetricsData]]:
        def collect(metric_reader: MetricReader, timeout_millis: float = 10_000,
                    **kwargs: Any) -> Optional[MetricsData]:
            data = original(metric_reader, timeout_millis=timeout_millis, **kwargs)
            try:
                ours = self._points(reader)
                if ours:
                    # attach() set the resource before it put this hook in place
                    return _merged(data, ours, cast(Resource, self._resource))
            except Exception:
                _logger.debug("otel_kvtransfer could not add its metric points", exc_info=True)
            return data

        return collect

    def _points(self, reader: MetricReader) -> List[Metric]:
        self.apply_pending()  # before the busy sums: the rows add to them
        self._record_held()
        now = time.time_ns()
        taken: List[Tuple[int, bool, List[Tuple[Tuple[Any, ...], _Point]]]] = []
        with self._lock:
            table = self._tables.get(id(reader))
            if table is None:
                return []
            for index, series in enumerate(table.series):
                if series:
                    taken.append((index, table.delta[index], [(key, _taken(point)) for key, point in series.items()]))
                    if table.delta[index]:
                        table.series[index] = {}
            table.interval_start = now
            labels = table.labels
        metrics: List[Metric] = []
        for index, delta, points in taken:
            name, unit, description, bounds = INSTRUMENTS[index]
            temporality = AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE
            data: Union[Sum, Histogram]
            if bounds is None:
                data = Sum(data_points=[_number_point(labels[key], point, now) for key, point in points],
                           aggregation_temporality=temporality, is_monotonic=True)
            else:
                data = Histogram(data_points=[_histogram_point(labels[key], point, now, bounds)
                                              for key, point in points],
                                 aggregation_temporality=temporality)
            metrics.append(Metric(name=name, description=description, unit=unit, data=data))
        return metrics


def _taken(point: _Point) -> _Point:
    """The point as collected now. Its exemplars leave with it (one collection's, as the SDK's reservoirs); a
    cumulative point keeps counting from where it is."""
    copy = _Point(point.start, 0)
    copy.sum, copy.min, copy.max = point.sum, point.min, point.max
    copy.buckets, copy.exemplars = list(point.buckets), point.exemplars
    point.exemplars = [None] * len(point.buckets)
    return copy


def _exemplars(point: _Point, labels: Dict[str, Any]) -> List[Any]:
    exemplar = sdk_internals.exemplar_class()
    return [exemplar({}, value, at, context.span_id, context.trace_id)
            for value, (at, context) in (e for e in point.exemplars if e is not None)]


def _histogram_point(labels: Dict[str, Any], point: _Point, now: int, bounds: Tuple[float, ...]) -> HistogramDataPoint:
    return HistogramDataPoint(attributes=labels, start_time_unix_nano=point.start, time_unix_nano=now,
                              count=sum(point.buckets), sum=point.sum, bucket_counts=tuple(point.buckets),
                              explicit_bounds=tuple(bounds), min=point.min, max=point.max,
                              exemplars=_exemplars(point, labels))


def _number_point(labels: Dict[str, Any], point: _Point, now: int) -> NumberDataPoint:
    return NumberDataPoint(attributes=labels, start_time_unix_nano=point.start, time_unix_nano=now,
                           value=point.sum, exemplars=_exemplars(point, labels))


def _exemplar_filter_name(exemplar_filter: object) -> str:
    name = type(exemplar_filter).__name__ if exemplar_filter is not None else "TraceBasedExemplarFilter"
    if name == "AlwaysOnExemplarFilter":
        return "always_on"
    if name == "AlwaysOffExemplarFilter":
        return "always_off"
    return "trace_based"


def _merged(data: Optional[MetricsData], ours: List[Metric], resource: Resource) -> MetricsData:
    """The reader's collection with our metrics added under our scope (merged into it when the SDK already has
    a scope of ours, e.g. for the dropped-records counter)."""
    if data is None or not data.resource_metrics:
        return MetricsData(resource_metrics=[ResourceMetrics(resource=resource, scope_metrics=[
            ScopeMetrics(scope=SCOPE, metrics=ours, schema_url="")], schema_url="")])
    first, rest = data.resource_metrics[0], list(data.resource_metrics[1:])
    scopes, merged = [], False
    for scope_metrics in first.scope_metrics:
        if not merged and scope_metrics.scope.name == SCOPE.name:
            scope_metrics = ScopeMetrics(scope=scope_metrics.scope, metrics=list(scope_metrics.metrics) + ours,
                                         schema_url=scope_metrics.schema_url)
            merged = True
        scopes.append(scope_metrics)
    if not merged:
        scopes.append(ScopeMetrics(scope=SCOPE, metrics=ours, schema_url=""))
    return MetricsData(resource_metrics=[ResourceMetrics(resource=first.resource, scope_metrics=scopes,
                                                         schema_url=first.schema_url)] + rest)


__all__ = ["KVMetrics", "INSTRUMENTS", "SendRows", "metric_labels", "series_of", "tables_for"]
