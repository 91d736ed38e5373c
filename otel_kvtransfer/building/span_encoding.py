"""Our spans' OTLP protobuf bytes, written in their fixed shape, for the user's own OTLP exporters.

The OTLP exporters encode a batch with `encode_spans`, which builds one protobuf object per span, attribute and
value: ~70 us per span of ours on this machine, more than everything else a transfer costs. Our spans
(`direct_spans.KVSpan`) have a known shape and few distinct attribute values, so their wire bytes are mostly
cached pieces: each (key, value) pair of a repeated string, flag or count is encoded once, numbers that vary are
packed in place. `accelerate()` wraps `encode_spans` inside the OTLP/HTTP and OTLP/gRPC span exporter modules
that are in use: a batch's KVSpans are written here and merged (protobuf concatenation) into what the original
encoder makes of the other spans, so the exporter sends one request as before, through its own transport,
endpoint, headers, TLS, compression, timeouts and retries. Any other span, or an error here, takes the
original encoder. tests/building/test_span_encoding.py decodes both encoders' output and compares them field by field.

What the SDK's encoder drops, this one drops too: an attribute whose key or string UTF-8 cannot carry (the span
pipelines repair such strings before a span is made: attribute_values), an integer outside int64. What it keeps
in its cache is bounded by count and by bytes; a pair too large to be worth keeping is encoded on each use.

One span the SDK's encoder cannot encode (a time outside OTLP's fixed64: "Value out of range") makes it fail the
whole batch, and the batch processor drops it. Here such a span costs itself alone, in both pipelines (the wrapper
is installed for either): it is left out and counted (`span_encoding`), the rest of its batch goes out.
"""

import logging
import struct
import sys
from itertools import islice
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, TypeGuard

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_kvtransfer import sdk_internals
from otel_kvtransfer.building.direct_spans import TUPLE_CONTEXT as _TUPLE_CONTEXT
from otel_kvtransfer.building.direct_spans import UNSET_STATUS, KVSpan, SendAttributes

_logger = logging.getLogger(__name__)

# The exporter modules whose `encode_spans` gets our fast path (when they are imported: never imported here).
EXPORTER_MODULES = ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter")

_pack_d = struct.Struct("<d").pack
_pack_i = struct.Struct("<I").pack
_SMALL = [bytes([n]) for n in range(128)]
_KIND = {SpanKind.INTERNAL: b"\x30\x01", SpanKind.SERVER: b"\x30\x02", SpanKind.CLIENT: b"\x30\x03",
         SpanKind.PRODUCER: b"\x30\x04", SpanKind.CONSUMER: b"\x30\x05"}
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # SpanFlags
_FLAGS_LOCAL = b"\x85\x01" + _pack_i(_HAS_IS_REMOTE)
_FLAGS_REMOTE = b"\x85\x01" + _pack_i(_HAS_IS_REMOTE | _IS_REMOTE)
_STATUS_UNSET = b"\x7a\x00"  # the SDK encoder always sets a Status message, empty when unset
# The ids and times in one struct pack each (~0.15 us a span less than formatting their bytes in): trace_id
# (field 1, 16 bytes: its two halves), span_id (2, 8 bytes), parent_span_id (4); start and end (7, 8: fixed64).
_LOW64 = (1 << 64) - 1
_IDS = struct.Struct(">HQQHQ").pack  # 0x0a10 trace_id, 0x1208 span_id
_IDS_WITH_PARENT = struct.Struct(">HQQHQHQ").pack  # and 0x2208 parent_span_id
_TIMES = struct.Struct("<BQBQ").pack  # 0x39 start, 0x41 end
_CACHE_LIMIT = 16384  # encoded (key, value) pairs kept; cleared whole when full (request keys are unique)
_CACHE_BYTES = 8 << 20  # and at most this many bytes of them (the same for the static parts' encodings)
_MAX_CACHED_PAIR = 4096  # a longer pair (a framework's long string) is encoded each time, never kept
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_DROPPED = b"\x50"  # Span.dropped_attributes_count, varint


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    if n < 0x4000:  # two bytes: a span's own length, mostly
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


