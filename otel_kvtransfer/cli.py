"""The `otel-kvtransfer` command: `demo`, and the span-file tools `timeline` and `summarize`.

    otel-kvtransfer demo [...]
    otel-kvtransfer timeline FILE [--html OUT.html] [--png OUT.png] [--perfetto OUT.json] [--key K ...]
                                  [--since S] [--until S] [--page-size N] [--max-requests N]
                                  [--max-sends-per-request N]
    otel-kvtransfer summarize FILE [--json] [--key K ...] [--since S] [--until S] [--limit N]
    otel-kvtransfer summarize FILE --links [--json]

FILE is OTLP-JSON (what `OTEL_TRACES_EXPORTER=kvtransfer_file` or the Collector's file exporter writes) or the
older JSON-lines span format; `-` is stdin, and a pipe or FIFO works too. Bad input (an empty, foreign or hostile
file, a bad option, an unwritable output) is one line on stderr and exit code 2, never a traceback, and leaves no
output file behind; torn lines (a crash, a full disk), spans that end before they start (the wall clock stepped
back) and spans repeating the id of one read before are left out, one warning line for each kind. Files are read
as a stream (summarize keeps per-request aggregates, not spans; timeline reads twice, keeping only the spans of
the requests it draws, and copies a pipe to a temporary file first); reads that take long show progress.
"""

import argparse
import math
import os
import sys
from types import SimpleNamespace
from typing import Any, Callable, List, NoReturn, Optional, Sequence

from otel_kvtransfer.tools.text import PROG, bounded, label


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad option in one line (exit 2) instead of usage plus error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {bounded(message)}\n")


# What a subcommand runs (`set_defaults(handler=...)`): its parsed arguments -> the exit code.
_Handler = Callable[[argparse.Namespace], int]


def _error(message: str) -> int:
    sys.stderr.write(f"{PROG}: error: {bounded(message, 400)}\n")
    return 2


MAX_WINDOW_S = 1e9  # about 31 years either way: any window of real spans fits, and no arithmetic overflows


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    if abs(value) > MAX_WINDOW_S:
        raise argparse.ArgumentTypeError(f"{text!r} is outside -{MAX_WINDOW_S:g} .. {MAX_WINDOW_S:g} seconds")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _span_file_command(sub: "argparse._SubParsersAction[_Parser]", name: str, handler: _Handler, summary: str,
                       description: str) -> argparse.ArgumentParser:
    """A subcommand that reads one span file, with the request filters every such command has."""
    parser = sub.add_parser(name, help=summary, description=description)
    parser.set_defaults(handler=handler)
    parser.add_argument("file", help="span file: OTLP-JSON (kvtransfer_file exporter, Collector file exporter) or "
                                     "the older JSON-lines spans; - for stdin")
    parser.add_argument("--key", "--room", dest="keys", action="append", metavar="KEY",
                        help="only this request key (sglang: the bootstrap room); repeatable")
    parser.add_argument("--since", type=_finite, metavar="S",
                        help="only requests active after S seconds from the file's first request")
    parser.add_argument("--until", type=_finite, metavar="S",
                        help="only requests active before S seconds from the file's first request")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="KV-transfer telemetry: a demo, and tools for span files.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo_parser = sub.add_parser("demo", help="prefill -> decode KV transfers over real Mooncake on 127.0.0.1",
                                 add_help=False)
    demo_parser.set_defaults(handler=_demo)

    timeline = _span_file_command(
        sub, "timeline", run_timeline, "HTML page + PNG of a span file (and Perfetto JSON)",
        "Render a span file as a self-contained HTML timeline and a PNG: one block per request, a lane for "
        "compute and one per destination, transfers coloured by payload.")
    timeline.add_argument("--html", metavar="OUT.html", help="HTML page (default: FILE stem + .timeline.html)")
    timeline.add_argument("--png", metavar="OUT.png", help="PNG picture (default: FILE stem + .timeline.png)")
    timeline.add_argument("--no-html", action="store_true", help="do not write the HTML page")
    timeline.add_argument("--no-png", action="store_true", help="do not write the PNG")
    timeline.add_argument("--perfetto", metavar="OUT.json",
                          help="also write Chrome trace-event JSON for ui.perfetto.dev / chrome://tracing")
    timeline.add_argument("--page-size", type=_count, default=20, metavar="N", help="requests per HTML page (20)")
    timeline.add_argument("--png-requests", type=_count, default=6, metavar="N",
                          help="request blocks drawn in the PNG after the overview (6)")
    timeline.add_argument("--max-requests", type=_count, default=2000, metavar="N",
                          help="request blocks in the page and the Perfetto file, the first N by start (2000)")
    timeline.add_argument("--max-sends-per-request", type=_count, metavar="N",  # None: requests.DRAWN_PER_REQUEST
                          help="sends (and computes) drawn of one request in the page and the Perfetto file, the "
                               "first N by start; the figures count all (1000; 0 = all)")

    summarize = _span_file_command(
        sub, "summarize", run_summarize, "per-request table and per-transfer throughput distribution of a span file",
        "Summarize a span file: one row per request (bytes, busy time, true throughput, overlap) and the "
        "distribution of per-transfer throughput.")
    summarize.add_argument("--json", action="store_true", help="machine-readable output")
    summarize.add_argument("--limit", type=_count, default=50, metavar="N",
                           help="rows of the text table: requests, or peers with --links (50; 0 = all)")
    summarize.add_argument("--links", action="store_true",
                           help="the link model instead: per peer, duration = fixed cost + bytes / bandwidth "
                                "(+ per descriptor), its spread, the calls far above it, the requests it bounds")
    return parser


