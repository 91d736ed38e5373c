"""Per-request summaries of a span file, and the distribution of per-transfer throughput.

`build_requests` groups the spans of a file into requests (a ``kv_transfer.request`` span with its
``kv_transfer.send`` and ``kv_transfer.compute`` children, plus the decode side's ``kv_transfer.receive`` of the
same trace). The figures come from the request span's attributes when it has them, and are computed from the
children otherwise (a file of raw engine-call spans has no request span); both follow DESIGN.md: busy time is the
union of the transfer intervals, true throughput is bytes over busy time.

    otel-kvtransfer summarize spans.jsonl          # table + throughput distribution
    otel-kvtransfer summarize spans.jsonl --json   # the same, machine-readable
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from otel_kvtransfer import intervals
from otel_kvtransfer import semconv as sc
from otel_kvtransfer.spanfile_reader import Span

__all__ = [
    "Request",
    "build_requests",
    "select_requests",
    "transfer_throughputs",
    "distribution",
    "summary_dict",
    "format_text",
    "fmt_bytes",
    "fmt_rate",
    "fmt_ms",
]


# --------------------------------------------------------------------------------------------------- units


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if abs(n) / scale < 100 else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def fmt_rate(bps: Optional[float]) -> str:
    """Bytes per second in binary units, as the demo's table prints them (GiB/s)."""
    if bps is None or not math.isfinite(bps):
        return "-"
    for unit, scale in (("GiB/s", 1 << 30), ("MiB/s", 1 << 20), ("KiB/s", 1 << 10)):
        if abs(bps) >= scale:
            return f"{bps / scale:.3g} {unit}" if abs(bps) / scale < 100 else f"{bps / scale:.0f} {unit}"
    return f"{bps:.0f} B/s"


def fmt_ms(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f} ms"
    if ms >= 1:
        return f"{ms:.2f} ms"
    return f"{ms * 1e3:.0f} us"


# --------------------------------------------------------------------------------------------------- model


def _num(value) -> Optional[float]:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _int(value) -> Optional[int]:
    number = _num(value)
    return int(number) if number is not None else None


def send_bytes(span: Span) -> int:
    return _int(span.attr(sc.BYTES)) or 0


def send_throughput(span: Span) -> Optional[float]:
    """The span's own throughput attribute, or bytes / duration when it has none."""
    value = _num(span.attr(sc.THROUGHPUT))
    if value is not None:
        return float(value)
    if span.duration_ns > 0 and send_bytes(span) > 0:
        return send_bytes(span) / span.duration_s
    return None


def engine_label(resource: dict) -> str:
    """A short name of the process that emitted a span: service name plus instance id or pid."""
    name = str(resource.get("service.name") or "unknown_service")
    inst = resource.get("service.instance.id")
    pid = resource.get("process.pid")
    if inst:
        inst = str(inst)
        if len(inst) == 36 and inst.count("-") == 4:  # a uuid: its first group is enough to tell engines apart
            inst = inst[:8]
        return f"{name} [{inst}]"
    if pid:
        return f"{name} [pid {pid}]"
    return name


