"""The one place where records become spans: `SpanBuilder.handle` runs on the recorder's background thread.

It starts every span with the exact timestamps taken on the engine thread, parents sends and compute to their
request's span, and when a request ends, sets its aggregates from its children with `aggregate.RequestAggregate`:
wire and logical bytes, busy time (the union of the transfer intervals), true throughput and compute overlap.
The spans that stay open across records live in `open_spans.OpenSpans` (bounded by number and by TTL; what it
evicts ends here, as evicted, and is counted); a send's attributes come from `send_attributes`.
"""

import math
import time
from typing import Callable, Dict, Optional

from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_kvtransfer import semconv
from otel_kvtransfer.building import late, send_attributes
from otel_kvtransfer.building.aggregate import FIGURE_ATTRIBUTES, span_figures
from otel_kvtransfer.building.direct_spans import UNSET_STATUS, span_context_of
from otel_kvtransfer.building.first_calls import FirstToPeer
from otel_kvtransfer.building.open_spans import OpenPeer, OpenRequest, OpenSpans
from otel_kvtransfer.building.record_metrics import NO_METRICS
from otel_kvtransfer.building.sdk_spans import SdkSpans
from otel_kvtransfer.building.stitching import key_parent_span_context
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import now_ns

# backend -> function(peer) -> span attributes of that engine's peer name (server.address, server.port, ...).
PeerParser = Callable[[object], dict]


_OK = UNSET_STATUS  # the direct path's own object: a span with it needs no repair
# A send's times are checked here, off the engine's thread: OTLP's fixed64 nanoseconds, the end not before the
# start (an engine call's come from clock.now_ns(); a bad one came through integration.deliver()).
_TIME_LIMIT = 1 << 64


def _error(span, error_type: str) -> None:
    span.set_attribute(semconv.ERROR_TYPE, error_type)
    span.set_status(Status(StatusCode.ERROR, error_type))


