"""The peer's waiting spans (`kv_transfer.receive` for a push, `kv_transfer.serve` for a pull): from the moment it
asks for the KV until it sees the outcome. A wait that ended with an error is held for a while (late KV of it is
a late completion); one whose outcome comes later (a framework's integrity check) is held until it does."""

from typing import TYPE_CHECKING, Callable, Optional

from otel_kvtransfer import semconv
from otel_kvtransfer.building import late
from otel_kvtransfer.building.builder_part import (
    BuilderMetrics,
    BuilderPart,
    BuiltSpan,
    Record,
    SpanFactory,
    mark_error,
)
from otel_kvtransfer.building.open_spans import OpenPeer, OpenSpans
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import now_ns

if TYPE_CHECKING:
    from otel_kvtransfer.building.stuck import OpenWatch


class PeerSpans(BuilderPart):
    """`open_spans`: the table the waits stay open in; `late_lines`: the late transfers' log lines; `watch`:
    `stuck.OpenWatch` (None: not watched). A wait that ended with an error is held `late_watch_s`, one awaiting
    its outcome at most `request_ttl_s`."""

    def __init__(self, spans: SpanFactory, metrics: BuilderMetrics, open_spans: OpenSpans, late_lines: late.LateLines,
                 watch: Optional["OpenWatch"], request_ttl_s: float, late_watch_s: float,
                 on_drop: Callable[[str, int], None]) -> None:
        super().__init__(spans, metrics)
        self._open = open_spans
        self._peers = open_spans.peers
        self._late_lines = late_lines
        self._watch = watch
        self._on_drop = on_drop
        self._held = late.HeldPeers(late_watch_s, self.close)  # peer waits that ended with an error
        # Peer waits that ended with more to come (records.PEER_OUTCOME: sglang's KV checksum, verified later)
        self._awaiting = late.HeldPeers(request_ttl_s, self.close)

    def begin(self, rec: Record, now: float) -> None:
        key = rec[r.KEY]
        if key in self._peers:
            return
        for waits in (self._held, self._awaiting):  # a new wait of the same key: the old one's watch is over
            held = waits.take(key)
            if held is not None:
                self.close(held.span, held.end_ns)
        self._open.make_room(False)
        span = self._start_top(rec[r.PEER_SPAN_NAME], key, rec[r.PEER_ROLE], rec[r.PEER_BACKEND],
                               rec[r.PEER_FRAMEWORK], rec[r.PEER_ATTRIBUTES], rec[r.PEER_PARENT], rec[r.TIME])
        state = self._peers[key] = OpenPeer(span, now, rec[r.PEER_ROLE], rec[r.PEER_BACKEND],
                                             (rec[r.PEER_ATTRIBUTES] or {}).get(semconv.EXPECTED_BYTES))
        if self._watch is not None:
            self._watch.opened(semconv.INFLIGHT_PEER, key, state, rec[r.TIME])

    def end(self, rec: Record, now: float) -> None:
        state = self._peers.pop(rec[r.KEY], None)
        if state is None:
            return
        if rec[r.END_ERROR]:  # its KV was let go unread: what still arrives of it is late
            mark_error(state.span, rec[r.END_ERROR])
            self._held.hold(rec[r.KEY], state.span, rec[r.TIME])
        elif len(rec) > r.END_PENDING and rec[r.END_PENDING]:  # its outcome comes later: exported with it
            self._awaiting.hold(rec[r.KEY], state.span, rec[r.TIME])
        else:
            self.close(state.span, rec[r.TIME])

    def close(self, span: BuiltSpan, end_ns: int) -> None:
        self._spans.close(span, end_ns)
        self._metrics.peer(span, end_ns)

    def late_arrival(self, rec: Record, now: float) -> None:
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
        self.close(span, held.end_ns)
        self._held.reported(key)
        self._metrics.late(span.attributes, self._spans.context_of(span))
        self._late_lines.arrival(key, rec[r.LATE_BACKEND], late_s, False)

    def outcome(self, rec: Record, now: float) -> None:
        """What the peer found out about its KV after the wait (a framework's integrity check): onto the wait's
        span while it is open or awaits it, which then ends as it had; one that comes too late is counted."""
        key = rec[r.KEY]
        state = self._peers.get(key)
        awaited = None if state is not None else self._awaiting.take(key)
        if state is None and awaited is None:
            self._on_drop("outcome_unmatched", 1)
            return
        span = state.span if state is not None else awaited.span  # type: ignore[union-attr]  # one is set (see above)
        if rec[r.OUTCOME_ATTRIBUTES]:
            span.set_attributes(rec[r.OUTCOME_ATTRIBUTES])
        for name, attributes in rec[r.OUTCOME_EVENTS] or ():
            span.add_event(name, attributes, max(rec[r.TIME], span.start_time))
        if awaited is not None:
            self.close(span, awaited.end_ns)

    def end_evicted(self, state: OpenPeer) -> None:
        state.span.set_attribute(semconv.EVICTED, True)
        mark_error(state.span, semconv.EVICTED_ERROR)
        self.close(state.span, now_ns())  # the records' clock

    def end_at_exit(self, state: OpenPeer) -> None:
        state.span.set_attribute(semconv.ENDED_BY, semconv.ENDED_BY_PROCESS_EXIT)
        mark_error(state.span, semconv.ENDED_BY_PROCESS_EXIT)
        self.close(state.span, now_ns())

    # --- the held waits --------------------------------------------------------------------------------------
    def release_due(self, now: int) -> None:
        """Export the waits whose watch is over."""
        self._held.release_due(now)
        self._awaiting.release_due(now)

    def release_all(self) -> None:
        """Export every held wait, as it ended."""
        self._held.release_all()
        self._awaiting.release_all()

    def clear(self) -> None:
        self._held.clear()
        self._awaiting.clear()
