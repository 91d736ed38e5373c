"""How records travel to the builder process (`OTEL_KVTRANSFER_BUILDER=process`): frames on a pipe.

A frame is a 4-byte big-endian length and a pickle: records are plain tuples, and pickle (C, about as fast as
marshal here) keeps every value's exact type, so the helper's builder sees what the in-process builder would (a
numpy integer stays one; marshal would turn it into bytes). An OpenTelemetry `Context` (a raw send's current
context, a request's real parent) travels as the span context it holds. The pipe runs from a process to the
helper it started itself, nothing else can write to it, so the helper unpickles its frames; it still bounds
their size. A value pickle cannot carry (a framework's odd attribute) travels as a plain equivalent.
"""

import pickle
import struct
from typing import Optional

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from otel_kvtransfer import records as r

# Frame kinds: every payload is (kind, sequence, ...); the helper writes each frame's sequence back (ACK) once it
# has handled it, in order.
BATCH = "b"  # ("b", sequence, [record, ...], {drop reason: count})
FLUSH = "f"  # ("f", sequence): acknowledged once the helper's providers have flushed
END_OPEN = "e"  # ("e", sequence): end the spans still open as evicted (uninstrument)

HEADER = struct.Struct(">I")
ACK = struct.Struct(">Q")
MAX_FRAME = 256 << 20  # far above any real frame (a full queue is ~140 MiB in memory, less on the wire)

# Where a record kind keeps a Context.
_CONTEXT_FIELD = {r.SEND: r.SEND_CONTEXT, r.BEGIN_REQUEST: r.REQ_PARENT, r.BEGIN_PEER: r.PEER_PARENT}


def context_out(context) -> Optional[tuple]:
    """A Context -> (trace_id, span_id, flags, trace state header, remote), or None without a valid span."""
    if not context:  # None, or an empty Context (the common case of a raw engine call)
        return None
    span_context = trace.get_current_span(context).get_span_context()
    if not span_context.is_valid:
        return None
    return (span_context.trace_id, span_context.span_id, int(span_context.trace_flags),
            span_context.trace_state.to_header(), span_context.is_remote)


def context_in(wired) -> Optional[Context]:
    if wired is None:
        return None
    trace_id, span_id, flags, state, remote = wired
    span_context = SpanContext(trace_id, span_id, bool(remote), TraceFlags(flags),
                               TraceState.from_header([state]) if state else TraceState())
    return trace.set_span_in_context(NonRecordingSpan(span_context), Context())


def _map_contexts(batch: list, convert) -> list:
    """The records with `convert` applied to their context field (a new list; the other tuples are the same
    objects)."""
    out = []
    for rec in batch:
        field = _CONTEXT_FIELD.get(rec[r.KIND])
        if field is not None and rec[field] is not None:
            rec = rec[:field] + (convert(rec[field]),) + rec[field + 1:]
        out.append(rec)
    return out


def records_out(batch: list) -> list:
    return _map_contexts(batch, context_out)


def records_in(batch: list) -> list:
    return _map_contexts(batch, context_in)


def _plain(value, depth=0):
    """A value pickle can carry: containers rebuilt, numbers as numbers, anything else its bounded str()."""
    if value is None or type(value) in (bool, int, float, str, bytes):  # pylint: disable=unidiomatic-typecheck
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str(value)[:4096]
    if depth < 8:
        if isinstance(value, tuple):
            return tuple(_plain(v, depth + 1) for v in value)
        if isinstance(value, list):
            return [_plain(v, depth + 1) for v in value]
        if isinstance(value, dict):
            return {str(k)[:256]: _plain(v, depth + 1) for k, v in value.items()}
    if hasattr(value, "__index__"):
        return int(value.__index__())
    if hasattr(value, "__float__"):
        return float(value)
    return str(value)[:256]


def encode(payload: tuple) -> bytes:
    try:
        body = pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
    except Exception:  # pylint: disable=broad-except  # something unpicklable deep inside: plain values instead
        body = pickle.dumps(_plain(payload), pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> tuple:
    return pickle.loads(body)  # nosec B301: written by the process that started this one, on a private pipe
