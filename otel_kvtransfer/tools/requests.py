"""Group a stream of spans into requests, keeping per-request aggregates instead of the spans themselves.

A request is one ``kv_transfer.request`` span with its ``kv_transfer.send`` and ``kv_transfer.compute``
children (spans are grouped by (trace, request span id), so children may come before their parent, as exporters
write them); sends outside any request span (raw engine calls) group by their parent, or by
(trace, request key) when they have none. The peer's waiting spans (``kv_transfer.receive`` for a push,
``kv_transfer.serve`` for a pull) join the requests of the same (trace, request key), falling back to the
bootstrap room of older files, then to the trace.

Every figure comes from `otel_kvtransfer.building.aggregate`, the rules the span builder uses: a request span that
carries its aggregates is shown as it is; otherwise `RequestAggregate` computes them from the children.
"""

from __future__ import annotations

import heapq
from array import array
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.building import aggregate
from otel_kvtransfer.tools.spanfile import Span

PEER_SPANS = (sc.SPAN_RECEIVE, sc.SPAN_SERVE)
CHILD_SPANS = (sc.SPAN_SEND, sc.SPAN_COMPUTE)
# Intervals kept per request before they are merged (busy time needs only their union). After a merge the next
# one waits until the list has doubled: disjoint intervals do not shrink when merged, and merging at a fixed size
# would sort the whole list again for every new span (quadratic); doubling keeps the total O(n log n).
_COMPACT_AT = 4096
# Send (and compute) spans of one request attached for drawing: a bar each is all a block can show in its ~1,000
# pixels, so a request of 100,000 sends would make a page of tens of MB for nothing (`attach_children`).
DRAWN_PER_REQUEST = 1000

# Request-span attributes shown as they are, and their names in a summary row.
FIGURE_ATTRIBUTES = aggregate.FIGURE_ATTRIBUTES
_IDENTITY = (sc.REQUEST_KEY, sc.BOOTSTRAP_ROOM, sc.FRAMEWORK, sc.BACKEND, sc.ROLE, sc.GEN_AI_REQUEST_MODEL)


def engine_label(resource: dict) -> str:
    """A short name of the process that emitted a span: service name plus instance id or pid."""
    name = str(resource.get("service.name") or "unknown_service")
    inst = resource.get("service.instance.id")
    if inst:
        inst = str(inst)
        if len(inst) == 36 and inst.count("-") == 4:  # a uuid: its first group tells engines apart
            inst = inst[:8]
        return f"{name} [{inst}]"
    pid = resource.get("process.pid")
    return f"{name} [pid {pid}]" if pid else name


def send_bytes(span: Span) -> int:
    return span.attributes.get(sc.BYTES) or 0


def send_throughput(span: Span) -> Optional[float]:
    """The send span's own throughput attribute, else its bytes over its duration (aggregate.throughput)."""
    value = span.attributes.get(sc.THROUGHPUT)
    if value is not None:
        return float(value)
    return aggregate.throughput(send_bytes(span), span.duration_ns) or None


def group_key(span: Span) -> Optional[tuple]:
    """The request a span belongs to, or None for spans that are not part of one (peers, foreign spans)."""
    if span.name == sc.SPAN_REQUEST:
        return span.trace_id, span.span_id
    if span.name in CHILD_SPANS:
        if span.parent_span_id:
            return span.trace_id, span.parent_span_id
        key = span.attributes.get(sc.REQUEST_KEY, span.attributes.get(sc.BOOTSTRAP_ROOM))
        return span.trace_id, f"key:{key}"
    return None


def _key_of(attributes: dict) -> Optional[str]:
    key = attributes.get(sc.REQUEST_KEY)
    if key is None and attributes.get(sc.BOOTSTRAP_ROOM) is not None:
        key = str(attributes[sc.BOOTSTRAP_ROOM])
    return key


