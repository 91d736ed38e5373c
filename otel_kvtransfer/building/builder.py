"""The one place where records become spans: `SpanBuilder.handle` runs on the recorder's background thread (or in
the builder process's frame loop).

It hands each record, in the order it was recorded, to the part of the builder that builds its kind of span:
`request_spans` (requests and their compute), `send_spans` (sends), `peer_spans` (the peer's waits) and
`connect_spans` (set-up calls). Every span starts with the exact timestamps taken on the engine thread. The spans
that stay open across records live in `open_spans.OpenSpans` (bounded by number and by TTL; what it evicts ends
as evicted, and is counted); the builder's own work is what happens between records: eviction, stuck reports,
late-transfer lines, and ending what is open when instrumentation or the process ends.
"""

import math
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Optional, Tuple, Union

from opentelemetry.trace import Tracer

from otel_kvtransfer import semconv
from otel_kvtransfer.building import late
from otel_kvtransfer.building.builder_part import BuilderMetrics, Record, SpanFactory, span_factory
from otel_kvtransfer.building.connect_spans import ConnectSpans
from otel_kvtransfer.building.open_spans import OpenSpans
from otel_kvtransfer.building.peer_spans import PeerSpans
from otel_kvtransfer.building.record_metrics import NO_METRICS
from otel_kvtransfer.building.request_spans import RequestSpans
from otel_kvtransfer.building.send_spans import SendSpans
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import now_ns

if TYPE_CHECKING:
    from otel_kvtransfer.building.stuck import OpenWatch

# backend -> function(peer) -> span attributes of that engine's peer name (server.address, server.port, ...).
PeerParser = Callable[[Any], Dict[str, Any]]


