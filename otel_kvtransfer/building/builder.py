"""The one place where records become spans: `SpanBuilder.handle` runs on the recorder's background thread.

It keeps the open request spans (initiator side) and peer spans (receive / serve) per request key, starts every
span with the exact timestamps taken on the engine thread, and when a request ends, sets its aggregates from its
children with `aggregate.RequestAggregate`: wire and logical bytes, busy time (the union of the transfer
intervals), true throughput and compute overlap. Open spans are bounded by time (TTL without activity) and by
number (the least recently active goes first); both end as evicted and are counted, and both cost O(evicted),
not O(open), because the open tables are kept in order of last activity.
"""

import time
from collections import OrderedDict
from typing import Callable, Dict, Optional

from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_kvtransfer import semconv
from otel_kvtransfer.building.aggregate import FIGURE_ATTRIBUTES, RequestAggregate, span_figures, throughput
from otel_kvtransfer.building.direct_spans import SendAttributes, span_context_of
from otel_kvtransfer.building.kvmetrics import NO_METRICS
from otel_kvtransfer.building.sdk_spans import SdkSpans
from otel_kvtransfer.building.stitching import key_parent_span_context
from otel_kvtransfer.recording import records as r

# backend -> function(peer) -> span attributes of that engine's peer name (server.address, server.port, ...).
PeerParser = Callable[[object], dict]


class _OpenRequest:
    __slots__ = ("span", "aggregate", "failure", "touched", "labels", "parent", "statics", "backend")

    def __init__(self, span, now: float, labels: dict):
        self.span = span
        self.aggregate = RequestAggregate()
        self.failure: Optional[str] = None
        self.touched = now
        self.labels = labels  # attributes every send of the request repeats (framework, role, model)
        self.parent = None  # the request span's context: its children's parent
        self.statics = {}  # send shape -> its static attributes (SpanBuilder._static)
        self.backend = None


class _OpenPeer:
    __slots__ = ("span", "touched", "role", "backend", "expected")

    def __init__(self, span, now: float, role=None, backend=None, expected=None):
        self.span = span
        self.touched = now
        self.role, self.backend, self.expected = role, backend, expected


_OK = Status(StatusCode.UNSET)
_MAX_SHAPES = 4096  # cached static attribute sets per request (and for raw sends)
_PER_SEND = (semconv.BYTES, semconv.DESCRIPTOR_COUNT, semconv.ENGINE_CALLS, semconv.THROUGHPUT,
             semconv.CHUNK_INDEX, semconv.ERROR_TYPE, semconv.RETURN_CODE, semconv.END_UNCERTAINTY_S)


def _error(span, error_type: str) -> None:
    span.set_attribute(semconv.ERROR_TYPE, error_type)
    span.set_status(Status(StatusCode.ERROR, error_type))


