"""The synthetic parent that puts both sides' spans of one request into one trace, with no propagation.

Both sides derive the same remote parent from the request key alone (docs/telemetry.md, stitching): an int key (a
bootstrap room) hashes its 8 big-endian bytes, a str key (a transfer id, a request id) its UTF-8 bytes. The
parent carries a trace-state marker so `RecordUnsampledSampler` can keep it from deciding sampling: a trace under
it is sampled as a root span with that trace id would be, identically on both sides.
"""

from hashlib import blake2b
from typing import Any, Union

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

Key = Union[int, str]
MARKER = ("kvt", "synthetic")  # trace-state entry of the synthetic parent only
_MARKED = TraceState([MARKER])


def _key_bytes(key: Key) -> bytes:
    if isinstance(key, int):
        return (key & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big")
    return str(key).encode("utf-8", "surrogatepass")


def key_trace_id(key: Key) -> int:
    return int.from_bytes(blake2b(_key_bytes(key), digest_size=16, person=b"kv_transfer").digest(), "big")


def key_span_id(key: Key) -> int:
    return int.from_bytes(blake2b(_key_bytes(key), digest_size=8, person=b"kv_transfer.req").digest(), "big")


def is_synthetic(span_context: SpanContext) -> bool:
    state: Any = getattr(span_context, "trace_state", None)  # a TraceState, or None from a foreign object
    return bool(state) and state.get(MARKER[0]) == MARKER[1]


def key_parent_span_context(key: Key) -> SpanContext:
    """The request's synthetic remote parent."""
    return SpanContext(
        trace_id=key_trace_id(key),
        span_id=key_span_id(key),
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.DEFAULT),
        trace_state=_MARKED,
    )


def key_parent_context(key: Key) -> Context:
    """A context whose current span is the request's synthetic remote parent."""
    return trace.set_span_in_context(NonRecordingSpan(key_parent_span_context(key)), Context())