class SpanBuilder:
    """`spans`: `direct_spans.DirectSpans`, or `sdk_spans.SdkSpans` (an SDK tracer given here is wrapped in one).
    `metrics`: where the builder's figures go as measurements (`record_metrics.RecordMetrics`), or nothing when a
    span processor derives them from the spans (the SDK pipeline). `watch`: `stuck.OpenWatch`."""

    def __init__(self, spans: Union[SpanFactory, Tracer], request_ttl_s: float, max_open: int = 65536,
                 peer_parsers: Optional[Dict[str, PeerParser]] = None,
                 on_drop: Optional[Callable[[str, int], None]] = None, clock: Callable[[], float] = time.monotonic,
                 metrics: Optional[BuilderMetrics] = None, watch: Optional["OpenWatch"] = None,
                 setup_in_first_call: Iterable[str] = (), late_watch_s: float = 30.0) -> None:
        spans, metrics = span_factory(spans), metrics or NO_METRICS
        peer_parsers = peer_parsers if peer_parsers is not None else {}
        self._spans = spans
        self._on_drop = on_drop = on_drop or (lambda reason, n: None)
        self._watch = watch  # stuck.OpenWatch: what is open now, what is stuck (None: not watched)
        self._ttl = request_ttl_s
        self._clock = clock
        # What the table evicts, the parts end (as evicted).
        self._open = OpenSpans(max_open, lambda state: self._request_spans.end_evicted(state),
                               lambda state: self._peer_spans.end_evicted(state), on_drop)
        self._ended = late.EndedRequests(on_drop=on_drop)  # concluded: a send of theirs arriving later is late
        self._late_lines = late.LateLines()  # the late transfers' log lines, a few a scan
        self._request_spans = requests = RequestSpans(spans, metrics, self._open, self._ended, watch)
        self._peer_spans = peers = PeerSpans(spans, metrics, self._open, self._late_lines, watch, request_ttl_s,
                                             late_watch_s, on_drop)
        sends = SendSpans(spans, metrics, requests, self._open, self._ended, self._late_lines, peer_parsers,
                          setup_in_first_call, on_drop)
        connects = ConnectSpans(spans, metrics, self._open.requests, peer_parsers)
        self._parts = (requests, peers, sends, connects)
        self._count_queue_drops()
        self._handlers = {
            r.SEND: sends.send,
            r.RAW_CALL: sends.raw_call,
            r.RAW_MONOTONIC: sends.raw_monotonic,
            r.RAW_ASYNC: sends.raw_async,
            r.BEGIN_REQUEST: requests.begin,
            r.END_REQUEST: requests.end,
            r.COMPUTE: requests.compute,
            r.BEGIN_PEER: peers.begin,
            r.END_PEER: peers.end,
            r.INFLIGHT: self._inflight,
            r.CONNECT: connects.connect,
            r.LATE_ARRIVAL: peers.late_arrival,
            r.PEER_OUTCOME: peers.outcome,
        }

    def handle(self, rec: Record) -> None:
        """One record, in the order it was recorded. Raises only on a bug (the recorder counts it)."""
        self._handlers[rec[r.KIND]](rec, self._clock())

    def set_spans(self, spans: Union[SpanFactory, Tracer], metrics: Optional[BuilderMetrics] = None) -> None:
        """The factory (and metrics) to build with from now on (an SDK that appeared after instrument())."""
        self._spans = spans = span_factory(spans)
        metrics = metrics or NO_METRICS
        for part in self._parts:
            part.use(spans, metrics)
        self._count_queue_drops()

    def _count_queue_drops(self) -> None:
        room = getattr(self._spans, "room", None)  # the direct path's back-pressure from the export queues
        if room is not None:
            room.on_drop = self._on_drop

    def open_count(self) -> int:
        return len(self._open)

    def reset(self) -> None:
        """Forget open spans without ending them (a forked child must not end its parent's spans)."""
        self._open.clear()
        self._ended.clear()
        self._peer_spans.clear()
        if self._watch is not None:
            self._watch.reset()

    # --- between records -------------------------------------------------------------------------------------
    def _inflight(self, rec: Record, now: float) -> None:
        if self._watch is not None:
            self._watch.sends(rec, self._open.requests.get)

    @staticmethod
    def _describe_open(kind: str, state: Any) -> Tuple[None, Optional[int], Optional[str], Optional[str]]:
        """(peer, bytes, backend, role) of an open request or peer wait, for a stuck report."""
        if kind == semconv.INFLIGHT_PEER:
            return None, state.expected, state.backend, state.role
        return None, state.aggregate.bytes, state.backend, state.labels.get(semconv.ROLE)

    def evict_stale(self) -> None:
        """End, as evicted, what has had no activity for longer than the TTL (oldest first, stops at the first
        fresh one); then report what just became stuck. Export the peer waits whose late watch is over."""
        now = now_ns()
        self._peer_spans.release_due(now)
        self._ended.expire(now)
        self._late_lines.flush()  # the scan's summary line of late transfers, if any
        if self._watch is not None:
            self._watch.tick({semconv.INFLIGHT_REQUEST: self._open.requests, semconv.INFLIGHT_PEER: self._open.peers},
                             self._describe_open)
        self._open.evict_before(self._clock() - self._ttl)

    # --- the end ---------------------------------------------------------------------------------------------
    def end_all(self, on_drop: Optional[Callable[[str, int], None]] = None) -> None:
        """Uninstrument: end every open span as evicted (nothing would ever end it) and count them; export the
        held peer waits as they ended."""
        self._peer_spans.release_all()
        self._open.end_all(on_drop)
        self._late_lines.flush()

    def release_held(self) -> None:
        """A flush: the peer waits held for late KV or an outcome are exported now, as they ended."""
        self._peer_spans.release_all()

    def end_at_exit(self, deadline: float = math.inf) -> int:
        """The process is ending (or its engine, seen from the builder process): every request and peer wait
        still open ends now, as ended by the exit (ERROR, error.type and kv_transfer.ended_by = process_exit),
        with its aggregates so far, so its sends' parent arrives. Delivered, so not counted as dropped. Until
        `deadline` (time.monotonic()): returns how many it could not end by then (the caller counts them)."""
        self._peer_spans.release_all()
        left = self._open.end_every(self._request_spans.end_at_exit, self._peer_spans.end_at_exit, deadline)
        self._late_lines.flush()
        return left