class TailMark(NamedTuple):
    """Where a request's tail lies (ns, on the initiator's clock; the last byte may precede the compute end, a tail
    of 0) and its figures (s) as the request states them."""

    compute_end_ns: int
    last_byte_ns: int
    tail_s: float
    tail_busy_s: float
    tail_queued_s: float


class Request:
    """One request: identity, status, its figures, and (filled only for drawing) its child spans."""

    __slots__ = ("trace_id", "group", "span_id", "identity", "engine", "start_ns", "end_ns", "has_span",
                 "status", "error_type", "figure_attrs", "aggregate", "send_spans", "compute_spans",
                 "send_error", "last_chunk", "last_flagged", "peers", "span", "sends", "computes", "compact_at",
                 "sends_not_drawn", "computes_not_drawn", "all_busy", "last_ends")
    start_ns: Any  # ints from the first span noted (note_time) on
    end_ns: Any
    last_chunk: Optional[list]
    last_flagged: Optional[list]

    def __init__(self, trace_id: str, group):
        self.trace_id = trace_id
        self.group = group
        self.span_id: Optional[str] = None
        self.identity: dict = {}
        self.engine = ""
        self.start_ns = self.end_ns = None
        self.has_span = False
        self.status = "UNSET"
        self.error_type: Optional[str] = None
        self.figure_attrs: dict = {}
        self.aggregate: Any = aggregate.RequestAggregate()  # None once the span's own figures are shown
        self.send_spans = self.compute_spans = 0
        self.send_error: Optional[str] = None
        self.last_chunk = None  # [chunk index, first start, last end] of the highest chunk's sends
        self.last_flagged = None  # [first start, last end] of the sends marked is_last_chunk
        self.peers: list = []
        self.span: Optional[Span] = None  # the request span itself, kept only by `attach_children`
        self.sends: list = []
        self.computes: list = []
        self.compact_at = _COMPACT_AT
        # Set by `attach_children` when it keeps only some children: how many it left out, the union of every send
        # (the busy strip and the tail's gaps), and the last end of every send and compute (the tail).
        self.sends_not_drawn = self.computes_not_drawn = 0
        self.all_busy: Optional[list] = None
        self.last_ends: Optional[tuple] = None

    # ---- building
    def note_time(self, span: Span, own: bool) -> None:
        """The request span's own times when there is one, else the hull of what was seen."""
        lo, hi = span.start_time_unix_nano, span.end_time_unix_nano
        if own or self.start_ns is None:
            self.start_ns, self.end_ns = lo, hi
        elif not self.has_span:
            self.start_ns, self.end_ns = min(self.start_ns, lo), max(self.end_ns, hi)

    def note_identity(self, span: Span, override: bool = False) -> None:
        for key in _IDENTITY:
            value = span.attributes.get(key)
            if value is not None and (override or key not in self.identity):
                self.identity[key] = value
        if override or not self.engine:
            self.engine = engine_label(span.resource)

    def add_request_span(self, span: Span) -> None:
        self.has_span = True
        self.span_id = span.span_id
        self.note_time(span, own=True)
        self.note_identity(span, override=True)
        self.status = span.status_code
        error = span.attributes.get(sc.ERROR_TYPE)
        self.error_type = str(error) if error is not None else None
        self.figure_attrs = {name: span.attributes[key] for name, key in FIGURE_ATTRIBUTES.items()
                             if key in span.attributes}
        if self._has_own_figures():
            self.aggregate = None  # the span's figures are shown: the children's intervals are not needed

    def add_child(self, span: Span) -> None:
        self.note_time(span, own=False)
        self.note_identity(span)
        lo, hi = span.start_time_unix_nano, span.end_time_unix_nano
        if span.name == sc.SPAN_COMPUTE:
            self.compute_spans += 1
            if self.aggregate is not None:
                self.aggregate.add_compute(lo, hi)
                self._maybe_compact(len(self.aggregate.compute))
            return
        attrs = span.attributes
        self.send_spans += 1
        chunk = attrs.get(sc.CHUNK_INDEX)
        if self.aggregate is not None:
            self.aggregate.add_send(lo, hi, send_bytes(span), attrs.get(sc.REPLICA_FACTOR) or 1, chunk)
            self._maybe_compact(len(self.aggregate.sends))
        if span.is_error and self.send_error is None:
            self.send_error = str(attrs.get(sc.ERROR_TYPE) or "error")
        if chunk is not None:
            last = self.last_chunk
            if last is None or chunk > last[0]:
                self.last_chunk = [chunk, lo, hi]
            elif chunk == last[0]:
                last[1], last[2] = min(last[1], lo), max(last[2], hi)
        if attrs.get(sc.IS_LAST_CHUNK) is True:
            flagged = self.last_flagged
            self.last_flagged = [lo, hi] if flagged is None else [min(flagged[0], lo), max(flagged[1], hi)]

    def _maybe_compact(self, kept: int) -> None:
        if kept > self.compact_at:
            self.aggregate.compact()
            self.compact_at = max(_COMPACT_AT, 2 * max(len(self.aggregate.sends), len(self.aggregate.compute)))

    # ---- identity
    @property
    def key(self) -> Optional[str]:
        return _key_of(self.identity)

    @property
    def room(self) -> Optional[int]:
        return self.identity.get(sc.BOOTSTRAP_ROOM)

    @property
    def framework(self) -> Optional[str]:
        return self.identity.get(sc.FRAMEWORK)

    @property
    def backend(self) -> Optional[str]:
        return self.identity.get(sc.BACKEND)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / aggregate.NS_PER_S

    @property
    def final_status(self) -> str:
        if self.has_span:
            return self.status
        return "ERROR" if self.send_error or any(p.is_error for p in self.peers) else "UNSET"

    @property
    def final_error_type(self) -> Optional[str]:
        return self.error_type or self.send_error

    # ---- figures
    def figures(self) -> dict:
        """The request's aggregates (docs/telemetry.md): the request span's own when it carries them, else from
        its children."""
        out = dict.fromkeys(FIGURE_ATTRIBUTES)
        if self._has_own_figures():
            out.update(self.figure_attrs)
            return out
        if not self.send_spans:
            return out
        out.update(aggregate.span_figures(self.aggregate.figures()))
        return out

    def _has_own_figures(self) -> bool:
        return "bytes" in self.figure_attrs and "busy_s" in self.figure_attrs

    def busy_intervals(self) -> list:
        """The union of the send intervals (from the attached sends when drawing)."""
        if self.all_busy is not None:
            return self.all_busy
        if self.sends or self.aggregate is None:
            return aggregate.union((s.start_time_unix_nano, s.end_time_unix_nano) for s in self.sends)
        return aggregate.union(self.aggregate.sends)

    def tail_mark(self) -> Optional[TailMark]:
        """The tail to draw: from the end of the last compute to the last byte of the attached children, with the
        request's tail figures (its span's own, else `aggregate.tail` of the children); None where the request
        states no tail (compute unknown) or its children are not attached."""
        figures = self.figures()
        if figures["tail_s"] is None or not self.sends or not self.computes:
            return None
        # The last ends are what aggregate.tail takes from the unions: the greatest end of each kind (of every
        # child, drawn or not).
        if self.last_ends is not None:
            last_byte, compute_end = self.last_ends
        else:
            compute_end = max(s.end_time_unix_nano for s in self.computes)
            last_byte = max(s.end_time_unix_nano for s in self.sends)
        return TailMark(compute_end, last_byte, figures["tail_s"], figures["tail_busy_s"] or 0.0,
                        figures["tail_queued_s"] or 0.0)

    def last_chunk_rate(self, nbytes: Optional[float]) -> Optional[float]:
        """What engines report today: all of a request's bytes over the latency of only its last chunk."""
        window = self.last_flagged or (self.last_chunk[1:] if self.last_chunk else None)
        if window is None or not nbytes:
            return None
        return aggregate.throughput(nbytes, window[1] - window[0]) or None

    def to_dict(self) -> dict:
        figures = self.figures()
        return {
            "request_key": self.key,
            "bootstrap_room": self.room,
            "framework": self.framework,
            "backend": self.backend,
            "role": self.identity.get(sc.ROLE),
            "model": self.identity.get(sc.GEN_AI_REQUEST_MODEL),
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "engine": self.engine,
            "status": self.final_status,
            "error_type": self.final_error_type,
            "start_time_unix_nano": self.start_ns,
            "end_time_unix_nano": self.end_ns,
            "duration_s": self.duration_s,
            **figures,
            "last_chunk_rate": self.last_chunk_rate(figures["bytes"]),
            "send_spans": self.send_spans,
            "compute_spans": self.compute_spans,
            "peer_spans": len(self.peers),
        }


