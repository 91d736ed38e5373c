"""The metric table and its rules: which instruments exist, and what one ended span measures into them.

Both pipelines apply these rules: `record_metrics.RecordMetrics` (our own tables, the default) to the figures the
builder has in hand, `processor.KVTransferMetricsProcessor` (SDK instruments, `OTEL_KVTRANSFER_PIPELINE=sdk`) to
ended spans. A rule returns (instrument index, value) pairs; each pipeline only says where they go.
"""

import logging
import threading
from bisect import bisect_left, bisect_right
from typing import Any, Dict, List, Mapping, Optional, Tuple

from otel_kvtransfer import semconv

_logger = logging.getLogger(__name__)

# Bucket boundaries that fit KV transfers: a few KiB to tens of GiB, microseconds to minutes, MB/s to TB/s.
SECONDS_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0)
BYTES_BUCKETS = tuple(float(1 << n) for n in range(10, 36, 2))  # 1 KiB .. 16 GiB, x4 steps
RATE_BUCKETS = tuple(x * 10.0 ** e for e in range(6, 13) for x in (1.0, 2.5, 5.0))  # 1 MB/s .. 5 TB/s
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
COUNT_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0)

# A rule's measurements: (instrument index, value) pairs.
Measurements = Tuple[Tuple[int, float], ...]
# A series: (key, labels): the key identifies it in a table, the labels are its metric attributes.
Series = Tuple[Tuple[Any, ...], Dict[str, Any]]
# (name, unit, description, bucket boundaries or None for a counter): the telemetry contract's table.
Instrument = Tuple[str, str, str, Optional[Tuple[float, ...]]]
INSTRUMENTS: Tuple[Instrument, ...] = (
    (semconv.METRIC_DURATION, "s", "Duration of one KV transfer", SECONDS_BUCKETS),
    (semconv.METRIC_SIZE, "By", "Bytes moved by one KV transfer", BYTES_BUCKETS),
    (semconv.METRIC_THROUGHPUT, "By/s", "Bytes of one successful KV transfer over its own duration", RATE_BUCKETS),
    (semconv.METRIC_DESCRIPTORS, "{descriptor}", "Memory descriptors (contiguous pieces) in one KV transfer",
     COUNT_BUCKETS),
    (semconv.METRIC_FAILURES, "{transfer}", "KV transfers that failed", None),
    (semconv.METRIC_REQUEST_DURATION, "s", "From a request's first transfer enqueue to its conclusion",
     SECONDS_BUCKETS),
    (semconv.METRIC_REQUEST_SIZE, "By", "Wire bytes of one request's KV transfers", BYTES_BUCKETS),
    (semconv.METRIC_REQUEST_THROUGHPUT, "By/s",
     "A successful request's wire bytes over its busy time (union of its transfer intervals)", RATE_BUCKETS),
    (semconv.METRIC_REQUEST_COMPUTE_OVERLAP, "1",
     "Share of a request's busy transfer time that overlapped its compute", RATIO_BUCKETS),
    (semconv.METRIC_RECEIVE_DURATION, "s", "The peer's wait for a request's KV (receive or serve span)",
     SECONDS_BUCKETS),
    (semconv.METRIC_REQUEST_TAIL, "s",
     "Time from a request's last compute to its last KV byte: what the first decode step waited for",
     SECONDS_BUCKETS),
    (semconv.METRIC_REQUEST_TAIL_QUEUED, "s",
     "The part of a request's tail in which none of its transfers moved bytes (queues, threads)", SECONDS_BUCKETS),
    (semconv.METRIC_PEER_THROUGHPUT, "By/s",
     "Bytes of one successful KV send of at least 1 MiB over its own duration, per peer", RATE_BUCKETS),
    (semconv.METRIC_POST_DURATION, "s",
     "Time inside the call that posted a KV transfer (NIXL transfer(), Mooncake async submit)", SECONDS_BUCKETS),
    (semconv.METRIC_LATE_COMPLETIONS, "{transfer}", "KV sends that completed after their request had concluded",
     None),
    (semconv.METRIC_PEER_BUSY_TIME, "s",
     "Time in which at least one send of this process to the peer was in flight (rate(): the link's use)", None),
    (semconv.METRIC_BUSY_TIME, "s",
     "Time in which at least one send of this process was in flight, over all its peers", None),
    (semconv.METRIC_CONNECT_DURATION, "s", "Duration of one set-up call towards a peer (NIXL add_remote_agent...)",
     SECONDS_BUCKETS),
    (semconv.METRIC_RECEIVE_ALLOCATION_WAIT, "s",
     "Time from a request's admission on the receiving side until its KV memory was reserved", SECONDS_BUCKETS),
    (semconv.METRIC_INTEGRITY_MISMATCHES, "{request}",
     "Requests whose received KV failed the framework's integrity check (sglang's KV checksum)", None),
)
(I_DURATION, I_SIZE, I_THROUGHPUT, I_DESCRIPTORS, I_FAILURES, I_REQUEST_DURATION, I_REQUEST_SIZE,
 I_REQUEST_THROUGHPUT, I_REQUEST_OVERLAP, I_RECEIVE_DURATION, I_REQUEST_TAIL, I_REQUEST_TAIL_QUEUED,
 I_PEER_THROUGHPUT, I_POST_DURATION, I_LATE_COMPLETIONS, I_PEER_BUSY_TIME, I_BUSY_TIME,
 I_CONNECT_DURATION, I_ALLOCATION_WAIT, I_INTEGRITY_MISMATCHES) = range(len(INSTRUMENTS))
