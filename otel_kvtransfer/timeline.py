"""Timeline pictures of KV transfers from span files: a self-contained HTML page and a PNG.

One block per request: a header with the request's busy time (union of its transfer intervals), true throughput
(bytes over busy time), compute-overlap ratio and the figure engines report today (all bytes over the last
chunk's latency); under it a lane for compute and one lane per destination, each transfer a bar coloured by payload
(kv, aux, state; errors red) and labelled with its bytes and throughput; the union of the transfers is drawn as
a "busy" strip. Above the blocks an overview of the whole selection (true throughput per request over time, and
the distribution of per-transfer throughput) keeps a file of 1,000 requests readable; the page shows the blocks
a page at a time (the PNG shows the first few), with filters by room and time window.

The layout is computed once as drawing operations; `_svg` writes them as inline SVG, `_png` draws them with
Pillow, so the PNG needs no browser. The HTML loads nothing from the network.

    otel-kvtransfer timeline spans.jsonl                 # spans.timeline.html + spans.timeline.png
    otel-kvtransfer timeline spans.jsonl --room 42 --since 0.5 --until 2 --perfetto trace.json
"""

from __future__ import annotations

import html
import json
import math
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.summarize import (
    Request,
    distribution,
    engine_label,
    fmt_bytes,
    fmt_ms,
    fmt_rate,
    send_bytes,
    send_throughput,
    transfer_throughputs,
)

__all__ = ["render_html", "render_png", "write_timeline", "layout_request", "layout_overview", "PAYLOAD_COLORS"]

WIDTH = 1200
LEFT = 170  # lane labels
RIGHT = 20
ROW_H = 20
BAR_H = 16
FONT = 11
CHAR_W = 0.62  # average glyph width / font size, for fitting labels

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


@dataclass
class Circle:
    x: float
    y: float
    r: float
    fill: str
    stroke: Optional[str] = None
    title: str = ""


@dataclass
class Panel:
    """One picture: the overview or one request block."""

    width: int
    height: int
    ops: list
    cls: str = ""
    data: dict = field(default_factory=dict)


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


def _pack(items: Sequence, start, end) -> list:
    """Greedy interval packing: the row of each item so that no two items of a row overlap."""
    row_ends = []
    rows = []
    for item in items:
        for number, row_end in enumerate(row_ends):
            if row_end <= start(item):
                row_ends[number] = end(item)
                rows.append(number)
                break
        else:
            row_ends.append(end(item))
            rows.append(len(row_ends) - 1)
    return rows


# --------------------------------------------------------------------------------------------------- layout


def _send_label(span) -> str:
    return f"{fmt_bytes(send_bytes(span))} · {fmt_rate(send_throughput(span))}"


def _send_title(span) -> str:
    a = span.attributes
    parts = [
        f"{a.get(sc.PAYLOAD, 'send')} chunk {a.get(sc.CHUNK_INDEX, '?')} → dest {a.get(sc.DESTINATION_INDEX, '?')}",
        f"{fmt_bytes(send_bytes(span))} in {fmt_ms(span.duration_s)} = {fmt_rate(send_throughput(span))}",
    ]
    if a.get(sc.SERVER_ADDRESS) is not None:
        parts.append(f"peer {a.get(sc.SERVER_ADDRESS)}:{a.get(sc.SERVER_PORT)}")
    if a.get(sc.IS_LAST_CHUNK):
        parts.append("last chunk")
    if a.get(sc.PREFIX_EARLY_SEND):
        parts.append("prefix sent early")
    if a.get(sc.REPLICA_FACTOR) is not None:
        parts.append(f"replica factor {a.get(sc.REPLICA_FACTOR)}")
    if span.is_error:
        parts.append(f"ERROR {a.get(sc.ERROR_TYPE) or ''} {span.status_description or ''}".strip())
    parts.append(f"span {span.span_id}")
    return "\n".join(parts)


