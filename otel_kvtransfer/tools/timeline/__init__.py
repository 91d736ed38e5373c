"""Timeline pictures of KV transfers from span files: a self-contained HTML page and a PNG.

One block per request: a header with the request's busy time (union of its transfer intervals), true throughput
(bytes over busy time), compute-overlap ratio and the figure engines report today (all bytes over the last chunk's
latency); under it a lane for compute and one lane per destination, each transfer a bar coloured by payload (kv,
aux, state; errors red) and labelled with its bytes and throughput; the union of the transfers is drawn as a "busy"
strip. Where the request's compute is known, its tail (from the end of its last compute to its last byte: what the
first decode step waited for) is a band across the block and a lane of its own labelled with the tail and the part
of it in which nothing of the request moved (queued), those gaps shaded. Above the blocks an overview of the whole
selection (true throughput per request over time, and the distribution of per-transfer throughput) keeps a file of
1,000 requests readable; the page shows the blocks a page at a time (the PNG shows the first few), with filters by
request key and time window. The peer's waiting spans (receive for a push, serve for a pull) have lanes of their
own.

The layout is computed once as drawing operations (`drawing`, `block` for a request, `overview`); `page` writes
them as inline SVG in the HTML page and `png` draws them with Pillow, so the PNG needs no browser. Every value
from the span file is escaped in text and attributes; the page loads nothing from the network and its
Content-Security-Policy runs no script but its own static one. This module is the entry the CLI and the demo call.

    otel-kvtransfer timeline spans.jsonl                 # spans.timeline.html + spans.timeline.png
    otel-kvtransfer timeline spans.jsonl --key 42 --since 0.5 --until 2 --perfetto trace.json
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from otel_kvtransfer.tools.output import staged_outputs
from otel_kvtransfer.tools.reading import load
from otel_kvtransfer.tools.requests import Request
from otel_kvtransfer.tools.text import label
from otel_kvtransfer.tools.timeline.block import layout_request
from otel_kvtransfer.tools.timeline.drawing import PAYLOAD_COLORS
from otel_kvtransfer.tools.timeline.overview import layout_overview
from otel_kvtransfer.tools.timeline.page import render_html
from otel_kvtransfer.tools.timeline.png import png_data, render_png

__all__ = ["render_html", "render_png", "write_timeline", "timeline_from_file", "layout_request", "layout_overview",
           "PAYLOAD_COLORS"]


def write_timeline(requests: Sequence[Request], html_path: Optional[str] = None, png_path: Optional[str] = None,
                   page_size: int = 20, png_requests: int = 6, source: str = "", note: str = "",
                   origin_ns: Optional[int] = None, throughputs: Sequence[float] = (), extra=()) -> dict:
    """Write the HTML page and/or the PNG for `requests` (their children attached), and the `extra` outputs
    ((kind, path, data) already rendered); returns the paths written. Everything is rendered before anything is
    written, and the files appear together or not at all."""
    written, outputs = {}, []
    title = f"KV transfer timeline — {label(os.path.basename(source), 120)}" if source else "KV transfer timeline"
    if html_path:
        outputs.append(("html", html_path, render_html(
            requests, title=title, page_size=page_size, source=label(source, 400), note=note, origin_ns=origin_ns,
            throughputs=throughputs)))
    if png_path:
        outputs.append(("png", png_path, png_data(requests, max_requests=png_requests, title=title, note=note,
                                                  origin_ns=origin_ns, throughputs=throughputs)[0]))
    outputs.extend(extra)
    with staged_outputs() as stage:
        for kind, path, data in outputs:
            stage.write(path, data)
            written[kind] = path
    return written


def timeline_from_file(src: str, html_path: Optional[str] = None, png_path: Optional[str] = None) -> dict:
    """For the demo: read `src` and write the timeline beside it (or where told); returns the paths written."""
    stem = os.path.splitext(src)[0]
    loaded = load(src, drawing=True)
    return write_timeline(loaded.selected, html_path or f"{stem}.timeline.html", png_path or f"{stem}.timeline.png",
                          source=src, origin_ns=loaded.origin, throughputs=loaded.throughputs)