class RequestSet:
    """Feed spans with `add` (any order), then `finish()`: the requests, ordered by start time. Keeps per-request
    aggregates and the per-transfer throughputs, not the spans."""

    def __init__(self):
        self.groups: dict = {}
        self.peers: list = []
        self.throughputs = array("d")  # every successful send's own throughput (By/s), for the distribution
        self.span_count = 0

    def add(self, span: Span) -> None:
        self.span_count += 1
        if span.name in PEER_SPANS:
            self.peers.append(span)
            return
        group = group_key(span)
        if group is None:
            return
        request = self.groups.get(group)
        if request is None:
            request = self.groups[group] = Request(span.trace_id, group)
        if span.name == sc.SPAN_REQUEST:
            request.add_request_span(span)
            return
        request.add_child(span)
        if span.name == sc.SPAN_SEND and not span.is_error:
            rate = send_throughput(span)
            if rate:
                self.throughputs.append(rate)

    def finish(self) -> list:
        requests = [r for r in self.groups.values() if r.has_span or r.send_spans]
        by_key: Dict[Tuple[str, str], List[Request]]
        by_trace: Dict[str, List[Request]]
        by_key, by_trace = {}, {}
        for request in requests:
            by_trace.setdefault(request.trace_id, []).append(request)
            if request.key is not None:
                by_key.setdefault((request.trace_id, request.key), []).append(request)
        for peer in self.peers:
            key = _key_of(peer.attributes)
            matched = by_key.get((peer.trace_id, key)) if key is not None else None
            matched = matched or by_trace.get(peer.trace_id)
            if not matched:  # a peer-only view (the decode side's file): the peer stands as its own request
                request = Request(peer.trace_id, (peer.trace_id, peer.span_id))
                request.note_identity(peer)
                request.note_time(peer, own=False)
                matched = [request]
                requests.append(request)
                by_trace.setdefault(peer.trace_id, []).append(request)
                if key is not None:
                    by_key[(peer.trace_id, key)] = matched
            for request in matched:
                request.peers.append(peer)
        requests.sort(key=lambda r: (r.start_ns, r.key or ""))
        return requests