# --------------------------------------------------------------------------------------------------- demo


def _demo(argv: List[str]) -> int:
    # The demo (and Mooncake under it) is imported only when asked for.
    from otel_kvtransfer import demo
    from otel_kvtransfer.demo.loopback import MooncakeUnavailable
    from otel_kvtransfer.demo.nixl_loopback import NixlUnavailable

    parser = _Parser(prog=f"{PROG} demo", description="prefill -> decode KV transfers over a real engine")
    demo.add_arguments(parser)
    cfg = demo.config_from_args(parser.parse_args(argv))
    try:
        summary = demo.run(cfg)
    except (MooncakeUnavailable, NixlUnavailable) as exc:
        return _error(f"demo: {exc}")
    print(summary["table"])
    print(f"bytes verified on every decode engine: {'yes' if summary['bytes_verified'] else 'NO'}")
    print(f"spans: {summary['span_file']}")
    for line in summary.get("next_steps", []):
        print(line)
    status = 0 if summary["bytes_verified"] else 1
    if cfg.engine == "nixl":
        # nixl 1.5.1's UCX backend crashes the interpreter at exit once an agent existed (docs/vllm.md); the
        # providers are already shut down and every file written, so leave without the interpreter's teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


# --------------------------------------------------------------------------------------------------- span files


def _filter_note(args: argparse.Namespace, loaded: SimpleNamespace) -> str:
    parts = []
    if args.keys:
        parts.append("keys " + ",".join(args.keys))
    if args.since is not None or args.until is not None:
        lo = "start" if args.since is None else f"{args.since:g} s"
        hi = "end" if args.until is None else f"{args.until:g} s"
        parts.append(f"window {lo} – {hi}")
    note = f"filtered ({'; '.join(parts)}): {len(loaded.selected)} of {len(loaded.requests)} requests" if parts else ""
    if len(loaded.shown) < len(loaded.selected):
        cap = f"drawing the first {len(loaded.shown)} of {len(loaded.selected)} requests (--max-requests)"
        note = f"{note}; {cap}" if note else cap
    return note


def _warn_children_not_drawn(requests: Sequence[Any], limit: int) -> None:
    """One line when some requests had more sends or computes than are drawn of one request."""
    capped = [r for r in requests if r.sends_not_drawn or r.computes_not_drawn]
    if not capped:
        return
    left = sum(r.sends_not_drawn + r.computes_not_drawn for r in capped)
    most = max(capped, key=lambda r: r.send_spans + r.compute_spans)
    sys.stderr.write(f"{PROG}: warning: {len(capped)} request{'s' if len(capped) > 1 else ''} with more than {limit} "
                     f"sends or computes (--max-sends-per-request): {left} spans not drawn (the first {limit} by "
                     f"start of each are; the most: key {label(most.key, 40)}, {most.send_spans} sends); figures, "
                     "busy strip and tail count them all\n")


