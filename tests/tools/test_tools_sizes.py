"""Span files of the sizes docs/tools.md states as supported, and the generator that makes them.

The generator writes OTLP-JSON as `OtlpJsonFileSpanExporter` does (one export request of up to 512 spans a line)
straight from text templates, so files of 10^6 spans take seconds to make. Its requests have known figures, which
the tests check at small scale; the measurements in docs/tools.md come from the same generator:

    python tests/tools/test_tools_sizes.py requests FILE --requests 100000      # 10^6 spans (10 a request)
    python tests/tools/test_tools_sizes.py overlap FILE --sends 5000            # one request, 5,000 overlapping sends
"""

import argparse
import gc
import json
import random
import re
import sys
import tracemalloc

import pytest

from otel_kvtransfer.cli import main as cli_main
from otel_kvtransfer.tools.reading import load
from otel_kvtransfer.tools.requests import DRAWN_PER_REQUEST
from otel_kvtransfer.tools.span_ids import SpanIds
from otel_kvtransfer.tools.spanfile import Span
from otel_kvtransfer.tools.timeline.drawing import LEFT, RIGHT, WIDTH

T0 = 1_700_000_000_000_000_000
BATCH = 512
SEND_BYTES = 1 << 20
SENDS = 8  # per request in `requests_file`: 8 sends of 1 MiB, each 1 ms, back to back; busy 8 ms


def _attr(key, value):
    if isinstance(value, int):
        return '{"key":"%s","value":{"intValue":"%d"}}' % (key, value)
    if isinstance(value, float):
        return '{"key":"%s","value":{"doubleValue":%r}}' % (key, value)
    return '{"key":"%s","value":{"stringValue":"%s"}}' % (key, value)


def _span(trace, span_id, parent, name, kind, start, end, attrs):
    return ('{"traceId":"%032x","spanId":"%016x"%s,"name":"%s","kind":%d,"startTimeUnixNano":"%d",'
            '"endTimeUnixNano":"%d","attributes":[%s],"status":{}}'
            % (trace, span_id, ',"parentSpanId":"%016x"' % parent if parent else "", name, kind, start, end,
               ",".join(_attr(k, v) for k, v in attrs.items())))


def _write_batches(path, spans):
    head = ('{"resourceSpans":[{"resource":{"attributes":[%s,%s]},"scopeSpans":[{"scope":{"name":"otel_kvtransfer"},'
            '"spans":[' % (_attr("service.name", "prefill"), _attr("process.pid", 4242)))
    count = 0
    with open(path, "w", encoding="utf-8") as handle:
        batch = []
        for span in spans:
            batch.append(span)
            count += 1
            if len(batch) == BATCH:
                handle.write(head + ",".join(batch) + "]}]}]}\n")
                batch = []
        if batch:
            handle.write(head + ",".join(batch) + "]}]}]}\n")
    return count


def _request_spans(requests):
    """Per request: 8 sends then its request span (with the builder's aggregates) and one compute span."""
    for number in range(requests):
        trace, req, key = number + 1, (number + 1) << 8, str(number)
        t = T0 + number * 20_000_000
        common = {"kv_transfer.request_key": key, "kv_transfer.framework": "sglang", "kv_transfer.backend": "mooncake"}
        for index in range(SENDS):
            yield _span(trace, req + index + 1, req, "kv_transfer.send", 3, t + index * 1_000_000,
                        t + (index + 1) * 1_000_000,
                        {**common, "kv_transfer.bytes": SEND_BYTES, "kv_transfer.payload": "kv",
                         "kv_transfer.chunk_index": index // 2, "kv_transfer.destination_index": index % 2,
                         "kv_transfer.replica_factor": 2, "kv_transfer.throughput": SEND_BYTES * 1000.0})
        yield _span(trace, req + 100, req, "kv_transfer.compute", 1, t, t + 4_000_000,
                    {"kv_transfer.request_key": key})
        yield _span(trace, req, 0, "kv_transfer.request", 1, t, t + 9_000_000,
                    {**common, "kv_transfer.bytes": SENDS * SEND_BYTES,
                     "kv_transfer.logical_bytes": SENDS * SEND_BYTES // 2,
                     "kv_transfer.transfer_count": SENDS, "kv_transfer.chunk_count": SENDS // 2,
                     "kv_transfer.replica_factor": 2, "kv_transfer.busy_s": 0.008,
                     "kv_transfer.throughput": SENDS * SEND_BYTES / 0.008})


