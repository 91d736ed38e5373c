"""The link model of a span file: per peer, over its successful engine calls,

    duration = fixed cost per call + bytes / bandwidth (+ a cost per descriptor, where descriptor counts vary)

fitted by least squares; with its residual spread, the calls far above it, and the requests whose modelled time is
mostly fixed or per-descriptor cost (bound by latency or by descriptors, not by the link's bandwidth).

    otel-kvtransfer summarize spans.jsonl --links          # one row per peer, then the requests so marked
    otel-kvtransfer summarize spans.jsonl --links --json   # each peer: bandwidth (By/s), fixed_s, per_descriptor_s

One engine call is one observation: the sends one call was split into (requests or replicas sharing a batch) share
its start and end, and are put back together by peer, start and end. Only the first MAX_CALLS calls of a file are
kept (the rest are counted and said), so a file of any size is read in bounded memory; a pipe works (one pass).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Optional, TextIO

from otel_kvtransfer import semconv
from otel_kvtransfer.building import aggregate
from otel_kvtransfer.tools.reading import first_of_each_id
from otel_kvtransfer.tools.source import SourceError, open_source
from otel_kvtransfer.tools.spanfile import Skipped, SpanFileError, iter_spans, stderr_progress
from otel_kvtransfer.tools.text import PROG, fmt_ms, fmt_rate, json_finite, label

MAX_CALLS = 500_000
MIN_CALLS = 3  # a line through fewer points says nothing about its spread
FAR_ABOVE = 2.0  # a call taking more than twice its model's time (and FAR_ABOVE_MIN_S more) is far above it
FAR_ABOVE_MIN_S = 1e-3
SHOWN = 10  # calls far above each peer's model listed, and request keys of each kind in the text
LISTED = 1000  # request keys of each kind in the JSON, the most bound first
BOUND_SHARE = 0.5  # a request whose modelled time is at least this share fixed (or per-descriptor) cost is bound so
COLLINEAR = 0.99  # descriptors this correlated with bytes cannot be told apart from them


def _key(attrs) -> Optional[tuple]:
    """(server.address, server.port) of a send, bounded (values from the file are untrusted)."""
    address, port = attrs.get(semconv.SERVER_ADDRESS), attrs.get(semconv.SERVER_PORT)
    if address is None:
        return None
    if not (isinstance(port, int) and not isinstance(port, bool) and 0 <= port < 65536):
        port = None if port is None else str(port)[:20]
    return str(address)[:200], port


class _Calls:
    """The engine calls of a span file, by peer: {(peer, start, end): [bytes, descriptors, request keys]}."""

    def __init__(self):
        self.calls = {}
        self.sends = 0
        self.left_out = 0  # sends past MAX_CALLS
        self.failed = 0

    def add(self, span) -> None:
        peer = _key(span.attributes)
        if span.name != semconv.SPAN_SEND or peer is None:
            return
        self.sends += 1
        if span.is_error:
            self.failed += 1
            return
        call = (peer, span.start_time_unix_nano, span.end_time_unix_nano)
        found = self.calls.get(call)
        if found is None:
            if len(self.calls) >= MAX_CALLS:
                self.left_out += 1
                return
            found = self.calls[call] = [0, 0, set()]
        found[0] += _count(span.attr(semconv.BYTES))
        found[1] += _count(span.attr(semconv.DESCRIPTOR_COUNT))
        key = span.attr(semconv.REQUEST_KEY)
        if key is not None and len(found[2]) < 64:
            found[2].add(str(key)[:200])


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62 else 0


def fit(points) -> dict:
    """Least squares of duration (s) on bytes, and on descriptors where they vary apart from bytes, over `points`
    [(bytes, descriptors, duration_s)]: {"bandwidth", "fixed_s", "per_descriptor_s" (or None), "note"}. A
    coefficient that comes out negative is left out and the rest fitted again (no cost is negative). Then the calls
    far above that fit (stalls: more than FAR_ABOVE times it and FAR_ABOVE_MIN_S over) are left out and the rest
    fitted once more, so a few stalled calls do not bend the model of the link's normal calls (they are listed)."""
    model = _fit(points)
    if model["bandwidth"] is None and model["fixed_s"] is None:
        return model
    kept = [p for p in points if not _far_above(p[2], sum(_modelled(model, p[0], p[1])))]
    if len(points) > len(kept) >= MIN_CALLS:
        model = _fit(kept)
    return model


def _far_above(seconds: float, expected: float) -> bool:
    return expected > 0 and seconds > FAR_ABOVE * expected and seconds - expected > FAR_ABOVE_MIN_S


