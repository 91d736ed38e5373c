"""`kv_transfer.connect` spans: one explicit set-up call towards a peer (NIXL's add_remote_agent, a framework's
bootstrap), with its outcome."""

from typing import TYPE_CHECKING, Any, Dict, Optional

from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode

from otel_kvtransfer import semconv
from otel_kvtransfer.building.builder_part import OK, BuilderMetrics, BuilderPart, Record, SpanFactory
from otel_kvtransfer.building.direct_spans import span_context_of
from otel_kvtransfer.building.stitching import key_parent_span_context
from otel_kvtransfer.recording import records as r

if TYPE_CHECKING:
    from otel_kvtransfer.building.open_spans import OpenRequest
    from otel_kvtransfer.building.send_attributes import PeerParsers


class ConnectSpans(BuilderPart):
    """`requests`: the open requests (key -> `open_spans.OpenRequest`); `peer_parsers` as `send_spans`'."""

    def __init__(self, spans: SpanFactory, metrics: BuilderMetrics, requests: Dict[Any, "OpenRequest"],
                 peer_parsers: "PeerParsers") -> None:
        super().__init__(spans, metrics)
        self._requests = requests
        self._peer_parsers = peer_parsers

    def connect(self, rec: Record, now: float) -> None:
        """A set-up call towards a peer: under its request when that request is open here; with a key but no
        request open (a decode's bootstrap, before its receive), in the key's stitched trace."""
        start, end, backend, error = rec[r.CONNECT_START], rec[r.CONNECT_END], rec[r.CONNECT_BACKEND], \
            rec[r.CONNECT_ERROR]
        attrs: Dict[str, Any] = {semconv.BACKEND: backend, semconv.CONNECT_OPERATION: rec[r.CONNECT_OPERATION],
                 semconv.CONNECT_OUTCOME: semconv.OUTCOME_ERROR if error else semconv.OUTCOME_OK}
        peer, parser = rec[r.CONNECT_PEER], self._peer_parsers.get(backend)
        if peer is not None and parser is not None:
            attrs.update(parser(peer))
        if rec[r.CONNECT_ATTRIBUTES]:
            attrs.update(rec[r.CONNECT_ATTRIBUTES])
        key = rec[r.CONNECT_KEY]
        state = self._requests.get(key) if key is not None else None
        synthetic = False
        parent: Optional[SpanContext]
        if state is not None:
            attrs[semconv.REQUEST_KEY] = str(key)
            attrs.update(state.labels)
            parent = state.parent
        elif key is not None:
            attrs[semconv.REQUEST_KEY] = str(key)
            parent, synthetic = key_parent_span_context(key), True
        else:
            parent = span_context_of(rec[r.CONNECT_CONTEXT])
        status = OK
        if error:
            attrs[semconv.ERROR_TYPE] = error
            status = Status(StatusCode.ERROR, error)
        span_context = self._spans.child(semconv.SPAN_CONNECT, parent, SpanKind.CLIENT, attrs, start, end, status,
                                         synthetic)
        self._metrics.connect(attrs, start, end, span_context)