class _Pieces:
    """The cached pieces: encoded attribute pairs by key then value (a table per type: True and 1 are equal keys
    in a dict), prefixes of double-valued keys, span names, and per-(resource, scope) wrappers."""

    def __init__(self) -> None:
        self.strings: Dict[str, Dict[str, bytes]] = {}  # key -> value -> the encoded pair
        self.ints: Dict[str, Dict[int, bytes]] = {}
        self.bools: Dict[str, Dict[bool, bytes]] = {}
        self.double_prefix: Dict[str, bytes] = {}
        self.names: Dict[str, bytes] = {}
        # (id(resource), id(scope)) -> (resource, scope, ResourceSpans bytes, ScopeSpans bytes)
        self.wrappers: Dict[Tuple[int, int], Tuple[Resource, Optional[InstrumentationScope], bytes, bytes]] = {}
        self.statics: Dict[int, Tuple[Dict[str, Any], bytes]] = {}  # id(static attributes) -> (them, their bytes)
        self.size = 0
        self.bytes = 0
        self.statics_bytes = 0

    def slow(self, key: Any, value: Any) -> bytes:
        """A pair not cached yet: encoded (empty where the SDK's encoder drops it), and cached unless it is a
        double or too large."""
        any_value: Optional[bytes]
        table: Dict[str, Dict[Any, bytes]]
        kind = type(value)
        if type(key) is not str:
            raise _Unsupported(type(key))
        try:
            key_bytes = key.encode("utf-8")
        except UnicodeEncodeError:  # the SDK's encoder drops the attribute
            return b""
        if kind is float:
            head = _field(b"\x0a", key_bytes)
            prefix = b"\x4a" + _varint(len(head) + 11) + head + b"\x12\x09\x21"
            if len(self.double_prefix) >= 4096:
                self.double_prefix.clear()
            self.double_prefix[key] = prefix
            return prefix + _pack_d(value)
        if kind is str:
            try:
                any_value = _field(b"\x0a", value.encode("utf-8"))
            except UnicodeEncodeError:  # the SDK's encoder drops the attribute
                any_value = None
            table = self.strings
        elif kind is bool:
            any_value, table = (b"\x10\x01" if value else b"\x10\x00"), self.bools
        elif kind is int:
            # protobuf refuses an int64 outside its range, and the SDK's encoder drops the attribute
            any_value = b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF) if _INT64_MIN <= value <= _INT64_MAX else None
            table = self.ints
        else:
            raise _Unsupported(kind)
        pair = b"" if any_value is None else _field(b"\x4a", _field(b"\x0a", key_bytes) + _field(b"\x12", any_value))
        size = 2 * len(pair) + 64  # what the cache holds for it, roughly: the pair and the value it is found by
        if size > _MAX_CACHED_PAIR:
            return pair
        if self.size >= _CACHE_LIMIT or self.bytes + size > _CACHE_BYTES:
            self.strings.clear()
            self.ints.clear()
            self.bools.clear()
            self.size = self.bytes = 0
        self.size += 1
        self.bytes += size
        table.setdefault(key, {})[value] = pair
        return pair

    def static(self, attributes: Dict[str, Any]) -> bytes:
        """The encoded pairs of a static attribute dict (builder: never changed once made), by identity."""
        cached = self.statics.get(id(attributes))
        if cached is not None and cached[0] is attributes:
            return cached[1]
        encoded = b"".join(self.slow(key, value) for key, value in attributes.items())
        if len(encoded) > _CACHE_BYTES // 16:  # kept, it would crowd out the rest: encoded again on each use
            return encoded
        if len(self.statics) >= _CACHE_LIMIT or self.statics_bytes + len(encoded) > _CACHE_BYTES:
            self.statics.clear()
            self.statics_bytes = 0
        self.statics_bytes += len(encoded)
        self.statics[id(attributes)] = (attributes, encoded)
        return encoded

    def name(self, name: str) -> bytes:
        encoded = self.names.get(name)
        if encoded is None:
            if len(self.names) >= 256:  # our span names are a handful
                self.names.clear()
            encoded = self.names[name] = _field(b"\x2a", name.encode("utf-8"))
        return encoded

    def wrapper(self, resource: Resource, scope: Optional[InstrumentationScope]) -> Tuple[bytes, bytes]:
        """(ResourceSpans bytes without its scope_spans, ScopeSpans bytes without its spans), made once with the
        SDK encoder's own functions, so resource and scope are encoded exactly as it encodes them."""
        key = (id(resource), id(scope))
        cached = self.wrappers.get(key)
        if cached is not None and cached[0] is resource and cached[1] is scope:
            return cached[2], cached[3]
        from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans

        encode_resource, encode_scope = sdk_internals.otlp_resource_and_scope_encoders()
        resource_part = ResourceSpans(resource=encode_resource(resource),
                                      schema_url=resource.schema_url).SerializeToString()
        scope_part = ScopeSpans(scope=encode_scope(scope),  # (protobuf takes None for unset; its stub says str)
                                schema_url=scope.schema_url if scope else None).SerializeToString()  # type: ignore[arg-type]
        if len(self.wrappers) > 64:
            self.wrappers.clear()
        self.wrappers[key] = (resource, scope, resource_part, scope_part)
        return resource_part, scope_part


