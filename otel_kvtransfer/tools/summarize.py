"""Per-request summaries of a span file, and the distribution of per-transfer throughput.

The figures are those of `requests.Request.figures` (the request span's aggregates, or `aggregate` applied to its
children); quantiles are `aggregate.quantile`. Text output escapes control characters of every value from the
file; JSON output is always valid JSON (a figure that cannot be computed is null, never NaN).

    otel-kvtransfer summarize spans.jsonl          # table + throughput distribution
    otel-kvtransfer summarize spans.jsonl --json   # the same, machine-readable

The tail columns (tail, of which queued) are the request span's own `kv_transfer.tail_s` / `tail_queued_s`, or
`aggregate.tail` of its children; "-" (null in JSON) where the request's compute is unknown.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, Optional, Sequence, TextIO

from otel_kvtransfer.building import aggregate
from otel_kvtransfer.tools.text import fmt_bytes, fmt_ms, fmt_rate, fmt_ratio, json_finite, label

QUANTILES = (("p10", 0.10), ("p50", 0.50), ("p90", 0.90), ("p99", 0.99))


def distribution(values: Sequence[float], bins: int = 10) -> dict:
    """Count, mean, quantiles and a log-spaced histogram of the positive finite values."""
    values = sorted(v for v in values if v > 0 and math.isfinite(v))
    if not values:
        return {"count": 0}
    result: Dict[str, Any] = {"count": len(values), "min": values[0]}
    result.update({name: aggregate.quantile(values, q) for name, q in QUANTILES})
    result.update({"max": values[-1], "mean": math.fsum(values) / len(values)})
    lo, hi = math.log10(values[0]), math.log10(values[-1])
    if hi - lo < 1e-9:
        edges, counts = [values[0], values[-1]], [len(values)]
    else:
        edges = [10 ** (lo + (hi - lo) * i / bins) for i in range(bins + 1)]
        edges[0], edges[-1] = values[0], values[-1]
        counts = [0] * bins
        for v in values:
            counts[min(int((math.log10(v) - lo) / (hi - lo) * bins), bins - 1)] += 1
    result["histogram"] = [{"low": edges[i], "high": edges[i + 1], "count": counts[i]} for i in range(len(counts))]
    return result


def summary_dict(path: str, span_count: int, requests: Sequence, throughputs: Sequence[float],
                 left_out=None) -> dict:
    """The summary; "requests" holds the Request objects, turned into rows only as they are written; `left_out`
    (a `spanfile.Skipped`) what the read left out, by kind."""
    return {
        "file": str(path),
        "span_count": span_count,
        "left_out": {"torn_lines": left_out.torn.count if left_out else 0,
                     "spans_ending_before_they_start": left_out.backwards.count if left_out else 0,
                     "repeated_span_ids": left_out.duplicates.count if left_out else 0,
                     "foreign_attributes": left_out.foreign.count if left_out else 0},
        "request_count": len(requests),
        "requests": requests,
        "transfer_throughput": distribution(throughputs),
        "units": {"bytes": "By", "throughput": "By/s", "time": "s"},
    }


# The table's figure columns: (header, field of Request.to_dict(), how the cell is written), side by side so a
# header cannot drift from its value.
_FIGURE_COLUMNS = (
    ("wire", "bytes", fmt_bytes),
    ("logical", "logical_bytes", fmt_bytes),
    ("xfers", "transfer_count", label),
    ("chunks", "chunk_count", label),
    ("repl", "replica_factor", label),
    ("busy", "busy_s", fmt_ms),
    ("true tput", "throughput", fmt_rate),
    ("last-chunk*", "last_chunk_rate", fmt_rate),
    ("overlap", "compute_overlap_ratio", fmt_ratio),
    ("tail**", "tail_s", fmt_ms),
    ("queued", "tail_queued_s", fmt_ms),
    ("span", "duration_s", fmt_ms),
)


def _row(r: dict) -> tuple:
    """One request's cells: who it is (values from the file, bounded), then its figures."""
    status = r["status"] if not r["error_type"] else f"ERROR:{label(r['error_type'], 30)}"
    who = (label(r["request_key"], 24), f"{label(r['framework'], 12)}/{label(r['backend'], 12)}", status)
    return who + tuple(fmt(r[field]) for _name, field, fmt in _FIGURE_COLUMNS)


def format_text(summary: dict, limit: Optional[int] = None) -> str:
    reqs = summary["requests"]
    lines = [f"{label(summary['file'], 200)}: {summary['span_count']} spans, {summary['request_count']} requests",
             ""]
    header = ("key", "framework/backend", "status") + tuple(name for name, _field, _fmt in _FIGURE_COLUMNS)
    rows = [_row(request.to_dict()) for request in (reqs if limit is None else reqs[:limit])]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(header)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)
    if limit is not None and len(reqs) > limit:
        lines.append(f"... {len(reqs) - limit} more requests (use --limit 0 for all, or --json)")
    lines += ["",
              "* last-chunk: all bytes over the latency of the last chunk only, as engines report it today;",
              "  true tput: bytes over the union of the actual transfer intervals (busy time).",
              "** tail: end of the last send - end of the last compute (what decode waited for after prefill), on",
              "  the initiator's own clock; queued: the part of it in which no transfer of the request moved bytes;",
              "  \"-\" where the request's compute is unknown.",
              ""]
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


def write_json(summary: dict, stream: TextIO) -> None:
    """The summary as JSON, one request row at a time (a file of 10^6 spans never holds all rows at once)."""
    head = json.dumps(json_finite({k: v for k, v in summary.items() if k != "requests"}), indent=2, allow_nan=False)
    stream.write(head[:-2] + ',\n  "requests": [')
    for number, request in enumerate(summary["requests"]):
        row = json.dumps(json_finite(request.to_dict()), allow_nan=False)
        stream.write(("," if number else "") + "\n    " + row)
    stream.write("\n  ]\n}\n")
