"""The one place where records become spans: `SpanBuilder` runs on the recorder's background thread.

It keeps the open request (prefill) and receive (decode) spans per bootstrap room, starts every span with the
exact timestamps taken on the engine thread, and when a request ends, derives its aggregates from its children:
wire and logical bytes, busy time (the union of the transfer intervals), true throughput and compute overlap.
Rooms that stay open past the TTL are ended as evicted and counted, so memory stays bounded.
"""

import time
from typing import Dict, List, Optional

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_kvtransfer import intervals, semconv
from otel_kvtransfer.recorder import BEGIN_RECEIVE, BEGIN_REQUEST, COMPUTE, END_RECEIVE, END_REQUEST, SEND
from otel_kvtransfer.stitching import room_parent_context

_NS = 1e9


def _throughput(nbytes: int, duration_ns: int) -> float:
    return nbytes * _NS / duration_ns if duration_ns > 0 else 0.0


def split_session(session) -> tuple:
    """'host:port' (Mooncake's session name) -> (host, port or None)."""
    if not isinstance(session, str):
        return None, None
    host, sep, port = session.rpartition(":")
    if sep and port.isdigit():
        return host.strip("[]"), int(port)
    return session, None


class _OpenRequest:
    __slots__ = ("span", "sends", "compute", "chunks", "bytes", "logical_bytes", "transfers", "replica",
                 "failure", "touched")

    def __init__(self, span, now: float):
        self.span = span
        self.sends: List[tuple] = []  # (start_ns, end_ns)
        self.compute: List[tuple] = []
        self.chunks = set()
        self.bytes = 0
        self.logical_bytes = 0.0
        self.transfers = 0
        self.replica = 1
        self.failure: Optional[str] = None
        self.touched = now


class _OpenReceive:
    __slots__ = ("span", "touched")

    def __init__(self, span, now: float):
        self.span = span
        self.touched = now


