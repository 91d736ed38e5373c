"""The layout of one request block: header, busy strip, compute lane, the tail, one lane per destination, the
peer lanes and the time axis, as drawing operations (pure data: the renderers escape and draw them)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.building import aggregate
from otel_kvtransfer.tools.lanes import pack
from otel_kvtransfer.tools.requests import Request, engine_label, send_bytes, send_throughput
from otel_kvtransfer.tools.text import fmt_bytes, fmt_ms, fmt_rate, label
from otel_kvtransfer.tools.timeline.drawing import (
    BAR_H,
    BUSY_COLOR,
    COMPUTE_COLOR,
    ERROR_COLOR,
    FONT,
    GRID,
    LEFT,
    MUTED,
    PAYLOAD_COLORS,
    POST_COLOR,
    QUEUED_COLOR,
    RECEIVE_COLOR,
    RIGHT,
    ROW_H,
    TAIL_BAND,
    TAIL_COLOR,
    TEXT,
    WIDTH,
    Line,
    Op,
    Panel,
    Rect,
    Text,
    clip,
    fits,
    fmt_axis_s,
    nice_step,
)

# Bounds on what one block holds, whatever the file: a lane draws at most MAX_ROWS rows of overlapping spans, a
# block at most MAX_DEST_LANES destinations and MAX_PEER_LANES peer engines ("+N more" rows say what is left).
MAX_ROWS = 12
MAX_DEST_LANES = 8
MAX_PEER_LANES = 4
MAX_TAIL_GAPS = 200  # queued gaps shaded in one tail (the longest; narrower ones are under a pixel anyway)


def _send_label(span) -> str:
    return f"{fmt_bytes(send_bytes(span))} · {fmt_rate(send_throughput(span))}"


def post_share(span) -> Optional[float]:
    """The share of a send spent inside its posting call (`kv_transfer.post_s`), when the span says it sanely."""
    post, duration = span.attr(sc.POST_S), span.duration_ns
    if type(post) not in (int, float) or not 0 < post < float("inf") or duration <= 0:
        return None
    return min(post * aggregate.NS_PER_S / duration, 1.0)


def _send_title(span) -> str:
    a = span.attributes
    parts = [
        f"{label(a.get(sc.PAYLOAD, 'send'))} chunk {label(a.get(sc.CHUNK_INDEX, '?'))} → dest "
        f"{label(a.get(sc.DESTINATION_INDEX, '?'))}",
        f"{fmt_bytes(send_bytes(span))} in {fmt_ms(span.duration_ns / aggregate.NS_PER_S)} = "
        f"{fmt_rate(send_throughput(span))}",
    ]
    share = post_share(span)
    if share is not None:
        parts.append(f"posting {fmt_ms(a[sc.POST_S])} ({share:.0%} of the send), the rest on the wire")
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
    by_dest: Dict[Any, list] = {}
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
    if req.sends_not_drawn or req.computes_not_drawn:
        lanes.append((_not_drawn_text(req), "not-drawn", []))
    engines: Dict[str, list] = {}
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


def _not_drawn_text(req: Request) -> str:
    parts = []
    if req.sends_not_drawn:
        parts.append(f"{req.sends_not_drawn} of {req.send_spans} sends")
    if req.computes_not_drawn:
        parts.append(f"{req.computes_not_drawn} of {req.compute_spans} computes")
    drawn = len(req.sends) if req.sends_not_drawn else len(req.computes)
    return (f"+{' and '.join(parts)} not drawn: only the first {drawn} by start "
            "are (--max-sends-per-request); figures, busy strip and tail count them all")


def _pixel_runs(intervals: Sequence[tuple], x_of) -> list:
    """(x0, x1) of the intervals, those less than a pixel apart drawn as one (at most one run per pixel)."""
    runs: List[list] = []
    for lo, hi in intervals:
        x0, x1 = x_of(lo), x_of(hi)
        if runs and x0 - runs[-1][1] < 1:
            runs[-1][1] = max(runs[-1][1], x1)
        else:
            runs.append([x0, x1])
    return runs


def _bar(kind: str, span, x0: float, by: float, w: float) -> list:
    """The rectangle (and its label when it fits) of one span in a lane."""
    ops: List[Op]
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
        share = post_share(span)
        if share is not None:  # the posting part, darker, from the send's start
            ops.append(Rect(x0, by, max(w * share, 1), BAR_H, POST_COLOR, cls="send-post", title=_send_title(span)))
        text = _send_label(span)
        if not fits(text, w):
            text = fmt_bytes(send_bytes(span))
    if fits(text, w):
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
    ops: List[Op] = [Rect(x0, by, w, BAR_H, TAIL_BAND, TAIL_COLOR, cls="tail", title=title,
                data={"tail-s": mark.tail_s, "tail-busy-s": mark.tail_busy_s, "tail-queued-s": mark.tail_queued_s,
                      "compute-end-ns": mark.compute_end_ns, "last-byte-ns": mark.last_byte_ns,
                      "queued-gaps": len(gaps)})]
    for lo, hi in sorted(drawn):
        ops.append(Rect(x_of(lo), by + 3, max(x_of(hi) - x_of(lo), 1), BAR_H - 6, QUEUED_COLOR, cls="tail-queued",
                        title=f"queued {fmt_ms((hi - lo) / aggregate.NS_PER_S)}",
                        data={"start-ns": lo, "end-ns": hi}))
    text = _tail_text(mark)
    if fits(text, w):
        ops.append(Text(x0 + 4, by + BAR_H - 4, text, FONT, TEXT, bold=True, cls="tail-label"))
    elif fits(text, width - RIGHT - x1 - 4):
        ops.append(Text(x1 + 4, by + BAR_H - 4, text, FONT, TAIL_COLOR, bold=True, cls="tail-label"))
    else:
        ops.append(Text(max(x0 - 4, LEFT + 4), by + BAR_H - 4, clip(text, max(x0 - LEFT - 8, 0)), FONT, TAIL_COLOR,
                        bold=True, anchor="end" if x0 - 4 > LEFT + 4 else "start", cls="tail-label"))
    return ops


def layout_request(req: Request, width: int = WIDTH, origin_ns: Optional[int] = None) -> Panel:
    """One request block: header, busy strip, compute lane, the tail (where compute is known), one lane per
    destination, peer lanes, axis. A lane shows at most MAX_ROWS rows of overlapping spans; what does not fit is
    counted in a "+N more" row."""
    ops: List[Op] = []
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
    body: List[Op] = []
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
        if kind == "not-drawn":
            body.append(Text(LEFT - 8, y + ROW_H / 2 + 4, "not drawn", FONT, MUTED, anchor="end", cls="lane-label"))
            body.append(Text(LEFT + 4, y + ROW_H - 6, clip(text, plot_w - 8), FONT - 1, MUTED, cls="more not-drawn"))
            y += ROW_H + 4
            continue
        y += _lane(body, text, kind, spans, busy, x_of, y, plot_w) + 4
    grid = _grid(t0, t1, plot_w, grid_top, y)  # under everything
    if mark is not None:  # the tail across every lane, under the grid and the bars
        x0 = x_of(mark.compute_end_ns)
        end = max(mark.last_byte_ns, mark.compute_end_ns)
        grid.insert(0, Rect(x0, grid_top, max(x_of(end) - x0, 2), y - grid_top, TAIL_BAND,
                            cls="tail-band"))
    return Panel(width, int(y + 22), ops + grid + body, cls="request")


def _lane(body: List[Op], text: str, kind: str, spans: List[Any], busy: List[Tuple[int, int]],
          x_of: Callable[[int], float], y: int, plot_w: int) -> int:
    """One lane of spans (or the busy strip) drawn into `body` at `y`: its height."""
    if kind in ("busy", "more"):
        lane_h = 10 if kind == "busy" else ROW_H
        rows, row_count, hidden = [], 1, 0
    else:
        rows = pack(spans, lambda s: s.start_time_unix_nano, lambda s: s.end_time_unix_nano)
        row_count = min(max(rows, default=0) + 1, MAX_ROWS)
        hidden = sum(1 for row in rows if row >= MAX_ROWS)
        lane_h = (row_count + (1 if hidden else 0)) * ROW_H
    body.append(Text(LEFT - 8, y + min(lane_h, ROW_H) / 2 + 4, clip(text, LEFT - 16), FONT, MUTED,
                     anchor="end", cls="lane-label"))
    if kind == "busy" and len(busy) > plot_w:  # more intervals than pixels: one bar per run of them
        for x0, x1 in _pixel_runs(busy, x_of):
            body.append(Rect(x0, y + 2, max(x1 - x0, 1), 6, BUSY_COLOR, cls="busy"))
    elif kind == "busy":
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
    return lane_h


def _grid(t0: int, t1: int, plot_w: int, grid_top: int, y: int) -> List[Op]:
    """The time grid and its axis under a request's lanes, from `grid_top` down to `y`."""
    span_s = (t1 - t0) / 1e9
    step = nice_step(span_s)
    grid: List[Op] = []
    for number in range(int(span_s / step + 1e-9) + 1):
        tick = number * step
        x = LEFT + tick / span_s * plot_w
        grid.append(Line(x, grid_top, x, y, GRID))
        grid.append(Text(x, y + 13, fmt_axis_s(tick, step), FONT - 1, MUTED, anchor="middle", cls="tick"))
    grid.append(Line(LEFT, y, LEFT + plot_w, y, "#bbbbbb"))
    return grid


def _dest(span):
    return span.attr(sc.DESTINATION_INDEX)