def request_header(req: Request) -> tuple:
    """The two header lines of a request block."""
    room = "-" if req.room is None else str(req.room)
    status = {"UNSET": "ok"}.get(req.status, req.status)  # instrumentations leave success UNSET
    if req.error_type:
        status = f"ERROR {req.error_type}"
    first = f"room {room}  ·  {req.engine}  ·  {status}"
    ratio = req.compute_overlap_ratio
    overlap = "overlap -" if ratio is None else f"overlap {ratio * 100:.0f}% ({fmt_ms(req.compute_overlap_s)})"
    replicas = f", ×{req.replica_factor}" if req.replica_factor and req.replica_factor > 1 else ""
    second = (
        f"busy {fmt_ms(req.busy_s)}  ·  true {fmt_rate(req.throughput)}  ·  {overlap}  ·  "
        f"{fmt_bytes(req.bytes)} wire (logical {fmt_bytes(req.logical_bytes)}{replicas})  ·  "
        f"{req.transfer_count} transfers / {req.chunk_count} chunks  ·  span {fmt_ms(req.duration_s)}  ·  "
        f"last-chunk figure {fmt_rate(req.last_chunk_rate)}"
    )
    return first, second


def layout_request(req: Request, width: int = WIDTH, origin_ns: Optional[int] = None) -> Panel:
    """One request block: header, busy strip, compute lane, one lane per destination, receive lane, axis."""
    ops = []
    first, second = request_header(req)
    ops.append(Text(8, 17, first, 13, TEXT, bold=True, cls="req-title"))
    ops.append(Text(8, 35, second, FONT, MUTED, cls="req-figures"))
    t0 = min([req.start_ns] + [s.start_time_unix_nano for s in req.receives])
    t1 = max([req.end_ns, t0 + 1] + [s.end_time_unix_nano for s in req.receives])
    if origin_ns is not None:
        ops.append(Text(width - RIGHT, 17, f"starts +{max(t0 - origin_ns, 0) / 1e9:.3f} s", FONT, MUTED, anchor="end",
                        cls="offset"))
    plot_w = width - LEFT - RIGHT

    def x_of(ns: int) -> float:
        return LEFT + (ns - t0) / (t1 - t0) * plot_w

    lanes = []  # (label, [(span, kind)])
    lanes.append(("busy (union)", "busy", []))
    lanes.append(("compute", "compute", req.computes))
    for dest in req.destinations:
        sends = [s for s in req.sends if _dest(s) == dest]
        peer = sends[0].attr(sc.SERVER_ADDRESS) if sends else None
        port = sends[0].attr(sc.SERVER_PORT) if sends else None
        label = f"dest {dest}" if dest is not None else "send"
        if peer is not None:
            label += f" {peer}:{port}" if port is not None else f" {peer}"
        lanes.append((label, "send", sends))
    engines = {}
    for receive in req.receives:
        engines.setdefault(receive.resource.get("service.instance.id") or engine_label(receive.resource),
                           []).append(receive)
    for receives in engines.values():
        name = str(receives[0].resource.get("service.name") or "decode")
        lanes.append((f"receive {name}", "receive", receives))

    y = 46
    grid_top = y
    body = []
    for label, kind, spans in lanes:
        if kind == "busy":
            row_count = 1
            lane_h = 10
        else:
            spans = sorted(spans, key=lambda s: s.start_time_unix_nano)
            rows = _pack(spans, lambda s: s.start_time_unix_nano, lambda s: s.end_time_unix_nano)
            row_count = max(rows, default=0) + 1
            lane_h = row_count * ROW_H
        body.append(Text(LEFT - 8, y + min(lane_h, ROW_H) / 2 + 4, _clip(label, LEFT - 16), FONT, MUTED,
                         anchor="end", cls="lane-label"))
        if kind == "busy":
            for lo, hi in req.busy_intervals():
                body.append(Rect(x_of(lo), y + 2, max(x_of(hi) - x_of(lo), 1), 6, BUSY_COLOR, cls="busy",
                                 title=f"busy {fmt_ms((hi - lo) / 1e9)}"))
        else:
            for span, row in zip(spans, rows):
                x0 = x_of(span.start_time_unix_nano)
                w = max(x_of(span.end_time_unix_nano) - x0, 1.5)
                by = y + row * ROW_H + (ROW_H - BAR_H) / 2
                if kind == "compute":
                    chunk = span.attr(sc.CHUNK_INDEX)
                    label_text = f"chunk {chunk}" if chunk is not None else "compute"
                    body.append(Rect(x0, by, w, BAR_H, COMPUTE_COLOR, "#ffffff", cls="compute",
                                     title=f"compute {label_text}: {fmt_ms(span.duration_s)}",
                                     data={"chunk": chunk}))
                    if _fits(label_text, w):
                        body.append(Text(x0 + 3, by + BAR_H - 4, label_text, FONT - 1, "#ffffff", cls="bar-label"))
                elif kind == "receive":
                    body.append(Rect(x0, by, w, BAR_H, ERROR_COLOR if span.is_error else RECEIVE_COLOR,
                                     cls="receive", title=f"decode receive {fmt_ms(span.duration_s)}"))
                    text = f"receive {fmt_ms(span.duration_s)}"
                    if _fits(text, w):
                        body.append(Text(x0 + 3, by + BAR_H - 4, text, FONT - 1, "#ffffff", cls="bar-label"))
                else:
                    payload = span.attr(sc.PAYLOAD) or "other"
                    color = PAYLOAD_COLORS.get(payload, PAYLOAD_COLORS["other"])
                    body.append(Rect(x0, by, w, BAR_H, color, ERROR_COLOR if span.is_error else None,
                                     cls=f"send payload-{payload}" + (" error" if span.is_error else ""),
                                     title=_send_title(span),
                                     data={"payload": payload, "bytes": send_bytes(span),
                                           "span": span.span_id}))
                    label_text = _send_label(span)
                    if not _fits(label_text, w):
                        label_text = fmt_bytes(send_bytes(span))
                    if _fits(label_text, w):
                        body.append(Text(x0 + 3, by + BAR_H - 4, label_text, FONT - 1, "#ffffff",
                                         cls="bar-label"))
        y += lane_h + 4
    # Grid and axis under everything.
    span_s = (t1 - t0) / 1e9
    step = _nice_step(span_s)
    grid = []
    tick = 0.0
    while tick <= span_s + 1e-12:
        x = LEFT + tick / span_s * plot_w
        grid.append(Line(x, grid_top, x, y, GRID))
        grid.append(Text(x, y + 13, _fmt_axis_s(tick, step), FONT - 1, MUTED, anchor="middle", cls="tick"))
        tick += step
    grid.append(Line(LEFT, y, LEFT + plot_w, y, "#bbbbbb"))
    ops = ops + grid + body
    height = int(y + 22)
    return Panel(width, height, ops, cls="request",
                 data={"room": req.room, "status": req.status, "start": t0})