class SpanBuilder:
    """`spans`: `direct_spans.DirectSpans`, or `sdk_spans.SdkSpans` (an SDK tracer given here is wrapped in one).
    `metrics`: where the builder's figures go as measurements (`record_metrics.RecordMetrics`), or nothing when a
    span processor derives them from the spans (the SDK pipeline). `watch`: `stuck.OpenWatch`."""

    def __init__(self, spans, request_ttl_s: float, max_open: int = 65536,
                 peer_parsers: Optional[Dict[str, PeerParser]] = None,
                 on_drop: Optional[Callable[[str, int], None]] = None, clock=time.monotonic, metrics=None,
                 watch=None, setup_in_first_call=(), late_watch_s: float = 30.0):
        self._spans = spans if hasattr(spans, "child") else SdkSpans(spans)
        self._on_drop = on_drop or (lambda reason, n: None)
        self._count_queue_drops()
        self._watch = watch  # stuck.OpenWatch: what is open now, what is stuck (None: not watched)
        self._metrics = metrics or NO_METRICS
        self._ttl = request_ttl_s
        self._peer_parsers = peer_parsers if peer_parsers is not None else {}
        self._clock = clock
        self._raw_statics = {}  # static attributes of raw engine calls, by shape
        self._open = OpenSpans(max_open, self._end_evicted_request, self._end_evicted_peer, self._on_drop)
        self._ended = late.EndedRequests(on_drop=self._on_drop)  # concluded: a send of theirs arriving later is late
        self._late_lines = late.LateLines()  # the late transfers' log lines, a few a scan
        self._held = late.HeldPeers(late_watch_s, self._close_peer)  # peer waits that ended with an error
        # Peer waits that ended with more to come (records.PEER_OUTCOME: sglang's KV checksum, verified later)
        self._awaiting = late.HeldPeers(request_ttl_s, self._close_peer)
        # Backends whose first transfer to a peer sets the connection up, and the peers each has sent to.
        first_calls = FirstToPeer(setup_in_first_call)
        self._first_backends, self._mark_first = first_calls.backends, first_calls.mark
        # Read per record: bound here, no extra lookup on the builder thread.
        self._requests, self._peers = self._open.requests, self._open.peers
        self._touch_request = self._open.touch_request
        self._handlers = {
            r.SEND: self._send,
            r.RAW_CALL: self._raw_call,
            r.BEGIN_REQUEST: self._begin_request,
            r.END_REQUEST: self._end_request,
            r.COMPUTE: self._compute,
            r.BEGIN_PEER: self._begin_peer,
            r.END_PEER: self._end_peer,
            r.INFLIGHT: self._inflight,
            r.CONNECT: self._connect,
            r.LATE_ARRIVAL: self._late_arrival,
            r.PEER_OUTCOME: self._peer_outcome,
        }

    def handle(self, rec: tuple) -> None:
        """One record, in the order it was recorded. Raises only on a bug (the recorder counts it)."""
        self._handlers[rec[r.KIND]](rec, self._clock())

    def set_spans(self, spans, metrics=None) -> None:
        """The factory (and metrics) to build with from now on (an SDK that appeared after instrument())."""
        self._spans = spans if hasattr(spans, "child") else SdkSpans(spans)
        self._metrics = metrics or NO_METRICS
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
        self._held.clear()
        self._awaiting.clear()
        if self._watch is not None:
            self._watch.reset()

    # --- top spans -------------------------------------------------------------------------------------------
    def _start_top(self, name, key, role, backend, framework, attributes, parent, start_ns):
        """A request's or peer's top span: under the real parent given, else under the key's synthetic parent."""
        attrs = {semconv.REQUEST_KEY: str(key), semconv.ROLE: role, semconv.BACKEND: backend}
        if framework:
            attrs[semconv.FRAMEWORK] = framework
        if attributes:
            attrs.update(attributes)
        parent = span_context_of(parent)
        return self._spans.open(name, parent if parent is not None else key_parent_span_context(key),
                                SpanKind.INTERNAL, attrs, start_ns)

    def _open_request(self, key, start_ns, now, role=semconv.ROLE_PREFILL, backend=None, framework=None,
                      attributes=None, parent=None) -> OpenRequest:
        self._open.make_room(True)
        span = self._start_top(semconv.SPAN_REQUEST, key, role, backend, framework, attributes, parent, start_ns)
        labels = {semconv.ROLE: role}
        if framework:
            labels[semconv.FRAMEWORK] = framework
        model = (attributes or {}).get(semconv.GEN_AI_REQUEST_MODEL)
        if model is not None:
            labels[semconv.GEN_AI_REQUEST_MODEL] = model
        if attributes:  # the initiator's rank: repeated on every send and compute span of the request
            labels.update((name, attributes[name]) for name in semconv.RANK_ATTRIBUTES if name in attributes)
        state = self._requests[key] = OpenRequest(span, now, labels, key)
        state.parent = self._spans.context_of(span)
        state.backend = backend
        if self._watch is not None:
            self._watch.opened(semconv.INFLIGHT_REQUEST, key, state, start_ns)
        return state

    def _begin_request(self, rec, now):
        key = rec[r.KEY]
        self._ended.reopened(key)
        if key not in self._requests:
            self._open_request(key, rec[r.TIME], now, rec[r.REQ_ROLE], rec[r.REQ_BACKEND], rec[r.REQ_FRAMEWORK],
                               rec[r.REQ_ATTRIBUTES], rec[r.REQ_PARENT])

    def _end_request(self, rec, now):
        state = self._requests.pop(rec[r.KEY], None)
        if state is not None:
            self._finish_request(state, rec[r.TIME], rec[r.END_ERROR])

    def _finish_request(self, state: OpenRequest, end_ns: int, error_type: Optional[str], evicted=False,
                        ended_by: Optional[str] = None):
        span = state.span
        attrs = {FIGURE_ATTRIBUTES[name]: value
                 for name, value in span_figures(state.aggregate.figures()).items()}
        if evicted:
            attrs[semconv.EVICTED] = True
        if ended_by:
            attrs[semconv.ENDED_BY] = ended_by
        span.set_attributes(attrs)
        failure = error_type or state.failure
        if failure:
            _error(span, failure)
        self._spans.close(span, end_ns)
        self._metrics.request(attrs, span, state, end_ns, failure)
        self._ended.ended(state.key, state.parent, end_ns, state.labels)

    def _end_evicted_request(self, state: OpenRequest) -> None:
        self._finish_request(state, now_ns(), semconv.EVICTED_ERROR, evicted=True)  # the records' clock

    # --- transfers -------------------------------------------------------------------------------------------
    def _raw_call(self, rec, now):
        start, end, nbytes, descriptors, failure, return_code, call = send_attributes.measure_call(
            rec[r.RAW_CALL_FIELDS], None)
        if not 0 <= start <= end < _TIME_LIMIT:  # no engine measures that: bad input to deliver(), counted
            return self._on_drop("api_error", 1)
        call, nbytes, descriptors = self._checked(call, nbytes, descriptors)
        self._raw_send(start, end, nbytes, descriptors, 1, failure, return_code, call, rec[r.RAW_CONTEXT])

    def _send(self, rec, now):
        start, end, nbytes, descriptors, failure, return_code, first = send_attributes.measure(rec)
        if not 0 <= start <= end < _TIME_LIMIT:
            return self._on_drop("api_error", 1)
        first, nbytes, descriptors = self._checked(first, nbytes, descriptors)
        info = rec[r.SEND_INFO]
        if info is None:
            return self._raw_send(start, end, nbytes, descriptors, len(rec[r.SEND_CALLS]), failure, return_code,
                                  first, rec[r.SEND_CONTEXT])
        key = info[r.INFO_KEY]
        state = self._touch_request(key, now)
        if state is None:
            ended = self._ended.get(key)
            if ended is not None:
                return self._ended_request_send(rec, key, ended, start, end, nbytes, descriptors, failure,
                                                return_code, first)
            state = self._open_request(key, start, now,
                                       backend=first[r.CALL_BACKEND] if first is not None else None)
        state.aggregate.add_send(start, end, nbytes, info[r.INFO_REPLICA], info[r.INFO_CHUNK])
        if failure and state.failure is None:
            state.failure = failure
        attrs = send_attributes.attributes(start, end, nbytes, descriptors, len(rec[r.SEND_CALLS]), failure,
                                           return_code, first, info, state.labels, state.statics,
                                           self._peer_parsers)
        self._send_span(state.parent, attrs, start, end, nbytes, descriptors, failure)

    def _checked(self, first, nbytes, descriptors):
        """The first call of a backend marked as such, and negative lengths counted and clamped: an engine asked
        to move a negative length moved no such bytes."""
        if first is not None and first[r.CALL_BACKEND] in self._first_backends:
            first = self._mark_first(first)
        if nbytes < 0 or descriptors < 0:
            self._on_drop("invalid_length", 1)
            nbytes, descriptors = max(nbytes, 0), max(descriptors, 0)
        return first, nbytes, descriptors

    def _raw_send(self, start, end, nbytes, descriptors, calls, failure, return_code, first, context):
        """A send outside any transfer scope: under the context current at its engine call."""
        attrs = send_attributes.attributes(start, end, nbytes, descriptors, calls, failure, return_code, first, None,
                                           None, self._raw_statics, self._peer_parsers)
        self._send_span(span_context_of(context), attrs, start, end, nbytes, descriptors, failure)

    def _send_span(self, parent, attrs, start, end, nbytes, descriptors, failure):
        status = Status(StatusCode.ERROR, failure) if failure else _OK
        span_context = self._spans.child(semconv.SPAN_SEND, parent, SpanKind.CLIENT, attrs, start, end, status)
        self._metrics.send(attrs, start, end, nbytes, descriptors, failure, span_context)

    def _ended_request_send(self, rec, key, ended, start, end, nbytes, descriptors, failure, return_code, first):
        """A send of a request that already concluded: under that request's span, late if it ended after it."""
        attrs = send_attributes.attributes(start, end, nbytes, descriptors, len(rec[r.SEND_CALLS]), failure,
                                           return_code, first, rec[r.SEND_INFO], ended.labels,
                                           self._ended.shapes(key), self._peer_parsers)
        late_s = late.late_by_s(ended, end)
        if late_s is None:  # it ended in time, its record only came after the request's end
            return self._send_span(ended.parent, attrs, start, end, nbytes, descriptors, failure)
        span = self._spans.open(semconv.SPAN_SEND, ended.parent, SpanKind.CLIENT, attrs, start)
        span.add_event(semconv.EVENT_LATE_COMPLETION, {semconv.AFTER_REQUEST_END_S: late_s}, end)
        if failure:
            _error(span, failure)
        span_context = self._spans.context_of(span)
        self._spans.close(span, end)
        self._metrics.late(attrs, span_context)
        self._late_lines.send(ended, key, attrs.get(semconv.BACKEND), first[r.CALL_PEER] if first else None, late_s)
        self._metrics.send(attrs, start, end, nbytes, descriptors, failure, span_context)

    # --- compute ---------------------------------------------------------------------------------------------
    def _compute(self, rec, now):
        start_ns, end_ns, chunk = rec[r.COMPUTE_START], rec[r.COMPUTE_END], rec[r.COMPUTE_CHUNK]
        clock = rec[r.COMPUTE_CLOCK] or semconv.CLOCK_HOST
        for key in rec[r.COMPUTE_KEYS]:
            # Compute of a request with no open request span (warm-up, health checks, requests that never
            # transfer) makes no span: it would be an orphan trace.
            state = self._touch_request(key, now)
            if state is None:
                continue
            state.aggregate.add_compute(start_ns, end_ns)
            attrs = {semconv.REQUEST_KEY: str(key), semconv.COMPUTE_CLOCK: clock}
            if chunk is not None:
                attrs[semconv.CHUNK_INDEX] = chunk
            for name in semconv.RANK_ATTRIBUTES:
                if name in state.labels:
                    attrs[name] = state.labels[name]
            self._spans.child(semconv.SPAN_COMPUTE, state.parent, SpanKind.INTERNAL, attrs, start_ns, end_ns, _OK)

    # --- set-up ----------------------------------------------------------------------------------------------
    def _connect(self, rec, now):
        """A set-up call towards a peer: under its request when that request is open here; with a key but no
        request open (a decode's bootstrap, before its receive), in the key's stitched trace."""
        start, end, backend, error = rec[r.CONNECT_START], rec[r.CONNECT_END], rec[r.CONNECT_BACKEND], \
            rec[r.CONNECT_ERROR]
        attrs = {semconv.BACKEND: backend, semconv.CONNECT_OPERATION: rec[r.CONNECT_OPERATION],
                 semconv.CONNECT_OUTCOME: semconv.OUTCOME_ERROR if error else semconv.OUTCOME_OK}
        peer, parser = rec[r.CONNECT_PEER], self._peer_parsers.get(backend)
        if peer is not None and parser is not None:
            attrs.update(parser(peer))
        if rec[r.CONNECT_ATTRIBUTES]:
            attrs.update(rec[r.CONNECT_ATTRIBUTES])
        key = rec[r.CONNECT_KEY]
        state = self._requests.get(key) if key is not None else None
        synthetic = False
        if state is not None:
            attrs[semconv.REQUEST_KEY] = str(key)
            attrs.update(state.labels)
            parent = state.parent
        elif key is not None:
            attrs[semconv.REQUEST_KEY] = str(key)
            parent, synthetic = key_parent_span_context(key), True
        else:
            parent = span_context_of(rec[r.CONNECT_CONTEXT])
        status = _OK
        if error:
            attrs[semconv.ERROR_TYPE] = error
            status = Status(StatusCode.ERROR, error)
        span_context = self._spans.child(semconv.SPAN_CONNECT, parent, SpanKind.CLIENT, attrs, start, end, status,
                                         synthetic)
        self._metrics.connect(attrs, start, end, span_context)

    # --- peers (receive / serve) -----------------------------------------------------------------------------
    def _begin_peer(self, rec, now):
        key = rec[r.KEY]
        if key in self._peers:
            return
        for waits in (self._held, self._awaiting):  # a new wait of the same key: the old one's watch is over
            held = waits.take(key)
            if held is not None:
                self._close_peer(held.span, held.end_ns)
        self._open.make_room(False)
        span = self._start_top(rec[r.PEER_SPAN_NAME], key, rec[r.PEER_ROLE], rec[r.PEER_BACKEND],
                               rec[r.PEER_FRAMEWORK], rec[r.PEER_ATTRIBUTES], rec[r.PEER_PARENT], rec[r.TIME])
        state = self._peers[key] = OpenPeer(span, now, rec[r.PEER_ROLE], rec[r.PEER_BACKEND],
                                             (rec[r.PEER_ATTRIBUTES] or {}).get(semconv.EXPECTED_BYTES))
        if self._watch is not None:
            self._watch.opened(semconv.INFLIGHT_PEER, key, state, rec[r.TIME])

    def _end_peer(self, rec, now):
        state = self._peers.pop(rec[r.KEY], None)
        if state is None:
            return
        if rec[r.END_ERROR]:  # its KV was let go unread: what still arrives of it is late
            _error(state.span, rec[r.END_ERROR])
            self._held.hold(rec[r.KEY], state.span, rec[r.TIME])
        elif len(rec) > r.END_PENDING and rec[r.END_PENDING]:  # its outcome comes later: exported with it
            self._awaiting.hold(rec[r.KEY], state.span, rec[r.TIME])
        else:
            self._close_peer(state.span, rec[r.TIME])

    def _close_peer(self, span, end_ns: int) -> None:
        self._spans.close(span, end_ns)
        self._metrics.peer(span, end_ns)

    def _late_arrival(self, rec, now):
        key, at_ns = rec[r.KEY], rec[r.TIME]
        held = self._held.take(key)
        if held is None:  # not held (ended in time, or never seen here), or held and exported already
            end_ns = self._held.released_end(key)
            if end_ns is not None:
                self._late_lines.arrival(key, rec[r.LATE_BACKEND], max(at_ns - end_ns, 0) / 1e9, True)
            return
        late_s = max(at_ns - held.end_ns, 0) / 1e9
        span = held.span
        span.add_event(semconv.EVENT_LATE_COMPLETION, {semconv.AFTER_REQUEST_END_S: late_s}, max(at_ns, held.end_ns))
        self._close_peer(span, held.end_ns)
        self._held.reported(key)
        self._metrics.late(span.attributes, self._spans.context_of(span))
        self._late_lines.arrival(key, rec[r.LATE_BACKEND], late_s, False)

    def _peer_outcome(self, rec, now):
        """What the peer found out about its KV after the wait (a framework's integrity check): onto the wait's
        span while it is open or awaits it, which then ends as it had; one that comes too late is counted."""
        key = rec[r.KEY]
        state = self._peers.get(key)
        awaited = None if state is not None else self._awaiting.take(key)
        if state is None and awaited is None:
            self._on_drop("outcome_unmatched", 1)
            return
        span = state.span if state is not None else awaited.span
        if rec[r.OUTCOME_ATTRIBUTES]:
            span.set_attributes(rec[r.OUTCOME_ATTRIBUTES])
        for name, attributes in rec[r.OUTCOME_EVENTS] or ():
            span.add_event(name, attributes, max(rec[r.TIME], span.start_time))
        if awaited is not None:
            self._close_peer(span, awaited.end_ns)

    def _end_evicted_peer(self, state: OpenPeer) -> None:
        state.span.set_attribute(semconv.EVICTED, True)
        _error(state.span, semconv.EVICTED_ERROR)
        end_ns = now_ns()  # the records' clock
        self._spans.close(state.span, end_ns)
        self._metrics.peer(state.span, end_ns)

    def _end_request_at_exit(self, state: OpenRequest) -> None:
        self._finish_request(state, now_ns(), semconv.ENDED_BY_PROCESS_EXIT, ended_by=semconv.ENDED_BY_PROCESS_EXIT)

    def _end_peer_at_exit(self, state: OpenPeer) -> None:
        state.span.set_attribute(semconv.ENDED_BY, semconv.ENDED_BY_PROCESS_EXIT)
        _error(state.span, semconv.ENDED_BY_PROCESS_EXIT)
        end_ns = now_ns()
        self._spans.close(state.span, end_ns)
        self._metrics.peer(state.span, end_ns)

    # --- eviction --------------------------------------------------------------------------------------------
    def _inflight(self, rec, now):
        if self._watch is not None:
            self._watch.sends(rec, self._requests.get)

    @staticmethod
    def _describe_open(kind, state):
        """(peer, bytes, backend, role) of an open request or peer wait, for a stuck report."""
        if kind == semconv.INFLIGHT_PEER:
            return None, state.expected, state.backend, state.role
        return None, state.aggregate.bytes, state.backend, state.labels.get(semconv.ROLE)

    def evict_stale(self) -> None:
        """End, as evicted, what has had no activity for longer than the TTL (oldest first, stops at the first
        fresh one); then report what just became stuck. Export the peer waits whose late watch is over."""
        now = now_ns()
        self._held.release_due(now)
        self._awaiting.release_due(now)
        self._ended.expire(now)
        self._late_lines.flush()  # the scan's summary line of late transfers, if any
        if self._watch is not None:
            self._watch.tick({semconv.INFLIGHT_REQUEST: self._requests, semconv.INFLIGHT_PEER: self._peers},
                             self._describe_open)
        self._open.evict_before(self._clock() - self._ttl)

    def end_all(self, on_drop: Optional[Callable[[str, int], None]] = None) -> None:
        """Uninstrument: end every open span as evicted (nothing would ever end it) and count them; export the
        held peer waits as they ended."""
        self._held.release_all()
        self._awaiting.release_all()
        self._open.end_all(on_drop)
        self._late_lines.flush()

    def release_held(self) -> None:
        """A flush: the peer waits held for late KV or an outcome are exported now, as they ended."""
        self._held.release_all()
        self._awaiting.release_all()

    def end_at_exit(self, deadline: float = math.inf) -> int:
        """The process is ending (or its engine, seen from the builder process): every request and peer wait
        still open ends now, as ended by the exit (ERROR, error.type and kv_transfer.ended_by = process_exit),
        with its aggregates so far, so its sends' parent arrives. Delivered, so not counted as dropped. Until
        `deadline` (time.monotonic()): returns how many it could not end by then (the caller counts them)."""
        self._held.release_all()
        self._awaiting.release_all()
        left = self._open.end_every(self._end_request_at_exit, self._end_peer_at_exit, deadline)
        self._late_lines.flush()
        return left
