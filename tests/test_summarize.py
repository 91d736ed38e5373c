"""`otel-kvtransfer summarize`: figures equal numbers worked out by hand from spans of known bytes and intervals,
the request span's own aggregates are shown as they are, and the output is safe: valid JSON, no raw control
characters, one bounded line and exit 2 for bad input."""

import json
import subprocess
import sys

import pytest
from test_spanfile_reader import demo_span_file, span_record, synthetic_records, write_jsonl, write_otlp

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.tools.cli import main as cli_main
from otel_kvtransfer.tools.spanfile import read_spans
from otel_kvtransfer.tools.summarize import distribution

MS = 1_000_000
T = 1_800_000_000_000_000_000
TRACE, REQ = "11" * 16, "22" * 8
MIB = 1 << 20


def known_request(with_aggregates=None):
    """One request, replica factor 2, worked out by hand:
    send a: kv chunk 0 dest 0, [0, 10) ms, 10 MiB      send b: kv chunk 0 dest 1, [5, 15) ms, 10 MiB
    send c: aux chunk 1 dest 0, [20, 21) ms, 4096 B, last chunk      compute [0, 12) ms
    busy = [0, 15) + [20, 21) = 16 ms; bytes = 20 MiB + 4096 = 20,975,616; logical = every payload / 2 =
    10,487,808 (dividing only kv would give 10,489,856); throughput = 20,975,616 / 0.016 s = 1,310,976,000 By/s;
    overlap = 12 ms, ratio 0.75; last-chunk figure = 20,975,616 B / 1 ms = 20,975,616,000 By/s."""
    ident = {sc.REQUEST_KEY: "req-7", sc.FRAMEWORK: "vllm", sc.BACKEND: "nixl"}

    def send(span_id, lo, hi, nbytes, payload, chunk, dest, last=False):
        attrs = {**ident, sc.BYTES: nbytes, sc.PAYLOAD: payload, sc.CHUNK_INDEX: chunk, sc.DESTINATION_INDEX: dest,
                 sc.REPLICA_FACTOR: 2, sc.IS_LAST_CHUNK: last}
        return span_record(sc.SPAN_SEND, TRACE, span_id, REQ, T + lo * MS, T + hi * MS, attrs, kind="CLIENT")

    request_attrs = {**ident, sc.ROLE: sc.ROLE_DECODE, **(with_aggregates or {})}
    return [
        send("a1" * 8, 0, 10, 10 * MIB, "kv", 0, 0),
        send("b1" * 8, 5, 15, 10 * MIB, "kv", 0, 1),
        send("c1" * 8, 20, 21, 4096, "aux", 1, 0, last=True),
        span_record(sc.SPAN_COMPUTE, TRACE, "d1" * 8, REQ, T, T + 12 * MS, {sc.REQUEST_KEY: "req-7"}),
        span_record(sc.SPAN_REQUEST, TRACE, REQ, None, T, T + 25 * MS, request_attrs),
        span_record(sc.SPAN_SERVE, TRACE, "e1" * 8, "f1" * 8, T + 1 * MS, T + 24 * MS,
                    {sc.REQUEST_KEY: "req-7", sc.ROLE: sc.ROLE_PREFILL},
                    resource={"service.name": "prefill", "process.pid": 99}),
    ]