@dataclass
class Request:
    """One prefill request (per room and sending rank), its transfers and compute, and its decode receive."""

    trace_id: str
    span: Optional[Span]  # the kv_transfer.request span; None for sends grouped without one
    sends: list = field(default_factory=list)
    computes: list = field(default_factory=list)
    receives: list = field(default_factory=list)

    # ---- identity and time
    @property
    def room(self) -> Optional[int]:
        for span in ([self.span] if self.span else []) + self.sends + self.receives:
            room = _int(span.attr(sc.BOOTSTRAP_ROOM))
            if room is not None:
                return room
        return None

    @property
    def engine(self) -> str:
        source = self.span or (self.sends[0] if self.sends else None)
        return engine_label(source.resource) if source else "unknown_service"

    @property
    def start_ns(self) -> int:
        starts = [s.start_time_unix_nano for s in self._own_spans()]
        return min(starts)

    @property
    def end_ns(self) -> int:
        return max(s.end_time_unix_nano for s in self._own_spans())

    def _own_spans(self) -> list:
        own = ([self.span] if self.span else []) + self.sends + self.computes
        return own or self.receives

    @property
    def duration_s(self) -> float:
        if self.span is not None:
            return self.span.duration_s
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def status(self) -> str:
        if self.span is not None:
            return self.span.status_code
        return "ERROR" if any(s.is_error for s in self.sends) else "UNSET"

    @property
    def error_type(self) -> Optional[str]:
        if self.span is not None and self.span.attr(sc.ERROR_TYPE) is not None:
            return str(self.span.attr(sc.ERROR_TYPE))
        for send in self.sends:
            if send.attr(sc.ERROR_TYPE) is not None:
                return str(send.attr(sc.ERROR_TYPE))
        return None

    def _attr(self, key):
        return self.span.attr(key) if self.span is not None else None

    # ---- figures: the request span's attributes when present, else computed from the children
    @property
    def bytes(self) -> int:
        value = _int(self._attr(sc.BYTES))
        return value if value is not None else sum(send_bytes(s) for s in self.sends)

    @property
    def logical_bytes(self) -> Optional[int]:
        value = _int(self._attr(sc.LOGICAL_BYTES))
        if value is not None:
            return value
        factor = self.replica_factor or 1
        kv = sum(send_bytes(s) for s in self.sends if s.attr(sc.PAYLOAD) == sc.PAYLOAD_KV)
        rest = sum(send_bytes(s) for s in self.sends if s.attr(sc.PAYLOAD) != sc.PAYLOAD_KV)
        return int(round(kv / factor)) + rest if self.sends else None

    @property
    def transfer_count(self) -> int:
        value = _int(self._attr(sc.TRANSFER_COUNT))
        return value if value is not None else len(self.sends)

    @property
    def chunk_count(self) -> int:
        value = _int(self._attr(sc.CHUNK_COUNT))
        if value is not None:
            return value
        return len({s.attr(sc.CHUNK_INDEX) for s in self.sends if s.attr(sc.CHUNK_INDEX) is not None})

    @property
    def replica_factor(self) -> Optional[int]:
        value = _int(self._attr(sc.REPLICA_FACTOR))
        if value is not None:
            return value
        factors = [_int(s.attr(sc.REPLICA_FACTOR)) for s in self.sends if s.attr(sc.REPLICA_FACTOR) is not None]
        return max(factors) if factors else None

    def busy_intervals(self) -> list:
        return intervals.union((s.start_time_unix_nano, s.end_time_unix_nano) for s in self.sends)

    def compute_intervals(self) -> list:
        return intervals.union((s.start_time_unix_nano, s.end_time_unix_nano) for s in self.computes)

    @property
    def busy_s(self) -> Optional[float]:
        value = _num(self._attr(sc.BUSY_S))
        if value is not None:
            return float(value)
        if not self.sends:
            return None
        return intervals.length(self.busy_intervals()) / 1e9

    @property
    def throughput(self) -> Optional[float]:
        """True throughput: bytes over the union of the transfer intervals (By/s)."""
        value = _num(self._attr(sc.THROUGHPUT))
        if value is not None:
            return float(value)
        busy = self.busy_s
        return self.bytes / busy if busy else None

    @property
    def compute_overlap_s(self) -> Optional[float]:
        value = _num(self._attr(sc.COMPUTE_OVERLAP_S))
        if value is not None:
            return float(value)
        if not self.computes or not self.sends:
            return None
        return intervals.intersection_length(self.busy_intervals(), self.compute_intervals()) / 1e9

    @property
    def compute_overlap_ratio(self) -> Optional[float]:
        value = _num(self._attr(sc.COMPUTE_OVERLAP_RATIO))
        if value is not None:
            return float(value)
        overlap, busy = self.compute_overlap_s, self.busy_s
        if overlap is None or not busy:
            return None
        return overlap / busy

    @property
    def last_chunk_rate(self) -> Optional[float]:
        """What engines report today: all bytes over the latency of only the last chunk's transfers."""
        last = [s for s in self.sends if s.attr(sc.IS_LAST_CHUNK) is True]
        if not last:
            chunks = [_int(s.attr(sc.CHUNK_INDEX)) for s in self.sends if s.attr(sc.CHUNK_INDEX) is not None]
            if not chunks:
                return None
            top = max(chunks)
            last = [s for s in self.sends if _int(s.attr(sc.CHUNK_INDEX)) == top]
        span_ns = max(s.end_time_unix_nano for s in last) - min(s.start_time_unix_nano for s in last)
        return self.bytes / (span_ns / 1e9) if span_ns > 0 else None

    @property
    def destinations(self) -> list:
        """Sorted destination indexes of the sends (None when a send names none)."""
        found = {_int(s.attr(sc.DESTINATION_INDEX)) for s in self.sends}
        return sorted(found, key=lambda d: (d is None, d if d is not None else 0))

    def to_dict(self) -> dict:
        return {
            "bootstrap_room": self.room,
            "trace_id": self.trace_id,
            "span_id": self.span.span_id if self.span else None,
            "engine": self.engine,
            "status": self.status,
            "error_type": self.error_type,
            "start_time_unix_nano": self.start_ns,
            "end_time_unix_nano": self.end_ns,
            "duration_s": self.duration_s,
            "bytes": self.bytes,
            "logical_bytes": self.logical_bytes,
            "transfer_count": self.transfer_count,
            "chunk_count": self.chunk_count,
            "replica_factor": self.replica_factor,
            "busy_s": self.busy_s,
            "throughput": self.throughput,
            "last_chunk_rate": self.last_chunk_rate,
            "compute_overlap_s": self.compute_overlap_s,
            "compute_overlap_ratio": self.compute_overlap_ratio,
            "send_spans": len(self.sends),
            "compute_spans": len(self.computes),
            "receive_spans": len(self.receives),
        }


