"""The ``timeline`` and ``summarize`` subcommands of ``otel-kvtransfer``: span files to pictures and tables.

``cli.py`` calls :func:`add_subcommands` with its subparsers; each handler returns an exit code. Bad input (an
empty, truncated or foreign file, an unwritable output) is one line on stderr and exit code 2, never a traceback.

    otel-kvtransfer timeline spans.jsonl [--html OUT.html] [--png OUT.png] [--perfetto OUT.json]
                                         [--room ROOM ...] [--since S] [--until S] [--page-size N]
    otel-kvtransfer summarize spans.jsonl [--json] [--room ROOM ...] [--since S] [--until S] [--limit N]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

PROG = "otel-kvtransfer"


def _error(message: str) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return 2


def _add_filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="span file: the demo's JSON-lines spans, or OTLP-JSON from a file exporter")
    parser.add_argument("--room", type=int, action="append", metavar="ROOM",
                        help="only this bootstrap room (repeatable)")
    parser.add_argument("--since", type=float, metavar="S",
                        help="only requests active after S seconds from the file's first request")
    parser.add_argument("--until", type=float, metavar="S",
                        help="only requests active before S seconds from the file's first request")


def add_subcommands(subparsers) -> None:
    """Register ``timeline`` and ``summarize`` on an argparse subparsers object."""
    timeline = subparsers.add_parser(
        "timeline", help="HTML page + PNG of a span file (and Perfetto JSON)",
        description="Render a span file as a self-contained HTML timeline and a PNG: one block per request, a "
                    "lane for compute and one per destination, transfers coloured by payload.")
    _add_filters(timeline)
    timeline.add_argument("--html", metavar="OUT.html", help="HTML page (default: FILE stem + .timeline.html)")
    timeline.add_argument("--png", metavar="OUT.png", help="PNG picture (default: FILE stem + .timeline.png)")
    timeline.add_argument("--no-html", action="store_true", help="do not write the HTML page")
    timeline.add_argument("--no-png", action="store_true", help="do not write the PNG")
    timeline.add_argument("--perfetto", metavar="OUT.json",
                          help="also write Chrome trace-event JSON for ui.perfetto.dev / chrome://tracing")
    timeline.add_argument("--page-size", type=int, default=20, metavar="N", help="requests per HTML page (20)")
    timeline.add_argument("--png-requests", type=int, default=6, metavar="N",
                          help="request blocks drawn in the PNG after the overview (6)")
    timeline.set_defaults(handler=run_timeline)

    summarize = subparsers.add_parser(
        "summarize", help="per-request table and per-transfer throughput distribution of a span file",
        description="Summarize a span file: one row per request (bytes, busy time, true throughput, overlap) and "
                    "the distribution of per-transfer throughput.")
    _add_filters(summarize)
    summarize.add_argument("--json", action="store_true", help="machine-readable output")
    summarize.add_argument("--limit", type=int, default=50, metavar="N",
                           help="rows of the text table (50; 0 = all)")
    summarize.set_defaults(handler=run_summarize)


def _load(args):
    """Read and select; returns (spans, all requests, selected requests, origin)."""
    from otel_kvtransfer.spanfile_reader import read_spans, stderr_progress
    from otel_kvtransfer.summarize import build_requests, select_requests

    spans = read_spans(args.file, progress=stderr_progress(f"reading {args.file}"))
    requests = build_requests(spans)
    origin = min((r.start_ns for r in requests), default=None)
    selected = select_requests(requests, rooms=args.room, since_s=args.since, until_s=args.until, origin_ns=origin)
    return spans, requests, selected, origin


def _filter_note(args, selected, requests) -> str:
    parts = []
    if args.room:
        parts.append("rooms " + ",".join(map(str, args.room)))
    if args.since is not None or args.until is not None:
        lo = "start" if args.since is None else f"{args.since:g} s"
        hi = "end" if args.until is None else f"{args.until:g} s"
        parts.append(f"window {lo} – {hi}")
    if not parts:
        return ""
    return f"filtered ({'; '.join(parts)}): {len(selected)} of {len(requests)} requests"


def run_timeline(args) -> int:
    from otel_kvtransfer.spanfile_reader import SpanFileError

    if args.page_size < 1 or args.png_requests < 0:
        return _error("--page-size must be >= 1 and --png-requests >= 0")
    try:
        spans, requests, selected, origin = _load(args)
    except SpanFileError as exc:
        return _error(str(exc))
    if not requests:
        return _error(f"{args.file}: no kv_transfer spans in {len(spans)} spans")
    stem = os.path.splitext(args.file)[0]
    html_path = None if args.no_html else (args.html or f"{stem}.timeline.html")
    png_path = None if args.no_png else (args.png or f"{stem}.timeline.png")
    note = _filter_note(args, selected, requests)
    try:
        from otel_kvtransfer.timeline import write_timeline

        if len(selected) > 200:
            sys.stderr.write(f"rendering {len(selected)} requests...\n")
        written = write_timeline(selected, html_path, png_path, page_size=args.page_size,
                                 png_requests=args.png_requests, source=args.file, note=note, origin_ns=origin)
        if args.perfetto:
            from otel_kvtransfer.perfetto import write_perfetto

            chosen = _spans_of(selected, spans, filtered=bool(note))
            write_perfetto(chosen, args.perfetto)
            written["perfetto"] = args.perfetto
    except OSError as exc:
        return _error(f"cannot write {exc.filename or 'output'}: {exc.strerror or exc}")
    except ImportError as exc:
        return _error(f"{exc.name or exc} is needed for the PNG: pip install pillow (or pass --no-png)")
    if note:
        print(note)
    for kind, path in written.items():
        print(f"{kind}: {path}")
    if not selected:
        sys.stderr.write(f"{PROG}: warning: no request matches the filters\n")
    return 0


def _spans_of(selected, spans, filtered: bool) -> list:
    if not filtered:
        return list(spans)
    out = {}
    for request in selected:
        for span in ([request.span] if request.span else []) + request.sends + request.computes + request.receives:
            out[(span.trace_id, span.span_id)] = span
    return list(out.values())


def run_summarize(args) -> int:
    from otel_kvtransfer.spanfile_reader import SpanFileError
    from otel_kvtransfer.summarize import format_text, summary_dict, to_json

    try:
        spans, requests, selected, _origin = _load(args)
    except SpanFileError as exc:
        return _error(str(exc))
    if not requests:
        return _error(f"{args.file}: no kv_transfer spans in {len(spans)} spans")
    summary = summary_dict(args.file, spans, selected)
    note = _filter_note(args, selected, requests)
    if note:
        summary["filter"] = note
    try:
        if args.json:
            sys.stdout.write(to_json(summary))
        else:
            if note:
                sys.stdout.write(note + "\n")
            sys.stdout.write(format_text(summary, limit=None if args.limit <= 0 else args.limit))
        sys.stdout.flush()
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
    return 0


def main(argv: Optional[list] = None) -> int:
    """Stand-alone entry (``python -m otel_kvtransfer.report_cli``) for when cli.py is not wired yet."""
    parser = argparse.ArgumentParser(prog=PROG)
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