class _Unsupported(Exception):
    """A value this encoder does not write (a sequence attribute): the span takes the original encoder."""


_PIECES = _Pieces()


def encode_span(span: KVSpan, pieces: _Pieces = _PIECES) -> bytes:
    """One Span message (without its field tag). The span's fields are read by their private names, listed in
    sdk_internals.SPAN_FIELD_NAMES (the cheapest read there is, per span)."""
    context = span._context
    if _TUPLE_CONTEXT:  # a SpanContext is a tuple: indexing it skips three property calls
        trace_id, span_id, state = context[0], context[1], context[4]
    else:
        trace_id, span_id, state = context.trace_id, context.span_id, context.trace_state
    parent = span._parent
    if parent is None:
        head = _IDS(0x0A10, trace_id >> 64, trace_id & _LOW64, 0x1208, span_id)
    else:
        head = _IDS_WITH_PARENT(0x0A10, trace_id >> 64, trace_id & _LOW64, 0x1208, span_id, 0x2208,
                                parent.span_id)
    if state:
        head += _field(b"\x1a", ",".join(f"{k}={v}" for k, v in state.items()).encode("utf-8"))
    parts = [head, pieces.name(span._name), _KIND[span._kind], _TIMES(0x39, span._start_time, 0x41,
                                                                     span._end_time)]
    strings, ints, bools, doubles, append = pieces.strings, pieces.ints, pieces.bools, pieces.double_prefix, \
        parts.append
    attributes = span._attributes
    items: Iterable[Tuple[str, Any]]
    items, static = attributes.items(), b""
    if type(attributes) is SendAttributes:
        shared = attributes.static
        if len(attributes) == attributes.dynamic + len(shared):  # nothing of the static part overridden
            static = pieces.static(shared)
            items = islice(items, attributes.dynamic)
    for key, value in items:
        kind = type(value)
        if kind is float:
            prefix = doubles.get(key)
            append(prefix + _pack_d(value) if prefix is not None else pieces.slow(key, value))
            continue
        # exact types only: a subclass (a float of numpy's equal to an int) must not find the int's pair
        table = strings.get(key) if kind is str else ints.get(key) if kind is int else \
            bools.get(key) if kind is bool else None
        pair = table.get(value) if table is not None else None
        append(pair if pair is not None else pieces.slow(key, value))
    append(static)
    if type(attributes) is BoundedAttributes and attributes.dropped:  # the span limits cut some
        append(_DROPPED + _varint(attributes.dropped))
    status = span._status
    if status is UNSET_STATUS or (status.status_code is StatusCode.UNSET and not status.description):
        append(_STATUS_UNSET)
    else:
        append(_status_field(status))
    append(_FLAGS_REMOTE if parent is not None and parent.is_remote else _FLAGS_LOCAL)
    return b"".join(parts)


