"""A send's figures and span attributes, computed from its SEND (or RAW_CALL) record: pure functions, no open state.

`measure` merges a send's engine calls into one interval, its bytes and its outcome (`SendFigures`); `attributes`
makes the span's attribute dict from them: what varies per send first, then the part the send shares with the
other sends of its request to the same peer and destination (its shape), made once per shape and reused from a
cache the caller keeps (the builder keeps one per open request, and one for raw engine calls).
"""

from typing import Any, Callable, Dict, Optional, Tuple

from otel_kvtransfer import semconv
from otel_kvtransfer.building.aggregate import NS_PER_S
from otel_kvtransfer.building.attribute_values import repaired, repaired_text, repaired_value
from otel_kvtransfer.building.direct_spans import SendAttributes
from otel_kvtransfer.recording import records as r

Record = Tuple[Any, ...]  # a SEND record, a call or a transfer-scope info tuple (recording.records)
PeerParsers = Dict[str, Callable[[Any], Dict[str, Any]]]  # backend -> its engine's peer_attributes

MAX_SHAPES = 4096  # cached static attribute sets per cache
# What each send sets itself: a framework's or engine's extra attribute may not shadow it.
PER_SEND = (semconv.BYTES, semconv.DESCRIPTOR_COUNT, semconv.ENGINE_CALLS, semconv.THROUGHPUT,
            semconv.CHUNK_INDEX, semconv.ERROR_TYPE, semconv.RETURN_CODE, semconv.END_UNCERTAINTY_S, semconv.POST_S)
# An engine's extra attributes that differ from send to send (timings): never part of a send's cached shape.
_PER_SEND_EXTRA = (semconv.END_UNCERTAINTY_S, semconv.POST_S)


class SendFigures:
    """One send, measured: the interval over all its engine calls (or the scope's own times when it failed before
    making one), its bytes and descriptors, its outcome, and its first call (the engine, op, peer and transport
    its attributes name). Bytes may be negative (an engine asked to move a negative length): the builder decides
    what that means. Bytes are a Python int (a batch's lengths may be an array's integers), the error type a
    valid string (attribute_values). Slotted: one is made per send on the builder's thread, and read there."""

    __slots__ = ("start", "end", "nbytes", "descriptors", "calls", "failure", "return_code", "first")

    def __init__(self, start: int, end: int, nbytes: int, descriptors: int, calls: int, failure: Optional[str],
                 return_code: Any, first: Optional[Record]) -> None:
        self.start = start
        self.end = end
        self.nbytes = nbytes
        self.descriptors = descriptors
        self.calls = calls  # engine calls
        self.failure = failure  # error.type, or None
        self.return_code = return_code  # the engine's code of a failed send, or None
        self.first = first  # its first engine call (records.CALL_*), or None when it made none

    def __repr__(self) -> str:
        return "SendFigures(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__) + ")"


def measure(rec: Record) -> SendFigures:
    """A SEND record's figures: the first failing call names the failure unless the scope set its own."""
    calls, failure, return_code = rec[r.SEND_CALLS], rec[r.SEND_ERROR], None
    if len(calls) == 1:  # the common case, without the loops
        return measure_call(calls[0], failure)
    if not calls:  # a scope that failed before any engine call: its own time, taken on the engine thread
        start, end = rec[r.SEND_SCOPE_TIMES]
        return SendFigures(start, end, 0, 0, 0, failure and _valid_failure(failure, None)[0], None, None)
    nbytes = descriptors = 0
    for call in calls:
        moved = call[r.CALL_BYTES]
        nbytes += moved if type(moved) is int else int(sum(moved))
        descriptors += call[r.CALL_DESCRIPTORS]
    for call in calls:
        if call[r.CALL_ERROR] is not None:
            failure, return_code = failure or call[r.CALL_ERROR], call[r.CALL_RETURN_CODE]
            break
    if failure is not None:
        failure, return_code = _valid_failure(failure, return_code)
    return SendFigures(min(c[r.CALL_START] for c in calls), max(c[r.CALL_END] for c in calls), nbytes, descriptors,
                       len(calls), failure, return_code, calls[0])


