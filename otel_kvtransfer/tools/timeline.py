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

The layout is computed once as drawing operations; `_svg` writes them as inline SVG, `_draw_panel` draws them
with Pillow, so the PNG needs no browser. Every value from the span file is escaped in text and attributes; the
page loads nothing from the network and its Content-Security-Policy runs no script but its own static one.

    otel-kvtransfer timeline spans.jsonl                 # spans.timeline.html + spans.timeline.png
    otel-kvtransfer timeline spans.jsonl --key 42 --since 0.5 --until 2 --perfetto trace.json
"""

from __future__ import annotations

import base64
import hashlib
import html
import math
import os
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Optional, Sequence

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.building import aggregate
from otel_kvtransfer.tools.lanes import pack
from otel_kvtransfer.tools.output import atomic_output, staged_outputs
from otel_kvtransfer.tools.requests import Request, engine_label, send_bytes, send_throughput
from otel_kvtransfer.tools.summarize import distribution
from otel_kvtransfer.tools.text import fmt_bytes, fmt_ms, fmt_rate, label

__all__ = ["render_html", "render_png", "write_timeline", "layout_request", "layout_overview", "PAYLOAD_COLORS"]

WIDTH = 1200
LEFT = 170  # lane labels
RIGHT = 20
ROW_H = 20
BAR_H = 16
FONT = 11
CHAR_W = 0.62  # average glyph width / font size, for fitting labels
# Bounds on what one picture holds, whatever the file: a lane draws at most MAX_ROWS rows of overlapping spans,
# a block at most MAX_DEST_LANES destinations and MAX_PEER_LANES peer engines ("+N more" rows say what is left);
# the overview plots at most MAX_POINTS requests; the PNG is at most MAX_PNG_HEIGHT pixels tall.
MAX_ROWS = 12
MAX_DEST_LANES = 8
MAX_PEER_LANES = 4
MAX_POINTS = 20_000
MAX_TAIL_GAPS = 200  # queued gaps shaded in one tail (the longest; narrower ones are under a pixel anyway)
MAX_PNG_HEIGHT = 8000
OVERVIEW_ALLOWANCE = 320  # pixels kept for the overview panel when fitting request blocks into the PNG

PAYLOAD_COLORS = {
    sc.PAYLOAD_KV: "#4e79a7",
    sc.PAYLOAD_AUX: "#f28e2b",
    sc.PAYLOAD_STATE: "#59a14f",
    "other": "#76b7b2",
}
COMPUTE_COLOR = "#a0a0a0"
RECEIVE_COLOR = "#b07aa1"
ERROR_COLOR = "#e15759"
BUSY_COLOR = "#2f4b7c"
TAIL_COLOR = "#8a5a00"  # the tail's outline and label
TAIL_BAND = "#fbecc6"  # the tail across the block, behind every lane
QUEUED_COLOR = "#e8a202"  # parts of the tail in which no transfer of the request moved bytes
TEXT = "#222222"
MUTED = "#666666"
GRID = "#e4e4e4"


# --------------------------------------------------------------------------------------------------- drawing ops


@dataclass
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str
    stroke: Optional[str] = None
    cls: str = ""
    title: str = ""
    data: dict = field(default_factory=dict)


@dataclass
class Text:
    x: float
    y: float  # baseline
    text: str
    size: int = FONT
    color: str = TEXT
    bold: bool = False
    anchor: str = "start"  # start | middle | end
    cls: str = ""


@dataclass
class Line:
    x1: float
    y1: float
    x2: float
    y2: float
    color: str = GRID
    width: float = 1.0


# A point of the overview's scatter plot.
Circle = namedtuple("Circle", "x y r fill stroke title", defaults=(None, ""))


@dataclass
class Panel:
    """One picture: the overview or one request block."""

    width: int
    height: int
    ops: list
    cls: str = ""


def _fits(text: str, width: float, size: int = FONT) -> bool:
    return len(text) * size * CHAR_W + 6 <= width


def _nice_step(span: float, target: int = 8) -> float:
    raw = span / max(target, 1)
    if raw <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 2.5, 5, 10):
        if raw <= mult * power:
            return mult * power
    return 10 * power


def _fmt_axis_s(value: float, step: float) -> str:
    if step >= 1:
        return f"{value:g} s"
    if step >= 1e-3:
        ms = value * 1e3
        return f"{ms:.{max(0, -math.floor(math.log10(step * 1e3)) + 1) if step * 1e3 < 1 else 0}f} ms"
    return f"{value * 1e6:.0f} us"


# --------------------------------------------------------------------------------------------------- layout


def _send_label(span) -> str:
    return f"{fmt_bytes(send_bytes(span))} · {fmt_rate(send_throughput(span))}"


def _send_title(span) -> str:
    a = span.attributes
    parts = [
        f"{label(a.get(sc.PAYLOAD, 'send'))} chunk {label(a.get(sc.CHUNK_INDEX, '?'))} → dest "
        f"{label(a.get(sc.DESTINATION_INDEX, '?'))}",
        f"{fmt_bytes(send_bytes(span))} in {fmt_ms(span.duration_ns / aggregate.NS_PER_S)} = "
        f"{fmt_rate(send_throughput(span))}",
    ]
    if a.get(sc.SERVER_ADDRESS) is not None:
        parts.append(f"peer {label(a.get(sc.SERVER_ADDRESS))}:{label(a.get(sc.SERVER_PORT))}")
    if a.get(sc.IS_LAST_CHUNK) is True:
        parts.append("last chunk")
    if a.get(sc.PREFIX_EARLY_SEND) is True:
        parts.append("prefix sent early")
    if a.get(sc.REPLICA_FACTOR) is not None:
        parts.append(f"replica factor {a.get(sc.REPLICA_FACTOR)}")
    if span.is_error:
        parts.append(f"ERROR {label(a.get(sc.ERROR_TYPE) or '')} {label(span.status_description or '')}".strip())
    parts.append(f"span {span.span_id}")
    return "\n".join(parts)


def request_header(req: Request) -> tuple:
    """The two header lines of a request block."""
    figures = req.figures()
    status = {"UNSET": "ok"}.get(req.final_status, req.final_status)  # instrumentations leave success UNSET
    if req.final_error_type:
        status = f"ERROR {label(req.final_error_type, 40)}"
    stack = "/".join(label(v, 20) for v in (req.framework, req.backend) if v is not None) or "raw"
    first = f"key {label(req.key, 40)}  ·  {stack}  ·  {label(req.engine, 60)}  ·  {status}"
    ratio = figures["compute_overlap_ratio"]
    overlap = ("overlap -" if ratio is None
               else f"overlap {ratio * 100:.0f}% ({fmt_ms(figures['compute_overlap_s'])})")
    replicas = figures["replica_factor"]
    replicas = f", ×{replicas}" if replicas and replicas > 1 else ""
    second = (
        f"busy {fmt_ms(figures['busy_s'])}  ·  true {fmt_rate(figures['throughput'])}  ·  {overlap}  ·  "
        f"{fmt_bytes(figures['bytes'])} wire (logical {fmt_bytes(figures['logical_bytes'])}{replicas})  ·  "
        f"{label(figures['transfer_count'])} transfers / {label(figures['chunk_count'])} chunks  ·  "
        f"span {fmt_ms(req.duration_s)}  ·  last-chunk figure {fmt_rate(req.last_chunk_rate(figures['bytes']))}"
    )
    return first, second


def _lanes(req: Request) -> list:
    """(label, kind, spans) of a request block, at most MAX_DEST_LANES destinations and MAX_PEER_LANES peers; the
    rest are counted in one "+N more" lane."""
    lanes = [("busy (union)", "busy", []), ("compute", "compute", req.computes)]
    by_dest = {}
    for send in req.sends:
        by_dest.setdefault(_dest(send), []).append(send)
    dests = sorted(by_dest, key=lambda d: (d is None, d or 0))
    for dest in dests[:MAX_DEST_LANES]:
        sends = by_dest[dest]
        peer, port = sends[0].attr(sc.SERVER_ADDRESS), sends[0].attr(sc.SERVER_PORT)
        text = f"dest {dest}" if dest is not None else "send"
        if peer is not None:
            text += f" {label(peer, 40)}:{label(port)}" if port is not None else f" {label(peer, 40)}"
        lanes.append((text, "send", sends))
    if len(dests) > MAX_DEST_LANES:
        hidden = sum(len(by_dest[d]) for d in dests[MAX_DEST_LANES:])
        lanes.append((f"+{len(dests) - MAX_DEST_LANES} more destinations ({hidden} transfers)", "more", []))
    engines = {}
    for peer in req.peers:
        engines.setdefault(str(peer.resource.get("service.instance.id") or engine_label(peer.resource)),
                           []).append(peer)
    groups = list(engines.values())
    for peers in groups[:MAX_PEER_LANES]:
        name = label(peers[0].resource.get("service.name") or "peer", 30)
        lanes.append((f"{peers[0].name.rsplit('.', 1)[-1]} {name}", "peer", peers))
    if len(groups) > MAX_PEER_LANES:
        lanes.append((f"+{len(groups) - MAX_PEER_LANES} more peer engines", "more", []))
    return lanes


def _bar(kind: str, span, x0: float, by: float, w: float) -> list:
    """The rectangle (and its label when it fits) of one span in a lane."""
    if kind == "compute":
        chunk = span.attr(sc.CHUNK_INDEX)
        text = f"chunk {chunk}" if chunk is not None else "compute"
        ops = [Rect(x0, by, w, BAR_H, COMPUTE_COLOR, "#ffffff", cls="compute", data={"chunk": chunk},
                    title=f"compute {text}: {fmt_ms(span.duration_ns / aggregate.NS_PER_S)}")]
    elif kind == "peer":
        what = span.name.rsplit(".", 1)[-1]
        text = f"{what} {fmt_ms(span.duration_ns / aggregate.NS_PER_S)}"
        ops = [Rect(x0, by, w, BAR_H, ERROR_COLOR if span.is_error else RECEIVE_COLOR, cls="peer", title=text)]
    else:
        payload = span.attr(sc.PAYLOAD)
        known = payload if payload in PAYLOAD_COLORS else "other"  # class names from a fixed set only
        ops = [Rect(x0, by, w, BAR_H, PAYLOAD_COLORS[known], ERROR_COLOR if span.is_error else None,
                    cls=f"send payload-{known}" + (" error" if span.is_error else ""), title=_send_title(span),
                    data={"payload": label(payload), "bytes": send_bytes(span), "span": span.span_id})]
        text = _send_label(span)
        if not _fits(text, w):
            text = fmt_bytes(send_bytes(span))
    if _fits(text, w):
        ops.append(Text(x0 + 3, by + BAR_H - 4, text, FONT - 1, "#ffffff", cls="bar-label"))
    return ops


def _tail_text(mark) -> str:
    if mark.tail_s <= 0:
        return "tail 0: the last byte left before compute ended"
    return f"tail {fmt_ms(mark.tail_s)} (queued {fmt_ms(mark.tail_queued_s)})"


def _queued_gaps(busy: Sequence[tuple], lo: int, hi: int) -> list:
    """The parts of [lo, hi) that no interval of the sorted disjoint `busy` covers."""
    gaps, cursor = [], lo
    for start, end in busy:
        if end <= cursor:
            continue
        if start >= hi:
            break
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < hi:
        gaps.append((cursor, hi))
    return gaps


def _tail_lane(mark, busy, x_of, y: float, width: int) -> list:
    """The tail lane: the interval from the last compute end to the last byte, its queued gaps shaded (at most
    MAX_TAIL_GAPS, the longest), and its label inside the interval when it fits, else beside it."""
    end = max(mark.last_byte_ns, mark.compute_end_ns)
    x0, x1 = x_of(mark.compute_end_ns), x_of(end)
    w = max(x1 - x0, 2)
    gaps = _queued_gaps(busy, mark.compute_end_ns, end)
    drawn = sorted(gaps, key=lambda g: g[0] - g[1])[:MAX_TAIL_GAPS]
    more = f"; the {len(drawn)} longest of {len(gaps)} queued gaps shaded" if len(gaps) > len(drawn) else ""
    title = (f"tail {fmt_ms(mark.tail_s)}: from the end of the last compute to the last byte; "
             f"{fmt_ms(mark.tail_busy_s)} moving bytes, {fmt_ms(mark.tail_queued_s)} queued (nothing of the "
             f"request moved){more}")
    by = y + (ROW_H - BAR_H) / 2
    ops = [Rect(x0, by, w, BAR_H, TAIL_BAND, TAIL_COLOR, cls="tail", title=title,
                data={"tail-s": mark.tail_s, "tail-busy-s": mark.tail_busy_s, "tail-queued-s": mark.tail_queued_s,
                      "compute-end-ns": mark.compute_end_ns, "last-byte-ns": mark.last_byte_ns,
                      "queued-gaps": len(gaps)})]
    for lo, hi in sorted(drawn):
        ops.append(Rect(x_of(lo), by + 3, max(x_of(hi) - x_of(lo), 1), BAR_H - 6, QUEUED_COLOR, cls="tail-queued",
                        title=f"queued {fmt_ms((hi - lo) / aggregate.NS_PER_S)}",
                        data={"start-ns": lo, "end-ns": hi}))
    text = _tail_text(mark)
    if _fits(text, w):
        ops.append(Text(x0 + 4, by + BAR_H - 4, text, FONT, TEXT, bold=True, cls="tail-label"))
    elif _fits(text, width - RIGHT - x1 - 4):
        ops.append(Text(x1 + 4, by + BAR_H - 4, text, FONT, TAIL_COLOR, bold=True, cls="tail-label"))
    else:
        ops.append(Text(max(x0 - 4, LEFT + 4), by + BAR_H - 4, _clip(text, max(x0 - LEFT - 8, 0)), FONT, TAIL_COLOR,
                        bold=True, anchor="end" if x0 - 4 > LEFT + 4 else "start", cls="tail-label"))
    return ops


def layout_request(req: Request, width: int = WIDTH, origin_ns: Optional[int] = None) -> Panel:
    """One request block: header, busy strip, compute lane, the tail (where compute is known), one lane per
    destination, peer lanes, axis. A lane shows at most MAX_ROWS rows of overlapping spans; what does not fit is
    counted in a "+N more" row."""
    ops = []
    first, second = request_header(req)
    ops.append(Text(8, 17, first, 13, TEXT, bold=True, cls="req-title"))
    ops.append(Text(8, 35, second, FONT, MUTED, cls="req-figures"))
    t0 = min([req.start_ns] + [s.start_time_unix_nano for s in req.peers])
    t1 = max([req.end_ns, t0 + 1] + [s.end_time_unix_nano for s in req.peers])
    if origin_ns is not None:
        ops.append(Text(width - RIGHT, 17, f"starts +{max(t0 - origin_ns, 0) / 1e9:.3f} s", FONT, MUTED,
                        anchor="end", cls="offset"))
    plot_w = width - LEFT - RIGHT

    def x_of(ns: int) -> float:
        return LEFT + (ns - t0) / (t1 - t0) * plot_w

    y = grid_top = 46
    body = []
    busy = req.busy_intervals()
    mark = req.tail_mark()
    lanes = _lanes(req)
    if mark is not None:
        lanes.insert(2, ("tail", "tail", []))
    for text, kind, spans in lanes:
        if kind == "tail":
            body.append(Text(LEFT - 8, y + ROW_H / 2 + 4, text, FONT, TAIL_COLOR, bold=True, anchor="end",
                             cls="lane-label"))
            body.extend(_tail_lane(mark, busy, x_of, y, width))
            y += ROW_H + 4
            continue
        if kind in ("busy", "more"):
            lane_h = 10 if kind == "busy" else ROW_H
            rows, row_count, hidden = [], 1, 0
        else:
            rows = pack(spans, lambda s: s.start_time_unix_nano, lambda s: s.end_time_unix_nano)
            row_count = min(max(rows, default=0) + 1, MAX_ROWS)
            hidden = sum(1 for row in rows if row >= MAX_ROWS)
            lane_h = (row_count + (1 if hidden else 0)) * ROW_H
        body.append(Text(LEFT - 8, y + min(lane_h, ROW_H) / 2 + 4, _clip(text, LEFT - 16), FONT, MUTED,
                         anchor="end", cls="lane-label"))
        if kind == "busy":
            for lo, hi in busy:
                body.append(Rect(x_of(lo), y + 2, max(x_of(hi) - x_of(lo), 1), 6, BUSY_COLOR, cls="busy",
                                 title=f"busy {fmt_ms((hi - lo) / 1e9)}"))
        for span, row in zip(spans, rows):
            if row < MAX_ROWS:
                x0 = x_of(span.start_time_unix_nano)
                w = max(x_of(span.end_time_unix_nano) - x0, 1.5)
                body.extend(_bar(kind, span, x0, y + row * ROW_H + (ROW_H - BAR_H) / 2, w))
        if hidden:
            body.append(Text(LEFT + 4, y + MAX_ROWS * ROW_H + ROW_H - 6,
                             f"+{hidden} more overlapping (not drawn; see summarize or --perfetto)", FONT - 1,
                             MUTED, cls="more"))
        y += lane_h + 4
    # Grid and axis under everything.
    span_s = (t1 - t0) / 1e9
    step = _nice_step(span_s)
    grid = []
    for number in range(int(span_s / step + 1e-9) + 1):
        tick = number * step
        x = LEFT + tick / span_s * plot_w
        grid.append(Line(x, grid_top, x, y, GRID))
        grid.append(Text(x, y + 13, _fmt_axis_s(tick, step), FONT - 1, MUTED, anchor="middle", cls="tick"))
    grid.append(Line(LEFT, y, LEFT + plot_w, y, "#bbbbbb"))
    if mark is not None:  # the tail across every lane, under the grid and the bars
        x0 = x_of(mark.compute_end_ns)
        end = max(mark.last_byte_ns, mark.compute_end_ns)
        grid.insert(0, Rect(x0, grid_top, max(x_of(end) - x0, 2), y - grid_top, TAIL_BAND,
                            cls="tail-band"))
    return Panel(width, int(y + 22), ops + grid + body, cls="request")


def _dest(span):
    return span.attr(sc.DESTINATION_INDEX)


def _clip(text: str, width: float, size: int = FONT) -> str:
    limit = max(int(width / (size * CHAR_W)), 4)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def layout_overview(requests: Sequence[Request], width: int = WIDTH, origin_ns: Optional[int] = None,
                    note: str = "", throughputs: Sequence[float] = ()) -> Panel:
    """Aggregate view of the whole selection: true throughput per request over time, the figure engines report
    (last-chunk) beside it, and the histogram of per-transfer throughput."""
    ops = []
    figures = [r.figures() for r in requests]
    sends = sum(r.send_spans for r in requests)
    errors = sum(1 for r in requests if r.final_status == "ERROR")
    total = sum(f["bytes"] or 0 for f in figures)
    trues = sorted(f["throughput"] for f in figures if f["throughput"])
    med = aggregate.quantile(trues, 0.5) if trues else None
    ops.append(Text(8, 18, f"{len(requests)} requests · {sends} transfers · {fmt_bytes(total)} on the wire · "
                           f"{errors} failed · median true throughput {fmt_rate(med)}", 13, TEXT, bold=True,
                    cls="overview-title"))
    if note:
        ops.append(Text(8, 36, note, FONT, MUTED, cls="overview-note"))
    top, h = (68 if note else 52), 150
    # Left: per-request true throughput (filled) and last-chunk figure (hollow) over time.
    sx0, sx1 = 60, int(width * 0.58)
    points = [(r.start_ns, f["throughput"], r.last_chunk_rate(f["bytes"]), r, f) for r, f in zip(requests, figures)]
    if origin_ns is None:
        origin_ns = min((r.start_ns for r in requests), default=0)
    t_max = max(((r.end_ns - origin_ns) for r in requests), default=1) or 1
    y_max = max([p[1] or 0 for p in points] + [p[2] or 0 for p in points] + [1.0])
    unit = float(1 << 30) if y_max >= 1 << 30 else float(1 << 20) if y_max >= 1 << 20 else 1.0
    y_step = _nice_step(y_max / unit, 4) * unit
    y_top = math.ceil(y_max / y_step) * y_step
    ops.append(Text(sx0, top - 4, "throughput per request over time (● true = bytes / busy time, "
                                  "○ last-chunk figure)", FONT, MUTED, cls="chart-title"))
    for number in range(int(y_top / y_step + 1e-9) + 1):
        value = number * y_step
        yy = top + h - value / y_top * h
        ops.append(Line(sx0, yy, sx1, yy, GRID))
        ops.append(Text(sx0 - 4, yy + 4, fmt_rate(value).replace(" ", ""), FONT - 2, MUTED, anchor="end"))
    x_step = _nice_step(t_max / 1e9, 6)
    for number in range(int(t_max / 1e9 / x_step + 1e-9) + 1):
        tick = number * x_step
        xx = sx0 + tick * 1e9 / t_max * (sx1 - sx0)
        ops.append(Text(xx, top + h + 13, _fmt_axis_s(tick, x_step), FONT - 2, MUTED, anchor="middle"))
    for start, true, legacy, req, fig in points[:MAX_POINTS]:
        xx = sx0 + (start - origin_ns) / t_max * (sx1 - sx0)
        key = label(req.key, 40)
        if legacy:
            ops.append(Circle(xx, top + h - min(legacy / y_top, 1) * h, 3, "none", "#999999",
                              title=f"key {key}: last-chunk figure {fmt_rate(legacy)}"))
        if true:
            color = ERROR_COLOR if req.final_status == "ERROR" else BUSY_COLOR
            ops.append(Circle(xx, top + h - min(true / y_top, 1) * h, 3, color,
                              title=f"key {key}: true {fmt_rate(true)}, busy {fmt_ms(fig['busy_s'])}"))
    ops.append(Line(sx0, top + h, sx1, top + h, "#bbbbbb"))
    # Right: histogram of per-transfer throughput (log-spaced bins).
    hx0, hx1 = int(width * 0.64), width - RIGHT
    dist = distribution(throughputs, bins=12)
    ops.append(Text(hx0, top - 4, f"per-transfer throughput ({dist['count']} transfers)", FONT, MUTED,
                    cls="chart-title"))
    if dist["count"]:
        bins = dist["histogram"]
        top_count = max(b["count"] for b in bins) or 1
        bw = (hx1 - hx0) / len(bins)
        for i, b in enumerate(bins):
            bh = b["count"] / top_count * (h - 12)
            ops.append(Rect(hx0 + i * bw + 1, top + h - bh, max(bw - 2, 1), bh, PAYLOAD_COLORS[sc.PAYLOAD_KV],
                            cls="hist-bar",
                            title=f"{fmt_rate(b['low'])} – {fmt_rate(b['high'])}: {b['count']} transfers"))
            if b["count"] and _fits(str(b["count"]), bw, FONT - 2):
                ops.append(Text(hx0 + (i + 0.5) * bw, top + h - bh - 3, str(b["count"]), FONT - 2, MUTED,
                                anchor="middle"))
        ops.append(Line(hx0, top + h, hx1, top + h, "#bbbbbb"))
        ops.append(Text(hx0, top + h + 13, fmt_rate(dist["min"]), FONT - 2, MUTED))
        ops.append(Text((hx0 + hx1) / 2, top + h + 13, f"p50 {fmt_rate(dist['p50'])}", FONT - 2, MUTED,
                        anchor="middle"))
        ops.append(Text(hx1, top + h + 13, fmt_rate(dist["max"]), FONT - 2, MUTED, anchor="end"))
    ly, lx = top + h + 36, 8
    for text, color in (("kv", PAYLOAD_COLORS["kv"]), ("aux", PAYLOAD_COLORS["aux"]),
                        ("state", PAYLOAD_COLORS["state"]), ("compute", COMPUTE_COLOR),
                        ("peer receive / serve", RECEIVE_COLOR), ("busy (union of transfers)", BUSY_COLOR),
                        ("failed", ERROR_COLOR), ("tail (compute end → last byte)", TAIL_BAND),
                        ("tail queued", QUEUED_COLOR)):
        ops.append(Rect(lx, ly - 10, 12, 12, color, TAIL_COLOR if color == TAIL_BAND else None, cls="legend"))
        ops.append(Text(lx + 16, ly, text, FONT, TEXT))
        lx += 16 + len(text) * FONT * CHAR_W + 18
    if any(r.peers for r in requests):
        ly += 18
        ops.append(Text(8, ly, "Peer lanes (receive / serve) are on the peer engines' clocks: clocks of different "
                               "hosts may disagree. Busy time and the tail are on the initiator's clock alone.",
                        FONT, MUTED, cls="clock-note"))
    return Panel(width, ly + 10, ops, cls="overview")


# --------------------------------------------------------------------------------------------------- SVG / HTML


def _esc(value) -> str:
    """Every value written into the page, text or attribute, goes through here."""
    return html.escape(str(value), quote=True)


def _num(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _svg(panel: Panel) -> str:
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{panel.width}" height="{panel.height}" '
           f'viewBox="0 0 {panel.width} {panel.height}" class="panel {_esc(panel.cls)}">']
    for op in panel.ops:
        if isinstance(op, Rect):
            extra = "".join(f' data-{_esc(k)}="{_esc(v)}"' for k, v in op.data.items() if v is not None)
            stroke = f' stroke="{_esc(op.stroke)}" stroke-width="2"' if op.stroke else ""
            cls = f' class="{_esc(op.cls)}"' if op.cls else ""
            title = f"<title>{_esc(op.title)}</title>" if op.title else ""
            out.append(f'<rect x="{_num(op.x)}" y="{_num(op.y)}" width="{_num(op.w)}" height="{_num(op.h)}" '
                       f'fill="{_esc(op.fill)}"{stroke}{cls}{extra} rx="2">{title}</rect>')
        elif isinstance(op, Text):
            weight = ' font-weight="bold"' if op.bold else ""
            cls = f' class="{_esc(op.cls)}"' if op.cls else ""
            out.append(f'<text x="{_num(op.x)}" y="{_num(op.y)}" font-size="{op.size}" fill="{_esc(op.color)}" '
                       f'text-anchor="{_esc(op.anchor)}"{weight}{cls}>{_esc(op.text)}</text>')
        elif isinstance(op, Line):
            out.append(f'<line x1="{_num(op.x1)}" y1="{_num(op.y1)}" x2="{_num(op.x2)}" y2="{_num(op.y2)}" '
                       f'stroke="{_esc(op.color)}" stroke-width="{op.width}"/>')
        elif isinstance(op, Circle):
            stroke = f' stroke="{_esc(op.stroke)}"' if op.stroke else ""
            title = f"<title>{_esc(op.title)}</title>" if op.title else ""
            out.append(f'<circle cx="{_num(op.x)}" cy="{_num(op.y)}" r="{op.r}" fill="{_esc(op.fill)}"{stroke}>'
                       f"{title}</circle>")
    out.append("</svg>")
    return "".join(out)


_CSS = """
body{font-family:"DejaVu Sans",Verdana,Arial,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:18px;margin:0 0 4px}
.meta{color:#666;font-size:12px;margin-bottom:10px}
.controls{position:sticky;top:0;background:#fafafa;padding:6px 0;z-index:2;font-size:13px;border-bottom:1px solid #ddd}
.controls input{width:120px}
section.request,section.overview{background:#fff;border:1px solid #ddd;border-radius:4px;margin:10px 0;padding:4px}
section.request.status-ERROR{border-color:#e15759}
svg text{font-family:"DejaVu Sans",Verdana,Arial,sans-serif}
svg rect.send:hover,svg rect.compute:hover{opacity:.75}
.empty{color:#666;font-style:italic}
"""

# The page's one script: static text (no value from the file is ever in it), allowed by its hash in the policy.
_JS = """
(function(){
  var all=Array.prototype.slice.call(document.querySelectorAll('section.request'));
  var size=parseInt(document.body.getAttribute('data-page-size'),10)||20;
  var page=0, shown=all;
  var info=document.getElementById('page-info'), key=document.getElementById('key-filter');
  function render(){
    var pages=Math.max(1,Math.ceil(shown.length/size));
    if(page>=pages)page=pages-1; if(page<0)page=0;
    all.forEach(function(s){s.hidden=true;});
    shown.slice(page*size,(page+1)*size).forEach(function(s){s.hidden=false;});
    info.textContent='page '+(page+1)+' of '+pages+' · '+shown.length+' of '+all.length+' requests';
  }
  function filter(){
    var q=key.value.trim();
    var st=document.getElementById('status-filter').value;
    shown=all.filter(function(s){
      if(q && (s.getAttribute('data-key')||'').indexOf(q)!==0)return false;
      if(st && s.getAttribute('data-status')!==st)return false;
      return true;});
    page=0; render();
  }
  document.getElementById('prev').addEventListener('click',function(){page--;render();});
  document.getElementById('next').addEventListener('click',function(){page++;render();});
  key.addEventListener('input',filter);
  document.getElementById('status-filter').addEventListener('change',filter);
  render();
  document.body.setAttribute('data-ready','1');
})();
"""


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


# Nothing from the network, no inline script but the one above (by hash), no inline style but the sheet above.
CONTENT_SECURITY_POLICY = (f"default-src 'none'; script-src {_sha256(_JS)}; style-src {_sha256(_CSS)}; "
                           "img-src data:; base-uri 'none'; form-action 'none'")


def render_html(requests: Sequence[Request], title: str = "KV transfer timeline", page_size: int = 20,
                source: str = "", note: str = "", origin_ns: Optional[int] = None,
                throughputs: Sequence[float] = ()) -> str:
    """The whole page: overview, controls, and one section per request (all given, shown a page at a time)."""
    if origin_ns is None:
        origin_ns = min((r.start_ns for r in requests), default=0)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CONTENT_SECURITY_POLICY}">',
        f"<title>{_esc(title)}</title>",
        f"<style>{_CSS}</style></head>",
        f'<body data-page-size="{int(page_size)}" data-requests="{len(requests)}">',
        f"<h1>{_esc(title)}</h1>",
        f'<div class="meta">{_esc(source)}</div>',
    ]
    overview = layout_overview(requests, origin_ns=origin_ns, note=note, throughputs=throughputs)
    parts.append(f'<section class="overview">{_svg(overview)}</section>')
    parts.append(
        '<div class="controls">'
        '<button id="prev" type="button">◀ prev</button> <button id="next" type="button">next ▶</button> '
        '<span id="page-info"></span> · key <input id="key-filter" placeholder="key prefix"> '
        '<select id="status-filter"><option value="">any status</option><option>OK</option>'
        "<option>UNSET</option><option>ERROR</option></select></div>"
    )
    if not requests:
        parts.append('<p class="empty">No request matches the filters.</p>')
    for index, request in enumerate(requests):
        panel = layout_request(request, origin_ns=origin_ns)
        hidden = " hidden" if index >= page_size else ""
        status = _esc(request.final_status)
        parts.append(f'<section class="request status-{status}" data-key="{_esc(request.key or "")}" '
                     f'data-status="{status}" data-index="{index}"{hidden}>{_svg(panel)}</section>')
    parts.append(f"<script>{_JS}</script></body></html>")
    return "\n".join(parts) + "\n"


# --------------------------------------------------------------------------------------------------- PNG


def _font(size: int, bold: bool = False):
    from PIL import ImageFont  # pylint: disable=import-outside-toplevel

    names = ("DejaVuSans-Bold.ttf", "Verdana Bold.ttf") if bold else ("DejaVuSans.ttf", "Verdana.ttf")
    for name in names + ("/usr/share/fonts/truetype/dejavu/" + names[0],):
        try:
            return ImageFont.truetype(name, size)
        except OSError:
            continue
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


def _rgb(color: str):
    color = color.lstrip("#")
    return tuple(int(color[i:i + 2], 16) for i in (0, 2, 4))


def _draw_panel(draw, panel: Panel, dx: int, dy: int, fonts: dict) -> None:
    for op in panel.ops:
        if isinstance(op, Rect):
            box = [dx + op.x, dy + op.y, dx + op.x + max(op.w, 1), dy + op.y + max(op.h, 0.5)]
            draw.rectangle(box, fill=_rgb(op.fill), outline=_rgb(op.stroke) if op.stroke else None,
                           width=2 if op.stroke else 0)
        elif isinstance(op, Line):
            draw.line([dx + op.x1, dy + op.y1, dx + op.x2, dy + op.y2], fill=_rgb(op.color), width=int(op.width))
        elif isinstance(op, Circle):
            box = [dx + op.x - op.r, dy + op.y - op.r, dx + op.x + op.r, dy + op.y + op.r]
            draw.ellipse(box, fill=None if op.fill == "none" else _rgb(op.fill),
                         outline=_rgb(op.stroke) if op.stroke else None)
        elif isinstance(op, Text):
            key = (op.size, op.bold)
            if key not in fonts:
                fonts[key] = _font(op.size, op.bold)
            anchor = {"start": "ls", "middle": "ms", "end": "rs"}[op.anchor]
            try:
                draw.text((dx + op.x, dy + op.y), op.text, fill=_rgb(op.color), font=fonts[key], anchor=anchor)
            except ValueError:  # a bitmap font knows no anchors
                draw.text((dx + op.x, dy + op.y - op.size), op.text, fill=_rgb(op.color), font=fonts[key])


def render_png(requests: Sequence[Request], path: str, max_requests: int = 6, title: str = "",
               note: str = "", origin_ns: Optional[int] = None, throughputs: Sequence[float] = ()) -> tuple:
    """Draw the overview and the first `max_requests` request blocks into `path` (no taller than
    MAX_PNG_HEIGHT: blocks that do not fit are left to the HTML page); returns (width, height)."""
    data, size = png_data(requests, max_requests, title, note, origin_ns, throughputs)
    with atomic_output(path, "wb") as handle:
        handle.write(data)
    return size


def png_data(requests: Sequence[Request], max_requests: int = 6, title: str = "", note: str = "",
             origin_ns: Optional[int] = None, throughputs: Sequence[float] = ()) -> tuple:
    """(PNG bytes, (width, height)) of what `render_png` draws."""
    import io  # pylint: disable=import-outside-toplevel

    from PIL import Image, ImageDraw  # pylint: disable=import-outside-toplevel

    if origin_ns is None:
        origin_ns = min((r.start_ns for r in requests), default=0)
    margin, gap, head = 10, 8, 30 if title else 0
    panels, height = [], margin * 2 + head
    for request in requests[:max_requests]:
        panel = layout_request(request, origin_ns=origin_ns)
        if height + panel.height + gap > MAX_PNG_HEIGHT - OVERVIEW_ALLOWANCE:
            break
        panels.append(panel)
        height += panel.height + gap
    if len(requests) > len(panels):
        extra = f"showing the first {len(panels)} of {len(requests)} requests; the HTML page has more"
        note = f"{note} · {extra}" if note else extra
    panels.insert(0, layout_overview(requests, origin_ns=origin_ns, note=note, throughputs=throughputs))
    height += panels[0].height
    image = Image.new("RGB", (WIDTH + 2 * margin, int(height)), _rgb("#fafafa"))
    draw = ImageDraw.Draw(image)
    fonts = {}
    if title:
        _draw_panel(draw, Panel(WIDTH, head, [Text(0, 20, title, 16, TEXT, bold=True)]), margin, margin, fonts)
    y = margin + head
    for panel in panels:
        draw.rectangle([margin - 2, y - 2, margin + panel.width + 1, y + panel.height + 1], fill=(255, 255, 255),
                       outline=_rgb("#dddddd"))
        _draw_panel(draw, panel, margin, y, fonts)
        y += panel.height + gap
    buffer = io.BytesIO()
    image.save(buffer, "PNG", optimize=True)
    return buffer.getvalue(), image.size


# --------------------------------------------------------------------------------------------------- files


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
    from otel_kvtransfer.tools.reading import load  # pylint: disable=import-outside-toplevel

    stem = os.path.splitext(src)[0]
    loaded = load(src, drawing=True)
    return write_timeline(loaded.selected, html_path or f"{stem}.timeline.html", png_path or f"{stem}.timeline.png",
                          source=src, origin_ns=loaded.origin, throughputs=loaded.throughputs)