def _status_field(status: Status) -> bytes:
    """The Status field of a span whose status was set (a failed send's: its description and code)."""
    body = b""
    if status.description:
        body += _field(b"\x12", status.description.encode("utf-8"))
    if status.status_code.value:
        body += b"\x18" + _varint(status.status_code.value)
    return _field(b"\x7a", body)


# What a span's own fields raise when they are outside what OTLP carries (a time or an id outside fixed64, a time
# that is not an int): that span is left out, alone.
_UNENCODABLE = (struct.error, OverflowError, TypeError, ValueError)


def encode_request(spans: Iterable[KVSpan], pieces: _Pieces = _PIECES,
                   unencodable: Optional[List[KVSpan]] = None) -> bytes:
    """ExportTraceServiceRequest bytes for KVSpans: one ResourceSpans per (resource, scope), spans in order. A span
    whose own fields OTLP cannot carry raises, or, given the list `unencodable`, is put there and left out."""
    # (id(resource), id(scope)) -> (resource, scope, the encoded spans with their tags)
    groups: Dict[Tuple[int, int], Tuple[Resource, Optional[InstrumentationScope], List[bytes]]] = {}
    for span in spans:
        try:
            encoded = encode_span(span, pieces)
        except _UNENCODABLE:
            if unencodable is None:
                raise
            unencodable.append(span)
            continue
        key = (id(span._resource), id(span._instrumentation_scope))
        group = groups.get(key)
        if group is None:
            group = groups[key] = (span._resource, span._instrumentation_scope, [])
        group[2].extend((b"\x12" + _varint(len(encoded)), encoded))  # joined once below: one copy of the span
    out = []
    for resource, scope, encoded_spans in groups.values():
        resource_part, scope_part = pieces.wrapper(resource, scope)
        scope_spans = scope_part + b"".join(encoded_spans)
        resource_spans = resource_part + _field(b"\x12", scope_spans)
        out.append(_field(b"\x0a", resource_spans))
    return b"".join(out)


def _fast_enough(span: ReadableSpan) -> TypeGuard[KVSpan]:
    return type(span) is KVSpan and not span._events and not span._links


