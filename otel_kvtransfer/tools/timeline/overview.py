"""The layout of the overview above the request blocks: true throughput per request over time beside the
last-chunk figure, the distribution of per-transfer throughput, the legend; drawing operations only."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.building import aggregate
from otel_kvtransfer.tools.requests import Request
from otel_kvtransfer.tools.summarize import distribution
from otel_kvtransfer.tools.text import fmt_bytes, fmt_ms, fmt_rate, label
from otel_kvtransfer.tools.timeline.drawing import (
    BUSY_COLOR,
    CHAR_W,
    COMPUTE_COLOR,
    ERROR_COLOR,
    FONT,
    GRID,
    MUTED,
    PAYLOAD_COLORS,
    POST_COLOR,
    QUEUED_COLOR,
    RECEIVE_COLOR,
    RIGHT,
    TAIL_BAND,
    TAIL_COLOR,
    TEXT,
    WIDTH,
    Circle,
    Line,
    Op,
    Panel,
    Rect,
    Text,
    fits,
    fmt_axis_s,
    nice_step,
)

MAX_POINTS = 20_000  # requests plotted, whatever the file


def layout_overview(requests: Sequence[Request], width: int = WIDTH, origin_ns: Optional[int] = None,
                    note: str = "", throughputs: Sequence[float] = ()) -> Panel:
    """Aggregate view of the whole selection: true throughput per request over time, the figure engines report
    (last-chunk) beside it, and the histogram of per-transfer throughput."""
    ops: List[Op] = []
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
    y_step = nice_step(y_max / unit, 4) * unit
    y_top = math.ceil(y_max / y_step) * y_step
    ops.append(Text(sx0, top - 4, "throughput per request over time (● true = bytes / busy time, "
                                  "○ last-chunk figure)", FONT, MUTED, cls="chart-title"))
    ops.extend(_throughput_axes(sx0, sx1, top, h, y_top, y_step, t_max))
    for start, true, legacy, req, fig in points[:MAX_POINTS]:
        ops.extend(_point(sx0 + (start - origin_ns) / t_max * (sx1 - sx0), top, h, y_top, true, legacy, req, fig))
    ops.append(Line(sx0, top + h, sx1, top + h, "#bbbbbb"))
    # Right: histogram of per-transfer throughput (log-spaced bins).
    ops.extend(_histogram(throughputs, int(width * 0.64), width - RIGHT, top, h))
    ly = top + h + 36
    ops.extend(_legend(ly))
    if any(r.peers for r in requests):
        ly += 18
        ops.append(Text(8, ly, "Peer lanes (receive / serve) are on the peer engines' clocks: clocks of different "
                               "hosts may disagree. Busy time and the tail are on the initiator's clock alone.",
                        FONT, MUTED, cls="clock-note"))
    return Panel(width, ly + 10, ops, cls="overview")

def _throughput_axes(sx0: int, sx1: int, top: int, h: int, y_top: float, y_step: float, t_max: int) -> List[Op]:
    """The throughput chart's grid lines and labels (y) and its time ticks (x)."""
    ops: List[Op] = []
    for number in range(int(y_top / y_step + 1e-9) + 1):
        value = number * y_step
        yy = top + h - value / y_top * h
        ops.append(Line(sx0, yy, sx1, yy, GRID))
        ops.append(Text(sx0 - 4, yy + 4, fmt_rate(value).replace(" ", ""), FONT - 2, MUTED, anchor="end"))
    x_step = nice_step(t_max / 1e9, 6)
    for number in range(int(t_max / 1e9 / x_step + 1e-9) + 1):
        tick = number * x_step
        xx = sx0 + tick * 1e9 / t_max * (sx1 - sx0)
        ops.append(Text(xx, top + h + 13, fmt_axis_s(tick, x_step), FONT - 2, MUTED, anchor="middle"))
    return ops


def _point(xx: float, top: int, h: int, y_top: float, true: Optional[float], legacy: Optional[float], req: Request,
           fig: dict) -> List[Op]:
    """One request's marks at x `xx`: its last-chunk figure (hollow) and its true throughput (filled)."""
    ops: List[Op] = []
    key = label(req.key, 40)
    if legacy:
        ops.append(Circle(xx, top + h - min(legacy / y_top, 1) * h, 3, "none", "#999999",
                          title=f"key {key}: last-chunk figure {fmt_rate(legacy)}"))
    if true:
        color = ERROR_COLOR if req.final_status == "ERROR" else BUSY_COLOR
        ops.append(Circle(xx, top + h - min(true / y_top, 1) * h, 3, color,
                          title=f"key {key}: true {fmt_rate(true)}, busy {fmt_ms(fig['busy_s'])}"))
    return ops


def _histogram(throughputs: Sequence[float], hx0: int, hx1: int, top: int, h: int) -> List[Op]:
    """The histogram of per-transfer throughput between x `hx0` and `hx1`, its bars `h` high at most."""
    ops: List[Op] = []
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
            if b["count"] and fits(str(b["count"]), bw, FONT - 2):
                ops.append(Text(hx0 + (i + 0.5) * bw, top + h - bh - 3, str(b["count"]), FONT - 2, MUTED,
                                anchor="middle"))
        ops.append(Line(hx0, top + h, hx1, top + h, "#bbbbbb"))
        ops.append(Text(hx0, top + h + 13, fmt_rate(dist["min"]), FONT - 2, MUTED))
        ops.append(Text((hx0 + hx1) / 2, top + h + 13, f"p50 {fmt_rate(dist['p50'])}", FONT - 2, MUTED,
                        anchor="middle"))
        ops.append(Text(hx1, top + h + 13, fmt_rate(dist["max"]), FONT - 2, MUTED, anchor="end"))
    return ops


def _legend(ly: int) -> List[Op]:
    """The colours' legend, one row at `ly`."""
    ops: List[Op] = []
    lx: float = 8
    for text, color in (("kv", PAYLOAD_COLORS["kv"]), ("aux", PAYLOAD_COLORS["aux"]),
                        ("state", PAYLOAD_COLORS["state"]), ("compute", COMPUTE_COLOR),
                        ("peer receive / serve", RECEIVE_COLOR), ("busy (union of transfers)", BUSY_COLOR),
                        ("posting", POST_COLOR), ("failed", ERROR_COLOR), ("tail (compute end → last byte)", TAIL_BAND),
                        ("tail queued", QUEUED_COLOR)):
        ops.append(Rect(lx, ly - 10, 12, 12, color, TAIL_COLOR if color == TAIL_BAND else None, cls="legend"))
        ops.append(Text(lx + 16, ly, text, FONT, TEXT))
        lx += 16 + len(text) * FONT * CHAR_W + 18
    return ops