def _fit(points) -> dict:
    n = len(points)
    if n < MIN_CALLS:
        return {"bandwidth": None, "fixed_s": None, "per_descriptor_s": None,
                "note": f"{n} calls: too few to fit"}
    columns = [[p[0] for p in points], [p[1] for p in points]]
    y = [p[2] for p in points]
    use = [_varies(columns[0]), _varies(columns[1])]
    note = None
    if use[0] and use[1] and abs(_correlation(columns[0], columns[1])) >= COLLINEAR:
        use[1] = False
        note = "descriptors proportional to bytes: their cost is in the bandwidth"
    if not use[0]:
        note = "one call size only: the fixed cost and the bandwidth cannot be told apart"
    intercept = True
    while True:
        chosen = [i for i in (0, 1) if use[i]]
        coefficients, fixed = _least_squares([columns[i] for i in chosen], y, intercept)
        negative = [i for i, c in zip(chosen, coefficients) if c < 0]
        if negative:
            use[negative[-1]] = False  # the descriptors' term first, then the bytes'
            continue
        if intercept and fixed < 0:
            intercept = False
            continue
        break
    by = dict(zip(chosen, coefficients))
    per_byte = by.get(0)
    return {"bandwidth": 1.0 / per_byte if per_byte else None, "fixed_s": fixed,
            "per_descriptor_s": by.get(1), "note": note}


def _varies(values) -> bool:
    return len(set(values)) > 1


def _mean(values) -> float:
    return math.fsum(values) / len(values)


def _correlation(a, b) -> float:
    ma, mb = _mean(a), _mean(b)
    saa = math.fsum((x - ma) ** 2 for x in a)
    sbb = math.fsum((x - mb) ** 2 for x in b)
    sab = math.fsum((x - ma) * (z - mb) for x, z in zip(a, b))
    return sab / math.sqrt(saa * sbb) if saa > 0 and sbb > 0 else 0.0


def _least_squares(columns, y, intercept: bool) -> tuple:
    """(slopes, intercept) of y on `columns` (at most two), centred for precision when there is an intercept."""
    if intercept:
        means = [_mean(c) for c in columns]
        my = _mean(y)
        xs = [[x - m for x in c] for c, m in zip(columns, means)]
        ys = [v - my for v in y]
    else:
        xs, ys = columns, y
    gram = [[math.fsum(a * b for a, b in zip(xi, xj)) for xj in xs] for xi in xs]
    right = [math.fsum(a * b for a, b in zip(xi, ys)) for xi in xs]
    slopes = _solve(gram, right)
    if not intercept:
        return slopes, 0.0
    return slopes, my - math.fsum(s * m for s, m in zip(slopes, means))


def _solve(gram, right) -> list:
    if not gram:
        return []
    if len(gram) == 1:
        return [right[0] / gram[0][0]] if gram[0][0] else [0.0]
    (a, b), (c, d) = gram
    det = a * d - b * c
    if not det:
        return [right[0] / a if a else 0.0, 0.0]
    return [(right[0] * d - b * right[1]) / det, (a * right[1] - c * right[0]) / det]


def _modelled(model, nbytes, descriptors) -> tuple:
    """(fixed, per-descriptor, bytes) parts of a call's modelled time."""
    fixed = model["fixed_s"] or 0.0
    per_descriptor = (model["per_descriptor_s"] or 0.0) * descriptors
    on_the_wire = nbytes / model["bandwidth"] if model["bandwidth"] else 0.0
    return fixed, per_descriptor, on_the_wire


def link_model(path: str) -> dict:
    """Read `path` (one pass) and fit each peer's link. Raises SpanFileError on bad input."""
    try:
        source = open_source(path)
    except SourceError as exc:
        raise SpanFileError(path, None, str(exc)) from None
    calls, skipped, spans = _Calls(), Skipped(), 0
    try:
        for span in first_of_each_id(iter_spans(source, progress=stderr_progress(f"reading {path}"),
                                                skipped=skipped), skipped.duplicates):
            spans += 1
            calls.add(span)
    finally:
        source.close()
    for line in skipped.warnings(path):
        sys.stderr.write(f"{PROG}: warning: {line}\n")
    by_peer = {}
    for (peer, start, end), (nbytes, descriptors, keys) in calls.calls.items():
        by_peer.setdefault(peer, []).append((nbytes, descriptors, (end - start) / 1e9, keys))
    peers, bound = [], {"fixed_cost": {}, "per_descriptor": {}, "bandwidth": {}}
    per_request = {}  # key -> [fixed, per-descriptor, bytes] modelled seconds over its calls
    for peer, observed in sorted(by_peer.items(), key=lambda item: (item[0][0], str(item[0][1]))):
        model = fit([(b, d, s) for b, d, s, _keys in observed if s > 0])
        peers.append(_peer_row(peer, observed, model))
        if model["bandwidth"] is None and model["fixed_s"] is None:
            continue
        for nbytes, descriptors, _seconds, keys in observed:
            parts = _modelled(model, nbytes, descriptors)
            for key in keys:
                total = per_request.setdefault(key, [0.0, 0.0, 0.0])
                for i in range(3):
                    total[i] += parts[i] / len(keys)
    for key, (fixed, per_descriptor, on_the_wire) in per_request.items():
        whole = fixed + per_descriptor + on_the_wire
        kind = "bandwidth"
        if whole > 0 and fixed / whole >= BOUND_SHARE:
            kind = "fixed_cost"
        elif whole > 0 and per_descriptor / whole >= BOUND_SHARE:
            kind = "per_descriptor"
        bound[kind][key] = max(fixed, per_descriptor) / whole if whole > 0 else 0.0
    return {
        "file": str(path), "span_count": spans, "send_count": calls.sends, "failed_sends": calls.failed,
        "calls_left_out": calls.left_out,
        "left_out": {"torn_lines": skipped.torn.count, "spans_ending_before_they_start": skipped.backwards.count,
                     "repeated_span_ids": skipped.duplicates.count},
        "peers": peers,
        "requests": {kind: {"count": len(keys),
                            "keys": sorted(keys, key=lambda k: -keys[k])[:LISTED] if kind != "bandwidth" else []}
                     for kind, keys in bound.items()},
        "units": {"bandwidth": "By/s", "time": "s"},
    }


