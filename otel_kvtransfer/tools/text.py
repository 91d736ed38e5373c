"""Text the tools print: units, and values from span files made safe for a terminal (control and format characters
escaped by `building.printable`, the one rule the engine's log lines follow too; length bounded), since every value
in a span file is untrusted."""

from __future__ import annotations

import math
from typing import Any, Optional

from otel_kvtransfer.building.printable import printable

PROG = "otel-kvtransfer"  # the command, as its messages name it


def bounded(text: Any, limit: int = 200) -> str:
    """`text` cut to `limit` characters, with a note of how much was cut, and no control characters."""
    text = printable(str(text))
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def label(value: Any, limit: int = 60) -> str:
    """A value from a span file shown in a table cell or a picture: printable, bounded, '-' when absent."""
    if value is None:
        return "-"
    text = printable(str(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _scaled(value: float, units) -> Optional[str]:
    for unit, scale in units:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}" if abs(value) / scale < 100 else f"{value / scale:.0f} {unit}"
    return None


def fmt_bytes(n: Optional[float]) -> str:
    if n is None or not math.isfinite(n):
        return "-"
    return _scaled(float(n), (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))) or f"{n:.0f} B"


def fmt_rate(bps: Optional[float]) -> str:
    """Bytes per second in binary units, as the demo's table prints them (GiB/s)."""
    if bps is None or not math.isfinite(bps):
        return "-"
    return _scaled(float(bps), (("GiB/s", 1 << 30), ("MiB/s", 1 << 20), ("KiB/s", 1 << 10))) or f"{bps:.0f} B/s"


def fmt_ms(seconds: Optional[float]) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f} ms"
    if ms >= 1:
        return f"{ms:.2f} ms"
    return f"{ms * 1e3:.0f} us"


def fmt_ratio(value: Optional[float]) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value * 100:.0f}%"


def json_finite(value):
    """`value` for JSON, which has no NaN or Infinity: such a figure is null, in dicts and lists too."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_finite(v) for v in value]
    return value
