"""Read span files into one span model, whatever wrote them.

Two formats, one JSON object per line, detected line by line:

* the package's own JSON-lines format (what ``otel-kvtransfer demo`` writes): one span per line, keys ``name``,
  ``trace_id``, ``span_id``, ``parent_span_id``, ``kind``, ``start_time_unix_nano``, ``end_time_unix_nano``,
  ``status``, ``attributes``, ``resource``, ``scope``;
* OTLP-JSON as the OpenTelemetry file exporters write it (the Collector's ``file`` exporter): one
  ``{"resourceSpans": [...]}`` export request per line, ids in hex (base64 ids are accepted too), kinds and
  status codes as numbers or enum names, attribute values as ``AnyValue`` objects.

Anything else (an empty file, a truncated last line, a file of some other JSON, a binary file) raises
:class:`SpanFileError`, whose message names the file and the line, so a command can print one clear line.

    spans = read_spans("spans.jsonl")
    for span in spans:
        print(span.name, span.duration_ns, span.attributes.get("kv_transfer.bytes"))
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

__all__ = ["Span", "SpanFileError", "read_spans", "iter_spans"]

KINDS = ("INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
_OTLP_KIND_BY_NUMBER = {0: "INTERNAL", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS_BY_NUMBER = {0: "UNSET", 1: "OK", 2: "ERROR"}
STATUS_CODES = ("UNSET", "OK", "ERROR")

# A progress callback gets (bytes read so far, total bytes, spans so far).
Progress = Callable[[int, int, int], None]


class SpanFileError(ValueError):
    """A span file that cannot be read; ``str()`` is one line naming the file and, when known, the line."""

    def __init__(self, path: str, line: Optional[int], message: str):
        self.path = str(path)
        self.line = line
        self.message = message
        where = f"{self.path}:{line}" if line else self.path
        super().__init__(f"{where}: {message}")


@dataclass
class Span:
    """One finished span, the same whichever format it came from."""

    name: str
    trace_id: str  # 32 lowercase hex
    span_id: str  # 16 lowercase hex
    parent_span_id: Optional[str]
    kind: str  # INTERNAL | SERVER | CLIENT | PRODUCER | CONSUMER
    start_time_unix_nano: int
    end_time_unix_nano: int
    status_code: str = "UNSET"  # UNSET | OK | ERROR
    status_description: Optional[str] = None
    attributes: dict = field(default_factory=dict)
    resource: dict = field(default_factory=dict)
    scope_name: str = ""
    scope_version: str = ""
    line: int = 0  # line of the file it came from (1-based)

    @property
    def duration_ns(self) -> int:
        return self.end_time_unix_nano - self.start_time_unix_nano

    @property
    def duration_s(self) -> float:
        return self.duration_ns / 1e9

    @property
    def is_error(self) -> bool:
        return self.status_code == "ERROR"

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attributes.get(key, default)


# --------------------------------------------------------------------------------------------------- helpers


class _LineError(Exception):
    """Raised inside the line parsers; turned into a SpanFileError with file and line by the reader."""


def _hex_id(value: Any, length: int, what: str, allow_empty: bool = False) -> Optional[str]:
    """A trace or span id as lowercase hex of `length` chars; accepts hex or base64 (OTLP/JSON from protobuf)."""
    if value is None or value == "":
        if allow_empty:
            return None
        raise _LineError(f"{what} is missing")
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0 or value >= 1 << (4 * length):
            raise _LineError(f"{what} {value!r} is out of range")
        return f"{value:0{length}x}"
    if not isinstance(value, str):
        raise _LineError(f"{what} must be a hex string, got {type(value).__name__}")
    text = value.strip().lower()
    if len(text) == length and all(c in "0123456789abcdef" for c in text):
        if allow_empty and int(text, 16) == 0:
            return None
        return text
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) * 2 == length:
        if allow_empty and not any(raw):
            return None
        return raw.hex()
    raise _LineError(f"{what} {value!r} is not {length} hex digits")


def _nanos(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise _LineError(f"{what} must be an integer of nanoseconds, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    raise _LineError(f"{what} must be an integer of nanoseconds, got {value!r}")


def _check_times(start: int, end: int) -> None:
    if start <= 0:
        raise _LineError(f"start time {start} is not a Unix time in nanoseconds")
    if end < start:
        raise _LineError(f"span ends ({end}) before it starts ({start})")


def _kind(value: Any) -> str:
    if value is None or value == "":
        return "INTERNAL"
    if isinstance(value, int) and not isinstance(value, bool):
        if value in _OTLP_KIND_BY_NUMBER:
            return _OTLP_KIND_BY_NUMBER[value]
        raise _LineError(f"unknown span kind {value!r}")
    if isinstance(value, str):
        text = value.strip().upper()
        for prefix in ("SPAN_KIND_", "SPANKIND."):
            if text.startswith(prefix):
                text = text[len(prefix):]
        if text == "UNSPECIFIED":
            return "INTERNAL"
        if text in KINDS:
            return text
    raise _LineError(f"unknown span kind {value!r}")


def _status(value: Any) -> tuple[str, Optional[str]]:
    if value is None:
        return "UNSET", None
    if not isinstance(value, dict):
        raise _LineError(f"status must be an object, got {type(value).__name__}")
    code = value.get("code", value.get("status_code", "UNSET"))
    description = value.get("description", value.get("message"))
    if description is not None and not isinstance(description, str):
        description = str(description)
    if description == "":
        description = None
    if isinstance(code, int) and not isinstance(code, bool):
        if code not in _STATUS_BY_NUMBER:
            raise _LineError(f"unknown status code {code!r}")
        return _STATUS_BY_NUMBER[code], description
    if isinstance(code, str):
        text = code.strip().upper()
        for prefix in ("STATUS_CODE_", "STATUSCODE."):
            if text.startswith(prefix):
                text = text[len(prefix):]
        if text in STATUS_CODES:
            return text, description
    raise _LineError(f"unknown status code {code!r}")


def _any_value(value: Any) -> Any:
    """OTLP AnyValue -> plain Python value."""
    if not isinstance(value, dict):
        return value
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        raw = value["intValue"]
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise _LineError(f"intValue {raw!r} is not an integer") from None
    if "doubleValue" in value:
        raw = value["doubleValue"]
        if isinstance(raw, str):  # "NaN", "Infinity" in proto3 JSON
            try:
                return float(raw)
            except ValueError:
                raise _LineError(f"doubleValue {raw!r} is not a number") from None
        return raw
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [_any_value(v) for v in (value["arrayValue"] or {}).get("values", [])]
    if "kvlistValue" in value:
        return _otlp_attributes((value["kvlistValue"] or {}).get("values", []))
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def _otlp_attributes(items: Any) -> dict:
    if items is None:
        return {}
    if not isinstance(items, list):
        raise _LineError("attributes must be a list of {key, value}")
    out = {}
    for item in items:
        if not isinstance(item, dict) or "key" not in item:
            raise _LineError(f"attribute {item!r} has no key")
        out[item["key"]] = _any_value(item.get("value"))
    return out


# --------------------------------------------------------------------------------------------------- formats


def _native_span(obj: dict) -> Span:
    for key in ("name", "trace_id", "span_id", "start_time_unix_nano", "end_time_unix_nano"):
        if key not in obj:
            raise _LineError(f"span has no {key!r}")
    name = obj["name"]
    if not isinstance(name, str) or not name:
        raise _LineError("span name must be a non-empty string")
    attributes = obj.get("attributes") or {}
    resource = obj.get("resource") or {}
    scope = obj.get("scope") or {}
    if not isinstance(attributes, dict):
        raise _LineError("attributes must be an object")
    if not isinstance(resource, dict):
        raise _LineError("resource must be an object")
    if not isinstance(scope, dict):
        raise _LineError("scope must be an object")
    # A resource written as {"attributes": {...}} (the SDK's to_json shape) is accepted too.
    if set(resource) <= {"attributes", "schema_url"} and isinstance(resource.get("attributes"), dict):
        resource = resource["attributes"]
    start = _nanos(obj["start_time_unix_nano"], "start_time_unix_nano")
    end = _nanos(obj["end_time_unix_nano"], "end_time_unix_nano")
    _check_times(start, end)
    code, description = _status(obj.get("status"))
    return Span(
        name=name,
        trace_id=_hex_id(obj["trace_id"], 32, "trace_id"),
        span_id=_hex_id(obj["span_id"], 16, "span_id"),
        parent_span_id=_hex_id(obj.get("parent_span_id"), 16, "parent_span_id", allow_empty=True),
        kind=_kind(obj.get("kind")),
        start_time_unix_nano=start,
        end_time_unix_nano=end,
        status_code=code,
        status_description=description,
        attributes=dict(attributes),
        resource=dict(resource),
        scope_name=str(scope.get("name") or ""),
        scope_version=str(scope.get("version") or ""),
    )


def _otlp_spans(obj: dict) -> Iterator[Span]:
    resource_spans = obj.get("resourceSpans")
    if not isinstance(resource_spans, list):
        raise _LineError("resourceSpans must be a list")
    for rs in resource_spans:
        if not isinstance(rs, dict):
            raise _LineError("a resourceSpans entry must be an object")
        resource = _otlp_attributes((rs.get("resource") or {}).get("attributes"))
        scope_spans = rs.get("scopeSpans", rs.get("instrumentationLibrarySpans", []))
        if not isinstance(scope_spans, list):
            raise _LineError("scopeSpans must be a list")
        for ss in scope_spans:
            if not isinstance(ss, dict):
                raise _LineError("a scopeSpans entry must be an object")
            scope = ss.get("scope", ss.get("instrumentationLibrary")) or {}
            spans = ss.get("spans") or []
            if not isinstance(spans, list):
                raise _LineError("spans must be a list")
            for raw in spans:
                if not isinstance(raw, dict):
                    raise _LineError("a span must be an object")
                for key in ("traceId", "spanId", "name", "startTimeUnixNano", "endTimeUnixNano"):
                    if key not in raw:
                        raise _LineError(f"OTLP span has no {key!r}")
                start = _nanos(raw["startTimeUnixNano"], "startTimeUnixNano")
                end = _nanos(raw["endTimeUnixNano"], "endTimeUnixNano")
                _check_times(start, end)
                code, description = _status(raw.get("status"))
                yield Span(
                    name=str(raw["name"]),
                    trace_id=_hex_id(raw["traceId"], 32, "traceId"),
                    span_id=_hex_id(raw["spanId"], 16, "spanId"),
                    parent_span_id=_hex_id(raw.get("parentSpanId"), 16, "parentSpanId", allow_empty=True),
                    kind=_kind(raw.get("kind")),
                    start_time_unix_nano=start,
                    end_time_unix_nano=end,
                    status_code=code,
                    status_description=description,
                    attributes=_otlp_attributes(raw.get("attributes")),
                    resource=dict(resource),
                    scope_name=str(scope.get("name") or ""),
                    scope_version=str(scope.get("version") or ""),
                )


def _parse_line(obj: Any) -> list[Span]:
    if not isinstance(obj, dict):
        raise _LineError(f"expected a JSON object, got {type(obj).__name__}: not a span file")
    if "resourceSpans" in obj:
        return list(_otlp_spans(obj))
    if "trace_id" in obj and "span_id" in obj:
        return [_native_span(obj)]
    if "traceId" in obj and "spanId" in obj:
        raise _LineError("a bare OTLP span: expected one {\"resourceSpans\": [...]} export request per line")
    keys = ", ".join(sorted(map(str, obj))[:5]) or "none"
    raise _LineError(
        f"not a span: neither the JSON-lines span format nor OTLP-JSON (keys: {keys})"
    )


# --------------------------------------------------------------------------------------------------- reader


def iter_spans(path: str | os.PathLike, progress: Optional[Progress] = None) -> Iterator[Span]:
    """Yield the spans of `path` in file order; raises SpanFileError naming the line on bad input."""
    path = os.fspath(path)
    try:
        total = os.path.getsize(path)
        handle = open(path, "rb")
    except IsADirectoryError:
        raise SpanFileError(path, None, "is a directory, not a span file") from None
    except FileNotFoundError:
        raise SpanFileError(path, None, "no such file") from None
    except OSError as exc:
        raise SpanFileError(path, None, f"cannot open: {exc.strerror or exc}") from None
    count = 0
    lines_with_data = 0
    with handle:
        done = 0
        number = 0
        for number, raw in enumerate(handle, start=1):
            done += len(raw)
            if progress is not None and number % 5000 == 0:
                progress(done, total, count)
            if not raw.strip():
                continue
            lines_with_data += 1
            if b"\x00" in raw:
                raise SpanFileError(path, number, "binary data: not a JSON-lines span file")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise SpanFileError(path, number, "not UTF-8 text: not a JSON-lines span file") from None
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                ends_in_newline = raw.endswith(b"\n")
                last = done >= total
                if last and not ends_in_newline:
                    hint = "the line is cut short (file truncated?)"
                else:
                    hint = "invalid JSON"
                raise SpanFileError(path, number, f"{hint}: {exc.msg} at column {exc.colno}") from None
            try:
                spans = _parse_line(obj)
            except _LineError as exc:
                raise SpanFileError(path, number, str(exc)) from None
            for span in spans:
                span.line = number
                count += 1
                yield span
        if progress is not None:
            progress(done, total, count)
    if lines_with_data == 0:
        raise SpanFileError(path, None, "is empty: no spans")


def read_spans(path: str | os.PathLike, progress: Optional[Progress] = None) -> list[Span]:
    """All spans of `path`; raises SpanFileError (naming file and line) on an empty, truncated or foreign file."""
    spans = list(iter_spans(path, progress))
    if not spans:
        raise SpanFileError(os.fspath(path), None, "holds no spans")
    return spans


def stderr_progress(label: str = "reading") -> Progress:
    """A progress callback that writes one updating line to stderr for files bigger than a few MB."""
    import sys

    state = {"shown": False}

    def report(done: int, total: int, spans: int) -> None:
        if total < 4 << 20 and not state["shown"]:
            return
        state["shown"] = True
        pct = 100.0 * done / total if total else 100.0
        end = "\n" if done >= total else "\r"
        sys.stderr.write(f"{label}: {pct:5.1f}% ({done >> 20} MiB, {spans} spans){end}")
        sys.stderr.flush()

    return report