def attach_children(requests: Sequence[Request], spans: Iterable[Span],
                    max_children: Optional[int] = DRAWN_PER_REQUEST) -> None:
    """Second pass for drawing: give each of `requests` its request span and its send and compute spans; of a
    request with more than `max_children` sends (or computes), only the first `max_children` by start are kept
    (the rest counted in `sends_not_drawn` / `computes_not_drawn`; None: no bound), so memory follows what is
    drawn, and its busy strip and tail still come from every send (`all_busy`, `last_ends`)."""
    wanted = {r.group: r for r in requests}
    bounded = {}
    request: Optional[Request]
    for request in requests:
        if max_children and (request.send_spans > max_children or request.compute_spans > max_children):
            bounded[request.group] = _FirstChildren(max_children)
    for span in spans:
        group = group_key(span)
        request = wanted.get(group)
        if request is None:
            continue
        if span.name == sc.SPAN_REQUEST:
            request.span = span
        elif group in bounded:
            bounded[group].add(span)
        else:
            (request.sends if span.name == sc.SPAN_SEND else request.computes).append(span)
    for request in requests:
        kept = bounded.get(request.group)
        if kept is not None:
            kept.finish(request)
            continue
        request.sends.sort(key=lambda s: (s.start_time_unix_nano, s.end_time_unix_nano))
        request.computes.sort(key=lambda s: s.start_time_unix_nano)


