"""The initiator's request spans: opened by a framework's begin_request record (or by the first send of a key no
request opened), parents of their sends and compute, ended with the aggregates of all their children
(`aggregate.RequestAggregate`: wire and logical bytes, busy time, true throughput, compute overlap, tail)."""

from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from otel_kvtransfer import semconv
from otel_kvtransfer.building.aggregate import FIGURE_ATTRIBUTES, span_figures
from otel_kvtransfer.building.builder_part import OK, BuilderMetrics, BuilderPart, Record, SpanFactory, mark_error
from otel_kvtransfer.building.late import EndedRequests
from otel_kvtransfer.building.open_spans import OpenRequest, OpenSpans
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import now_ns

if TYPE_CHECKING:
    from otel_kvtransfer.building.stuck import OpenWatch


class RequestSpans(BuilderPart):
    """`open_spans`: the table the requests stay open in; `ended`: the requests that concluded (a send of theirs
    arriving later is late); `watch`: `stuck.OpenWatch` (None: not watched)."""

    def __init__(self, spans: SpanFactory, metrics: BuilderMetrics, open_spans: OpenSpans, ended: EndedRequests,
                 watch: Optional["OpenWatch"]) -> None:
        super().__init__(spans, metrics)
        self._open = open_spans
        self._requests, self._touch = open_spans.requests, open_spans.touch_request
        self._ended = ended
        self._watch = watch

    def open(self, key: Any, start_ns: int, now: float, role: Optional[str] = semconv.ROLE_PREFILL,
             backend: Optional[str] = None, framework: Optional[str] = None,
             attributes: Optional[Mapping[str, Any]] = None, parent: Optional[Context] = None) -> OpenRequest:
        self._open.make_room(True)
        span = self._start_top(semconv.SPAN_REQUEST, key, role, backend, framework, attributes, parent, start_ns)
        labels: Dict[str, Any] = {semconv.ROLE: role}
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

    def begin(self, rec: Record, now: float) -> None:
        key = rec[r.KEY]
        self._ended.reopened(key)
        if key not in self._requests:
            self.open(key, rec[r.TIME], now, rec[r.REQ_ROLE], rec[r.REQ_BACKEND], rec[r.REQ_FRAMEWORK],
                      rec[r.REQ_ATTRIBUTES], rec[r.REQ_PARENT])

    def end(self, rec: Record, now: float) -> None:
        state = self._requests.pop(rec[r.KEY], None)
        if state is not None:
            self.finish(state, rec[r.TIME], rec[r.END_ERROR])

    def finish(self, state: OpenRequest, end_ns: int, error_type: Optional[str], evicted: bool = False,
               ended_by: Optional[str] = None) -> None:
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
            mark_error(span, failure)
        self._spans.close(span, end_ns)
        self._metrics.request(attrs, span, state, end_ns, failure)
        self._ended.ended(state.key, state.parent, end_ns, state.labels)

    def end_evicted(self, state: OpenRequest) -> None:
        self.finish(state, now_ns(), semconv.EVICTED_ERROR, evicted=True)  # the records' clock

    def end_at_exit(self, state: OpenRequest) -> None:
        self.finish(state, now_ns(), semconv.ENDED_BY_PROCESS_EXIT, ended_by=semconv.ENDED_BY_PROCESS_EXIT)

    def compute(self, rec: Record, now: float) -> None:
        start_ns, end_ns, chunk = rec[r.COMPUTE_START], rec[r.COMPUTE_END], rec[r.COMPUTE_CHUNK]
        clock = rec[r.COMPUTE_CLOCK] or semconv.CLOCK_HOST
        for key in rec[r.COMPUTE_KEYS]:
            # Compute of a request with no open request span (warm-up, health checks, requests that never
            # transfer) makes no span: it would be an orphan trace.
            state = self._touch(key, now)
            if state is None:
                continue
            state.aggregate.add_compute(start_ns, end_ns)
            attrs: Dict[str, Any] = {semconv.REQUEST_KEY: str(key), semconv.COMPUTE_CLOCK: clock}
            if chunk is not None:
                attrs[semconv.CHUNK_INDEX] = chunk
            for name in semconv.RANK_ATTRIBUTES:
                if name in state.labels:
                    attrs[name] = state.labels[name]
            self._spans.child(semconv.SPAN_COMPUTE, state.parent, SpanKind.INTERNAL, attrs, start_ns, end_ns, OK)
