"""The span-file reader: OTLP-JSON (through opentelemetry-proto) and the older JSON lines into one model, and one
clear error naming the line for bad or hostile input. The span files and records are support/span_files.py's.
"""

import base64
import json
import os

import pytest
from support.span_files import demo_span_file, otlp_request, synthetic_records, write_jsonl, write_otlp

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.tools.spanfile import Skipped, SpanFileError, iter_spans, read_spans


def _same(a, b):
    assert (a.name, a.trace_id, a.span_id, a.parent_span_id, a.kind) == \
        (b.name, b.trace_id, b.span_id, b.parent_span_id, b.kind)
    assert (a.start_time_unix_nano, a.end_time_unix_nano, a.status_code) == \
        (b.start_time_unix_nano, b.end_time_unix_nano, b.status_code)
    assert a.attributes == b.attributes and a.resource == b.resource


def test_jsonl_format_reads_every_field(tmp_path):
    records = synthetic_records(requests=2)
    spans = read_spans(write_jsonl(tmp_path / "s.jsonl", records))
    assert len(spans) == len(records)
    for span, record in zip(spans, records):
        assert span.name == record["name"]
        assert (span.trace_id, span.span_id, span.parent_span_id) == \
            (record["trace_id"], record["span_id"], record["parent_span_id"])
        assert span.kind == record["kind"]
        assert (span.start_time_unix_nano, span.end_time_unix_nano) == \
            (record["start_time_unix_nano"], record["end_time_unix_nano"])
        assert span.status_code == record["status"]["code"]
        assert span.attributes == record["attributes"] and span.resource == record["resource"]
        assert span.scope_name == "otel_kvtransfer"