def requests_file(path, requests):
    """`requests` requests of 10 spans each; returns the span count."""
    return _write_batches(path, _request_spans(requests))


def overlap_file(path, sends):
    """One request (no aggregates on its span) whose `sends` sends all overlap: each starts 1 us after the last
    and lasts 1 s."""
    common = {"kv_transfer.request_key": "big"}
    spans = [_span(1, 10 + i, 1, "kv_transfer.send", 3, T0 + i * 1000, T0 + i * 1000 + 10**9,
                   {**common, "kv_transfer.bytes": SEND_BYTES, "kv_transfer.payload": "kv",
                    "kv_transfer.destination_index": 0}) for i in range(sends)]
    spans.append(_span(1, 1, 0, "kv_transfer.request", 1, T0, T0 + 2 * 10**9, common))
    return _write_batches(path, spans)


def test_generated_requests_read_with_their_known_figures(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    assert requests_file(path, 120) == 1200
    assert cli_main(["summarize", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["span_count"] == 1200 and summary["request_count"] == 120
    for row in summary["requests"]:
        assert (row["bytes"], row["logical_bytes"], row["busy_s"]) == (8 << 20, 4 << 20, 0.008)
        assert row["send_spans"] == 8 and row["compute_spans"] == 1
    assert summary["transfer_throughput"]["count"] == 960
    assert summary["transfer_throughput"]["p50"] == pytest.approx(SEND_BYTES * 1000.0)


def test_overlapping_sends_compute_busy_time_from_children(tmp_path):
    path = tmp_path / "o.jsonl"
    overlap_file(path, 1000)
    (request,) = load(str(path)).requests
    figures = request.figures()
    # 1000 sends, each 1 s, starts 1 us apart: the union is 1 s + 999 us.
    assert figures["busy_s"] == pytest.approx(1.000999, abs=1e-12)
    assert figures["bytes"] == 1000 * SEND_BYTES and figures["transfer_count"] == 1000


def test_summarize_keeps_aggregates_not_spans(tmp_path):
    """A streamed summary holds per-request aggregates: once read, no send, compute or request span is alive
    (only the peers' waiting spans, which are few, are kept to be matched at the end)."""
    path = tmp_path / "many.jsonl"
    _write_batches(path, (s for r in range(20) for s in _sends(r, 100)))
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, Span)}  # other tests' session fixtures hold some
    loaded = load(str(path))
    assert len(loaded.requests) == 20 and loaded.span_count == 2000
    gc.collect()
    assert sum(1 for o in gc.get_objects() if isinstance(o, Span) and id(o) not in before) == 0


def disjoint_file(path, sends, compute=False, order=None):
    """One request (no aggregates on its span) of `sends` disjoint sends, each 1 us long and 1 us after the last
    (in `order` of their indexes when given); with `compute`, a compute span before them all."""
    common = {"kv_transfer.request_key": "big"}
    order = range(sends) if order is None else order
    spans = [_span(1, 10 + i, 1, "kv_transfer.send", 3, T0 + 10**6 + 2000 * i, T0 + 10**6 + 2000 * i + 1000,
                   {**common, "kv_transfer.bytes": 4096, "kv_transfer.payload": "kv"}) for i in order]
    if compute:
        spans.append(_span(1, 5, 1, "kv_transfer.compute", 1, T0, T0 + 10**6, common))
    spans.append(_span(1, 1, 0, "kv_transfer.request", 1, T0, T0 + 10**6 + 2000 * sends, common))
    return _write_batches(path, spans)


def test_one_request_of_many_sends_draws_a_bounded_page(tmp_path, capsys):
    """20,000 sends of one request: the page draws DRAWN_PER_REQUEST of them and says how many it left out (in
    the block and in one line on stderr), its busy strip has at most a bar per pixel, the Perfetto file holds the
    drawn sends and says how many are not; the figures still count every send."""
    sends = 20_000
    path = tmp_path / "many.jsonl"
    disjoint_file(path, sends)
    html, trace = tmp_path / "t.html", tmp_path / "t.json"
    assert cli_main(["timeline", str(path), "--no-png", "--html", str(html), "--perfetto", str(trace)]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    left = sends - DRAWN_PER_REQUEST
    assert len(err) == 1 and f"{left} spans not drawn (the first {DRAWN_PER_REQUEST} by start" in err[0], err
    page = html.read_text()
    assert len(re.findall(r'<rect [^>]*class="send payload-kv', page)) == DRAWN_PER_REQUEST
    assert f"+{left} of {sends} sends not drawn" in page
    assert len(re.findall(r'<rect [^>]*class="busy"', page)) <= WIDTH - LEFT - RIGHT
    assert f"{sends} transfers" in page  # the overview and the header count them all
    assert html.stat().st_size < 600_000  # 380 bytes a send drawn: 7.6 MB for these before the bound
    data = json.loads(trace.read_text())
    drawn = [e for e in data["traceEvents"] if e["ph"] == "X" and e["args"].get("span.name") == "kv_transfer.send"]
    assert len(drawn) == DRAWN_PER_REQUEST and data["otherData"]["spans_not_drawn"] == left
    assert trace.stat().st_size < 600_000


def test_drawing_a_huge_request_holds_only_the_sends_it_draws(tmp_path):
    """The second pass keeps the first N sends by start (whatever the file order), not every send of the
    request: the Span objects alive after it are those N and the request span."""
    sends, limit = 5000, 40
    order = list(range(sends))
    random.Random(3).shuffle(order)
    path = tmp_path / "shuffled.jsonl"
    disjoint_file(path, sends, compute=True, order=order)
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, Span)}
    loaded = load(str(path), drawing=True, max_children=limit)
    (request,) = loaded.shown
    gc.collect()
    alive = sum(1 for o in gc.get_objects() if isinstance(o, Span) and id(o) not in before)
    assert alive == limit + 2  # the sends drawn, the compute span and the request span
    assert [s.span_id for s in request.sends] == [f"{10 + i:016x}" for i in range(limit)]
    assert (request.sends_not_drawn, request.computes_not_drawn) == (sends - limit, 0)
    # the busy strip and the tail come from every send: the last byte is the last send's, every gap counted
    assert len(request.busy_intervals()) == sends
    mark = request.tail_mark()
    assert mark.last_byte_ns == T0 + 10**6 + 2000 * (sends - 1) + 1000
    assert mark.tail_s == pytest.approx((2000 * (sends - 1) + 1000) / 1e9)


