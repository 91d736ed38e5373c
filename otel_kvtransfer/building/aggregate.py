"""The one set of rules for every figure derived from transfers: busy time, throughput, logical bytes, overlap,
quantiles.

The span builder computes a request's aggregates with `RequestAggregate`, and every offline tool (summarize,
timeline, perfetto, bench) uses the same functions, so a figure can never differ between a span and a summary.
Intervals are [start_ns, end_ns) pairs of integers.
"""

import math
from typing import Any, Dict, Hashable, Iterable, List, Optional, Sequence, Set, Tuple

from otel_kvtransfer import semconv

Interval = Tuple[int, int]
NS_PER_S = 1_000_000_000
MAX_COUNT = (1 << 63) - 1  # the largest integer OTLP carries (int64): byte and descriptor counts stop there


def union(intervals: Iterable[Interval]) -> List[Interval]:
    """Merge overlapping or touching intervals into a sorted disjoint list (a reversed pair is put right)."""
    merged: List[Interval] = []
    for start, end in sorted((s, e) if s <= e else (e, s) for s, e in intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def length(disjoint: Iterable[Interval]) -> int:
    return sum(end - start for start, end in disjoint)


def intersection_length(a: Sequence[Interval], b: Sequence[Interval]) -> int:
    """Total length shared by two sorted disjoint lists (as `union` returns them)."""
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def throughput(nbytes: float, duration_ns: float) -> float:
    """Bytes per second over a duration in nanoseconds; 0.0 when there is no duration to divide by."""
    return nbytes * NS_PER_S / duration_ns if duration_ns > 0 else 0.0


def logical_share(nbytes: float, replica_factor: Optional[int]) -> float:
    """The unique (non-replica) part of one send: every payload sent to N destinations counts once."""
    return nbytes / max(int(replica_factor or 1), 1)


def tail(busy: Sequence[Interval], compute: Sequence[Interval]) -> Dict[str, int]:
    """tail_ns, tail_busy_ns, tail_queued_ns of sorted disjoint send and compute intervals (as `union` returns)."""
    if not busy or not compute:
        return {"tail_ns": 0, "tail_busy_ns": 0, "tail_queued_ns": 0}
    compute_end, last_byte = compute[-1][1], busy[-1][1]
    tail_ns = max(last_byte - compute_end, 0)
    tail_busy = intersection_length(busy, [(compute_end, last_byte)]) if tail_ns else 0
    return {"tail_ns": tail_ns, "tail_busy_ns": tail_busy, "tail_queued_ns": tail_ns - tail_busy}


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = min(max(q, 0.0), 1.0) * (n - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class RequestAggregate:
    """Accumulates one request's sends and compute intervals; `figures()` gives its aggregates (docs/telemetry.md).

    Keys of `figures()`: bytes, logical_bytes, transfer_count, chunk_count, replica_factor, busy_ns,
    throughput, and when compute is known, overlap_ns and overlap_ratio, and the tail: tail_ns (end of the last
    send - end of the last compute, 0 when the last byte left before compute ended), tail_busy_ns (the part of
    that interval in which some transfer of the request moved bytes) and tail_queued_ns (the rest: nothing of
    the request moved).
    """

    __slots__ = ("sends", "compute", "chunks", "bytes", "logical", "transfers", "replica")

    def __init__(self) -> None:
        self.sends: List[Interval] = []
        self.compute: List[Interval] = []
        self.chunks: Set[Hashable] = set()
        self.bytes = 0
        self.logical = 0.0
        self.transfers = 0
        self.replica = 1

    def add_send(self, start_ns: int, end_ns: int, nbytes: int, replica_factor: Optional[int] = 1,
                 chunk_index: Optional[Hashable] = None) -> bool:
        """Add one send; True when the request's bytes cannot hold it: they stop at MAX_COUNT (no OTLP integer
        holds more)."""
        self.sends.append((start_ns, end_ns))
        if chunk_index is not None:
            self.chunks.add(chunk_index)
        capped = self.bytes + nbytes > MAX_COUNT
        self.bytes = min(self.bytes + nbytes, MAX_COUNT)
        self.logical += logical_share(nbytes, replica_factor)
        self.transfers += 1
        self.replica = max(self.replica, int(replica_factor or 1))
        return capped

    def add_compute(self, start_ns: int, end_ns: int) -> None:
        self.compute.append((start_ns, end_ns))

    def compact(self) -> None:
        """Merge the intervals kept so far (same figures, less memory for a request with many transfers)."""
        self.sends = union(self.sends)
        self.compute = union(self.compute)

    def figures(self) -> Dict[str, Any]:
        busy = union(self.sends)
        busy_ns = length(busy)
        out: Dict[str, Any] = {
            "bytes": self.bytes,
            "logical_bytes": min(int(round(self.logical)), MAX_COUNT),
            "transfer_count": self.transfers,
            "chunk_count": len(self.chunks),
            "replica_factor": self.replica,
            "busy_ns": busy_ns,
            "throughput": throughput(self.bytes, busy_ns),
        }
        if self.compute:
            compute = union(self.compute)
            overlap_ns = intersection_length(busy, compute)
            out["overlap_ns"] = overlap_ns
            out["overlap_ratio"] = overlap_ns / busy_ns if busy_ns else 0.0
            out.update(tail(busy, compute))
        return out


# A request's figures under the names its span carries them: the builder writes them with this mapping, and the
# tools read them back with it.
FIGURE_ATTRIBUTES = {
    "bytes": semconv.BYTES, "logical_bytes": semconv.LOGICAL_BYTES, "transfer_count": semconv.TRANSFER_COUNT,
    "chunk_count": semconv.CHUNK_COUNT, "replica_factor": semconv.REPLICA_FACTOR, "busy_s": semconv.BUSY_S,
    "throughput": semconv.THROUGHPUT, "compute_overlap_s": semconv.COMPUTE_OVERLAP_S,
    "compute_overlap_ratio": semconv.COMPUTE_OVERLAP_RATIO, "tail_s": semconv.TAIL_S,
    "tail_busy_s": semconv.TAIL_BUSY_S, "tail_queued_s": semconv.TAIL_QUEUED_S,
}


def span_figures(figures: Dict[str, Any]) -> Dict[str, Any]:
    """`RequestAggregate.figures()` in seconds, keyed as FIGURE_ATTRIBUTES (compute overlap only when known)."""
    out = {name: figures[name] for name in ("bytes", "logical_bytes", "transfer_count", "chunk_count",
                                             "replica_factor", "throughput")}
    out["busy_s"] = figures["busy_ns"] / NS_PER_S
    if "overlap_ns" in figures:
        out["compute_overlap_s"] = figures["overlap_ns"] / NS_PER_S
        out["compute_overlap_ratio"] = figures["overlap_ratio"]
    if "tail_ns" in figures:
        for name in ("tail", "tail_busy", "tail_queued"):
            out[name + "_s"] = figures[name + "_ns"] / NS_PER_S
    return out
