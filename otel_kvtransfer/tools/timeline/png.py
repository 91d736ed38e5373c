"""The PNG picture: the overview and the first request blocks drawn with Pillow (the optional `timeline`
extra), so a picture needs no browser; bounded in height whatever the file."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from otel_kvtransfer.tools.output import atomic_output
from otel_kvtransfer.tools.requests import Request
from otel_kvtransfer.tools.timeline.block import layout_request
from otel_kvtransfer.tools.timeline.drawing import TEXT, WIDTH, Circle, Line, Panel, Rect, Text
from otel_kvtransfer.tools.timeline.overview import layout_overview

MAX_PNG_HEIGHT = 8000  # pixels, whatever the file: blocks that do not fit are left to the HTML page
OVERVIEW_ALLOWANCE = 320  # pixels kept for the overview panel when fitting request blocks into the PNG


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
    import io

    from PIL import Image, ImageDraw

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
    fonts: Dict[Any, Any] = {}
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