def measure_call(call: Record, failure: Optional[str]) -> SendFigures:
    """The figures of a send made of the one engine call `call` (a raw call's, or a scope's only one); `failure`
    the scope's own error type, or None."""
    moved, return_code = call[r.CALL_BYTES], None
    nbytes = moved if type(moved) is int else int(sum(moved))
    if call[r.CALL_ERROR] is not None:
        failure, return_code = failure or call[r.CALL_ERROR], call[r.CALL_RETURN_CODE]
    if failure is not None:
        failure, return_code = _valid_failure(failure, return_code)
    return SendFigures(call[r.CALL_START], call[r.CALL_END], nbytes, call[r.CALL_DESCRIPTORS], 1, failure,
                       return_code, call)


def _valid_failure(failure: Any, return_code: Any) -> Tuple[str, Any]:
    """A failed send's error type and return code as span values: a string UTF-8 carries (the integration API
    passes a framework's string on as it is), the engine's code unchanged unless it is such a string."""
    return (repaired_text(failure) if type(failure) is str else str(failure)), repaired_value(return_code)


def attributes(figures: SendFigures, info: Optional[Record], labels: Optional[Dict[str, Any]],
               cache: Dict[Any, Dict[str, Any]], peer_parsers: PeerParsers) -> SendAttributes:
    """The send span's attributes: its own `dynamic` entries first, then its shape's `static` dict from `cache`
    (made and stored there on a miss). `info` and `labels` (its request's) are None for a raw engine call."""
    attrs = SendAttributes()
    attrs[semconv.BYTES] = nbytes = figures.nbytes
    attrs[semconv.DESCRIPTOR_COUNT] = figures.descriptors
    attrs[semconv.ENGINE_CALLS] = figures.calls
    duration = figures.end - figures.start
    if duration > 0:  # aggregate.throughput, inline; a send of no measurable duration has no speed (none set)
        attrs[semconv.THROUGHPUT] = nbytes * NS_PER_S / duration
    if info is not None:
        attrs[semconv.CHUNK_INDEX] = info[r.INFO_CHUNK]
    failure = figures.failure
    if failure:
        attrs[semconv.ERROR_TYPE] = failure
        if figures.return_code is not None:
            attrs[semconv.RETURN_CODE] = figures.return_code
    first = figures.first
    extra = first[r.CALL_EXTRA] if first is not None else None
    if extra and (semconv.POST_S in extra or semconv.END_UNCERTAINTY_S in extra):
        for name in _PER_SEND_EXTRA:
            if name in extra:
                attrs[name] = extra[name]
        extra = {k: v for k, v in extra.items() if k not in _PER_SEND_EXTRA}
    attrs.dynamic = len(attrs)
    # The static part: one dict per distinct shape, never changed once made, so the encoder and the metrics
    # can key their own caches on it.
    shape: Optional[Tuple[Any, ...]]
    try:
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
        static = static_attributes(first, info, labels, peer_parsers)
        if shape is not None:
            if len(cache) >= MAX_SHAPES:
                cache.clear()
            cache[shape] = static
    attrs.update(static)
    attrs.static = static
    return attrs


def static_attributes(first: Optional[Record], info: Optional[Record], labels: Optional[Dict[str, Any]],
                      peer_parsers: PeerParsers) -> Dict[str, Any]:
    """What a send shares with the other sends of its shape: engine, peer, transport, and its transfer's
    description and request labels."""
    attrs: Dict[str, Any] = {}
    backend = None
    if first is not None:
        backend = first[r.CALL_BACKEND]
        op = first[r.CALL_OP]
        attrs[semconv.OP] = op
        attrs[semconv.NETWORK_IO_DIRECTION] = semconv.DIRECTION_OF_OP.get(op, semconv.DIRECTION_TRANSMIT)
        parse = peer_parsers.get(backend)
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
        if labels:
            attrs.update(labels)
    for name in PER_SEND:
        attrs.pop(name, None)
    return repaired(attrs)  # framework values (ids, peers, labels) may hold strings UTF-8 cannot carry
