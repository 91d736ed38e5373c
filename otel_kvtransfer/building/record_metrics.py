"""The builder's figures as measurements into our metric tables (`kvmetrics.KVMetrics`), by the rules of
`metric_rules` (which the SDK pipeline's `processor.KVTransferMetricsProcessor` applies to the spans).

A successful send is one row appended to its shape's `kvmetrics.SendRows`; the tables take the rows a column at
a time (a bisect per value, a sum, a min and a max over each column), when enough are held and before every
collection, so a reader never misses one. Everything else (failed sends, sends whose attributes have no shared
part, requests, peer waits, set-up calls) is recorded as it comes.
"""

from time import time_ns
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Tuple, cast

from opentelemetry.trace import SpanContext

from otel_kvtransfer.building import metric_rules as rules
from otel_kvtransfer.building.kvmetrics import HeldSum, KVMetrics, SendRows, series_of

if TYPE_CHECKING:
    from otel_kvtransfer.building.direct_spans import OpenSpan
    from otel_kvtransfer.building.open_spans import OpenRequest

# Rows the builder holds before it applies them itself (the readers apply them at every collection): bounds the
# memory they take (a row carries its exemplar's own time, so a late application moves no exemplar).
PENDING_ROWS = 1024
# Send shapes kept (one per distinct shared part of a send's attributes): past it, the cache starts over.
MAX_SHAPES = 4096
# A send shape's series (`RecordMetrics._shape`): static attributes, key, labels, peer series, the process's busy
# time (its union's `add`, its running sum), the peer's (or None), the shape's SendRows (or None).
Busy = Tuple[Callable[[int, int], float], HeldSum]
Shape = Tuple[Optional[Dict[str, Any]], Tuple[Any, ...], Dict[str, Any], Optional[rules.Series], Busy, Optional[Busy],
              Optional[SendRows]]


class RecordMetrics:
    """What the builder measures, into one KVMetrics: a send's figures (rows or records), its busy time, and the
    figures of requests, peer waits and set-up calls."""

    def __init__(self, tables: KVMetrics, max_peers: int = 64) -> None:
        self.tables = tables
        # (id(static attributes), error type) -> the send shape's series (`_shape`)
        self._series: Dict[Tuple[int, Optional[str]], Shape] = {}
        self._peers = rules.PeerSeries(max_peers)
        self._busy = rules.BusyTime()
        self._held_rows = 0
        for index in rules.PER_PEER:
            tables.allow_series(index, max_peers + 1)  # every peer, and `other`

    def _shape(self, attrs: Mapping[str, Any], failure: Optional[str]) -> Shape:
        """(static, key, labels, peer series or None, the process's busy time (its union's `add`, its running
        sum), the peer's (or None), the shape's SendRows or None) of a send, computed once per shape of the
        builder's attributes (the part sends share, which holds the engine, the peer and the request's labels).
        Only a successful send with a shared part has rows: the others are few, and recorded as they come."""
        static = getattr(attrs, "static", None)
        if static is not None:
            cached = self._series.get((id(static), failure))
            if cached is not None and cached[0] is static:
                return cached
        key, labels = series_of(attrs)
        peer = self._peers.of(attrs)
        # busy time sums many sends: the tables add it up and record it once per collection, with no exemplar
        process = rules.process_series(attrs)
        process_sum = self.tables.held(rules.I_BUSY_TIME, *process)
        peer_sum = self.tables.held(rules.I_PEER_BUSY_TIME, *peer) if peer is not None else None
        if static is not None and len(self._series) >= MAX_SHAPES:
            self.tables.retire([shape[6] for shape in self._series.values() if shape[6] is not None])
            self._series.clear()
        rows = self.tables.send_rows(key, labels, peer, process_sum, peer_sum) \
            if static is not None and not failure else None
        # (a peer has its running sum: once per shape, the cast says so)
        shape: Shape = (static, key, labels, peer, (self._busy.union(process[0]).add, process_sum),
                        (self._busy.union(peer[0]).add, cast(HeldSum, peer_sum)) if peer is not None else None, rows)
        if static is not None:
            self._series[(id(static), failure)] = shape
        return shape

    def send(self, attrs: Mapping[str, Any], start_ns: int, end_ns: int, nbytes: int, descriptors: int,
             failure: Optional[str], span_context: SpanContext) -> None:
        _static, key, labels, peer, (process_add, process_sum), peer_busy, rows = self._shape(attrs, failure)
        busy_s = process_add(start_ns, end_ns)
        peer_busy_s = peer_busy[0](start_ns, end_ns) if peer_busy is not None else 0.0
        duration_s = (end_ns - start_ns) / 1e9
        if rows is not None:
            rows.append(rules.send_row(attrs, duration_s, nbytes, descriptors, busy_s, peer_busy_s,
                                       self.tables.exemplar(span_context, time_ns())))
            self._held_rows += 1
            if self._held_rows >= PENDING_ROWS:
                self._held_rows = 0
                self.tables.apply_pending()
            return
        sums = ((process_sum, busy_s),) if peer_busy is None else ((process_sum, busy_s), (peer_busy[1], peer_busy_s))
        self.tables.record(key, labels, rules.send(attrs, duration_s, nbytes, descriptors, bool(failure)),
                           span_context, sums)
        if failure:  # its own series: the NIC it went out on, where known
            self.tables.record(*rules.failure(attrs, key, labels), span_context)
        if peer is not None:
            speed = rules.peer_speed(attrs, nbytes, bool(failure))
            if speed:
                self.tables.record(peer[0], peer[1], speed, span_context)

    def late(self, attrs: Mapping[str, Any], span_context: SpanContext) -> None:
        self.tables.record(*series_of(attrs), rules.late_send(), span_context)

    def request(self, figures: Dict[str, Any], span: "OpenSpan", state: "OpenRequest", end_ns: int,
                failure: Optional[str]) -> None:
        duration_s = (max(end_ns, span.start_time) - span.start_time) / 1e9
        self.tables.record(*series_of(span.attributes), rules.request(figures, duration_s, bool(failure)),
                           span.context)

    def peer(self, span: "OpenSpan", end_ns: int) -> None:
        self.tables.record(*series_of(span.attributes),
                           rules.peer_wait((max(end_ns, span.start_time) - span.start_time) / 1e9), span.context)
        outcomes = rules.peer_outcomes(span.attributes)
        if outcomes:
            self.tables.record(*rules.framework_series(span.attributes), outcomes, span.context)

    def connect(self, attrs: Mapping[str, Any], start_ns: int, end_ns: int, span_context: SpanContext) -> None:
        self.tables.record(*rules.connect_series(attrs), rules.connect((end_ns - start_ns) / 1e9), span_context)


class _NoMetrics:
    """The SDK path: a span processor derives the metrics from the spans."""

    def send(self, *args: object) -> None:
        pass

    request = peer = late = connect = send


NO_METRICS = _NoMetrics()

__all__ = ["NO_METRICS", "PENDING_ROWS", "RecordMetrics"]
