"""`kv_transfer.send` spans: one per actual transfer, under its request's span (a raw engine call's under the
context current at its call), measured and given its attributes by `send_attributes`. A send of a request that
already concluded goes under that request's span, and is late if it ended after it."""

from typing import Any, Callable, Dict, Iterable, Optional

from opentelemetry.context import Context
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode

from otel_kvtransfer import semconv
from otel_kvtransfer.building import late
from otel_kvtransfer.building.aggregate import MAX_COUNT
from otel_kvtransfer.building.builder_part import (
    OK,
    TIME_LIMIT,
    BuilderMetrics,
    BuilderPart,
    Record,
    SpanFactory,
    mark_error,
)
from otel_kvtransfer.building.direct_spans import span_context_of
from otel_kvtransfer.building.first_calls import FirstToPeer
from otel_kvtransfer.building.open_spans import OpenSpans
from otel_kvtransfer.building.request_spans import RequestSpans
from otel_kvtransfer.building.send_attributes import PeerParsers, SendFigures, attributes, measure, measure_call
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import BASE


class SendSpans(BuilderPart):
    """`requests`: where a send of a key no request opened opens one; `ended` and `late_lines`: the concluded
    requests and the late transfers' log lines; `peer_parsers`: backend -> function(peer) -> the span
    attributes of that engine's peer name; `setup_in_first_call`: the backends whose first transfer to a peer
    sets the connection up."""

    def __init__(self, spans: SpanFactory, metrics: BuilderMetrics, requests: RequestSpans, open_spans: OpenSpans,
                 ended: late.EndedRequests, late_lines: late.LateLines, peer_parsers: PeerParsers,
                 setup_in_first_call: Iterable[str], on_drop: Callable[[str, int], None]) -> None:
        super().__init__(spans, metrics)
        self._open_request = requests.open
        self._touch_request = open_spans.touch_request  # read per record: bound here, no extra lookup
        self._ended = ended
        self._late_lines = late_lines
        self._peer_parsers = peer_parsers
        self._on_drop = on_drop
        self._raw_statics: Dict[Any, Dict[str, Any]] = {}  # static attributes of raw engine calls, by shape
        first_calls = FirstToPeer(setup_in_first_call)
        self._first_backends, self._mark_first = first_calls.backends, first_calls.mark

    def raw_call(self, rec: Record, now: float) -> None:
        """A RAW_CALL record."""
        self._raw(rec[r.RAW_CALL_FIELDS], rec[r.RAW_CONTEXT])

    def raw_monotonic(self, rec: Record, now: float) -> None:
        """A RAW_MONOTONIC record: a raw call whose two times are monotonic_ns() readings of this process's
        engine (the builder process has its engine's BASE: clock.py), what its engine's calls share in its form."""
        self._raw(r.monotonic_call(rec, BASE), rec[r.MONO_CONTEXT])

    def raw_async(self, rec: Record, now: float) -> None:
        """A RAW_ASYNC record: an async submission's send, its own attributes made here from its times."""
        self._raw(r.async_call(rec), rec[r.ASYNC_CONTEXT])

    def _raw(self, call: r.Call, context: Optional[Context]) -> None:
        figures = measure_call(call, None)
        if not 0 <= figures.start <= figures.end < TIME_LIMIT:  # no engine measures that: bad input to deliver()
            return self._on_drop("api_error", 1)
        self._check(figures)
        attrs = attributes(figures, None, None, self._raw_statics, self._peer_parsers)
        # context: None when no span was current at the call (the common case)
        self._send_span(span_context_of(context) if context is not None else None, attrs, figures)

    def send(self, rec: Record, now: float) -> None:
        figures = measure(rec)
        if not 0 <= figures.start <= figures.end < TIME_LIMIT:
            return self._on_drop("api_error", 1)
        self._check(figures)
        info = rec[r.SEND_INFO]
        if info is None:
            return self._raw_send(figures, rec[r.SEND_CONTEXT])
        key = info[r.INFO_KEY]
        state = self._touch_request(key, now)
        if state is None:
            ended = self._ended.get(key)
            if ended is not None:
                return self._ended_request_send(figures, info, key, ended)
            first = figures.first
            state = self._open_request(key, figures.start, now,
                                       backend=first[r.CALL_BACKEND] if first is not None else None)
        if state.aggregate.add_send(figures.start, figures.end, figures.nbytes, info[r.INFO_REPLICA],
                                    info[r.INFO_CHUNK]):
            self._on_drop("invalid_length", 1)  # the request's bytes past what OTLP carries: kept at its most
        if figures.failure and state.failure is None:
            state.failure = figures.failure
        attrs = attributes(figures, info, state.labels, state.statics, self._peer_parsers)
        self._send_span(state.parent, attrs, figures)

    def _check(self, figures: SendFigures) -> None:
        """The first call of a backend marked as such, and lengths OTLP cannot carry counted and clamped: an engine
        asked to move a negative length moved no such bytes, and a count past int64 (an unsigned array's wrapped
        -1, a float table read as integers) is no count of anything moved; an integer OTLP cannot encode would fail
        the whole metric export its exemplar is in."""
        first = figures.first
        if first is not None and first[r.CALL_BACKEND] in self._first_backends:
            figures.first = self._mark_first(first)
        if not (0 <= figures.nbytes <= MAX_COUNT and 0 <= figures.descriptors <= MAX_COUNT):
            self._on_drop("invalid_length", 1)
            figures.nbytes, figures.descriptors = _length(figures.nbytes), _length(figures.descriptors)

    def _raw_send(self, figures: SendFigures, context: Optional[Context]) -> None:
        """A send outside any transfer scope: under the context current at its engine call."""
        attrs = attributes(figures, None, None, self._raw_statics, self._peer_parsers)
        self._send_span(span_context_of(context), attrs, figures)

    def _send_span(self, parent: Optional[SpanContext], attrs: Dict[str, Any], figures: SendFigures) -> None:
        start, end, failure = figures.start, figures.end, figures.failure
        status = Status(StatusCode.ERROR, failure) if failure else OK
        span_context = self._spans.child(semconv.SPAN_SEND, parent, SpanKind.CLIENT, attrs, start, end, status)
        self._metrics.send(attrs, start, end, figures.nbytes, figures.descriptors, failure, span_context)

    def _ended_request_send(self, figures: SendFigures, info: Record, key: Any, ended: late.EndedRequest) -> None:
        """A send of a request that already concluded: under that request's span, late if it ended after it."""
        attrs = attributes(figures, info, ended.labels, self._ended.shapes(key), self._peer_parsers)
        late_s = late.late_by_s(ended, figures.end)
        if late_s is None:  # it ended in time, its record only came after the request's end
            return self._send_span(ended.parent, attrs, figures)
        start, end, failure, first = figures.start, figures.end, figures.failure, figures.first
        span = self._spans.open(semconv.SPAN_SEND, ended.parent, SpanKind.CLIENT, attrs, start)
        span.add_event(semconv.EVENT_LATE_COMPLETION, {semconv.AFTER_REQUEST_END_S: late_s}, end)
        if failure:
            mark_error(span, failure)
        span_context = self._spans.context_of(span)
        self._spans.close(span, end)
        self._metrics.late(attrs, span_context)
        self._late_lines.send(ended, key, attrs.get(semconv.BACKEND), first[r.CALL_PEER] if first else None, late_s)
        self._metrics.send(attrs, start, end, figures.nbytes, figures.descriptors, failure, span_context)


def _length(value: Any) -> int:
    """A count clamped into 0..MAX_COUNT, an int (NaN: 0)."""
    if value > MAX_COUNT:
        return MAX_COUNT
    return int(value) if value > 0 else 0
