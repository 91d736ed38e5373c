"""The link model of a span file: per peer, over its successful engine calls,

    duration = fixed cost per call + bytes / bandwidth (+ a cost per descriptor, where descriptor counts vary)

fitted by least squares; with its residual spread, the calls far above it, and the requests whose modelled time is
mostly fixed or per-descriptor cost (bound by latency or by descriptors, not by the link's bandwidth).

    otel-kvtransfer summarize spans.jsonl --links          # one row per peer, then the requests so marked
    otel-kvtransfer summarize spans.jsonl --links --json   # each peer: bandwidth (By/s), fixed_s, per_descriptor_s

One engine call is one observation: the sends one call was split into (requests or replicas sharing a batch) share
its start and end, and are put back together by peer, start and end. Memory and output are bounded whatever the
file: the first MAX_CALLS calls are kept, in flat arrays (the rest counted and said); request keys are kept once
each (at most MAX_KEYS of them, MAX_KEY_REFS references, KEYS_PER_CALL a call; what is past those is counted and
said); every peer is fitted, but only the PEERS_LISTED with the most calls are listed (`--json`), and of those the
text shows the first `limit`, then one line saying how many more there are. A pipe works (one pass).
"""

from __future__ import annotations

import json
import math
import sys
from array import array
from typing import Dict, Optional, TextIO

from otel_kvtransfer import semconv
from otel_kvtransfer.building import aggregate
from otel_kvtransfer.tools.reading import first_of_each_id
from otel_kvtransfer.tools.source import SourceError, open_source
from otel_kvtransfer.tools.spanfile import Skipped, SpanFileError, iter_spans, stderr_progress
from otel_kvtransfer.tools.text import PROG, fmt_ms, fmt_rate, json_finite, label

MAX_CALLS = 500_000
MAX_KEYS = 100_000  # distinct request keys kept (each cut to KEY_CHARS), to mark each request by what bounds it
MAX_KEY_REFS = 1 << 22  # (call, request key) pairs kept: 32 MiB
KEYS_PER_CALL = 64  # request keys a call is shared by, at most (a batch of many requests' sends)
KEY_CHARS = 200
PEERS_LISTED = 1000  # peers in the model (`--json`), the most calls first; every peer is fitted all the same
PEERS_SHOWN = 50  # peer rows of the text, by default (`--limit`)
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
    """The engine calls of a span file, in flat arrays indexed by call number: their peer, duration, bytes and
    descriptors; and the request keys sharing each call, as (call, key number) pairs (each key text kept once)."""

    def __init__(self):
        self.index = {}  # peer number << 128 | start << 64 | end -> call number
        self.peer_numbers, self.peers = {}, []  # peer -> number, and back
        self.peer_of, self.seconds = array("l"), array("d")
        self.nbytes, self.descriptors = array("q"), array("q")
        self.shared_by = array("B")  # key references of each call (at most KEYS_PER_CALL)
        self.ref_calls, self.ref_keys = array("i"), array("i")
        self.key_numbers, self.keys = {}, []  # request key -> number, and back
        self.sends = 0
        self.left_out = 0  # sends past MAX_CALLS
        self.keys_left_out = 0  # key references past MAX_KEYS / MAX_KEY_REFS / KEYS_PER_CALL
        self.failed = 0

    def add(self, span) -> None:
        peer = _key(span.attributes)
        if span.name != semconv.SPAN_SEND or peer is None:
            return
        self.sends += 1
        if span.is_error:
            self.failed += 1
            return
        peer_number = self.peer_numbers.get(peer)
        start, end = span.start_time_unix_nano, span.end_time_unix_nano
        call = None if peer_number is None else self.index.get(peer_number << 128 | start << 64 | end)
        if call is None:
            if len(self.seconds) >= MAX_CALLS:
                self.left_out += 1
                return
            if peer_number is None:
                peer_number = self.peer_numbers[peer] = len(self.peers)
                self.peers.append(peer)
            call = self.index[peer_number << 128 | start << 64 | end] = len(self.seconds)
            self.peer_of.append(peer_number)
            self.seconds.append((end - start) / 1e9)
            self.nbytes.append(0)
            self.descriptors.append(0)
            self.shared_by.append(0)
        self.nbytes[call] = min(self.nbytes[call] + _count(span.attr(semconv.BYTES)), _MAX_COUNT)
        self.descriptors[call] = min(self.descriptors[call] + _count(span.attr(semconv.DESCRIPTOR_COUNT)), _MAX_COUNT)
        key = span.attr(semconv.REQUEST_KEY)
        if key is not None:
            self._share(call, str(key)[:KEY_CHARS])

    def _share(self, call: int, key: str) -> None:
        number = self.key_numbers.get(key)
        if number is None and len(self.keys) < MAX_KEYS:
            number = self.key_numbers[key] = len(self.keys)
            self.keys.append(key)
        if number is None or self.shared_by[call] >= KEYS_PER_CALL or len(self.ref_calls) >= MAX_KEY_REFS:
            self.keys_left_out += 1
            return
        self.shared_by[call] += 1
        self.ref_calls.append(call)
        self.ref_keys.append(number)

    def by_peer(self) -> list:
        """[(peer number, array of its call numbers)], every peer (a counting sort: no per-call objects)."""
        counts = [0] * len(self.peers)
        for peer in self.peer_of:
            counts[peer] += 1
        starts, at = [], 0
        for count in counts:
            starts.append(at)
            at += count
        order = array("l", bytes(8 * len(self.peer_of)))
        fill = list(starts)
        for call, peer in enumerate(self.peer_of):
            order[fill[peer]] = call
            fill[peer] += 1
        return [(peer, order[starts[peer]:starts[peer] + counts[peer]]) for peer in range(len(self.peers))]

    def keys_of(self, calls) -> dict:
        """{call: [request keys]} of the given calls (one pass over the key references)."""
        wanted: Dict[int, list] = {call: [] for call in calls}
        if wanted:
            for call, key in zip(self.ref_calls, self.ref_keys):
                found = wanted.get(call)
                if found is not None:
                    found.append(self.keys[key])
        return wanted


