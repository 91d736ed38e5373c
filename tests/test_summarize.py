"""`otel-kvtransfer summarize`: the per-request table and the per-transfer throughput distribution equal what the
spans say."""

import json
import math
import subprocess
import sys

import pytest
from test_spanfile_reader import demo_span_file, synthetic_records, to_otlp_line, write_jsonl

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.report_cli import main as report_main
from otel_kvtransfer.spanfile_reader import read_spans
from otel_kvtransfer.summarize import distribution, fmt_rate

REQUEST_FIELDS = {
    "bytes": sc.BYTES, "logical_bytes": sc.LOGICAL_BYTES, "transfer_count": sc.TRANSFER_COUNT,
    "chunk_count": sc.CHUNK_COUNT, "replica_factor": sc.REPLICA_FACTOR, "busy_s": sc.BUSY_S,
    "throughput": sc.THROUGHPUT, "compute_overlap_s": sc.COMPUTE_OVERLAP_S,
    "compute_overlap_ratio": sc.COMPUTE_OVERLAP_RATIO,
}


@pytest.fixture(scope="session")
def demo_spans():
    return demo_span_file()


def _summary_json(src, *extra, capsys):
    assert report_main(["summarize", str(src), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _check_against_spans(summary, spans):
    request_spans = {s.span_id: s for s in spans if s.name == sc.SPAN_REQUEST}
    assert summary["request_count"] == len(request_spans)
    assert summary["span_count"] == len(spans)
    for row in summary["requests"]:
        span = request_spans[row["span_id"]]
        assert row["bootstrap_room"] == span.attributes[sc.BOOTSTRAP_ROOM]
        assert row["status"] == span.status_code
        assert row["duration_s"] == span.duration_s
        for field, key in REQUEST_FIELDS.items():
            if key in span.attributes:
                assert row[field] == span.attributes[key], field
        children = [s for s in spans if s.parent_span_id == span.span_id and s.name == sc.SPAN_SEND]
        assert row["send_spans"] == len(children)
        assert row["bytes"] == sum(s.attributes[sc.BYTES] for s in children)
    sends = [s for s in spans if s.name == sc.SPAN_SEND and s.status_code != "ERROR"]
    values = sorted(s.attributes[sc.THROUGHPUT] for s in sends)
    dist = summary["transfer_throughput"]
    assert dist["count"] == len(values)
    assert dist["min"] == values[0] and dist["max"] == values[-1]
    assert math.isclose(dist["mean"], sum(values) / len(values))
    assert sum(b["count"] for b in dist["histogram"]) == len(values)
    try:
        import numpy
    except ImportError:
        return
    for q in (10, 50, 90, 99):
        assert math.isclose(dist[f"p{q}"], float(numpy.percentile(values, q)), rel_tol=1e-12)


def test_demo_summary_equals_span_attributes(demo_spans, capsys):
    summary = _summary_json(demo_spans, capsys=capsys)
    _check_against_spans(summary, read_spans(demo_spans))


def test_demo_text_summary(demo_spans, capsys):
    assert report_main(["summarize", demo_spans]) == 0
    out = capsys.readouterr().out
    spans = read_spans(demo_spans)
    for span in spans:
        if span.name == sc.SPAN_REQUEST:
            assert str(span.attributes[sc.BOOTSTRAP_ROOM]) in out
            assert fmt_rate(span.attributes[sc.THROUGHPUT]) in out
    assert "per-transfer throughput" in out and "p50" in out


def test_synthetic_summary_and_otlp_agree(tmp_path, capsys):
    records = synthetic_records(requests=5, fail_room=1002)
    native = write_jsonl(tmp_path / "n.jsonl", records)
    otlp = tmp_path / "o.json"
    otlp.write_text(to_otlp_line(records) + "\n")
    a = _summary_json(native, capsys=capsys)
    b = _summary_json(otlp, capsys=capsys)
    _check_against_spans(a, read_spans(native))
    assert a["requests"] == b["requests"] and a["transfer_throughput"] == b["transfer_throughput"]
    failed = [r for r in a["requests"] if r["status"] == "ERROR"]
    assert [r["bootstrap_room"] for r in failed] == [1002] and failed[0]["error_type"] == "TransferFailed"


def test_figures_computed_from_children_without_request_attributes(tmp_path, capsys):
    records = synthetic_records(requests=2)
    stripped = []
    expected = {}
    for record in records:
        record = json.loads(json.dumps(record))
        if record["name"] == sc.SPAN_REQUEST:
            expected[record["attributes"][sc.BOOTSTRAP_ROOM]] = dict(record["attributes"])
            record["attributes"] = {sc.BOOTSTRAP_ROOM: record["attributes"][sc.BOOTSTRAP_ROOM]}
        stripped.append(record)
    summary = _summary_json(write_jsonl(tmp_path / "s.jsonl", stripped), capsys=capsys)
    for row in summary["requests"]:
        attrs = expected[row["bootstrap_room"]]
        for field, key in REQUEST_FIELDS.items():
            assert math.isclose(row[field], attrs[key], rel_tol=1e-9), field


def test_room_filter(tmp_path, capsys):
    src = write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=4))
    summary = _summary_json(src, "--room", "1001", capsys=capsys)
    assert [r["bootstrap_room"] for r in summary["requests"]] == [1001]
    assert "1 of 4" in summary["filter"]


def test_distribution_of_one_value():
    dist = distribution([5.0])
    assert dist["count"] == 1 and dist["p50"] == 5.0 and dist["histogram"][0]["count"] == 1
    assert distribution([]) == {"count": 0}


@pytest.mark.parametrize("content, expect", [
    (b"", "empty"),
    (b"\n\n", "empty"),
    (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "00"}]}]}]}\n', ":1: "),
    (b"name,trace_id\nfoo,bar\n", ":1: invalid JSON"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, content, expect):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "otel_kvtransfer", "summarize", str(src), "--json"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expect in lines[0] and "Traceback" not in proc.stderr
