"""`OtlpJsonFileSpanExporter`: spans to an OTLP-JSON file, the format `otel-kvtransfer summarize|timeline` read.

Each export batch is one line holding one `ExportTraceServiceRequest` in OTLP's JSON encoding (what the
Collector's file exporter writes): the SDK's own OTLP encoder builds the protobuf message, `json_format` turns it
into JSON, and trace and span ids are written as hex as OTLP/JSON requires. Lines are appended with O_APPEND and
one write() per batch, so several processes (and forked children, which reopen the file) can share one file.

    OTEL_TRACES_EXPORTER=kvtransfer_file OTEL_KVTRANSFER_SPAN_FILE=spans.jsonl opentelemetry-instrument python app.py

or in code: `BatchSpanProcessor(OtlpJsonFileSpanExporter("spans.jsonl"))`.
"""

import base64
import json
import logging
import os
import threading
from typing import Optional, Sequence

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

ENV_SPAN_FILE = "OTEL_KVTRANSFER_SPAN_FILE"
_LOG = logging.getLogger(__name__)

# Fields that hold ids: bytes in protobuf (base64 in proto3 JSON), hex strings in OTLP/JSON.
ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _spans_of(request: dict):
    """Every span and link dict of an OTLP-JSON export request, tolerating any shape (non-dicts are skipped)."""
    for resource_spans in _list(request.get("resourceSpans")):
        for scope_spans in _list(resource_spans.get("scopeSpans") if isinstance(resource_spans, dict) else None):
            for span in _list(scope_spans.get("spans") if isinstance(scope_spans, dict) else None):
                if isinstance(span, dict):
                    yield span
                    yield from (link for link in _list(span.get("links")) if isinstance(link, dict))


def _list(value) -> list:
    return value if isinstance(value, list) else []


def ids_to_hex(request: dict) -> dict:
    """proto3 JSON (base64 ids) -> OTLP/JSON (hex ids), in place."""
    for item in _spans_of(request):
        for key in ID_FIELDS:
            if isinstance(item.get(key), str):
                item[key] = base64.b64decode(item[key]).hex()
    return request


def ids_from_hex(request: dict) -> dict:
    """OTLP/JSON (hex ids) -> proto3 JSON (base64 ids), in place, so `json_format` can parse it. A value that is
    not hex of an id's length is left alone (it may be base64 already; the parser judges it)."""
    for item in _spans_of(request):
        for key in ID_FIELDS:
            value = item.get(key)
            if isinstance(value, str) and len(value) in (16, 32):
                try:
                    item[key] = base64.b64encode(bytes.fromhex(value)).decode("ascii")
                except ValueError:
                    pass
    return request


def encode_line(spans: Sequence[ReadableSpan]) -> str:
    """One OTLP-JSON line (with its newline) for a batch of finished spans."""
    message = encode_spans(spans)
    request = json_format.MessageToDict(message, use_integers_for_enums=True)
    return json.dumps(ids_to_hex(request), separators=(",", ":")) + "\n"


class OtlpJsonFileSpanExporter(SpanExporter):
    """Appends each export batch to `path` (default: $OTEL_KVTRANSFER_SPAN_FILE) as one OTLP-JSON line.

    With neither, it says so in one logged line and every export fails: a missing setting must not stop the
    process it was configured into (`opentelemetry-instrument` would print a traceback for an exception)."""

    def __init__(self, path: Optional[str] = None):
        path = path or os.environ.get(ENV_SPAN_FILE)
        if not path:
            _LOG.error("kvtransfer_file span exporter: no file to write: set %s=PATH; no spans will be written",
                       ENV_SPAN_FILE)
        self.path = os.fspath(path) if path else None
        self._lock = threading.Lock()
        self._fd = None
        self._pid = os.getpid()

    def _descriptor(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        return self._fd

    def _after_fork(self) -> None:
        # A forked child must not share the parent's lock state or descriptor bookkeeping.
        if self._pid != os.getpid():
            self._lock = threading.Lock()
            self._fd = None
            self._pid = os.getpid()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.path is None:
            return SpanExportResult.FAILURE
        if not spans:
            return SpanExportResult.SUCCESS
        self._after_fork()
        try:
            data = encode_line(spans).encode("ascii")  # json.dumps escapes all non-ASCII
            with self._lock:
                fd = self._descriptor()
                view = memoryview(data)
                while view:  # one write() per batch keeps lines of concurrent processes whole
                    view = view[os.write(fd, view):]
        except Exception:  # pylint: disable=broad-except  # an exporter reports failure, never raises
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._after_fork()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
            self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