class PreEncoded:
    """A request already in wire bytes, for an exporter that only serializes what `encode_spans` returned (the
    OTLP/HTTP one): no parse and re-serialize of bytes we just wrote."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self, **_: Any) -> bytes:
        return self.data

    SerializePartialToString = SerializeToString

    def ByteSize(self) -> int:
        return len(self.data)


DROP_REASON = "span_encoding"  # kv_transfer.drop_reason of a span left out of its batch (docs/settings.md)


def _no_count(reason: str, count: int) -> None:
    pass


class AcceleratedEncoder:
    """Stands in for an exporter module's `encode_spans`: our spans written here, the rest by the original.
    `as_message`: the exporter hands the result to a gRPC stub, which needs a real protobuf message.

    A span that cannot be encoded (a time outside OTLP's fixed64, whoever made the span: ours reach here checked,
    others' need not) costs that span alone: it is left out of the batch and counted (`count_dropped(DROP_REASON,
    n)`), and the rest of the batch goes out. The original encoder fails a whole batch on one such span."""

    def __init__(self, original: Callable[..., Any], as_message: bool = True,
                 count_dropped: Callable[[str, int], None] = _no_count) -> None:
        self.original = original
        self.as_message = as_message
        self.count_dropped = count_dropped
        self._failed_logged = False
        self._left_out_logged = False

    def __call__(self, sdk_spans: Sequence[ReadableSpan], *args: Any, **kwargs: Any) -> Any:
        ours = [span for span in sdk_spans if _fast_enough(span)]
        if ours:
            try:
                return self._fast(ours, sdk_spans, args, kwargs)
            except Exception:
                if not self._failed_logged:
                    self._failed_logged = True
                    _logger.warning("otel_kvtransfer: its fast span encoder failed; the exporter's own encoder takes "
                                    "over for that batch", exc_info=True)
        try:
            return self.original(sdk_spans, *args, **kwargs)
        except Exception:  # the whole batch would be lost: encode what encodes
            return self.original(self._encodable(sdk_spans, args, kwargs), *args, **kwargs)

    def _fast(self, ours: List[KVSpan], sdk_spans: Sequence[ReadableSpan], args: Tuple[Any, ...],
              kwargs: Dict[str, Any]) -> Any:
        unencodable: List[KVSpan] = []
        encoded = encode_request(ours, unencodable=unencodable)
        others = [span for span in sdk_spans if not _fast_enough(span)] if len(ours) < len(sdk_spans) else []
        if unencodable:
            self._left_out(len(unencodable))
        if others:
            try:
                message = self.original(others, *args, **kwargs)
            except Exception:
                message = self.original(self._encodable(others, args, kwargs), *args, **kwargs)
        if not self.as_message:  # protobuf concatenation is merging: their ResourceSpans, then ours
            return PreEncoded((message.SerializePartialToString() if others else b"") + encoded)
        if not others:
            message = self.original([], *args, **kwargs)
        message.MergeFromString(encoded)
        return message

    def _encodable(self, spans: Sequence[ReadableSpan], args: Tuple[Any, ...],
                   kwargs: Dict[str, Any]) -> List[ReadableSpan]:
        """The spans the original encoder encodes one by one (only after it failed a batch of them); the others
        counted."""
        kept = []
        for span in spans:
            try:
                self.original([span], *args, **kwargs)
            except Exception:
                continue
            kept.append(span)
        if len(kept) < len(spans):
            self._left_out(len(spans) - len(kept))
        return kept

    def _left_out(self, count: int) -> None:
        if not self._left_out_logged:
            self._left_out_logged = True
            _logger.warning("otel_kvtransfer: %d span(s) of an export batch could not be encoded (a time outside "
                            "what OTLP carries): left out of it, the rest sent; counted in "
                            "kv_transfer.instrumentation.dropped (%s), further ones without a line", count,
                            DROP_REASON)
        try:
            self.count_dropped(DROP_REASON, count)
        except Exception:
            _logger.debug("otel_kvtransfer: could not count spans left out of a batch", exc_info=True)


def accelerate(count_dropped: Optional[Callable[[str, int], None]] = None) -> int:
    """Wrap `encode_spans` in the OTLP span exporter modules already imported; how many are wrapped now.
    `count_dropped(reason, n)` counts the spans left out of a batch (the wrapper in place takes it too)."""
    wrapped = 0
    module: Any  # an exporter module, or None
    for name in EXPORTER_MODULES:
        module = sys.modules.get(name)
        current = getattr(module, "encode_spans", None)
        if current is None:
            continue
        if not isinstance(current, AcceleratedEncoder):
            current = module.encode_spans = AcceleratedEncoder(current, as_message=".grpc." in name)
        if count_dropped is not None:
            current.count_dropped = count_dropped
        wrapped += 1
    return wrapped


def restore() -> None:
    module: Any  # an exporter module, or None
    for name in EXPORTER_MODULES:
        module = sys.modules.get(name)
        current = getattr(module, "encode_spans", None)
        if isinstance(current, AcceleratedEncoder):
            module.encode_spans = current.original