PER_PEER = (I_PEER_THROUGHPUT, I_PEER_BUSY_TIME)  # instruments whose series are the peers (PeerSeries)


def metric_labels(attributes: Mapping[str, Any]) -> Dict[str, Any]:
    """The low-cardinality metric attributes of a span's attributes (the design contract's list)."""
    return {key: attributes[key] for key in semconv.METRIC_ATTRIBUTES if key in attributes}


# --- the rules -------------------------------------------------------------------------------------------------
_THROUGHPUT, _POST_S = semconv.THROUGHPUT, semconv.POST_S  # read for every send
_PAYLOAD, _KV, _PEER_MIN = semconv.PAYLOAD, semconv.PAYLOAD_KV, semconv.PEER_THROUGHPUT_MIN_BYTES

# A successful send's measurements as one row (`send_row`), position by position: the send's own series, then its
# peer's speed; then what the caller carries along (send_row's `extra`).
SEND_ROW = (I_DURATION, I_SIZE, I_DESCRIPTORS, I_THROUGHPUT, I_POST_DURATION)
ROW_PEER_SPEED = len(SEND_ROW)


def send_row(attrs: Mapping[str, Any], duration_s: float, nbytes: int, descriptors: int,
             *extra: Any) -> Tuple[Any, ...]:
    """A successful send's measurements, None where it has none: an empty send, or one of no measurable duration
    (it carries no throughput), has no speed; only a send whose engine has a posting call has a post duration;
    only a kv send of >= 1 MiB has a peer speed (smaller ones say more about latency than about the link)."""
    speed = attrs.get(_THROUGHPUT) if nbytes > 0 else None
    peer = speed if nbytes >= _PEER_MIN and attrs.get(_PAYLOAD) == _KV else None
    return (duration_s, nbytes, descriptors, speed, attrs.get(_POST_S), peer) + extra


def send(attrs: Mapping[str, Any], duration_s: float, nbytes: int, descriptors: int, failed: bool) -> Measurements:
    """A send's measurements in its own series: `send_row`'s, or a failed send's (no speed; its failure is counted
    in a series of its own, `failure`)."""
    if not failed:
        row = send_row(attrs, duration_s, nbytes, descriptors)
        return tuple([(index, value) for index, value in zip(SEND_ROW, row) if value is not None])
    measured: Measurements = ((I_DURATION, duration_s), (I_SIZE, nbytes), (I_DESCRIPTORS, descriptors))
    post_s = attrs.get(_POST_S)
    if post_s is not None:
        measured += ((I_POST_DURATION, post_s),)
    return measured


_FAILED: Measurements = ((I_FAILURES, 1),)
_NIC = semconv.NIC


def failure(attrs: Mapping[str, Any], key: Tuple[Any, ...],
            labels: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any], Measurements]:
    """(key, labels, measurements) of a failed send's `kv_transfer.failures`: the send's own series (`key`,
    `labels`) and, where the send names it, its local NIC (`kv_transfer.nic`: a host has a few, so the series stay
    few; a bad NIC shows as the failures on it)."""
    nic = attrs.get(_NIC)
    if nic is None:
        return key, labels, _FAILED
    return key + (nic,), {**labels, _NIC: nic}, _FAILED