def test_otlp_json_reads_like_the_jsonl_format(tmp_path):
    records = synthetic_records(requests=3)
    jsonl = read_spans(write_jsonl(tmp_path / "n.jsonl", records))
    otlp = read_spans(write_otlp(tmp_path / "o.jsonl", records, per_line=7))
    assert len(otlp) == len(jsonl) == len(records)
    for a, b in zip(sorted(jsonl, key=lambda s: s.span_id), sorted(otlp, key=lambda s: s.span_id)):
        _same(a, b)
    assert {s.line for s in otlp} == set(range(1, (len(records) + 6) // 7 + 1))
    failed = [s for s in otlp if s.status_code == "ERROR"]
    assert not failed  # no failure asked for


def test_otlp_base64_ids_and_enum_names_are_accepted(tmp_path):
    record = synthetic_records(requests=1)[0]
    data = otlp_request([record])
    span = data["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["traceId"] = base64.b64encode(bytes.fromhex(record["trace_id"])).decode()
    span["spanId"] = base64.b64encode(bytes.fromhex(record["span_id"])).decode()
    span["kind"] = "SPAN_KIND_CLIENT"
    path = tmp_path / "b64.json"
    path.write_text(json.dumps(data) + "\n")
    (parsed,) = read_spans(path)
    assert (parsed.trace_id, parsed.span_id, parsed.kind) == (record["trace_id"], record["span_id"], "CLIENT")


def _error_of(path):
    with pytest.raises(SpanFileError) as info:
        read_spans(path)
    return info.value


def test_empty_truncated_foreign_and_binary_files_name_the_line(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text("\n\n  \n")
    assert "empty" in str(_error_of(path)) and str(path) in str(_error_of(path))
    records = synthetic_records(requests=1)
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(text[: len(text) - 40])  # a crash cut the last line: it is skipped, the rest is read
    skipped = Skipped()
    assert len(read_spans(path, skipped=skipped)) == len(records) - 1
    assert skipped.lines == [len(records)] and "\n" not in skipped.message(str(path))
    path.write_bytes(text.encode() + b"\x00" * 4096)  # a crash on some filesystems leaves zeros at the end
    skipped = Skipped()
    assert len(read_spans(path, skipped=skipped)) == len(records) and skipped.lines == [len(records) + 1]
    path.write_text(text[:40])  # nothing but a cut line: not a span file
    error = _error_of(path)
    assert error.line == 1 and "cut short" in str(error) and "\n" not in str(error)
    path.write_text(json.dumps(records[0]) + "\n" + json.dumps({"hello": "world"}) + "\n")
    assert _error_of(path).line == 2 and "not a span" in str(_error_of(path))
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    assert _error_of(path).line == 1
    assert "no such file" in str(_error_of(tmp_path / "nope.jsonl"))
    assert "directory" in str(_error_of(tmp_path))


def test_bad_fields_name_the_line(tmp_path):
    records = synthetic_records(requests=1)
    for change, words in ((("start_time_unix_nano", 0), "start time"),
                          (("trace_id", "xyz"), "trace_id")):
        bad = dict(records[1], **dict([change]))
        error = _error_of(write_jsonl(tmp_path / "bad.jsonl", [records[0], bad]))
        assert error.line == 2 and words in str(error)


HOSTILE_JSONL = [
    ('{"name":"kv_transfer.send","trace_id":"%s","span_id":"%s","start_time_unix_nano":1,'
     '"end_time_unix_nano":2,"attributes":{"kv_transfer.bytes":NaN}}', "NaN"),
    ('{"name":"kv_transfer.send","trace_id":"%s","span_id":"%s","start_time_unix_nano":1,'
     '"end_time_unix_nano":2,"attributes":{"kv_transfer.bootstrap_room":Infinity}}', "Infinity"),
    ('{"name":"kv_transfer.send","trace_id":"%s","span_id":"%s","start_time_unix_nano":1,'
     '"end_time_unix_nano":2,"attributes":{"kv_transfer.chunk_index":1e999}}', "out of range"),
    ('{"name":"kv_transfer.send","trace_id":"%s","span_id":"%s","start_time_unix_nano":1,'
     '"end_time_unix_nano":2,"attributes":{"kv_transfer.bytes":"many"}}', "kv_transfer.bytes"),
    ('{"name":"kv_transfer.send","trace_id":"%s","span_id":"%s","start_time_unix_nano":1,'
     '"end_time_unix_nano":2,"scope":"x"}', "scope"),
    ('{"name":"kv_transfer.send","trace_id":"%s","span_id":"%s","start_time_unix_nano":1,'
     '"end_time_unix_nano":2,"resource":"x"}', "resource"),
    ('{"name":"kv_transfer.send","trace_id":"%s","span_id":"%s","start_time_unix_nano":1,'
     '"end_time_unix_nano":2,"attributes":{"k":"\\ud800"}}', "surrogate"),
]


@pytest.mark.parametrize("template, words", HOSTILE_JSONL)
def test_hostile_jsonl_values_are_one_clear_error(tmp_path, template, words):
    good = synthetic_records(requests=1)[0]
    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps(good) + "\n" + template % ("ab" * 16, "cd" * 8) + "\n")
    error = _error_of(path)
    assert error.line == 2 and words in str(error), str(error)


def _otlp_with(mutate):
    data = otlp_request(synthetic_records(requests=1)[:2])
    mutate(data)
    return json.dumps(data)


def _set_attr(key, value):
    def mutate(data):
        data["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"].append({"key": key, "value": value})
    return mutate


HOSTILE_OTLP = {
    "double NaN busy_s": (_set_attr(sc.BUSY_S, {"doubleValue": "NaN"}), sc.BUSY_S),
    "1e999 int": (_set_attr(sc.CHUNK_INDEX, {"intValue": "1e999"}), ":2: "),
    "string bytes": (_set_attr(sc.BYTES, {"stringValue": "9"}), sc.BYTES),
    "non-string key": (_set_attr(5, {"intValue": "1"}), ":2: "),
    "resource x": (lambda d: d["resourceSpans"][0].update(resource="x"), ":2: "),
    "scope x": (lambda d: d["resourceSpans"][0]["scopeSpans"][0].update(scope="x"), ":2: "),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_OTLP))
def test_hostile_otlp_values_are_one_clear_error(tmp_path, case):
    mutate, words = HOSTILE_OTLP[case]
    path = tmp_path / "h.json"
    path.write_text(json.dumps(otlp_request(synthetic_records(requests=1)[:1])) + "\n" + _otlp_with(mutate) + "\n")
    error = _error_of(path)
    assert error.line == 2 and words in str(error), str(error)
    assert len(str(error)) < 600


def test_deep_nesting_and_huge_values_are_bounded(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text("[       " * 100_000 + "\n")  # one list per 8 bytes: as dense as the reader decodes
    error = _error_of(path)
    assert error.line == 1 and "nested too deeply" in str(error)
    path.write_text("[" * 100_000 + "\n")  # denser: refused before decoding
    error = _error_of(path)
    assert error.line == 1 and "denser than any span exporter writes" in str(error)
    path.write_text(json.dumps({"hello": "x", "y" * 10_000_000: 1}) + "\n")
    error = _error_of(path)
    assert error.line == 1 and len(str(error)) < 600


def test_progress_is_reported_for_long_reads(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=40))
    calls = []
    spans = list(iter_spans(path, progress=lambda done, total, n: calls.append((done, total, n))))
    size = os.path.getsize(path)
    assert calls and calls[-1] == (size, size, len(spans))
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)


def test_demo_span_file_reads():
    spans = read_spans(demo_span_file())
    names = {s.name for s in spans}
    assert {sc.SPAN_REQUEST, sc.SPAN_SEND} <= names
    for span in spans:
        assert len(span.trace_id) == 32 and len(span.span_id) == 16
        assert span.end_time_unix_nano >= span.start_time_unix_nano
        if span.name in (sc.SPAN_REQUEST, sc.SPAN_SEND):
            assert isinstance(span.attributes[sc.REQUEST_KEY], str)
    assert len([s for s in spans if s.name == sc.SPAN_REQUEST]) >= 3


def test_repeated_otlp_attribute_values_keep_their_types(tmp_path):
    records = synthetic_records(requests=1)[:4]
    values = ["1", 1, 1.0, True]
    for record, value in zip(records, values):
        record["attributes"]["x.same"] = value
    spans = read_spans(write_otlp(tmp_path / "t.jsonl", records + records, per_line=4))
    got = [s.attributes["x.same"] for s in spans]
    assert got == values + values
    assert [type(v) for v in got] == [type(v) for v in values + values]


def test_a_span_that_ends_before_it_starts_is_skipped_and_the_rest_of_its_line_read(tmp_path):
    """A backwards step of the wall clock: one span of a line ends before it starts. The reader leaves out that
    span only and counts it with its line; `warnings` says so in one line."""
    records = synthetic_records(requests=2)
    records[3]["end_time_unix_nano"] = records[3]["start_time_unix_nano"] - 3600 * 10**9
    records[9]["end_time_unix_nano"] = records[9]["start_time_unix_nano"] - 1
    path = write_otlp(tmp_path / "back.jsonl", records, per_line=4)
    skipped = Skipped()
    spans = read_spans(path, skipped=skipped)
    assert [s.span_id for s in spans] == [r["span_id"] for i, r in enumerate(records) if i not in (3, 9)]
    assert (skipped.backwards.count, skipped.backwards.lines, skipped.count) == (2, [1, 3], 0)
    (line,) = skipped.warnings(path)
    assert "skipped 2 spans that end before they start (lines 1, 3)" in line and "\n" not in line