def run_timeline(args: argparse.Namespace) -> int:
    from otel_kvtransfer.tools.reading import load
    from otel_kvtransfer.tools.requests import DRAWN_PER_REQUEST

    if args.page_size < 1:
        return _error("--page-size must be >= 1")
    per_request = DRAWN_PER_REQUEST if args.max_sends_per_request is None else args.max_sends_per_request
    loaded = load(args.file, args.keys, args.since, args.until, max_requests=args.max_requests or None,
                  drawing=True, max_children=per_request or None)
    if not loaded.requests:
        return _error(f"{args.file}: no kv_transfer spans in {loaded.span_count} spans")
    _warn_children_not_drawn(loaded.shown, per_request)
    # Outputs go beside a file; for stdin or a pipe, with no name given, into the current folder.
    stem = os.path.splitext(args.file)[0] if loaded.regular else "timeline"
    html_path = None if args.no_html else (args.html or f"{stem}.timeline.html")
    png_path = None if args.no_png else (args.png or f"{stem}.timeline.png")
    note = _filter_note(args, loaded)
    if png_path:
        try:
            import PIL  # noqa: F401  imported only to see that Pillow loads
        except ImportError:
            return _error("the PNG needs Pillow: pip install 'otel_kvtransfer[timeline]' (or pass --no-png)")
    from otel_kvtransfer.tools.timeline import write_timeline

    if len(loaded.shown) > 200:
        sys.stderr.write(f"rendering {len(loaded.shown)} requests...\n")
    extra = []
    if args.perfetto:  # rendered before any file is written: all outputs appear together or none
        import json

        from otel_kvtransfer.tools.perfetto import request_spans, tail_marks, trace_events

        left = sum(r.sends_not_drawn + r.computes_not_drawn for r in loaded.shown)
        try:
            text = json.dumps(trace_events(request_spans(loaded.shown), tails=tail_marks(loaded.shown),
                                           not_drawn=left),
                              separators=(",", ":"), allow_nan=False)
        except ValueError as exc:
            return _error(f"{args.file}: cannot write Perfetto JSON: {exc}")
        extra.append(("perfetto", args.perfetto, text + "\n"))
    written = write_timeline(loaded.shown, html_path, png_path, page_size=args.page_size,
                             png_requests=args.png_requests, source=args.file, note=note, origin_ns=loaded.origin,
                             throughputs=loaded.throughputs, extra=extra)
    if note:
        print(label(note, 400))
    for kind, path in written.items():
        print(f"{kind}: {label(path, 400)}")
    if not loaded.selected:
        sys.stderr.write(f"{PROG}: warning: no request matches the filters\n")
    return 0


def run_summarize(args: argparse.Namespace) -> int:
    if args.links:
        return _run_links(args)
    from otel_kvtransfer.tools.reading import load
    from otel_kvtransfer.tools.summarize import format_text, summary_dict, write_json

    loaded = load(args.file, args.keys, args.since, args.until)
    if not loaded.requests:
        return _error(f"{args.file}: no kv_transfer spans in {loaded.span_count} spans")
    summary = summary_dict(args.file, loaded.span_count, loaded.selected, loaded.throughputs, loaded.left_out)
    note = _filter_note(args, loaded)
    if note:
        summary["filter"] = note
    if args.json:
        write_json(summary, sys.stdout)
    else:
        if note:
            sys.stdout.write(label(note, 400) + "\n")
        sys.stdout.write(format_text(summary, limit=args.limit or None))
    sys.stdout.flush()
    return 0


def _run_links(args: argparse.Namespace) -> int:
    from otel_kvtransfer.tools import links

    if args.keys or args.since is not None or args.until is not None:
        return _error("--links fits every send of the file: --key, --since and --until select requests, not sends")
    model = links.link_model(args.file)
    if not model["peers"]:
        return _error(f"{args.file}: no kv_transfer.send span with a peer (server.address) in "
                      f"{model['span_count']} spans")
    if args.json:
        links.write_json(model, sys.stdout)
    else:
        sys.stdout.write(links.format_text(model, limit=args.limit or None))
    sys.stdout.flush()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    args = build_parser().parse_args(argv)
    from otel_kvtransfer.tools.spanfile import SpanFileError

    try:
        handler: _Handler = args.handler
        return handler(args)
    except SpanFileError as exc:
        return _error(str(exc))
    except BrokenPipeError:
        with open(os.devnull, "w", encoding="utf-8") as devnull:
            os.dup2(devnull.fileno(), sys.stdout.fileno())
        return 0
    except OSError as exc:
        return _error(f"cannot write {exc.filename or 'output'}: {exc.strerror or exc}")


if __name__ == "__main__":
    sys.exit(main())