def _dest(span):
    value = span.attr(sc.DESTINATION_INDEX)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _clip(text: str, width: float, size: int = FONT) -> str:
    limit = max(int(width / (size * CHAR_W)), 4)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def layout_overview(requests: Sequence[Request], width: int = WIDTH, origin_ns: Optional[int] = None,
                    note: str = "") -> Panel:
    """Aggregate view of the whole selection: true throughput per request over time, the figure engines report
    (last-chunk) beside it, and the per-transfer throughput histogram."""
    ops = []
    n = len(requests)
    sends = sum(len(r.sends) for r in requests)
    errors = sum(1 for r in requests if r.status == "ERROR")
    total = sum(r.bytes for r in requests)
    trues = [r.throughput for r in requests if r.throughput]
    med = sorted(trues)[len(trues) // 2] if trues else None
    ops.append(Text(8, 18, f"{n} requests · {sends} transfers · {fmt_bytes(total)} on the wire · "
                           f"{errors} failed · median true throughput {fmt_rate(med)}", 13, TEXT, bold=True,
                    cls="overview-title"))
    if note:
        ops.append(Text(8, 36, note, FONT, MUTED, cls="overview-note"))
    top, h = (68 if note else 52), 150
    # Left: scatter of per-request true throughput (filled) and last-chunk figure (hollow) over time.
    sx0, sx1 = 60, int(width * 0.58)
    points = [(r.start_ns, r.throughput, r.last_chunk_rate, r) for r in requests]
    if origin_ns is None:
        origin_ns = min((r.start_ns for r in requests), default=0)
    t_max = max(((r.end_ns - origin_ns) for r in requests), default=1) or 1
    y_max = max([p[1] or 0 for p in points] + [p[2] or 0 for p in points] + [1.0])
    unit = float(1 << 30) if y_max >= 1 << 30 else float(1 << 20) if y_max >= 1 << 20 else 1.0
    y_step = _nice_step(y_max / unit, 4) * unit
    y_top = math.ceil(y_max / y_step) * y_step
    ops.append(Text(sx0, top - 4, "throughput per request over time (● true = bytes / busy time, "
                                  "○ last-chunk figure)", FONT, MUTED, cls="chart-title"))
    value = 0.0
    while value <= y_top + 1e-9:
        yy = top + h - value / y_top * h
        ops.append(Line(sx0, yy, sx1, yy, GRID))
        ops.append(Text(sx0 - 4, yy + 4, fmt_rate(value).replace(" ", ""), FONT - 2, MUTED, anchor="end"))
        value += y_step
    x_step = _nice_step(t_max / 1e9, 6)
    tick = 0.0
    while tick <= t_max / 1e9 + 1e-12:
        xx = sx0 + tick * 1e9 / t_max * (sx1 - sx0)
        ops.append(Text(xx, top + h + 13, _fmt_axis_s(tick, x_step), FONT - 2, MUTED, anchor="middle"))
        tick += x_step
    for start, true, legacy, req in points:
        xx = sx0 + (start - origin_ns) / t_max * (sx1 - sx0)
        room = "-" if req.room is None else req.room
        if legacy:
            ops.append(Circle(xx, top + h - min(legacy / y_top, 1) * h, 3, "none", "#999999",
                              title=f"room {room}: last-chunk figure {fmt_rate(legacy)}"))
        if true:
            color = ERROR_COLOR if req.status == "ERROR" else BUSY_COLOR
            ops.append(Circle(xx, top + h - min(true / y_top, 1) * h, 3, color,
                              title=f"room {room}: true {fmt_rate(true)}, busy {fmt_ms(req.busy_s)}"))
    ops.append(Line(sx0, top + h, sx1, top + h, "#bbbbbb"))
    # Right: histogram of per-transfer throughput (log-spaced bins).
    hx0, hx1 = int(width * 0.64), width - RIGHT
    dist = distribution(transfer_throughputs(requests), bins=12)
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
    # Legend.
    ly = top + h + 36
    lx = 8
    for label, color in (("kv", PAYLOAD_COLORS["kv"]), ("aux", PAYLOAD_COLORS["aux"]),
                         ("state", PAYLOAD_COLORS["state"]), ("compute", COMPUTE_COLOR),
                         ("decode receive", RECEIVE_COLOR), ("busy (union of transfers)", BUSY_COLOR),
                         ("failed", ERROR_COLOR)):
        ops.append(Rect(lx, ly - 10, 12, 12, color, cls="legend"))
        ops.append(Text(lx + 16, ly, label, FONT, TEXT))
        lx += 16 + len(label) * FONT * CHAR_W + 18
    return Panel(width, ly + 10, ops, cls="overview")


# --------------------------------------------------------------------------------------------------- SVG / HTML


def _attr(value) -> str:
    return html.escape(str(value), quote=True)


def _num(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _svg(panel: Panel) -> str:
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{panel.width}" height="{panel.height}" '
           f'viewBox="0 0 {panel.width} {panel.height}" class="panel {panel.cls}">']
    for op in panel.ops:
        if isinstance(op, Rect):
            extra = "".join(f' data-{k}="{_attr(v)}"' for k, v in op.data.items() if v is not None)
            stroke = f' stroke="{op.stroke}" stroke-width="2"' if op.stroke else ""
            cls = f' class="{op.cls}"' if op.cls else ""
            title = f"<title>{html.escape(op.title)}</title>" if op.title else ""
            out.append(f'<rect x="{_num(op.x)}" y="{_num(op.y)}" width="{_num(op.w)}" height="{_num(op.h)}" '
                       f'fill="{op.fill}"{stroke}{cls}{extra} rx="2">{title}</rect>')
        elif isinstance(op, Text):
            weight = ' font-weight="bold"' if op.bold else ""
            cls = f' class="{op.cls}"' if op.cls else ""
            out.append(f'<text x="{_num(op.x)}" y="{_num(op.y)}" font-size="{op.size}" fill="{op.color}" '
                       f'text-anchor="{op.anchor}"{weight}{cls}>{html.escape(op.text)}</text>')
        elif isinstance(op, Line):
            out.append(f'<line x1="{_num(op.x1)}" y1="{_num(op.y1)}" x2="{_num(op.x2)}" y2="{_num(op.y2)}" '
                       f'stroke="{op.color}" stroke-width="{op.width}"/>')
        elif isinstance(op, Circle):
            stroke = f' stroke="{op.stroke}"' if op.stroke else ""
            title = f"<title>{html.escape(op.title)}</title>" if op.title else ""
            out.append(f'<circle cx="{_num(op.x)}" cy="{_num(op.y)}" r="{op.r}" fill="{op.fill}"{stroke}>'
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

_JS = """
(function(){
  var all=Array.prototype.slice.call(document.querySelectorAll('section.request'));
  var size=parseInt(document.body.getAttribute('data-page-size'),10)||20;
  var page=0, shown=all;
  var info=document.getElementById('page-info'), room=document.getElementById('room-filter');
  function render(){
    var pages=Math.max(1,Math.ceil(shown.length/size));
    if(page>=pages)page=pages-1; if(page<0)page=0;
    all.forEach(function(s){s.hidden=true;});
    shown.slice(page*size,(page+1)*size).forEach(function(s){s.hidden=false;});
    info.textContent='page '+(page+1)+' of '+pages+' · '+shown.length+' of '+all.length+' requests';
  }
  function filter(){
    var q=room.value.trim();
    var st=document.getElementById('status-filter').value;
    shown=all.filter(function(s){
      if(q && (s.getAttribute('data-room')||'').indexOf(q)!==0)return false;
      if(st && s.getAttribute('data-status')!==st)return false;
      return true;});
    page=0; render();
  }
  document.getElementById('prev').onclick=function(){page--;render();};
  document.getElementById('next').onclick=function(){page++;render();};
  room.oninput=filter; document.getElementById('status-filter').onchange=filter;
  render();
  document.body.setAttribute('data-ready','1');
})();
"""


def render_html(requests: Sequence[Request], title: str = "KV transfer timeline", page_size: int = 20,
                source: str = "", note: str = "", origin_ns: Optional[int] = None) -> str:
    """The whole page: overview, controls, and one section per request (all of them, shown a page at a time)."""
    if origin_ns is None:
        origin_ns = min((r.start_ns for r in requests), default=0)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">",
        f"<style>{_CSS}</style></head>",
        f'<body data-page-size="{int(page_size)}" data-requests="{len(requests)}">',
        f"<h1>{html.escape(title)}</h1>",
        f'<div class="meta">{html.escape(source)}</div>',
    ]
    overview = layout_overview(requests, origin_ns=origin_ns, note=note)
    parts.append(f'<section class="overview">{_svg(overview)}</section>')
    parts.append(
        '<div class="controls">'
        '<button id="prev" type="button">◀ prev</button> <button id="next" type="button">next ▶</button> '
        '<span id="page-info"></span> · room <input id="room-filter" placeholder="room prefix"> '
        '<select id="status-filter"><option value="">any status</option><option>OK</option>'
        "<option>UNSET</option><option>ERROR</option></select></div>"
    )
    if not requests:
        parts.append('<p class="empty">No request matches the filters.</p>')
    for index, request in enumerate(requests):
        panel = layout_request(request, origin_ns=origin_ns)
        hidden = " hidden" if index >= page_size else ""
        room = "" if request.room is None else request.room
        parts.append(f'<section class="request status-{request.status}" data-room="{room}" '
                     f'data-status="{request.status}" data-index="{index}"{hidden}>{_svg(panel)}</section>')
    parts.append(f"<script>{_JS}</script></body></html>")
    return "\n".join(parts) + "\n"


# --------------------------------------------------------------------------------------------------- PNG


def _font(size: int, bold: bool = False):
    from PIL import ImageFont

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
            font = fonts[key]
            anchor = {"start": "ls", "middle": "ms", "end": "rs"}[op.anchor]
            try:
                draw.text((dx + op.x, dy + op.y), op.text, fill=_rgb(op.color), font=font, anchor=anchor)
            except ValueError:  # a bitmap font knows no anchors
                draw.text((dx + op.x, dy + op.y - op.size), op.text, fill=_rgb(op.color), font=font)


def render_png(requests: Sequence[Request], path: str, max_requests: int = 6, title: str = "",
               note: str = "", origin_ns: Optional[int] = None) -> tuple:
    """Draw the overview and the first `max_requests` request blocks into `path`; returns (width, height)."""
    from PIL import Image, ImageDraw

    if origin_ns is None:
        origin_ns = min((r.start_ns for r in requests), default=0)
    shown = list(requests[:max_requests])
    if len(requests) > len(shown):
        extra = f"showing the first {len(shown)} of {len(requests)} requests; the HTML page has them all"
        note = f"{note} · {extra}" if note else extra
    panels = [layout_overview(requests, origin_ns=origin_ns, note=note)]
    panels += [layout_request(r, origin_ns=origin_ns) for r in shown]
    margin, gap, head = 10, 8, 30 if title else 0
    width = WIDTH + 2 * margin
    height = margin * 2 + head + sum(p.height for p in panels) + gap * (len(panels) - 1)
    image = Image.new("RGB", (width, int(height)), _rgb("#fafafa"))
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
    image.save(path, "PNG", optimize=True)
    return image.size


# --------------------------------------------------------------------------------------------------- files


def write_timeline(requests: Sequence[Request], html_path: Optional[str] = None, png_path: Optional[str] = None,
                   page_size: int = 20, png_requests: int = 6, source: str = "", note: str = "",
                   origin_ns: Optional[int] = None) -> dict:
    """Write the HTML page and/or the PNG for `requests`; returns the paths written."""
    written = {}
    title = f"KV transfer timeline — {os.path.basename(source)}" if source else "KV transfer timeline"
    if html_path:
        page = render_html(requests, title=title, page_size=page_size, source=source, note=note,
                           origin_ns=origin_ns)
        with open(html_path, "w", encoding="utf-8") as handle:
            handle.write(page)
        written["html"] = html_path
    if png_path:
        render_png(requests, png_path, max_requests=png_requests, title=title, note=note, origin_ns=origin_ns)
        written["png"] = png_path
    return written


def timeline_from_file(src: str, html_path: Optional[str] = None, png_path: Optional[str] = None,
                       **kwargs) -> dict:
    """Convenience for the demo: read `src`, write the timeline next to it (or where told); returns the paths."""
    from otel_kvtransfer.spanfile_reader import read_spans
    from otel_kvtransfer.summarize import build_requests

    stem = os.path.splitext(src)[0]
    html_path = html_path or f"{stem}.timeline.html"
    png_path = png_path or f"{stem}.timeline.png"
    requests = build_requests(read_spans(src))
    return write_timeline(requests, html_path, png_path, source=src, **kwargs)


def requests_json(requests: Iterable[Request]) -> str:
    return json.dumps([r.to_dict() for r in requests])
