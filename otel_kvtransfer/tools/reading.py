"""A span file read into requests: the one reading every tool shares (the CLI's `timeline` and `summarize`, the
demo's timeline, the benchmarks).

The file is read as a stream into per-request aggregates, the requests are selected (keys, time window, a cap),
and, when the spans are to be drawn, the file is read a second time to attach the spans of the selected requests
only (at most `max_children` sends and computes of each); a pipe is first copied to a temporary file so it can be
read twice.

A span that repeats the (trace id, span id) of one read before is left out of both passes, the first kept
(`span_ids`); what was left out (torn lines, spans that end before they start, repeats) is one warning line on
stderr for each kind, and is in `left_out` (a `spanfile.Skipped`).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Optional

from otel_kvtransfer.tools.requests import DRAWN_PER_REQUEST, RequestSet, attach_children, select_requests
from otel_kvtransfer.tools.source import SourceError, open_source
from otel_kvtransfer.tools.span_ids import SpanIds
from otel_kvtransfer.tools.spanfile import Skipped, SpanFileError, iter_spans, stderr_progress
from otel_kvtransfer.tools.text import PROG


def first_of_each_id(spans, duplicates=None):
    """The spans whose (trace id, span id) was not seen before in `spans`; each repeat's line is noted in
    `duplicates` (a `spanfile.LineTally`)."""
    seen = SpanIds()
    for span in spans:
        if seen.seen(span.trace_id, span.span_id):
            if duplicates is not None:
                duplicates.add(span.line)
            continue
        yield span


def load(path: str, keys=None, since=None, until=None, max_requests: Optional[int] = None,
         drawing: bool = False, max_children: Optional[int] = DRAWN_PER_REQUEST) -> SimpleNamespace:
    """Read `path` as a stream into requests, select them, and (`drawing`) read it again to attach the spans
    of the selected requests (at most `max_children` sends and computes of each; None: all). Raises
    SpanFileError."""
    try:
        source = open_source(path)
        if drawing:  # two passes: a pipe is copied once to a temporary file
            spooled = source.spooled()
            if spooled is not source:
                source.close()
            source = spooled
    except SourceError as exc:
        raise SpanFileError(path, None, str(exc)) from None
    collected, skipped = RequestSet(), Skipped()
    seen = {"bytes": None}
    report = stderr_progress(f"reading {path}")

    def progress(done, total, spans):
        seen["bytes"] = done  # where the first pass ended: the second reads no further (a file still growing)
        report(done, total, spans)

    try:
        for span in first_of_each_id(iter_spans(source, progress=progress, skipped=skipped), skipped.duplicates):
            collected.add(span)
        for line in skipped.warnings(path):
            sys.stderr.write(f"{PROG}: warning: {line}\n")
        requests = collected.finish()
        origin = min((r.start_ns for r in requests), default=None)
        selected = select_requests(requests, keys=keys, since_s=since, until_s=until, origin_ns=origin)
        shown = selected[:max_requests] if max_requests else selected
        if drawing and shown:
            attach_children(shown, first_of_each_id(iter_spans(source, progress=stderr_progress(f"drawing {path}"),
                                                               limit_bytes=seen["bytes"], skipped=Skipped())),
                            max_children=max_children)
    finally:
        source.close()
    return SimpleNamespace(requests=requests, selected=selected, shown=shown, origin=origin,
                           throughputs=collected.throughputs, span_count=collected.span_count,
                           regular=source.regular, left_out=skipped)
