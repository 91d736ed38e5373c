"""Span files of the sizes docs/tools.md states as supported, and the generator that makes them.

The generator writes OTLP-JSON as `OtlpJsonFileSpanExporter` does (one export request of up to 512 spans a line)
straight from text templates, so files of 10^6 spans take seconds to make. Its requests have known figures, which
the tests check at small scale; the measurements in docs/tools.md come from the same generator:

    python tests/test_tools_sizes.py requests FILE --requests 100000      # 10^6 spans (10 a request)
    python tests/test_tools_sizes.py overlap FILE --sends 5000            # one request, 5,000 overlapping sends
"""

import argparse
import gc
import json
import sys

import pytest

from otel_kvtransfer.tools.cli import main as cli_main
from otel_kvtransfer.tools.reading import load
from otel_kvtransfer.tools.spanfile import Span

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