def peer_speed(attrs: Mapping[str, Any], nbytes: int, failed: bool) -> Measurements:
    """A send's measurement in its peer's series (`send_row`'s peer speed): none for a failed send."""
    speed = None if failed else send_row(attrs, 0.0, nbytes, 0)[ROW_PEER_SPEED]
    return () if speed is None else ((I_PEER_THROUGHPUT, speed),)


def late_send() -> Measurements:
    """A send that completed after its request had concluded (its send measurements come apart)."""
    return ((I_LATE_COMPLETIONS, 1),)


def request(attrs: Mapping[str, Any], duration_s: float, failed: bool) -> Measurements:
    """A request span's measurements; `attrs`: its figures (busy time, throughput, overlap, tail)."""
    nbytes = attrs.get(semconv.BYTES, 0)
    measured: Measurements = ((I_REQUEST_DURATION, duration_s), (I_REQUEST_SIZE, nbytes))
    if not failed and nbytes > 0 and attrs.get(semconv.BUSY_S, 0) > 0:  # no busy time: no speed
        measured += ((I_REQUEST_THROUGHPUT, attrs.get(semconv.THROUGHPUT, 0.0)),)
    if semconv.COMPUTE_OVERLAP_RATIO in attrs:
        measured += ((I_REQUEST_OVERLAP, attrs[semconv.COMPUTE_OVERLAP_RATIO]),)
    if semconv.TAIL_S in attrs:
        measured += ((I_REQUEST_TAIL, attrs[semconv.TAIL_S]), (I_REQUEST_TAIL_QUEUED, attrs[semconv.TAIL_QUEUED_S]))
    return measured


def peer_wait(duration_s: float) -> Measurements:
    """A receive or serve span: how long the peer waited for the request's KV."""
    return ((I_RECEIVE_DURATION, duration_s),)


def peer_outcomes(attrs: Mapping[str, Any]) -> Measurements:
    """A receive span's allocation wait and integrity mismatch, where its framework told them
    (`framework_series`)."""
    measured: Measurements = ()
    wait = attrs.get(semconv.ALLOCATION_WAIT_S)
    if wait is not None:
        measured += ((I_ALLOCATION_WAIT, wait),)
    if attrs.get(semconv.INTEGRITY) == semconv.INTEGRITY_MISMATCH:
        measured += ((I_INTEGRITY_MISMATCHES, 1),)
    return measured


def connect(duration_s: float) -> Measurements:
    """A set-up call towards a peer (a kv_transfer.connect span)."""
    return ((I_CONNECT_DURATION, duration_s),)


# --- the series that are not the spans' own labels -------------------------------------------------------------
class PeerSeries:
    """The peer series (server.address, server.port) of a send, for at most `max_peers` distinct peers per
    process; every other peer is `other` (said once in the log)."""

    def __init__(self, max_peers: int) -> None:
        self._max = max_peers
        self._known: Dict[Any, Series] = {}  # (address, port) -> its series (None -> `other`: the cap was reached)
        self._other: Series = ((semconv.PEER_OTHER, None), {semconv.SERVER_ADDRESS: semconv.PEER_OTHER})
        self._lock = threading.Lock()

    def of(self, attrs: Mapping[str, Any]) -> Optional[Series]:
        """(key, labels) of the send's peer, None when the send names none."""
        address = attrs.get(semconv.SERVER_ADDRESS)
        if address is None:
            return None
        peer = (address, attrs.get(semconv.SERVER_PORT))
        found = self._known.get(peer)
        if found is not None:
            return found
        with self._lock:
            if len(self._known) >= self._max:
                if len(self._known) == self._max:
                    self._known[None] = self._other  # the marker that the cap was reached (logged once)
                    _logger.warning("otel_kvtransfer: more than %d peers (OTEL_KVTRANSFER_MAX_PEERS); "
                                    "kv_transfer.peer.* counts the others as server.address=%s",
                                    self._max, semconv.PEER_OTHER)
                return self._other
            labels = {semconv.SERVER_ADDRESS: address}
            if peer[1] is not None:
                labels[semconv.SERVER_PORT] = peer[1]
            found = self._known[peer] = (peer, labels)
            return found


def process_series(attrs: Mapping[str, Any]) -> Series:
    """(key, labels) of a send's series of `kv_transfer.busy_time`: its backend and role."""
    labels = {key: attrs[key] for key in (semconv.BACKEND, semconv.ROLE) if key in attrs}
    return ("busy_time", labels.get(semconv.BACKEND), labels.get(semconv.ROLE)), labels