_MAX_COUNT = (1 << 63) - 1


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
    groups = calls.by_peer()
    # The peers listed: the most calls first (then by address); every peer is fitted for the requests' marks.
    listed = sorted(groups, key=lambda group: (-len(group[1]), calls.peers[group[0]][0],
                                               str(calls.peers[group[0]][1])))[:PEERS_LISTED]
    listed_numbers = {peer for peer, _ in listed}
    models, rows = [None] * len(calls.peers), {}
    for peer, members in groups:
        model = fit([(calls.nbytes[c], calls.descriptors[c], calls.seconds[c]) for c in members
                     if calls.seconds[c] > 0])
        if model["bandwidth"] is not None or model["fixed_s"] is not None:
            models[peer] = model
        if peer in listed_numbers:
            rows[peer] = _peer_row(calls, peer, members, model)
    _name_far_calls(calls, rows.values())
    return {
        "file": str(path), "span_count": spans, "send_count": calls.sends, "failed_sends": calls.failed,
        "calls_left_out": calls.left_out, "request_keys_left_out": calls.keys_left_out,
        "left_out": {"torn_lines": skipped.torn.count, "spans_ending_before_they_start": skipped.backwards.count,
                     "repeated_span_ids": skipped.duplicates.count, "foreign_attributes": skipped.foreign.count},
        "peer_count": len(calls.peers),
        "peers_not_listed": len(calls.peers) - len(rows),
        "peers": [rows[peer] for peer, _ in listed],
        "requests": _bound_requests(calls, models),
        "units": {"bandwidth": "By/s", "time": "s"},
    }


def _bound_requests(calls: _Calls, models: list) -> dict:
    """Each request key marked by what most of its modelled time is, over the calls it shares."""
    parts = [array("d", bytes(8 * len(calls.keys))) for _ in range(3)]  # fixed, per-descriptor, bytes
    seen = bytearray(len(calls.keys))
    for call, key in zip(calls.ref_calls, calls.ref_keys):
        model = models[calls.peer_of[call]]
        if model is None:
            continue
        share = calls.shared_by[call]
        seen[key] = 1
        for i, part in enumerate(_modelled(model, calls.nbytes[call], calls.descriptors[call])):
            parts[i][key] += part / share
    bound: Dict[str, Dict[int, float]] = {"fixed_cost": {}, "per_descriptor": {}, "bandwidth": {}}
    counts = dict.fromkeys(bound, 0)
    for key in range(len(calls.keys)):
        if not seen[key]:
            continue
        fixed, per_descriptor, on_the_wire = parts[0][key], parts[1][key], parts[2][key]
        whole = fixed + per_descriptor + on_the_wire
        kind = "bandwidth"
        if whole > 0 and fixed / whole >= BOUND_SHARE:
            kind = "fixed_cost"
        elif whole > 0 and per_descriptor / whole >= BOUND_SHARE:
            kind = "per_descriptor"
        counts[kind] += 1
        if kind != "bandwidth":
            bound[kind][key] = max(fixed, per_descriptor) / whole if whole > 0 else 0.0
    return {kind: {"count": counts[kind],
                   "keys": [calls.keys[k] for k in sorted(keys, key=lambda k: -keys[k])[:LISTED]]}
            for kind, keys in bound.items()}