class SpanBuilder:
    """`spans`: `direct_spans.DirectSpans`, or `sdk_spans.SdkSpans` (an SDK tracer given here is wrapped in one).
    `metrics`: where the builder's figures go as measurements (`kvmetrics.RecordMetrics`), or nothing when a
    span processor derives them from the spans (the SDK pipeline). `watch`: `stuck.OpenWatch`."""

    def __init__(self, spans, request_ttl_s: float, max_open: int = 65536,
                 peer_parsers: Optional[Dict[str, PeerParser]] = None,
                 on_drop: Optional[Callable[[str, int], None]] = None, clock=time.monotonic, metrics=None,
                 watch=None):
        self._spans = spans if hasattr(spans, "child") else SdkSpans(spans)
        self._on_drop = on_drop or (lambda reason, n: None)
        self._count_queue_drops()
        self._watch = watch  # stuck.OpenWatch: what is open now, what is stuck (None: not watched)
        self._metrics = metrics or NO_METRICS
        self._ttl = request_ttl_s
        self._max_open = max_open
        self._peer_parsers = peer_parsers if peer_parsers is not None else {}
        self._clock = clock
        self._raw_statics = {}  # static attributes of raw engine calls, by shape
        self._requests: "OrderedDict[object, _OpenRequest]" = OrderedDict()
        self._peers: "OrderedDict[object, _OpenPeer]" = OrderedDict()
        self._handlers = {
            r.SEND: self._send,
            r.BEGIN_REQUEST: self._begin_request,
            r.END_REQUEST: self._end_request,
            r.COMPUTE: self._compute,
            r.BEGIN_PEER: self._begin_peer,
            r.END_PEER: self._end_peer,
            r.INFLIGHT: self._inflight,
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
        return len(self._requests) + len(self._peers)

    def reset(self) -> None:
        """Forget open spans without ending them (a forked child must not end its parent's spans)."""
        self._requests.clear()
        self._peers.clear()
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

    def _make_room(self, table: OrderedDict, reason: str, end) -> None:
        """Below max_open before opening one more: the least recently active of `table` goes; when `table` has
        none open, the least recently active of the other kind (max_open bounds both kinds together)."""
        while len(self._requests) + len(self._peers) >= self._max_open:
            if not table:
                if table is self._requests:
                    table, reason, end = self._peers, "peer_limit", self._end_evicted_peer
                else:
                    table, reason, end = self._requests, "request_limit", self._end_evicted_request
                if not table:
                    return
            _, state = table.popitem(last=False)
            end(state)
            self._on_drop(reason, 1)

    def _open_request(self, key, start_ns, now, role=semconv.ROLE_PREFILL, backend=None, framework=None,
                      attributes=None, parent=None) -> _OpenRequest:
        self._make_room(self._requests, "request_limit", self._end_evicted_request)
        span = self._start_top(semconv.SPAN_REQUEST, key, role, backend, framework, attributes, parent, start_ns)
        labels = {semconv.ROLE: role}
        if framework:
            labels[semconv.FRAMEWORK] = framework
        model = (attributes or {}).get(semconv.GEN_AI_REQUEST_MODEL)
        if model is not None:
            labels[semconv.GEN_AI_REQUEST_MODEL] = model
        state = self._requests[key] = _OpenRequest(span, now, labels)
        state.parent = self._spans.context_of(span)
        state.backend = backend
        if self._watch is not None:
            self._watch.opened(semconv.INFLIGHT_REQUEST, key, state, start_ns)
        return state

    def _touch_request(self, key, now) -> Optional[_OpenRequest]:
        state = self._requests.get(key)
        if state is not None:
            state.touched = now
            self._requests.move_to_end(key)
        return state

    def _begin_request(self, rec, now):
        key = rec[r.KEY]
        if key not in self._requests:
            self._open_request(key, rec[r.TIME], now, rec[r.REQ_ROLE], rec[r.REQ_BACKEND], rec[r.REQ_FRAMEWORK],
                               rec[r.REQ_ATTRIBUTES], rec[r.REQ_PARENT])

    def _end_request(self, rec, now):
        state = self._requests.pop(rec[r.KEY], None)
        if state is not None:
            self._finish_request(state, rec[r.TIME], rec[r.END_ERROR])

    def _finish_request(self, state: _OpenRequest, end_ns: int, error_type: Optional[str], evicted=False):
        span = state.span
        attrs = {FIGURE_ATTRIBUTES[name]: value
                 for name, value in span_figures(state.aggregate.figures()).items()}
        if evicted:
            attrs[semconv.EVICTED] = True
        span.set_attributes(attrs)
        failure = error_type or state.failure
        if failure:
            _error(span, failure)
        self._spans.close(span, end_ns)
        self._metrics.request(attrs, span, state, end_ns, failure)

    def _end_evicted_request(self, state: _OpenRequest) -> None:
        self._finish_request(state, time.time_ns(), semconv.EVICTED_ERROR, evicted=True)

    # --- transfers -------------------------------------------------------------------------------------------
    def _send(self, rec, now):
        info, calls, scope_error = rec[r.SEND_INFO], rec[r.SEND_CALLS], rec[r.SEND_ERROR]
        failure, return_code = scope_error, None
        if len(calls) == 1:  # the common case, without the loops
            first = calls[0]
            start, end = first[r.CALL_START], first[r.CALL_END]
            moved = first[r.CALL_BYTES]
            nbytes = moved if type(moved) is int else sum(moved)  # pylint: disable=unidiomatic-typecheck
            descriptors = first[r.CALL_DESCRIPTORS]
            if first[r.CALL_ERROR] is not None:
                failure, return_code = failure or first[r.CALL_ERROR], first[r.CALL_RETURN_CODE]
        elif calls:
            start = min(c[r.CALL_START] for c in calls)
            end = max(c[r.CALL_END] for c in calls)
            first = calls[0]
            nbytes = descriptors = 0
            for call in calls:
                moved = call[r.CALL_BYTES]
                nbytes += moved if type(moved) is int else sum(moved)  # pylint: disable=unidiomatic-typecheck
                descriptors += call[r.CALL_DESCRIPTORS]
            for call in calls:
                if call[r.CALL_ERROR] is not None:  # the first failing engine call names the failure
                    failure, return_code = failure or call[r.CALL_ERROR], call[r.CALL_RETURN_CODE]
                    break
        else:  # a scope that failed before any engine call: its own time, taken on the engine thread
            start, end = rec[r.SEND_SCOPE_TIMES]
            first = None
            nbytes = descriptors = 0
        if nbytes < 0 or descriptors < 0:  # an engine asked to move a negative length: no such bytes moved
            self._on_drop("invalid_length", 1)
            nbytes, descriptors = max(nbytes, 0), max(descriptors, 0)
        # What varies per send first, then what its request, peer and payload repeat (cached: `_static`).
        attrs = SendAttributes()
        attrs[semconv.BYTES] = nbytes
        attrs[semconv.DESCRIPTOR_COUNT] = descriptors
        attrs[semconv.ENGINE_CALLS] = len(calls)
        attrs[semconv.THROUGHPUT] = throughput(nbytes, end - start)
        backend = first[r.CALL_BACKEND] if first is not None else None
        if info is not None:
            key, chunk = info[r.INFO_KEY], info[r.INFO_CHUNK]
            attrs[semconv.CHUNK_INDEX] = chunk
            state = self._touch_request(key, now) or self._open_request(key, start, now, backend=backend)
            state.aggregate.add_send(start, end, nbytes, info[r.INFO_REPLICA], chunk)
            if failure and state.failure is None:
                state.failure = failure
            parent = state.parent
            static = self._static(state.statics, first, info, state)
        else:
            parent = span_context_of(rec[r.SEND_CONTEXT])
            static = self._static(self._raw_statics, first, None, None)
        if failure:
            attrs[semconv.ERROR_TYPE] = failure
            if return_code is not None:
                attrs[semconv.RETURN_CODE] = return_code
        if first is not None and first[r.CALL_EXTRA] and semconv.END_UNCERTAINTY_S in first[r.CALL_EXTRA]:
            attrs[semconv.END_UNCERTAINTY_S] = first[r.CALL_EXTRA][semconv.END_UNCERTAINTY_S]
        attrs.dynamic = len(attrs)
        attrs.update(static)
        attrs.static = static
        status = Status(StatusCode.ERROR, failure) if failure else _OK
        span_context = self._spans.child(semconv.SPAN_SEND, parent, SpanKind.CLIENT, attrs, start, end, status)
        self._metrics.send(attrs, start, end, nbytes, descriptors, failure, span_context)

    def _static(self, cache: dict, first, info, state) -> dict:
        """The attributes a send shares with the other sends of its request to the same peer and destination:
        one dict per distinct shape, reused (never changed once made), so the encoder and the metrics can key
        their own caches on it."""
        try:
            extra = first[r.CALL_EXTRA] if first else None
            if extra and semconv.END_UNCERTAINTY_S in extra:  # per send: not part of the shape
                extra = {k: v for k, v in extra.items() if k != semconv.END_UNCERTAINTY_S}
            shape = (first[r.CALL_BACKEND], first[r.CALL_OP], first[r.CALL_PEER], first[r.CALL_PROTOCOL],
                     tuple(extra.items()) if extra else None) if first else None
            if info is not None:
                shape = (shape, info[r.INFO_PAYLOAD], info[r.INFO_DESTINATION], info[r.INFO_REPLICA],
                         info[r.INFO_IS_LAST], info[r.INFO_EARLY],
                         tuple(info[r.INFO_ATTRIBUTES].items()) if info[r.INFO_ATTRIBUTES] else None)
            static = cache.get(shape)
        except TypeError:  # an unhashable value somewhere: made afresh, not cached
            shape, static = None, None
        if static is None:
            static = self._static_attributes(first, info, state)
            if shape is not None:
                if len(cache) >= _MAX_SHAPES:
                    cache.clear()
                cache[shape] = static
        return static

    def _static_attributes(self, first, info, state) -> dict:
        attrs = {}
        backend = None
        if first is not None:
            backend = first[r.CALL_BACKEND]
            op = first[r.CALL_OP]
            attrs[semconv.OP] = op
            attrs[semconv.NETWORK_IO_DIRECTION] = semconv.DIRECTION_OF_OP.get(op, semconv.DIRECTION_TRANSMIT)
            parse = self._peer_parsers.get(backend)
            if parse is not None and first[r.CALL_PEER] is not None:
                attrs.update(parse(first[r.CALL_PEER]))
            protocol = first[r.CALL_PROTOCOL]
            if protocol:
                attrs[semconv.PROTOCOL] = protocol
                if protocol in semconv.WELL_KNOWN_TRANSPORTS:
                    attrs[semconv.NETWORK_TRANSPORT] = protocol
            if first[r.CALL_EXTRA]:
                attrs.update(first[r.CALL_EXTRA])
        if backend:
            attrs[semconv.BACKEND] = backend
        if info is not None:
            attrs.update({
                semconv.REQUEST_KEY: str(info[r.INFO_KEY]),
                semconv.PAYLOAD: info[r.INFO_PAYLOAD],
                semconv.DESTINATION_INDEX: info[r.INFO_DESTINATION],
                semconv.REPLICA_FACTOR: info[r.INFO_REPLICA],
                semconv.IS_LAST_CHUNK: info[r.INFO_IS_LAST],
                semconv.PREFIX_EARLY_SEND: info[r.INFO_EARLY],
            })
            if info[r.INFO_ATTRIBUTES]:
                attrs.update(info[r.INFO_ATTRIBUTES])
            attrs.update(state.labels)
        for name in _PER_SEND:  # a framework's extra attribute may not shadow what each send sets itself
            attrs.pop(name, None)
        return attrs

    # --- compute ---------------------------------------------------------------------------------------------
    def _compute(self, rec, now):
        start_ns, end_ns, chunk = rec[r.COMPUTE_START], rec[r.COMPUTE_END], rec[r.COMPUTE_CHUNK]
        for key in rec[r.COMPUTE_KEYS]:
            # Compute of a request with no open request span (warm-up, health checks, requests that never
            # transfer) makes no span: it would be an orphan trace.
            state = self._touch_request(key, now)
            if state is None:
                continue
            state.aggregate.add_compute(start_ns, end_ns)
            attrs = {semconv.REQUEST_KEY: str(key)}
            if chunk is not None:
                attrs[semconv.CHUNK_INDEX] = chunk
            self._spans.child(semconv.SPAN_COMPUTE, state.parent, SpanKind.INTERNAL, attrs, start_ns, end_ns, _OK)

    # --- peers (receive / serve) -----------------------------------------------------------------------------
    def _begin_peer(self, rec, now):
        key = rec[r.KEY]
        if key in self._peers:
            return
        self._make_room(self._peers, "peer_limit", self._end_evicted_peer)
        span = self._start_top(rec[r.PEER_SPAN_NAME], key, rec[r.PEER_ROLE], rec[r.PEER_BACKEND],
                               rec[r.PEER_FRAMEWORK], rec[r.PEER_ATTRIBUTES], rec[r.PEER_PARENT], rec[r.TIME])
        state = self._peers[key] = _OpenPeer(span, now, rec[r.PEER_ROLE], rec[r.PEER_BACKEND],
                                             (rec[r.PEER_ATTRIBUTES] or {}).get(semconv.EXPECTED_BYTES))
        if self._watch is not None:
            self._watch.opened(semconv.INFLIGHT_PEER, key, state, rec[r.TIME])

    def _end_peer(self, rec, now):
        state = self._peers.pop(rec[r.KEY], None)
        if state is None:
            return
        if rec[r.END_ERROR]:
            _error(state.span, rec[r.END_ERROR])
        self._spans.close(state.span, rec[r.TIME])
        self._metrics.peer(state.span, rec[r.TIME])

    def _end_evicted_peer(self, state: _OpenPeer) -> None:
        state.span.set_attribute(semconv.EVICTED, True)
        _error(state.span, semconv.EVICTED_ERROR)
        end_ns = time.time_ns()
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
        fresh one); then report what just became stuck."""
        if self._watch is not None:
            self._watch.tick({semconv.INFLIGHT_REQUEST: self._requests, semconv.INFLIGHT_PEER: self._peers},
                             self._describe_open)
        deadline = self._clock() - self._ttl
        for table, end, reason in ((self._requests, self._end_evicted_request, "request_evicted"),
                                   (self._peers, self._end_evicted_peer, "peer_evicted")):
            evicted = 0
            while table:
                key, state = next(iter(table.items()))
                if state.touched >= deadline:
                    break
                del table[key]
                end(state)
                evicted += 1
            if evicted:
                self._on_drop(reason, evicted)

    def end_all(self, on_drop: Optional[Callable[[str, int], None]] = None) -> None:
        """Uninstrument: end every open span as evicted (nothing would ever end it) and count them."""
        on_drop = on_drop or self._on_drop
        for table, end, reason in ((self._requests, self._end_evicted_request, "request_evicted"),
                                   (self._peers, self._end_evicted_peer, "peer_evicted")):
            count = len(table)
            while table:
                end(table.popitem(last=False)[1])
            if count:
                on_drop(reason, count)