class _FirstChildren:
    """The first `limit` sends and computes of one request by (start, end, file order), in bounded heaps, with
    the union of every send interval (merged as the list doubles, as `Request` does) and the last ends."""

    def __init__(self, limit: int):
        self.limit = limit
        self.heaps: Dict[str, list] = {sc.SPAN_SEND: [], sc.SPAN_COMPUTE: []}
        self.seen = {sc.SPAN_SEND: 0, sc.SPAN_COMPUTE: 0}
        self.ends: Dict[str, Optional[int]] = {sc.SPAN_SEND: None, sc.SPAN_COMPUTE: None}
        self.starts, self.stops = array("q"), array("q")
        self.compact_at = _COMPACT_AT

    def add(self, span: Span) -> None:
        name = span.name
        lo, hi = span.start_time_unix_nano, span.end_time_unix_nano
        number = self.seen[name]
        self.seen[name] = number + 1
        last = self.ends[name]
        self.ends[name] = hi if last is None else max(last, hi)
        heap = self.heaps[name]
        entry = (-lo, -hi, -number, span)  # a max-heap: its top is the child that comes last
        if len(heap) < self.limit:
            heapq.heappush(heap, entry)
        elif entry > heap[0]:
            heapq.heapreplace(heap, entry)
        if name == sc.SPAN_SEND:
            self.starts.append(lo)
            self.stops.append(hi)
            if len(self.starts) > self.compact_at:
                self._compact()

    def _compact(self) -> list:
        merged = aggregate.union(zip(self.starts, self.stops))
        self.starts = array("q", (lo for lo, _hi in merged))
        self.stops = array("q", (hi for _lo, hi in merged))
        self.compact_at = max(_COMPACT_AT, 2 * len(merged))
        return merged

    def finish(self, request: Request) -> None:
        def ordered(name):
            return [entry[3] for entry in sorted(self.heaps[name], key=lambda e: (-e[0], -e[1], -e[2]))]

        request.sends, request.computes = ordered(sc.SPAN_SEND), ordered(sc.SPAN_COMPUTE)
        request.sends_not_drawn = self.seen[sc.SPAN_SEND] - len(request.sends)
        request.computes_not_drawn = self.seen[sc.SPAN_COMPUTE] - len(request.computes)
        request.all_busy = self._compact()
        request.last_ends = (self.ends[sc.SPAN_SEND], self.ends[sc.SPAN_COMPUTE])


def select_requests(requests: Sequence[Request], keys: Optional[Iterable[str]] = None,
                    since_s: Optional[float] = None, until_s: Optional[float] = None,
                    origin_ns: Optional[int] = None) -> list:
    """Requests whose key (or bootstrap room) is in `keys` when given, and whose time overlaps
    [since_s, until_s] in seconds after `origin_ns` (default: the earliest request start)."""
    if not requests:
        return []
    if origin_ns is None:
        origin_ns = min(r.start_ns for r in requests)
    wanted = {str(k) for k in keys} if keys else None
    lo = origin_ns + _ns(since_s) if since_s is not None else None
    hi = origin_ns + _ns(until_s) if until_s is not None else None
    out = []
    for request in requests:
        if wanted is not None and request.key not in wanted and str(request.room) not in wanted:
            continue
        if lo is not None and request.end_ns < lo:
            continue
        if hi is not None and request.start_ns > hi:
            continue
        out.append(request)
    return out


_WINDOW_NS = 1 << 62  # beyond any span time (spans end before 2^63 ns): a window bound past it selects all


def _ns(seconds: float) -> int:
    """Seconds as nanoseconds, clamped so that no finite value overflows."""
    return int(max(-_WINDOW_NS, min(seconds * aggregate.NS_PER_S, _WINDOW_NS)))