def _summary(src, *extra, capsys):
    assert cli_main(["summarize", str(src), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("fmt", ["jsonl", "otlp"])
def test_figures_from_children_equal_hand_computed_numbers(tmp_path, capsys, fmt):
    write = write_jsonl if fmt == "jsonl" else write_otlp
    summary = _summary(write(tmp_path / "k.jsonl", known_request()), capsys=capsys)
    (row,) = summary["requests"]
    assert row["request_key"] == "req-7" and (row["framework"], row["backend"]) == ("vllm", "nixl")
    assert row["bytes"] == 20_975_616
    assert row["logical_bytes"] == 10_487_808
    assert row["transfer_count"] == 3 and row["chunk_count"] == 2 and row["replica_factor"] == 2
    assert row["busy_s"] == pytest.approx(0.016, abs=1e-12)
    assert row["throughput"] == pytest.approx(1_310_976_000, rel=1e-12)
    assert row["compute_overlap_s"] == pytest.approx(0.012, abs=1e-12)
    assert row["compute_overlap_ratio"] == pytest.approx(0.75, rel=1e-12)
    assert row["last_chunk_rate"] == pytest.approx(20_975_616_000, rel=1e-12)
    assert row["duration_s"] == pytest.approx(0.025, abs=1e-12)
    assert (row["send_spans"], row["compute_spans"], row["peer_spans"]) == (3, 1, 1)
    # Per-transfer throughput: a and b move 10 MiB in 10 ms, c 4096 B in 1 ms.
    dist = summary["transfer_throughput"]
    assert dist["count"] == 3
    assert dist["min"] == pytest.approx(4_096_000) and dist["max"] == pytest.approx(1_048_576_000)
    assert dist["p50"] == pytest.approx(1_048_576_000)
    assert dist["p10"] == pytest.approx(4_096_000 + 0.2 * (1_048_576_000 - 4_096_000))
    assert dist["mean"] == pytest.approx((4_096_000 + 2 * 1_048_576_000) / 3)


def test_request_span_aggregates_are_shown_as_they_are(tmp_path, capsys):
    # The builder wrote these; the summary must not recompute them from the (different) children.
    own = {sc.BYTES: 123, sc.LOGICAL_BYTES: 100, sc.TRANSFER_COUNT: 9, sc.CHUNK_COUNT: 4, sc.REPLICA_FACTOR: 3,
           sc.BUSY_S: 0.5, sc.THROUGHPUT: 246.0}
    (row,) = _summary(write_jsonl(tmp_path / "a.jsonl", known_request(own)), capsys=capsys)["requests"]
    assert (row["bytes"], row["logical_bytes"], row["transfer_count"], row["chunk_count"]) == (123, 100, 9, 4)
    assert (row["replica_factor"], row["busy_s"], row["throughput"]) == (3, 0.5, 246.0)
    assert row["compute_overlap_s"] is None and row["compute_overlap_ratio"] is None


def test_peer_only_file_and_empty_figures_are_null_not_nan(tmp_path, capsys):
    records = [r for r in known_request() if r["name"] == sc.SPAN_SERVE]
    src = write_jsonl(tmp_path / "peer.jsonl", records)
    assert cli_main(["summarize", src, "--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in JSON output"))
    (row,) = summary["requests"]
    assert row["request_key"] == "req-7" and row["peer_spans"] == 1
    assert row["bytes"] is None and row["throughput"] is None and row["last_chunk_rate"] is None
    assert summary["transfer_throughput"] == {"count": 0}


def test_key_filter_and_framework_in_text(tmp_path, capsys):
    src = write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=4))
    summary = _summary(src, "--key", "1001", capsys=capsys)
    assert [r["request_key"] for r in summary["requests"]] == ["1001"] and "1 of 4" in summary["filter"]
    assert cli_main(["summarize", src]) == 0
    out = capsys.readouterr().out
    assert out.count("sglang/mooncake") == 4 and "per-transfer throughput" in out


def test_control_characters_never_reach_the_terminal(tmp_path, capsys):
    records = known_request()
    for record in records:
        record["attributes"][sc.REQUEST_KEY] = "\x1b]0;owned\x07\x1b[2J"
        record["attributes"][sc.FRAMEWORK] = "\x9b31m"
    src = write_jsonl(tmp_path / "esc.jsonl", records)
    assert cli_main(["summarize", src]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out
    assert "\\x1b]0;owned" in out


def test_distribution_of_one_value_and_none():
    dist = distribution([5.0])
    assert dist["count"] == 1 and dist["p50"] == 5.0 and dist["histogram"][0]["count"] == 1
    assert distribution([]) == {"count": 0}


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "otel_kvtransfer", *args], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.parametrize("content, expect", [
    (b"", "empty"),
    (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "00"}]}]}]}\n', ":1: "),
    (b"name,trace_id\nfoo,bar\n", ":1: invalid JSON"),
    (b"[       " * 100_000 + b"\n", ":1: invalid JSON: nested too deeply"),
    (b"[" * 100_000 + b"\n", ":1: 100000 JSON objects and lists in 100001 bytes: denser"),
    (b'{"name":"x","trace_id":"' + b"ab" * 16 + b'","span_id":"' + b"cd" * 8
     + b'","start_time_unix_nano":1,"end_time_unix_nano":2,"attributes":{"kv_transfer.bytes":1e999}}\n', ":1: "),
    (b'{"hello": "x", "' + b"\\u001b[31m" * 1_000_000 + b'": 1}\n', ":1: not a span"),
], ids=["empty", "bare OTLP span", "csv", "deep nesting", "dense nesting", "1e999", "10 MB escape key"])
def test_bad_input_is_one_bounded_line_and_exit_2(tmp_path, content, expect):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(content)
    proc = _run_cli("summarize", str(src), "--json")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expect in lines[0] and "Traceback" not in proc.stderr, proc.stderr[-600:]
    assert len(lines[0]) < 600 and "\x1b" not in lines[0]


@pytest.mark.parametrize("option", [["--since", "nan"], ["--until", "inf"], ["--limit", "-1"]])
def test_bad_options_are_one_line_and_exit_2(tmp_path, option):
    src = write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=1))
    proc = _run_cli("summarize", src, *option)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and option[0] in lines[0], proc.stderr


def test_demo_summary_shows_the_request_spans_figures(capsys):
    path = demo_span_file()
    summary = _summary(path, capsys=capsys)
    requests = {s.attributes[sc.REQUEST_KEY]: s for s in read_spans(path) if s.name == sc.SPAN_REQUEST}
    assert summary["request_count"] == len(requests) >= 3
    for row in summary["requests"]:
        attrs = requests[row["request_key"]].attributes
        for field, key in (("bytes", sc.BYTES), ("logical_bytes", sc.LOGICAL_BYTES), ("busy_s", sc.BUSY_S),
                           ("throughput", sc.THROUGHPUT), ("transfer_count", sc.TRANSFER_COUNT)):
            assert row[field] == attrs[key], field
        assert row["send_spans"] == attrs[sc.TRANSFER_COUNT]