def test_span_ids_cost_machine_integers_not_objects():
    """The identities a read remembers to leave out repeats: exact for these (no repeat where none is), and at
    most 32 bytes each (a table of machine integers, at most half full after growing): measured as all the memory
    the remembered identities hold once the strings they were read from are gone."""
    count = 100_000
    tracemalloc.start()
    try:
        ids = SpanIds()
        assert not any(ids.seen(f"{i:032x}", f"{i:016x}") for i in range(count))
        assert not any(ids.seen(f"{i + 1:032x}", f"{i:016x}") for i in range(0, count, 7))  # same span, other trace
        assert all(ids.seen(f"{i:032x}", f"{i:016x}") for i in range(count))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(ids) == count + len(range(0, count, 7))
    assert held <= 32 * len(ids)


def _sends(number, count):
    common = {"kv_transfer.request_key": str(number), "kv_transfer.bytes": 4096}
    t = T0 + number * 10**9
    return [_span(number + 1, (number << 16) + i + 1, 0, "kv_transfer.send", 3, t + i * 2000, t + i * 2000 + 1000,
                  common) for i in range(count)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write a generated span file (OTLP-JSON)")
    parser.add_argument("kind", choices=("requests", "overlap"))
    parser.add_argument("file")
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--sends", type=int, default=5000)
    args = parser.parse_args()
    n = requests_file(args.file, args.requests) if args.kind == "requests" else overlap_file(args.file, args.sends)
    print(f"{args.file}: {n} spans", file=sys.stderr)