def build_requests(spans: Iterable[Span]) -> list:
    """Group spans into requests, ordered by start time."""
    spans = list(spans)
    by_id = {}
    requests = {}
    for span in spans:
        by_id[(span.trace_id, span.span_id)] = span
        if span.name == sc.SPAN_REQUEST:
            requests[(span.trace_id, span.span_id)] = Request(trace_id=span.trace_id, span=span)
    orphans = {}
    receives = []
    for span in spans:
        if span.name in (sc.SPAN_SEND, sc.SPAN_COMPUTE):
            parent = requests.get((span.trace_id, span.parent_span_id))
            if parent is None:
                # A send outside any request span (a raw engine call): group by its parent, or by room.
                room = span.attr(sc.BOOTSTRAP_ROOM)
                key = (span.trace_id, span.parent_span_id if span.parent_span_id else f"room:{room}")
                parent = orphans.get(key)
                if parent is None:
                    parent = orphans[key] = Request(trace_id=span.trace_id, span=None)
            (parent.sends if span.name == sc.SPAN_SEND else parent.computes).append(span)
        elif span.name == sc.SPAN_RECEIVE:
            receives.append(span)
    result = list(requests.values()) + [r for r in orphans.values() if r.sends]
    by_trace = {}
    by_room = {}
    for request in result:
        by_trace.setdefault(request.trace_id, []).append(request)
        if request.room is not None:
            by_room.setdefault(request.room, []).append(request)
    for receive in receives:
        matched = by_trace.get(receive.trace_id)
        if not matched:
            room = _int(receive.attr(sc.BOOTSTRAP_ROOM))
            matched = by_room.get(room) if room is not None else None
        if not matched:
            # A decode-only view: the receive stands as its own request.
            request = Request(trace_id=receive.trace_id, span=None, receives=[receive])
            result.append(request)
            by_trace.setdefault(receive.trace_id, []).append(request)
            continue
        for request in matched:
            request.receives.append(receive)
    for request in result:
        request.sends.sort(key=lambda s: (s.start_time_unix_nano, s.end_time_unix_nano))
        request.computes.sort(key=lambda s: s.start_time_unix_nano)
    result.sort(key=lambda r: (r.start_ns, r.room if r.room is not None else -1))
    return result


def select_requests(
    requests: Sequence[Request],
    rooms: Optional[Iterable[int]] = None,
    since_s: Optional[float] = None,
    until_s: Optional[float] = None,
    origin_ns: Optional[int] = None,
) -> list:
    """Requests whose room is in `rooms` (when given) and whose time overlaps [since_s, until_s], in seconds
    after `origin_ns` (default: the earliest request start)."""
    requests = list(requests)
    if not requests:
        return []
    if origin_ns is None:
        origin_ns = min(r.start_ns for r in requests)
    wanted = set(rooms) if rooms else None
    lo = origin_ns + int(since_s * 1e9) if since_s is not None else None
    hi = origin_ns + int(until_s * 1e9) if until_s is not None else None
    out = []
    for request in requests:
        if wanted is not None and request.room not in wanted:
            continue
        if lo is not None and request.end_ns < lo:
            continue
        if hi is not None and request.start_ns > hi:
            continue
        out.append(request)
    return out


# --------------------------------------------------------------------------------------------------- distribution


