"""The synthetic parent that puts prefill and decode spans of one bootstrap room into one trace.

Both sides derive the same remote parent from the room alone (DESIGN "Trace stitching"), so no context has to
travel between the engines.
"""

from hashlib import blake2b

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags


def room_trace_id(room: int) -> int:
    key = (room & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big")
    return int.from_bytes(blake2b(key, digest_size=16, person=b"kv_transfer").digest(), "big")


def room_span_id(room: int) -> int:
    key = (room & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big")
    return int.from_bytes(blake2b(key, digest_size=8, person=b"kv_transfer.req").digest(), "big")


def room_parent_context(room: int) -> Context:
    """A context whose current span is the room's synthetic remote parent (sampled)."""
    parent = SpanContext(
        trace_id=room_trace_id(room),
        span_id=room_span_id(room),
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(NonRecordingSpan(parent), Context())