def _peer_row(calls: _Calls, peer: int, members, model) -> dict:
    residuals, far = [], []
    for call in members:
        nbytes, descriptors, seconds = calls.nbytes[call], calls.descriptors[call], calls.seconds[call]
        expected = sum(_modelled(model, nbytes, descriptors))
        if expected <= 0:
            continue
        residuals.append(abs(seconds - expected) / expected)
        if _far_above(seconds, expected):
            far.append((seconds - expected, call, {"bytes": nbytes, "descriptors": descriptors,
                                                   "duration_s": seconds, "modelled_s": expected}))
    residuals.sort()
    far.sort(key=lambda item: -item[0])
    address, port = calls.peers[peer]
    return {
        semconv.SERVER_ADDRESS: address, semconv.SERVER_PORT: port, "calls": len(members),
        "bytes": sum(calls.nbytes[c] for c in members), **model,
        "spread": {"median_relative": aggregate.quantile(residuals, 0.5) if residuals else None,
                   "p90_relative": aggregate.quantile(residuals, 0.9) if residuals else None},
        "far_above": {"count": len(far), "calls": [dict(row, call=call) for _excess, call, row in far[:SHOWN]]},
    }


def _name_far_calls(calls: _Calls, rows) -> None:
    """The request keys of the far-above calls listed (one pass over the keys for all of them)."""
    listed = [entry for row in rows for entry in row["far_above"]["calls"]]
    keys = calls.keys_of(entry["call"] for entry in listed)
    for entry in listed:
        entry["request_keys"] = sorted(keys[entry.pop("call")])[:4]


def write_json(model: dict, stream: TextIO) -> None:
    stream.write(json.dumps(json_finite(model), indent=2, allow_nan=False) + "\n")


def _ratio(value) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _peer_text_row(peer: dict) -> tuple:
    """One peer's row of the text table (format_text's columns)."""
    where = label(peer[semconv.SERVER_ADDRESS], 40) + ("" if peer[semconv.SERVER_PORT] is None
                                                       else f":{label(peer[semconv.SERVER_PORT], 8)}")
    per_descriptor = peer["per_descriptor_s"]
    return (where, str(peer["calls"]), fmt_rate(peer["bandwidth"]), fmt_ms(peer["fixed_s"]),
            "-" if per_descriptor is None else f"{per_descriptor * 1e6:.3g} us",
            _ratio(peer["spread"]["median_relative"]), _ratio(peer["spread"]["p90_relative"]),
            str(peer["far_above"]["count"]))


def format_text(model: dict, limit: Optional[int] = PEERS_SHOWN) -> str:
    """The model as text: a row for each of the first `limit` peers listed (None: all listed), then one line for
    the peers not shown."""
    shown_peers = model["peers"][:limit] if limit else model["peers"]
    lines = [f"{label(model['file'], 200)}: {model['span_count']} spans, {model['send_count']} sends "
             f"({model['failed_sends']} failed, not fitted), {model['peer_count']} peers", ""]
    header = ("peer", "calls", "bandwidth", "fixed", "per descriptor", "spread p50", "p90", "far above")
    rows = [_peer_text_row(peer) for peer in shown_peers]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)
    hidden = model["peer_count"] - len(shown_peers)
    if hidden:
        listed, not_listed = len(model["peers"]), model["peers_not_listed"]
        line = f"... {hidden} more peer{'s' if hidden > 1 else ''} not shown (these are the {len(shown_peers)} with " \
               "the most calls"
        if len(shown_peers) < listed:
            line += f"; --limit 0 shows the {listed} that --json lists"
        if not_listed:
            line += f"; {not_listed} are fitted, their requests marked, but listed nowhere"
        lines.append(line + ")")
    notes = [f"  {label(p[semconv.SERVER_ADDRESS], 40)}: {p['note']}" for p in shown_peers if p["note"]]
    if notes:
        lines += ["", "notes:"] + notes
    if model["calls_left_out"]:
        lines += ["", f"{model['calls_left_out']} sends past the first {MAX_CALLS} engine calls were not fitted"]
    if model["request_keys_left_out"]:
        lines += ["", f"{model['request_keys_left_out']} request keys of sends were not marked (past the first "
                      f"{MAX_KEYS} keys, {KEYS_PER_CALL} a call or {MAX_KEY_REFS} in all)"]
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