def _peer_row(peer, observed, model) -> dict:
    residuals, far = [], []
    for nbytes, descriptors, seconds, keys in observed:
        expected = sum(_modelled(model, nbytes, descriptors))
        if expected <= 0:
            continue
        residuals.append(abs(seconds - expected) / expected)
        if _far_above(seconds, expected):
            far.append((seconds - expected, {"bytes": nbytes, "descriptors": descriptors, "duration_s": seconds,
                                             "modelled_s": expected, "request_keys": sorted(keys)[:4]}))
    residuals.sort()
    far.sort(key=lambda item: -item[0])
    return {
        semconv.SERVER_ADDRESS: peer[0], semconv.SERVER_PORT: peer[1], "calls": len(observed),
        "bytes": sum(o[0] for o in observed), **model,
        "spread": {"median_relative": aggregate.quantile(residuals, 0.5) if residuals else None,
                   "p90_relative": aggregate.quantile(residuals, 0.9) if residuals else None},
        "far_above": {"count": len(far), "calls": [row for _excess, row in far[:SHOWN]]},
    }


def write_json(model: dict, stream: TextIO) -> None:
    stream.write(json.dumps(json_finite(model), indent=2, allow_nan=False) + "\n")


def _ratio(value) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def format_text(model: dict) -> str:
    lines = [f"{label(model['file'], 200)}: {model['span_count']} spans, {model['send_count']} sends "
             f"({model['failed_sends']} failed, not fitted), {len(model['peers'])} peers", ""]
    header = ("peer", "calls", "bandwidth", "fixed", "per descriptor", "spread p50", "p90", "far above")
    rows = []
    for peer in model["peers"]:
        where = label(peer[semconv.SERVER_ADDRESS], 40) + ("" if peer[semconv.SERVER_PORT] is None
                                                           else f":{label(peer[semconv.SERVER_PORT], 8)}")
        per_descriptor = peer["per_descriptor_s"]
        rows.append((where, str(peer["calls"]), fmt_rate(peer["bandwidth"]), fmt_ms(peer["fixed_s"]),
                     "-" if per_descriptor is None else f"{per_descriptor * 1e6:.3g} us",
                     _ratio(peer["spread"]["median_relative"]), _ratio(peer["spread"]["p90_relative"]),
                     str(peer["far_above"]["count"])))
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)
    notes = [f"  {label(p[semconv.SERVER_ADDRESS], 40)}: {p['note']}" for p in model["peers"] if p["note"]]
    if notes:
        lines += ["", "notes:"] + notes
    if model["calls_left_out"]:
        lines += ["", f"{model['calls_left_out']} sends past the first {MAX_CALLS} engine calls were not fitted"]
    lines += ["", "model: duration = fixed + bytes / bandwidth (+ per descriptor x descriptors), least squares per "
                  "peer over its successful calls;",
              "  spread: |duration - model| / model; far above: more than 2x the model and 1 ms over it.", ""]
    requests = model["requests"]
    lines.append(f"requests bound by their link's bandwidth: {requests['bandwidth']['count']}")
    for kind, what in (("fixed_cost", "the fixed cost per call (latency)"),
                       ("per_descriptor", "the cost per descriptor")):
        found = requests[kind]
        shown = ", ".join(label(k, 40) for k in found["keys"][:SHOWN])
        more = f", ... {found['count'] - SHOWN} more (--json lists them)" if found["count"] > SHOWN else ""
        lines.append(f"requests whose modelled time is mostly {what}: {found['count']}"
                     + (f": {shown}{more}" if shown else ""))
    return "\n".join(lines) + "\n"