class SpanBuilder:
    def __init__(self, tracer, request_ttl_s: float, on_evicted=None, on_error=None, clock=time.monotonic):
        self._tracer = tracer
        self._ttl = request_ttl_s
        self._on_evicted = on_evicted or (lambda kind, n: None)
        self._on_error = on_error or (lambda n: None)
        self._clock = clock
        self._requests: Dict[int, _OpenRequest] = {}
        self._receives: Dict[int, _OpenReceive] = {}
        self._handlers = {
            SEND: self._send,
            BEGIN_REQUEST: self._begin_request,
            END_REQUEST: self._end_request,
            COMPUTE: self._compute,
            BEGIN_RECEIVE: self._begin_receive,
            END_RECEIVE: self._end_receive,
        }

    # Called by the recorder with a batch of records, in the order they were recorded.
    def consume(self, batch: List[tuple]) -> None:
        handlers, clock = self._handlers, self._clock
        for rec in batch:
            try:
                # The clock per record: a long batch must not make the rooms it just opened look stale.
                handlers[rec[0]](rec, clock())
            except Exception:  # pylint: disable=broad-except
                # One record that fails (a span processor raising, say) loses only itself, and is counted.
                self._on_error(1)

    def set_tracer(self, tracer) -> None:
        self._tracer = tracer

    def open_rooms(self) -> int:
        return len(self._requests) + len(self._receives)

    def reset(self) -> None:
        """Forget open rooms without ending them (a forked child must not end its parent's spans)."""
        self._requests.clear()
        self._receives.clear()

    # --- prefill request ----------------------------------------------------------------------------------
    def _start_room_span(self, name, kind, room, role, backend, parent, start_ns, extra, attributes):
        """A room's top span: under the given parent, else under the room's synthetic parent."""
        attrs = {semconv.BOOTSTRAP_ROOM: room, semconv.ROLE: role, semconv.BACKEND: backend}
        attrs.update(extra)
        if attributes:
            attrs.update(attributes)
        return self._tracer.start_span(
            name,
            context=parent if parent is not None else room_parent_context(room),
            kind=kind,
            attributes=attrs,
            start_time=start_ns,
        )

    def _open_request(self, room, start_ns, now, backend=semconv.BACKEND_MOONCAKE, rid=None, parent=None,
                      attributes=None) -> _OpenRequest:
        extra = {semconv.SGLANG_RID: str(rid)} if rid is not None else {}
        span = self._start_room_span(semconv.SPAN_REQUEST, SpanKind.INTERNAL, room, semconv.ROLE_PREFILL, backend,
                                     parent, start_ns, extra, attributes)
        state = _OpenRequest(span, now)
        self._requests[room] = state
        return state

    def _begin_request(self, rec, now):
        _, room, start_ns, backend, rid, parent, attributes = rec
        if room not in self._requests:
            self._open_request(room, start_ns, now, backend, rid, parent, attributes)

    def _end_request(self, rec, now):
        _, room, end_ns, error_type = rec
        state = self._requests.pop(room, None)
        if state is not None:
            self._finish_request(state, end_ns, error_type)

    def _finish_request(self, state: _OpenRequest, end_ns: int, error_type: Optional[str], evicted=False):
        span = state.span
        busy = intervals.union(state.sends)
        busy_ns = intervals.length(busy)
        attrs = {
            semconv.BYTES: state.bytes,
            semconv.LOGICAL_BYTES: int(round(state.logical_bytes)),
            semconv.TRANSFER_COUNT: state.transfers,
            semconv.CHUNK_COUNT: len(state.chunks),
            semconv.REPLICA_FACTOR: state.replica,
            semconv.BUSY_S: busy_ns / _NS,
            semconv.THROUGHPUT: _throughput(state.bytes, busy_ns),
        }
        if state.compute:
            overlap_ns = intervals.intersection_length(busy, intervals.union(state.compute))
            attrs[semconv.COMPUTE_OVERLAP_S] = overlap_ns / _NS
            attrs[semconv.COMPUTE_OVERLAP_RATIO] = overlap_ns / busy_ns if busy_ns else 0.0
        if evicted:
            attrs[semconv.EVICTED] = True
        failure = error_type or state.failure
        if failure:
            attrs[semconv.ERROR_TYPE] = failure
            span.set_status(Status(StatusCode.ERROR, failure))
        span.set_attributes(attrs)
        span.end(end_time=max(end_ns, span.start_time or end_ns))

    # --- transfers ----------------------------------------------------------------------------------------
    def _send(self, rec, now):
        _, info, calls, context, scope_error = rec
        start = min(c[0] for c in calls) if calls else None
        end = max(c[1] for c in calls) if calls else None
        if start is None:
            start = end = time.time_ns()
        nbytes = sum(c[2] for c in calls)
        descriptors = sum(c[3] for c in calls)
        first = calls[0] if calls else None
        failure, return_code = scope_error, None
        for call in calls:
            if call[8] is not None:  # the first failing engine call names the failure
                failure, return_code = failure or call[8], call[7]
                break
        attrs = {
            semconv.BYTES: nbytes,
            semconv.DESCRIPTOR_COUNT: descriptors,
            semconv.ENGINE_CALLS: len(calls),
            semconv.THROUGHPUT: _throughput(nbytes, end - start),
            semconv.NETWORK_IO_DIRECTION: semconv.DIRECTION_TRANSMIT,
        }
        if first is not None:
            attrs[semconv.OP] = first[4]
            host, port = split_session(first[5])
            if host is not None:
                attrs[semconv.SERVER_ADDRESS] = host
            if port is not None:
                attrs[semconv.SERVER_PORT] = port
            if first[6]:
                attrs[semconv.NETWORK_TRANSPORT] = first[6]
        if info is not None:
            room, chunk, payload, destination, replica, is_last, early, backend = info
            attrs.update({
                semconv.BOOTSTRAP_ROOM: room,
                semconv.CHUNK_INDEX: chunk,
                semconv.PAYLOAD: payload,
                semconv.DESTINATION_INDEX: destination,
                semconv.REPLICA_FACTOR: replica,
                semconv.IS_LAST_CHUNK: is_last,
                semconv.PREFIX_EARLY_SEND: early,
                semconv.BACKEND: backend,
                semconv.ROLE: semconv.ROLE_PREFILL,
            })
            state = self._requests.get(room) or self._open_request(room, start, now, backend)
            state.touched = now
            state.sends.append((start, end))
            state.chunks.add(chunk)
            state.bytes += nbytes
            state.logical_bytes += nbytes / max(replica, 1)
            state.transfers += 1
            state.replica = max(state.replica, replica)
            if failure and state.failure is None:
                state.failure = failure
            context = trace.set_span_in_context(state.span)
        else:
            attrs[semconv.BACKEND] = semconv.BACKEND_MOONCAKE
        if failure:
            attrs[semconv.ERROR_TYPE] = failure
            if return_code is not None:
                attrs[semconv.RETURN_CODE] = return_code
        span = self._tracer.start_span(
            semconv.SPAN_SEND, context=context, kind=SpanKind.CLIENT, attributes=attrs, start_time=start
        )
        if failure:
            span.set_status(Status(StatusCode.ERROR, failure))
        span.end(end_time=end)

    # --- compute ------------------------------------------------------------------------------------------
    def _compute(self, rec, now):
        _, rooms, start_ns, end_ns, chunk_index = rec
        for room in rooms:
            state = self._requests.get(room) or self._open_request(room, start_ns, now)
            state.touched = now
            state.compute.append((start_ns, end_ns))
            attrs = {semconv.BOOTSTRAP_ROOM: room}
            if chunk_index is not None:
                attrs[semconv.CHUNK_INDEX] = chunk_index
            span = self._tracer.start_span(
                semconv.SPAN_COMPUTE,
                context=trace.set_span_in_context(state.span),
                kind=SpanKind.INTERNAL,
                attributes=attrs,
                start_time=start_ns,
            )
            span.end(end_time=end_ns)

    # --- decode receive -----------------------------------------------------------------------------------
    def _begin_receive(self, rec, now):
        _, room, start_ns, backend, expected_bytes, parent, attributes = rec
        if room in self._receives:
            return
        extra = {semconv.NETWORK_IO_DIRECTION: semconv.DIRECTION_RECEIVE}
        if expected_bytes is not None:
            extra[semconv.EXPECTED_BYTES] = int(expected_bytes)
        span = self._start_room_span(semconv.SPAN_RECEIVE, SpanKind.SERVER, room, semconv.ROLE_DECODE, backend,
                                     parent, start_ns, extra, attributes)
        self._receives[room] = _OpenReceive(span, now)

    def _end_receive(self, rec, now):
        _, room, end_ns, error_type = rec
        state = self._receives.pop(room, None)
        if state is None:
            return
        if error_type:
            state.span.set_attribute(semconv.ERROR_TYPE, error_type)
            state.span.set_status(Status(StatusCode.ERROR, error_type))
        state.span.end(end_time=end_ns)

    # --- eviction -----------------------------------------------------------------------------------------
    def evict_stale(self) -> None:
        """End, as evicted, the rooms with no activity for longer than the TTL."""
        now = self._clock()
        deadline = now - self._ttl
        stale = [room for room, state in self._requests.items() if state.touched < deadline]
        for room in stale:
            state = self._requests.pop(room)
            self._finish_request(state, time.time_ns(), "evicted", evicted=True)
        if stale:
            self._on_evicted("request_evicted", len(stale))
        stale = [room for room, state in self._receives.items() if state.touched < deadline]
        for room in stale:
            state = self._receives.pop(room)
            state.span.set_attributes({semconv.EVICTED: True, semconv.ERROR_TYPE: "evicted"})
            state.span.set_status(Status(StatusCode.ERROR, "evicted"))
            state.span.end()
        if stale:
            self._on_evicted("receive_evicted", len(stale))
