"""Read span files into one span model, whatever wrote them; every value in them is untrusted.

Two formats, one JSON object per line, detected line by line:

* OTLP-JSON as the OpenTelemetry file exporters write it (`OtlpJsonFileSpanExporter`, the Collector's ``file``
  exporter): one ``{"resourceSpans": [...]}`` export request per line, parsed with opentelemetry-proto's
  ``ExportTraceServiceRequest`` and ``json_format`` (ids in hex as OTLP/JSON writes them, or base64);
* the older JSON-lines format of this package: one span per line, keys ``name``, ``trace_id``, ``span_id``,
  ``parent_span_id``, ``kind``, ``start_time_unix_nano``, ``end_time_unix_nano``, ``status``, ``attributes``,
  ``resource``, ``scope``.

Anything else (an empty, binary or foreign file; NaN, Infinity or 1e999 anywhere; a value of the wrong type in
a ``kv_transfer.*`` attribute of one of our spans; nesting too deep; a lone surrogate; a line over MAX_LINE; a
line denser in JSON objects than any exporter writes) raises :class:`SpanFileError`, whose message is one line
naming the file and the line, with echoed values bounded.

Only our own spans' attributes are ours to judge (`is_ours`: a ``kv_transfer.*`` span, or one of our scope). A
Collector's file holds every service's spans: an attribute of another span that the tools would refuse in one of
ours (a string ``server.port``, a non-finite double) is left out of that span and counted in
`skipped.foreign`, and the file is read on.

A torn line (what a crash or a full disk leaves: a line cut short, or the start of a line with the next one run
into it) is skipped and noted in `skipped`, so one lost batch does not cost the file; a file with no good span
line is still an error. A span that ends before it starts (the wall clock stepped back while it was open) is
skipped too, alone, and counted in `skipped.backwards`: the other spans of its line are read. A UTF-8
byte-order mark before the first line is ignored.

Memory: reading one line holds that line (at most MAX_LINE, 16 MiB), its decoded JSON (at most one object or
list per 8 bytes of line, so a hostile line is refused before it is decoded) and its spans; the attribute memo
holds at most 16,384 values of at most 256 characters. docs/tools.md gives the measured bound.

    for span in iter_spans("spans.jsonl"):
        print(span.name, span.duration_ns, span.attributes.get("kv_transfer.bytes"))
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Optional

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.building.file_exporter import MAX_LINE, ids_from_hex
from otel_kvtransfer.tools.source import SourceError, SpanSource, open_source
from otel_kvtransfer.tools.text import bounded

__all__ = ["Span", "SpanFileError", "Skipped", "LineTally", "iter_spans", "read_spans", "stderr_progress"]

KINDS = ("INTERNAL", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")  # by OTLP number (0 = unspecified)
STATUS_CODES = ("UNSET", "OK", "ERROR")
# A JSON object or list costs ~60-200 bytes decoded; OTLP-JSON spends 10+ bytes of text on each (`{"key":"k",
# "value":{}}` is the densest attribute), so a line with more than one per 8 bytes is refused before decoding.
_BYTES_PER_CONTAINER = 8
_MAX_NS = (1 << 63) - 1

# kv_transfer attributes the tools compute with: their type is checked on read, so no figure is NaN or a string.
COUNTS = frozenset({sc.BYTES, sc.LOGICAL_BYTES, sc.EXPECTED_BYTES, sc.TRANSFER_COUNT, sc.CHUNK_COUNT,
                    sc.REPLICA_FACTOR, sc.DESCRIPTOR_COUNT, sc.ENGINE_CALLS, sc.CHUNK_INDEX, sc.DESTINATION_INDEX,
                    sc.BOOTSTRAP_ROOM, sc.SERVER_PORT})
MEASURES = frozenset({sc.BUSY_S, sc.THROUGHPUT, sc.COMPUTE_OVERLAP_S, sc.COMPUTE_OVERLAP_RATIO, sc.TAIL_S,
                      sc.TAIL_BUSY_S, sc.TAIL_QUEUED_S})

# A progress callback gets (bytes read so far, total bytes, spans so far).
Progress = Callable[[int, int, int], None]


class SpanFileError(ValueError):
    """A span file that cannot be read; ``str()`` is one line naming the file and, when known, the line."""

    def __init__(self, path: str, line: Optional[int], message: str):
        self.path = str(path)
        self.line = line
        self.message = message
        where = f"{self.path}:{line}" if line else self.path
        super().__init__(bounded(f"{where}: {message}", 400))


class Span:
    """One finished span, the same whichever format it came from."""

    __slots__ = ("name", "trace_id", "span_id", "parent_span_id", "kind", "start_time_unix_nano",
                 "end_time_unix_nano", "status_code", "status_description", "attributes", "resource",
                 "scope_name", "line")

    def __init__(self, name, trace_id, span_id, parent_span_id, kind, start_time_unix_nano, end_time_unix_nano,
                 status_code="UNSET", status_description=None, attributes=None, resource=None, scope_name="",
                 line=0):
        self.name: str = name
        self.trace_id: str = trace_id  # 32 lowercase hex
        self.span_id: str = span_id  # 16 lowercase hex
        self.parent_span_id: Optional[str] = parent_span_id
        self.kind: str = kind
        self.start_time_unix_nano: int = start_time_unix_nano
        self.end_time_unix_nano: int = end_time_unix_nano
        self.status_code: str = status_code
        self.status_description: Optional[str] = status_description
        self.attributes: dict = attributes if attributes is not None else {}
        self.resource: dict = resource if resource is not None else {}
        self.scope_name: str = scope_name
        self.line: int = line

    @property
    def duration_ns(self) -> int:
        return self.end_time_unix_nano - self.start_time_unix_nano

    @property
    def is_error(self) -> bool:
        return self.status_code == "ERROR"

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attributes.get(key, default)


class _LineError(Exception):
    """Raised inside the line parsers; turned into a SpanFileError with file and line by the reader."""


def _reject_constant(name):
    raise _LineError(f"{name} is not a number JSON allows")


def _finite_float(text):
    value = float(text)
    if not math.isfinite(value):
        raise _LineError(f"number {bounded(text, 40)} is out of range")
    return value


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_FIELD_CHAIN = re.compile(r"Failed to parse (\w+) field")


def _check_text(value: Any) -> None:
    """Raise on a lone surrogate anywhere in a decoded JSON value (it cannot be written out as UTF-8)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise _LineError("a string holds a lone surrogate (not valid Unicode)") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