def transfer_throughputs(requests: Iterable[Request]) -> list:
    """Per-transfer throughput (By/s) of every successful send with bytes and a duration."""
    out = []
    for request in requests:
        for send in request.sends:
            if send.is_error:
                continue
            value = send_throughput(send)
            if value is not None and value > 0:
                out.append(value)
    return out


def _quantile(sorted_values: list, q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values: Sequence[float], bins: int = 10) -> dict:
    """Count, mean, quantiles and a log-spaced histogram of positive values."""
    values = sorted(v for v in values if v is not None and v > 0 and math.isfinite(v))
    if not values:
        return {"count": 0}
    result = {
        "count": len(values),
        "min": values[0],
        "p10": _quantile(values, 0.10),
        "p50": _quantile(values, 0.50),
        "p90": _quantile(values, 0.90),
        "p99": _quantile(values, 0.99),
        "max": values[-1],
        "mean": sum(values) / len(values),
    }
    lo, hi = math.log10(values[0]), math.log10(values[-1])
    if hi - lo < 1e-9:
        edges = [values[0], values[-1]]
        counts = [len(values)]
    else:
        edges = [10 ** (lo + (hi - lo) * i / bins) for i in range(bins + 1)]
        edges[0], edges[-1] = values[0], values[-1]
        counts = [0] * bins
        for v in values:
            index = min(int((math.log10(v) - lo) / (hi - lo) * bins), bins - 1)
            counts[index] += 1
    result["histogram"] = [
        {"low": edges[i], "high": edges[i + 1], "count": counts[i]} for i in range(len(counts))
    ]
    return result


# --------------------------------------------------------------------------------------------------- output


def summary_dict(path: str, spans: Sequence[Span], requests: Sequence[Request]) -> dict:
    throughputs = transfer_throughputs(requests)
    return {
        "file": str(path),
        "span_count": len(spans),
        "request_count": len(requests),
        "requests": [r.to_dict() for r in requests],
        "transfer_throughput": distribution(throughputs),
        "units": {"bytes": "By", "throughput": "By/s", "time": "s"},
    }


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def format_text(summary: dict, limit: Optional[int] = None) -> str:
    reqs = summary["requests"]
    lines = [
        f"{summary['file']}: {summary['span_count']} spans, {summary['request_count']} requests",
        "",
    ]
    header = ("room", "status", "wire", "logical", "xfers", "chunks", "repl", "busy", "true tput",
              "last-chunk*", "overlap", "span")
    rows = []
    shown = reqs if limit is None else reqs[:limit]
    for r in shown:
        status = r["status"] if not r["error_type"] else f"ERROR:{r['error_type']}"
        rows.append((
            "-" if r["bootstrap_room"] is None else str(r["bootstrap_room"]),
            status,
            fmt_bytes(r["bytes"]),
            fmt_bytes(r["logical_bytes"]),
            str(r["transfer_count"]),
            str(r["chunk_count"]),
            "-" if r["replica_factor"] is None else str(r["replica_factor"]),
            fmt_ms(r["busy_s"]),
            fmt_rate(r["throughput"]),
            fmt_rate(r["last_chunk_rate"]),
            _ratio(r["compute_overlap_ratio"]),
            fmt_ms(r["duration_s"]),
        ))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    if limit is not None and len(reqs) > limit:
        lines.append(f"... {len(reqs) - limit} more requests (use --limit 0 for all, or --json)")
    lines.append("")
    lines.append("* last-chunk: all bytes over the latency of the last chunk only, as engines report it today;")
    lines.append("  true tput: bytes over the union of the actual transfer intervals (busy time).")
    lines.append("")
    dist = summary["transfer_throughput"]
    lines.append(f"per-transfer throughput ({dist['count']} successful transfers)")
    if dist["count"]:
        lines.append("  " + "  ".join(
            f"{k} {fmt_rate(dist[k])}" for k in ("min", "p10", "p50", "p90", "p99", "max", "mean")))
        top = max(b["count"] for b in dist["histogram"]) or 1
        for b in dist["histogram"]:
            bar = "#" * int(round(40 * b["count"] / top))
            lines.append(f"  {fmt_rate(b['low']):>10} - {fmt_rate(b['high']):<10} {b['count']:>6}  {bar}")
    return "\n".join(lines) + "\n"


def to_json(summary: dict) -> str:
    return json.dumps(summary, indent=2, sort_keys=False) + "\n"