def framework_series(attrs: Mapping[str, Any]) -> Series:
    """(key, labels) of a peer wait's `peer_outcomes` series: its backend and framework."""
    labels = {key: attrs[key] for key in (semconv.BACKEND, semconv.FRAMEWORK) if key in attrs}
    return ("framework", labels.get(semconv.BACKEND), labels.get(semconv.FRAMEWORK)), labels


def connect_series(attrs: Mapping[str, Any]) -> Series:
    """(key, labels) of a set-up call's series: its backend, framework and outcome."""
    labels = {key: attrs[key] for key in (semconv.BACKEND, semconv.FRAMEWORK, semconv.CONNECT_OUTCOME)
              if key in attrs}
    return ("connect", labels.get(semconv.BACKEND), labels.get(semconv.FRAMEWORK),
            labels.get(semconv.CONNECT_OUTCOME)), labels


class BusyTime:
    """The link busy time: per series, the union of the send intervals seen so far, and what each new send adds
    to it (so a counter of the additions grows by the union's length, and its rate() is the share of time in use).

    Sends arrive as they end, not as they start: each series keeps its last `KEPT` disjoint busy stretches, which
    makes the addition exact for any send that starts after the oldest kept stretch ended. Past `KEPT`, the two
    oldest stretches are merged into one (the gap between them taken as busy), never forgotten: a send older than
    the kept stretches adds only what lies outside all of them, so the sum of the additions never exceeds the
    union of the intervals (at worst it misses a gap an old send covered), and no time is counted twice.

    A series' stretches are kept for the life of the process: up to `max_series` series (the peers, capped upstream
    at OTEL_KVTRANSFER_MAX_PEERS and `other`, and the process's few backend and role series); a series past that
    (a misuse) shares one union with the others past it, which again never counts a moment twice."""

    KEPT = 64
    MAX_SERIES = (1 << 16) + 1 + 256  # the most peers the setting allows, `other`, and the process series

    def __init__(self, max_series: int = MAX_SERIES) -> None:
        self._unions: Dict[Any, BusyUnion] = {}  # series key -> its BusyUnion
        self._max_series = max_series
        self._beyond: Optional[BusyUnion] = None  # the one union of the series past max_series

    def union(self, key: Any) -> "BusyUnion":
        """The union of series `key` (new and empty the first time): its `add` is `add(key, ...)` with the
        series already found, for a caller that keeps it per series."""
        union = self._unions.get(key)
        if union is None:
            if len(self._unions) >= self._max_series:
                if self._beyond is None:
                    self._beyond = BusyUnion(self.KEPT)
                return self._beyond
            union = self._unions[key] = BusyUnion(self.KEPT)
        return union

    def add(self, key: Any, start_ns: int, end_ns: int) -> float:
        """Seconds the send [start_ns, end_ns] adds to the busy time of series `key`."""
        return self.union(key).add(start_ns, end_ns)


class BusyUnion:
    """One series' kept busy stretches, sorted and disjoint (`BusyTime`)."""

    __slots__ = ("starts", "ends", "kept")
    starts: List[int]
    ends: List[int]
    kept: int

    def __init__(self, kept: int) -> None:
        self.starts, self.ends, self.kept = [], [], kept

    def add(self, start_ns: int, end_ns: int) -> float:
        """Seconds the send [start_ns, end_ns] adds to this union."""
        if end_ns <= start_ns:
            return 0.0
        starts, ends = self.starts, self.ends
        if not ends or start_ns > ends[-1]:  # after everything so far: the common case, sends in end order
            starts.append(start_ns)
            ends.append(end_ns)
            if len(starts) > self.kept:
                self._merge_oldest()
            return (end_ns - start_ns) / 1e9
        first = bisect_left(ends, start_ns)  # the first stretch that ends at or after the send's start
        last = bisect_right(starts, end_ns)  # past the last stretch that starts at or before its end
        before = 0  # what the stretches the send touches covered already
        for i in range(first, last):
            before += ends[i] - starts[i]
        if first < last:
            start_ns, end_ns = min(start_ns, starts[first]), max(end_ns, ends[last - 1])
        starts[first:last] = [start_ns]
        ends[first:last] = [end_ns]
        if len(starts) > self.kept:
            self._merge_oldest()
        return (end_ns - start_ns - before) / 1e9

    def _merge_oldest(self) -> None:
        """The two oldest stretches become one: what was counted stays covered (forgetting it would count it
        again when an old send ends over it)."""
        del self.starts[1], self.ends[0]
