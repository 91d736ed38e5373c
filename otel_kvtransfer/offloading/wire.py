"""How records travel to the builder process (`OTEL_KVTRANSFER_BUILDER=process`): frames on a socket.

A frame is a header (body length, record count) and a pickle: records are plain tuples, and pickle (C, about as
fast as marshal here) keeps every value's exact type, so the helper's builder sees what the in-process builder
would (a numpy integer stays one; marshal would turn it into bytes). The record count in the header lets the
helper count a frame it cannot read as that many records, not as one. An OpenTelemetry `Context` (a raw send's
current context, a request's real parent) travels as the span context it holds: the pickler reduces it so, with
no pass over the records in the engine process.

Both ends are ours (a process and the helper it started, on a private socket pair), so the helper unpickles its
frames; it still bounds their size, and it loads no class from a module it has not imported already (other than
the standard library and numpy): a value of a class defined in the engine's `__main__`, or in a heavy framework
the helper never imports, arrives as a placeholder and is built as a plain value, the rest of its frame intact.
A value pickle cannot carry at all (a framework's odd attribute) travels as a plain equivalent too.
"""

import copyreg
import io
import pickle
import struct
import sys
from typing import Any, Callable, Dict, Optional, Tuple

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

# Frame kinds: every payload is (kind, ...). The helper writes its pid first (HELLO), then each frame's sequence
# (from the header) back, an ACK, once it has handled it, in order; a FLUSH frame's sequence comes back a second
# time, with FLUSHED set, once the helper's providers have flushed (on a thread of its own: its frame loop never
# waits for an exporter).
BATCH = "b"  # ("b", [record, ...], {drop reason: count})
FLUSH = "f"  # ("f",)
END_OPEN = "e"  # ("e",): end the spans still open as evicted (uninstrument)

HEADER = struct.Struct(">IIQ")  # body length, records in it, sequence
ACK = struct.Struct(">Q")
FLUSHED = 1 << 63  # in an ACK: the flush asked by that sequence is done
HELLO = 1 << 62  # in an ACK: the helper's pid, its first message (it is not the engine's child)
MAX_FRAME = 256 << 20  # far above any real frame (a full queue is ~140 MiB in memory, less on the wire)

# Modules the helper may import to rebuild a value; any other class must be loaded already.
_IMPORTABLE = frozenset(getattr(sys, "stdlib_module_names", ())) | {"numpy"}

# A Context as it travels: (trace_id, span_id, flags, trace state header, remote).
WiredContext = Tuple[int, int, int, str, bool]


def context_out(context: Optional[Context]) -> Optional[WiredContext]:
    """A Context -> (trace_id, span_id, flags, trace state header, remote), or None without a valid span."""
    if not context:  # None, or an empty Context (the common case of a raw engine call)
        return None
    span_context = trace.get_current_span(context).get_span_context()
    if not span_context.is_valid:
        return None
    return (span_context.trace_id, span_context.span_id, int(span_context.trace_flags),
            span_context.trace_state.to_header(), span_context.is_remote)


def context_in(wired: Optional[WiredContext]) -> Optional[Context]:
    if wired is None:
        return None
    trace_id, span_id, flags, state, remote = wired
    span_context = SpanContext(trace_id, span_id, bool(remote), TraceFlags(flags),
                               TraceState.from_header([state]) if state else TraceState())
    return trace.set_span_in_context(NonRecordingSpan(span_context), Context())


def _reduce_context(context: Context) -> Tuple[Callable[[Optional[WiredContext]], Optional[Context]],
                                                Tuple[Optional[WiredContext]]]:
    return context_in, (context_out(context),)


_DISPATCH = copyreg.dispatch_table.copy()
_DISPATCH[Context] = _reduce_context
_KEPT = (bool, int, float, str, bytes, Context)  # what _plain leaves as it is (a Context: reduced as above)


def _plain(value: Any, depth: int = 0) -> Any:
    """A value pickle can carry: containers rebuilt, numbers as numbers, anything else its bounded str()."""
    if value is None or type(value) in _KEPT:
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


def _dumps(payload: Any) -> bytes:
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _DISPATCH
    pickler.dump(payload)
    return buffer.getvalue()


def encode(payload: Tuple[Any, ...], records: int = 0, sequence: int = 0) -> bytes:
    try:
        body = _dumps(payload)
    except Exception:  # something unpicklable deep inside: plain values instead
        body = _dumps(_plain(payload))
    return HEADER.pack(len(body), records, sequence) + body


class Unknown:
    """What a value of a class the helper does not load becomes while its frame is read: it accepts whatever
    pickle hands it (arguments, state, items) and keeps the arguments, for `unknown_to_plain`."""

    origin = "?"
    args: Tuple[Any, ...]

    def __new__(cls, *args: Any, **kwargs: Any) -> "Unknown":
        obj = object.__new__(cls)
        obj.args = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _Unpickler(pickle.Unpickler):
    def __init__(self, body: bytes) -> None:
        super().__init__(io.BytesIO(body))
        self.unknown: Dict[str, type] = {}  # "module.name" -> its Unknown subclass

    def find_class(self, module: str, name: str) -> Any:
        if module != "__main__" and (module in sys.modules or module.partition(".")[0] in _IMPORTABLE):
            try:
                return super().find_class(module, name)
            except Exception:  # an engine-only class: a placeholder below
                pass
        origin = f"{module}.{name}"[:256]
        stand_in = self.unknown.get(origin)
        if stand_in is None:
            stand_in = self.unknown[origin] = type("Unknown", (Unknown,), {"origin": origin})
        return stand_in


def decode(body: bytes) -> Tuple[Any, Tuple[str, ...]]:
    """(payload, names of the classes that arrived as placeholders: empty in the common case)."""
    unpickler = _Unpickler(body)
    payload = unpickler.load()  # nosec B301: written by the process that started this one, on a private socket
    return payload, tuple(unpickler.unknown)


def unknown_to_plain(value: Any, depth: int = 0) -> Any:
    """`value` with every placeholder replaced by a plain value: its one simple argument (an enum's or an int
    subclass's value), else the class's name in angle brackets."""
    if isinstance(value, Unknown):
        args = value.args
        if len(args) == 1 and type(args[0]) in (bool, int, float, str):
            return args[0]
        return f"<{value.origin}>"
    if depth < 8 and type(value) is not Context:
        if isinstance(value, tuple):
            return tuple(unknown_to_plain(v, depth + 1) for v in value)
        if isinstance(value, list):
            return [unknown_to_plain(v, depth + 1) for v in value]
        if isinstance(value, dict):
            return {unknown_to_plain(k, depth + 1): unknown_to_plain(v, depth + 1) for k, v in value.items()}
    return value
