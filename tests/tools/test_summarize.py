"""`otel-kvtransfer summarize`: figures equal numbers worked out by hand from spans of known bytes and intervals,
the request span's own aggregates are shown as they are, and the output is safe: valid JSON, no raw control
characters, one bounded line and exit 2 for bad input."""

import json
import re
import subprocess
import sys

import pytest
from support.span_files import demo_span_file, span_record, synthetic_records, write_jsonl, write_otlp

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.cli import main as cli_main
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
    # The tail: last byte at 21 ms, compute ends at 12 ms: 9 ms, of which [12, 15) and [20, 21) moved bytes.
    assert row["tail_s"] == pytest.approx(0.009, abs=1e-12)
    assert row["tail_busy_s"] == pytest.approx(0.004, abs=1e-12)
    assert row["tail_queued_s"] == pytest.approx(0.005, abs=1e-12)
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


def _cell(out: str, key: str, column: str) -> str:
    """The cell of `column` in the text table's row of request `key`, cut where the dashed rule under the header
    says the column is."""
    lines = out.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("-") and set(line) <= {"-", " "})
    spans = [m.span() for m in re.finditer(r"-+", lines[rule])]
    names = [lines[rule - 1][a:b].strip() for a, b in spans]
    row = next(line for line in lines[rule + 1:] if line[spans[0][0]:spans[0][1]].strip() == key)
    a, b = spans[names.index(column)]
    return row[a:b].strip()


def test_tail_columns_in_the_table(tmp_path, capsys):
    src = write_jsonl(tmp_path / "k.jsonl", known_request())
    assert cli_main(["summarize", src]) == 0
    out = capsys.readouterr().out
    assert _cell(out, "req-7", "tail**") == "9.00 ms" and _cell(out, "req-7", "queued") == "5.00 ms"
    assert "** tail: end of the last send - end of the last compute" in out


def test_tail_is_dash_and_null_without_compute(tmp_path, capsys):
    records = [r for r in known_request() if r["name"] != sc.SPAN_COMPUTE]
    src = write_jsonl(tmp_path / "nc.jsonl", records)
    (row,) = _summary(src, capsys=capsys)["requests"]
    assert row["busy_s"] == pytest.approx(0.016, abs=1e-12)  # the sends are known...
    assert row["tail_s"] is None and row["tail_busy_s"] is None and row["tail_queued_s"] is None  # ...compute not
    assert cli_main(["summarize", src]) == 0
    out = capsys.readouterr().out
    assert _cell(out, "req-7", "tail**") == "-" and _cell(out, "req-7", "queued") == "-"


def test_tail_is_zero_when_the_last_byte_left_before_compute_ended(tmp_path, capsys):
    records = known_request()
    for record in records:
        if record["name"] == sc.SPAN_COMPUTE:
            record["end_time_unix_nano"] = T + 30 * MS  # compute outlasts every send (last byte at 21 ms)
    (row,) = _summary(write_jsonl(tmp_path / "z.jsonl", records), capsys=capsys)["requests"]
    assert (row["tail_s"], row["tail_busy_s"], row["tail_queued_s"]) == (0.0, 0.0, 0.0)
    assert row["compute_overlap_s"] == pytest.approx(0.016, abs=1e-12)


def test_tail_of_the_span_is_shown_as_it_is(tmp_path, capsys):
    own = {sc.BYTES: 123, sc.BUSY_S: 0.5, sc.THROUGHPUT: 246.0, sc.COMPUTE_OVERLAP_S: 0.1,
           sc.COMPUTE_OVERLAP_RATIO: 0.2, sc.TAIL_S: 0.25, sc.TAIL_BUSY_S: 0.05, sc.TAIL_QUEUED_S: 0.2}
    (row,) = _summary(write_jsonl(tmp_path / "own.jsonl", known_request(own)), capsys=capsys)["requests"]
    assert (row["tail_s"], row["tail_busy_s"], row["tail_queued_s"]) == (0.25, 0.05, 0.2)


def _brute_tail(spans):
    """The tail worked out without aggregate: cut time at every span boundary and test each elementary piece."""
    sends = [(s.start_time_unix_nano, s.end_time_unix_nano) for s in spans if s.name == sc.SPAN_SEND]
    compute_end = max(s.end_time_unix_nano for s in spans if s.name == sc.SPAN_COMPUTE)
    last_byte = max(end for _start, end in sends)
    if last_byte <= compute_end:
        return 0, 0
    cuts = sorted({compute_end, last_byte} | {t for pair in sends for t in pair if compute_end < t < last_byte})
    busy = sum(hi - lo for lo, hi in zip(cuts, cuts[1:]) if any(a <= lo and hi <= b for a, b in sends))
    return last_byte - compute_end, busy


def test_tail_of_every_request_equals_a_brute_force_count(tmp_path, capsys):
    records = synthetic_records(requests=12, seed=3)
    src = write_jsonl(tmp_path / "s.jsonl", records)
    by_key = {}
    for span in read_spans(src):
        if span.name in (sc.SPAN_SEND, sc.SPAN_COMPUTE):
            by_key.setdefault(span.attributes[sc.REQUEST_KEY], []).append(span)
    rows = _summary(src, capsys=capsys)["requests"]
    assert len(rows) == 12
    nonzero = 0
    for row in rows:
        tail_ns, busy_ns = _brute_tail(by_key[row["request_key"]])
        nonzero += tail_ns > 0
        assert row["tail_s"] == pytest.approx(tail_ns / 1e9, abs=1e-12)
        assert row["tail_busy_s"] == pytest.approx(busy_ns / 1e9, abs=1e-12)
        assert row["tail_queued_s"] == pytest.approx((tail_ns - busy_ns) / 1e9, abs=1e-12)
    assert nonzero >= 6  # the generator sends after compute: most requests have a tail to check


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
        for field, key in (("tail_s", sc.TAIL_S), ("tail_busy_s", sc.TAIL_BUSY_S),
                           ("tail_queued_s", sc.TAIL_QUEUED_S)):
            assert row[field] == attrs[key], field  # the demo computes, so its requests have a tail
        assert row["send_spans"] == attrs[sc.TRANSFER_COUNT]


@pytest.mark.parametrize("value", ["'abc'", "-5", "true"])
def test_a_tail_figure_that_is_not_a_number_is_one_line_and_exit_2(tmp_path, value):
    own = {sc.BYTES: 123, sc.BUSY_S: 0.5, sc.THROUGHPUT: 246.0, sc.TAIL_S: "@"}
    text = "".join(json.dumps(r) + "\n" for r in known_request(own)).replace('"@"', value.replace("'", '"'))
    src = tmp_path / "bad-tail.jsonl"
    src.write_text(text)
    proc = _run_cli("summarize", str(src))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert len(lines) == 1 and f"{sc.TAIL_S} must be a finite number >= 0" in lines[0], proc.stderr