# --------------------------------------------------------------------------------------------------- values


def is_ours(name: str, scope_name: str) -> bool:
    """A span this package wrote (or one named as ours, which the tools compute with): its values are judged."""
    return name.startswith(_OUR_PREFIX) or scope_name == sc.INSTRUMENTATION_NAME


_OUR_PREFIX = sc.SPAN_REQUEST.split(".")[0] + "."  # "kv_transfer."


class _Foreign:
    """Attributes left out of spans not ours, for the reader to count per line."""

    __slots__ = ("count",)

    def __init__(self):
        self.count = 0


def _checked_attributes(attributes: dict, foreign: Optional[_Foreign] = None) -> dict:
    """The attributes with the numeric kv_transfer ones checked: counts are integers >= 0, measures finite >= 0.
    In our spans (`foreign` None) a bad one refuses the line; in another's it is left out and counted."""
    for key in COUNTS.intersection(attributes):
        value = attributes[key]
        if isinstance(value, float) and value.is_integer():
            value = attributes[key] = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
            if foreign is None:
                raise _LineError(f"{key} must be an integer >= 0, got {bounded(repr(value))}")
            del attributes[key]
            foreign.count += 1
    for key in MEASURES.intersection(attributes):
        value = attributes[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            if foreign is None:
                raise _LineError(f"{key} must be a finite number >= 0, got {bounded(repr(value))}")
            del attributes[key]
            foreign.count += 1
    if sc.REQUEST_KEY in attributes and not isinstance(attributes[sc.REQUEST_KEY], str):
        attributes[sc.REQUEST_KEY] = str(attributes[sc.REQUEST_KEY])
    return attributes


def _times(start: Any, end: Any) -> tuple:
    values = []
    for what, value in (("start time", start), ("end time", end)):
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX_NS:
            raise _LineError(f"{what} must be a Unix time in nanoseconds, got {bounded(repr(value))}")
        values.append(value)
    return values[0], values[1]  # an end before the start is skipped by the reader (`Skipped.backwards`)


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _LineError(f"{what} must be a string, got {type(value).__name__}")
    return value


def _object(value: Any, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _LineError(f"{what} must be an object, got {type(value).__name__}")
    return value


# --------------------------------------------------------------------------------------------------- OTLP-JSON


def _any_value(value) -> Any:
    """An OTLP AnyValue message as a plain value (a double must be finite: JSON output has no NaN)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "double_value" and not math.isfinite(value.double_value):
        raise _LineError(f"an attribute value is {value.double_value} (only finite numbers are allowed)")
    if which == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in value.kvlist_value.values}
    if which == "bytes_value":
        return base64.b64encode(value.bytes_value).decode("ascii")
    return getattr(value, which)


def _otlp_attributes(items) -> dict:
    return dict(_key_value(kv) for kv in items)


def _key_value(kv) -> tuple:
    try:
        return kv.key, _any_value(kv.value)
    except _LineError as exc:
        raise _LineError(f"attribute {bounded(kv.key, 80)}: {exc}") from None


def _hex(raw: bytes, size: int, what: str, optional: bool = False) -> Optional[str]:
    if optional and not any(raw):
        return None
    if len(raw) != size:
        raise _LineError(f"{what} must be {size} bytes ({2 * size} hex digits), got {len(raw)}")
    return raw.hex()


_MESSAGE_FIELDS: dict = {}


def _message_fields(descriptor) -> dict:
    """{JSON or proto name: (repeated, descriptor)} of the message-typed fields of a message type."""
    fields = _MESSAGE_FIELDS.get(descriptor.full_name)
    if fields is None:
        fields = {}
        for field in descriptor.fields:
            if field.message_type is not None:
                repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
                entry = (repeated, field.message_type)
                fields[field.json_name] = fields[field.name] = entry
        _MESSAGE_FIELDS[descriptor.full_name] = fields
    return fields


# Any list of one line but its spans (attributes, events, links, resources, scopes): the SDK keeps 128 attributes
# by default and a batch holds a few resources; a longer list is refused before json_format parses it (a hostile
# line of 800,000 attributes took 13 s to reject, one of 930,000 empty resources 9 s).
MAX_ITEMS = 1 << 14
_BATCH_LISTS = frozenset({"spans"})


def _check_shape(value: dict, descriptor) -> None:
    """Every message-typed field is an object (or a list of objects): json_format, told to skip unknown fields
    (as OTLP receivers must), would otherwise take `"resource": "x"` for an empty resource."""
    stack = [(value, descriptor)]
    while stack:
        obj, desc = stack.pop()
        fields = _message_fields(desc)
        for key, item in obj.items():
            entry = fields.get(key)
            if entry is None or item is None:
                continue
            repeated, child = entry
            if repeated and isinstance(item, list) and len(item) > MAX_ITEMS and key not in _BATCH_LISTS:
                raise _LineError(f"{key}: {len(item)} items, more than the reader accepts in one list ({MAX_ITEMS})")
            for element in (item if repeated and isinstance(item, list) else [item]):
                if not isinstance(element, dict):
                    raise _LineError(f"{key} must be an object, got {type(element).__name__}")
                stack.append((element, child))


# Span attributes repeat (keys always; most values: payload, framework, chunk and destination indexes, the
# request key across a request's spans), and json_format costs far more per field than the rest of the read:
# each distinct scalar attribute is parsed once with json_format into a KeyValue and remembered.
_KEY_VALUES: dict = {}
_KEY_VALUES_MAX = 1 << 14
_MEMO_TEXT_MAX = 256  # longer keys or string values are parsed every time: the memo's memory stays bounded
_SCALARS = (str, int, float, bool)


def _span_attributes(items, foreign: Optional[_Foreign] = None) -> dict:
    """The attributes of one span from its OTLP-JSON list, each KeyValue parsed by json_format (or remembered). In
    a span not ours (`foreign`), an attribute that cannot be read is left out and counted."""
    if items is None:
        return {}
    if not isinstance(items, list):
        raise _LineError(f"attributes must be a list, got {type(items).__name__}")
    if len(items) > MAX_ITEMS:
        raise _LineError(f"attributes: {len(items)} items, more than the reader accepts in one list ({MAX_ITEMS})")
    out = {}
    for item in items:
        memo = None
        if type(item) is dict and len(item) == 2 and type(item.get("key")) is str:
            value = item.get("value")
            if type(value) is dict and len(value) == 1:
                ((kind, scalar),) = value.items()
                if isinstance(scalar, _SCALARS) and len(item["key"]) <= _MEMO_TEXT_MAX and (
                        not isinstance(scalar, str) or len(scalar) <= _MEMO_TEXT_MAX):
                    memo = (item["key"], kind, type(scalar), scalar)
        parsed = _KEY_VALUES.get(memo) if memo is not None else None
        if parsed is None:
            try:
                parsed = _parsed_attribute(item)
            except (_LineError, json_format.ParseError, ValueError, TypeError):
                if foreign is None:
                    raise
                foreign.count += 1
                continue
            if memo is not None:
                if len(_KEY_VALUES) >= _KEY_VALUES_MAX:
                    _KEY_VALUES.clear()
                _KEY_VALUES[memo] = parsed
        out[parsed[0]] = parsed[1]
    return out


def _parsed_attribute(item) -> tuple:
    if not isinstance(item, dict):
        raise _LineError(f"an attribute must be an object, got {type(item).__name__}")
    key_value = KeyValue()
    json_format.ParseDict(item, key_value, ignore_unknown_fields=True)
    return _key_value(key_value)


def _span_dicts(obj: dict) -> Iterator[dict]:
    """The span objects of an export request, in the order json_format fills the message (either field name)."""
    for resource_spans in obj.get("resourceSpans") or obj.get("resource_spans") or ():
        if isinstance(resource_spans, dict):
            for scope_spans in resource_spans.get("scopeSpans") or resource_spans.get("scope_spans") or ():
                if isinstance(scope_spans, dict):
                    yield from (s for s in scope_spans.get("spans") or () if isinstance(s, dict))


def _otlp_spans(obj: dict, foreign: _Foreign) -> Iterator[Span]:
    attribute_lists: Iterable[Any] = [span.pop("attributes", None) for span in _span_dicts(obj)]
    _check_shape(obj, ExportTraceServiceRequest.DESCRIPTOR)
    message = ExportTraceServiceRequest()
    json_format.ParseDict(ids_from_hex(obj), message, ignore_unknown_fields=True)
    attribute_lists = iter(attribute_lists)
    for resource_spans in message.resource_spans:
        resource = _otlp_attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            scope = scope_spans.scope.name
            for raw in scope_spans.spans:
                if not raw.name:
                    raise _LineError("a span has no name")
                start, end = _times(raw.start_time_unix_nano, raw.end_time_unix_nano)
                judged = None if is_ours(raw.name, scope) else foreign
                attributes = _checked_attributes(_span_attributes(next(attribute_lists), judged), judged)
                yield Span(
                    name=raw.name,
                    trace_id=_hex(raw.trace_id, 16, "traceId"),
                    span_id=_hex(raw.span_id, 8, "spanId"),
                    parent_span_id=_hex(raw.parent_span_id, 8, "parentSpanId", optional=True),
                    kind=KINDS[raw.kind] if 0 <= raw.kind < len(KINDS) else "INTERNAL",
                    start_time_unix_nano=start,
                    end_time_unix_nano=end,
                    status_code=STATUS_CODES[raw.status.code] if 0 <= raw.status.code < 3 else "UNSET",
                    status_description=raw.status.message or None,
                    attributes=attributes,
                    resource=resource,
                    scope_name=scope,
                )


# --------------------------------------------------------------------------------------------------- JSON lines


def _hex_id(value: Any, digits: int, what: str, optional: bool = False) -> Optional[str]:
    if optional and value in (None, ""):
        return None
    if isinstance(value, str) and len(value) == digits:
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raw = None
        if raw is not None:
            return None if optional and not any(raw) else raw.hex()
    raise _LineError(f"{what} must be {digits} hex digits, got {bounded(repr(value))}")


def _native_span(obj: dict, foreign: _Foreign) -> Span:
    for key in ("name", "trace_id", "span_id", "start_time_unix_nano", "end_time_unix_nano"):
        if key not in obj:
            raise _LineError(f"span has no {key!r}")
    name = _text(obj["name"], "name")
    if not name:
        raise _LineError("span name must be a non-empty string")
    status = _object(obj.get("status"), "status")
    code = status.get("code") or "UNSET"
    if code not in STATUS_CODES:
        raise _LineError(f"unknown status code {bounded(repr(code))}")
    kind = obj.get("kind") or "INTERNAL"
    if kind not in KINDS:
        raise _LineError(f"unknown span kind {bounded(repr(kind))}")
    start, end = _times(obj["start_time_unix_nano"], obj["end_time_unix_nano"])
    scope = _text(_object(obj.get("scope"), "scope").get("name"), "scope name")
    judged = None if is_ours(name, scope) else foreign
    return Span(
        name=name,
        trace_id=_hex_id(obj["trace_id"], 32, "trace_id"),
        span_id=_hex_id(obj["span_id"], 16, "span_id"),
        parent_span_id=_hex_id(obj.get("parent_span_id"), 16, "parent_span_id", optional=True),
        kind=kind,
        start_time_unix_nano=start,
        end_time_unix_nano=end,
        status_code=code,
        status_description=_text(status.get("description"), "status description") or None,
        attributes=_checked_attributes(dict(_object(obj.get("attributes"), "attributes")), judged),
        resource=dict(_object(obj.get("resource"), "resource")),
        scope_name=scope,
    )


def _parse_error(message: str) -> str:
    """json_format's "Failed to parse a field: Failed to parse b field: reason" as "not OTLP-JSON at a.b: reason"."""
    where = _FIELD_CHAIN.findall(message)
    reason = message.rsplit(" field: ", 1)[-1] if where else message
    return f"not OTLP-JSON{' at ' + '.'.join(where) if where else ''}: {bounded(reason, 120)}"


class _TornLine(_LineError):
    """A line a crash or a full disk cut short (or the start of one with the next line run into it)."""


def _parse_line(raw: bytes, foreign: _Foreign) -> list:
    if raw.startswith(b"{") and (b"\x00" in raw or not raw.rstrip().endswith(b"}")):
        raise _TornLine("the line is cut short")  # a crash leaves zeros, a full disk a partial line
    if not raw.strip(b"\x00\r\n"):
        raise _TornLine("the line holds only zero bytes")
    if b"\x00" in raw:
        raise _LineError("binary data: not a span file")
    containers = raw.count(b"{") + raw.count(b"[")
    if containers > len(raw) // _BYTES_PER_CONTAINER + 64:
        raise _LineError(f"{containers} JSON objects and lists in {len(raw)} bytes: denser than any span "
                         "exporter writes (refused before decoding: it would take too much memory)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _LineError("not UTF-8 text: not a span file") from None
    try:
        obj = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        if raw.startswith(b'{"'):  # began as a span line and broke: torn (two lines run together, a cut)
            raise _TornLine(f"invalid JSON ({exc.msg} at column {exc.colno}): a torn line") from None
        raise _LineError(f"invalid JSON: {exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise _LineError("invalid JSON: nested too deeply") from None
    if _SURROGATE_ESCAPE.search(raw):
        _check_text(obj)
    if not isinstance(obj, dict):
        raise _LineError(f"expected a JSON object, got {type(obj).__name__}: not a span file")
    if "resourceSpans" in obj:
        try:
            return list(_otlp_spans(obj, foreign))
        except json_format.ParseError as exc:
            raise _LineError(_parse_error(str(exc))) from None
    if "trace_id" in obj and "span_id" in obj:
        return [_native_span(obj, foreign)]
    keys = ", ".join(sorted(bounded(k, 40) for k in obj)[:5]) or "none"
    raise _LineError(f"not a span: neither OTLP-JSON nor the JSON-lines span format (keys: {keys})")


# --------------------------------------------------------------------------------------------------- reader


class LineTally:
    """How many of one kind of thing a read left out, and the first few line numbers they were on."""

    SHOWN = 20

    def __init__(self):
        self.count = 0
        self.lines: list = []
        self.more_lines = False

    def add(self, number: int, count: int = 1) -> None:
        self.count += count
        if self.lines and self.lines[-1] == number:
            return
        if len(self.lines) < self.SHOWN:
            self.lines.append(number)
        else:
            self.more_lines = True

    def where(self) -> str:
        """The line numbers, "line 2", "lines 2, 11" or "lines 2, 11, ... and more" (each line named once)."""
        plural = "s" if len(self.lines) > 1 else ""
        return f"line{plural} " + ", ".join(map(str, self.lines)) + (" and more" if self.more_lines else "")


class Skipped:
    """What a read left out, each kind counted with the first few line numbers: torn lines (`count`, `lines`,
    `add`, as before), spans that end before they start (`backwards`), attributes of spans not ours that could not
    be read (`foreign`) and, counted by the reader of requests, spans that repeat the trace and span id of one read
    before (`duplicates`)."""

    SHOWN = LineTally.SHOWN

    def __init__(self):
        self.torn = LineTally()
        self.backwards = LineTally()
        self.duplicates = LineTally()
        self.foreign = LineTally()

    @property
    def count(self) -> int:
        return self.torn.count

    @property
    def lines(self) -> list:
        return self.torn.lines

    def add(self, number: int) -> None:
        self.torn.add(number)

    def message(self, name: str) -> str:
        """One line saying which torn lines were skipped and why."""
        count, lines = self.torn.count, self.torn.lines
        shown = ", ".join(map(str, lines)) + (f" and {count - len(lines)} more" if count > len(lines) else "")
        plural = "s" if count > 1 else ""
        return (f"{bounded(name)}: skipped {count} torn line{plural} ({shown}): cut short by a crash or a "
                "full disk; the other lines were read")

    def warnings(self, name: str) -> list:
        """One line for each kind of thing left out (none when the read left nothing out)."""
        out = [self.message(name)] if self.torn.count else []
        if self.backwards.count:
            n = self.backwards.count
            out.append(f"{bounded(name)}: skipped {n} span{'s' if n > 1 else ''} that end{'' if n > 1 else 's'} "
                       f"before {'they start' if n > 1 else 'it starts'} ({self.backwards.where()}): the wall "
                       "clock stepped back while the span was open; the other spans were read")
        if self.foreign.count:
            n = self.foreign.count
            out.append(f"{bounded(name)}: left out {n} attribute{'s' if n > 1 else ''} of spans not written by "
                       f"otel_kvtransfer that {'are' if n > 1 else 'is'} not what the tools read "
                       f"({self.foreign.where()}): those spans are not ours to judge; the rest was read")
        if self.duplicates.count:
            n = self.duplicates.count
            out.append(f"{bounded(name)}: left out {n} span{'s' if n > 1 else ''} repeating the trace and span id of "
                       f"a span read before ({self.duplicates.where()}): each id counts once, as first read")
        return out

    @property
    def spans(self) -> int:
        """Spans left out that the read otherwise took (backwards and duplicate spans; torn lines are lines)."""
        return self.backwards.count + self.duplicates.count


def iter_spans(path, progress: Optional[Progress] = None, limit_bytes: Optional[int] = None,
               skipped: Optional[Skipped] = None) -> Iterator[Span]:
    """Yield the spans of `path` (a file name, `-` for stdin, or a `SpanSource`) in file order (up to
    `limit_bytes` when given). Torn lines are skipped and noted in `skipped`; raises SpanFileError naming the
    line on bad input, or on a file with no span at all."""
    if isinstance(path, SpanSource):
        source, owned = path, False
    else:
        try:
            source, owned = open_source(os.fspath(path)), True
        except SourceError as exc:
            raise SpanFileError(os.fspath(path), None, str(exc)) from None
    try:
        yield from _read(source, progress, limit_bytes, skipped if skipped is not None else Skipped())
    finally:
        if owned:
            source.close()


def _read(source: SpanSource, progress, limit_bytes, skipped: Skipped) -> Iterator[Span]:
    name = source.name
    try:
        handle = source.open()
    except (OSError, SourceError) as exc:
        raise SpanFileError(name, None, f"cannot read: {exc}") from None
    total = source.size if limit_bytes is None else min(source.size, limit_bytes)
    count = done = number = 0
    first_torn = None
    with handle:
        while limit_bytes is None or done < limit_bytes:
            try:
                raw = handle.readline(MAX_LINE + 1)
            except OSError as exc:
                raise SpanFileError(name, number + 1, f"cannot read: {exc.strerror or exc}") from None
            if not raw:
                break
            number += 1
            done += len(raw)
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a byte-order mark some editors write
                raw = raw[3:]
            if progress is not None and number % 64 == 0:
                progress(done, max(total, done), count)
            if not raw.strip():
                continue
            if len(raw) > MAX_LINE and not raw.endswith(b"\n"):
                raise SpanFileError(name, number, f"line longer than {MAX_LINE >> 20} MiB, the longest a span "
                                                  "file may hold")
            foreign = _Foreign()
            try:
                spans = _spans_of_line(name, number, raw, foreign)
            except _TornLine as exc:
                skipped.add(number)
                first_torn = first_torn or (number, str(exc))
                continue
            if foreign.count:
                skipped.foreign.add(number, foreign.count)
            for span in spans:
                if span.end_time_unix_nano < span.start_time_unix_nano:
                    skipped.backwards.add(number)
                    continue
                span.line = number
                count += 1
                yield span
        if progress is not None:
            progress(done, max(total, done), count)
    if count == 0:
        _nothing_read(name, skipped, first_torn)


def _spans_of_line(name: str, number: int, raw: bytes, foreign: "_Foreign") -> list:
    """The spans of one line; a line that is no span line raises its one SpanFileError (a torn one, _TornLine)."""
    try:
        return _parse_line(raw, foreign)
    except _TornLine:
        raise
    except _LineError as exc:
        raise SpanFileError(name, number, str(exc)) from None
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:  # from the protobuf runtime
        raise SpanFileError(name, number, f"bad value: {bounded(str(exc))}") from None


def _nothing_read(name: str, skipped: Skipped, first_torn) -> None:
    """A source that gave no span: the one line saying why."""
    if skipped.backwards.count:  # whole lines, but not one span that can be drawn
        raise SpanFileError(name, skipped.backwards.lines[0], f"every span ({skipped.backwards.count}) ends "
                                                              "before it starts: no span to read")
    if first_torn is not None:  # nothing but broken lines: not a span file, whatever began like one
        raise SpanFileError(name, first_torn[0], f"{first_torn[1]}; no line of the file is a whole span line")
    raise SpanFileError(name, None, "is empty: no spans")


def read_spans(path, progress: Optional[Progress] = None, skipped: Optional[Skipped] = None) -> list:
    """All spans of `path` in a list (for small files and tests; the commands stream with `iter_spans`)."""
    return list(iter_spans(path, progress, skipped=skipped))


def stderr_progress(label: str, every_s: float = 1.0) -> Progress:
    """A progress callback for long reads: one updating line on stderr, at most once a second, and only once a
    read has taken longer than `every_s`."""
    state = {"start": time.monotonic(), "last": 0.0, "shown": False}

    def report(done: int, total: int, spans: int) -> None:
        now = time.monotonic()
        final = done >= total
        if not state["shown"] and (final or now - state["start"] < every_s):
            return
        if not final and now - state["last"] < every_s:
            return
        state["shown"], state["last"] = True, now
        pct = 100.0 * done / total if total else 100.0
        sys.stderr.write(f"{label}: {pct:5.1f}% ({done >> 20} MiB, {spans} spans){chr(10) if final else chr(13)}")
        sys.stderr.flush()

    return report
