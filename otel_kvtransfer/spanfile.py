"""`JsonLinesSpanExporter`: one span per line, the demo's default output and what `timeline`/`summarize` read.

Line format: {"name", "trace_id" (32 hex), "span_id" (16 hex), "parent_span_id" (16 hex or null), "kind",
"start_time_unix_nano", "end_time_unix_nano", "status": {"code", "description"}, "attributes", "resource",
"scope": {"name", "version"}}. Timestamps stay integers in nanoseconds, so nothing is rounded away.
"""

import json
import os
import threading
from typing import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def span_to_dict(span: ReadableSpan) -> dict:
    parent = span.parent
    scope = span.instrumentation_scope
    return {
        "name": span.name,
        "trace_id": format(span.context.trace_id, "032x"),
        "span_id": format(span.context.span_id, "016x"),
        "parent_span_id": format(parent.span_id, "016x") if parent is not None else None,
        "kind": span.kind.name,
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "attributes": {k: _plain(v) for k, v in (span.attributes or {}).items()},
        "resource": {k: _plain(v) for k, v in span.resource.attributes.items()},
        "scope": {"name": scope.name if scope else None, "version": scope.version if scope else None},
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends spans to a file, one JSON object per line; safe to share a file between processes (O_APPEND)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._fd = None
        self._pid = None

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():  # reopen in a forked child
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._pid = os.getpid()
        return self._fd

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_to_dict(span), separators=(",", ":")) + "\n" for span in spans).encode()
        try:
            with self._lock:
                fd = self._descriptor()
                view = memoryview(data)
                while view:  # one write() per batch keeps lines of concurrent processes whole
                    view = view[os.write(fd, view):]
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                os.close(self._fd)
            self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
