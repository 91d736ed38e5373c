"""What a timeline picture is made of, shared by the layout and both renderers: the drawing operations (pure
data, no value escaped yet), the geometry, the palette, and the helpers that fit labels and place axis ticks."""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass, field
from typing import Optional, Union

from otel_kvtransfer import semconv as sc

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
POST_COLOR = "#1d2f45"  # the part of a send spent inside its posting call (kv_transfer.post_s)
BUSY_COLOR = "#2f4b7c"
TAIL_COLOR = "#8a5a00"  # the tail's outline and label
TAIL_BAND = "#fbecc6"  # the tail across the block, behind every lane
QUEUED_COLOR = "#e8a202"  # parts of the tail in which no transfer of the request moved bytes
TEXT = "#222222"
MUTED = "#666666"
GRID = "#e4e4e4"


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

Op = Union[Rect, Text, Line, Circle]  # one drawing operation of a panel


@dataclass
class Panel:
    """One picture: the overview or one request block."""

    width: int
    height: int
    ops: list
    cls: str = ""


def fits(text: str, width: float, size: int = FONT) -> bool:
    """Whether `text` fits in `width` pixels: estimated from an average glyph, so both renderers agree."""
    return len(text) * size * CHAR_W + 6 <= width


def nice_step(span: float, target: int = 8) -> float:
    """A round tick step (1, 2, 2.5 or 5 times a power of ten) giving about `target` ticks over `span`."""
    raw = span / max(target, 1)
    if raw <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 2.5, 5, 10):
        if raw <= mult * power:
            return mult * power
    return 10 * power


def fmt_axis_s(value: float, step: float) -> str:
    """A tick label in s, ms or us, with as many decimals as `step` needs to tell neighbours apart."""
    if step >= 1:
        return f"{value:g} s"
    if step >= 1e-3:
        ms = value * 1e3
        return f"{ms:.{max(0, -math.floor(math.log10(step * 1e3)) + 1) if step * 1e3 < 1 else 0}f} ms"
    return f"{value * 1e6:.0f} us"


def clip(text: str, width: float, size: int = FONT) -> str:
    """`text` cut (with an ellipsis) to what fits in `width`, never below four characters."""
    limit = max(int(width / (size * CHAR_W)), 4)
    return text if len(text) <= limit else text[: limit - 1] + "…"
