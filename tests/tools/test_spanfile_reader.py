"""The span-file reader: OTLP-JSON (through opentelemetry-proto) and the older JSON lines into one model, and one
clear error naming the line for bad or hostile input.

Also home of the helpers the other tool tests share: `demo_span_file()` (a span file from a real
`otel-kvtransfer demo` run, made once per session), `synthetic_records()` (spans of the JSON-lines format for the
sizes and faults a demo run does not produce), `write_jsonl()` and `write_otlp()` (the same records as OTLP-JSON,
built with the proto messages).
"""

import atexit
import base64
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status
from support.parts import require_part

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.tools.spanfile import Skipped, SpanFileError, iter_spans, read_spans

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEMO = {}
T0 = 1_700_000_000_000_000_000


def demo_span_file() -> str:
    """Path of a span file written by a real demo run (`--requests 3`), made once per test session."""
    if "path" in _DEMO:
        return _DEMO["path"]
    if "error" in _DEMO:
        pytest.fail(_DEMO["error"])
    try:
        import mooncake.engine  # noqa: F401  imported only to see that the engine loads
    except Exception:
        require_part(False, "the Mooncake engine (mooncake-transfer-engine-non-cuda + libibverbs1)")
    out_dir = tempfile.mkdtemp(prefix="kvt-demo-")
    atexit.register(shutil.rmtree, out_dir, True)
    path = os.path.join(out_dir, "spans.jsonl")
    cmd = [sys.executable, "-m", "otel_kvtransfer", "demo", "--requests", "3", "--out-dir", out_dir]
    proc = subprocess.Popen(cmd, cwd=out_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate(timeout=10)
        _DEMO["error"] = "the demo did not finish in 240 s"
        pytest.fail(_DEMO["error"])
    if proc.returncode != 0 or not os.path.exists(path):
        _DEMO["error"] = f"demo failed (rc {proc.returncode}): {output[-2000:]}"
        pytest.fail(_DEMO["error"])
    _DEMO["path"] = path
    return path


# --------------------------------------------------------------------------------------------------- synthetic


def _hex(rng, digits):
    return "".join(rng.choice("0123456789abcdef") for _ in range(digits))


def span_record(name, trace_id, span_id, parent, start, end, attributes, resource=None, status="UNSET",
                kind="INTERNAL", description=None):
    """One span in the JSON-lines format."""
    return {"name": name, "trace_id": trace_id, "span_id": span_id, "parent_span_id": parent, "kind": kind,
            "start_time_unix_nano": start, "end_time_unix_nano": end,
            "status": {"code": status, "description": description}, "attributes": attributes,
            "resource": resource or {"service.name": "prefill", "service.instance.id": "prefill-0",
                                     "process.pid": 4242},
            "scope": {"name": "otel_kvtransfer", "version": "0.1.0"}}


def synthetic_records(requests=3, destinations=2, chunks=3, seed=7, fail_key=None, t0=T0):
    """Request, compute, send and receive spans of the JSON-lines format, children before parents as exporters
    write them. Request spans carry no aggregates (the tools compute them from the children), so figures in the
    tests are checked against the children."""
    rng = random.Random(seed)
    decode = {"service.name": "decode", "service.instance.id": "decode-0", "process.pid": 4343}
    out = []
    start = t0
    for index in range(requests):
        key = str(1000 + index)
        ident = {sc.REQUEST_KEY: key, sc.BOOTSTRAP_ROOM: 1000 + index, sc.FRAMEWORK: "sglang",
                 sc.BACKEND: "mooncake"}
        trace_id, req_id = _hex(rng, 32), _hex(rng, 16)
        cursor, failed = start, False
        children = []
        for chunk in range(chunks):
            c_start, c_end = cursor, cursor + rng.randint(2, 6) * 1_000_000
            children.append(span_record(sc.SPAN_COMPUTE, trace_id, _hex(rng, 16), req_id, c_start, c_end,
                                        {sc.REQUEST_KEY: key, sc.CHUNK_INDEX: chunk}))
            for dest in range(destinations):
                for payload in ("kv", "aux") if chunk == chunks - 1 else ("kv",):
                    s_start = c_end - 1_000_000 + rng.randint(0, 500_000) if chunk == 0 else c_start + 500_000
                    s_end = s_start + rng.randint(1, 4) * 1_000_000
                    nbytes = rng.randint(1, 8) * 1_048_576 if payload == "kv" else 4096
                    bad = fail_key == key and chunk == chunks - 1 and dest == 0 and payload == "kv"
                    failed = failed or bad
                    attrs = {**ident, sc.BYTES: nbytes, sc.PAYLOAD: payload, sc.OP: sc.OP_WRITE,
                             sc.CHUNK_INDEX: chunk, sc.IS_LAST_CHUNK: chunk == chunks - 1,
                             sc.PREFIX_EARLY_SEND: False, sc.REPLICA_FACTOR: destinations,
                             sc.DESTINATION_INDEX: dest, sc.THROUGHPUT: nbytes * 1e9 / (s_end - s_start),
                             sc.SERVER_ADDRESS: "127.0.0.1", sc.SERVER_PORT: 15000 + dest}
                    if bad:
                        attrs[sc.ERROR_TYPE] = "TransferFailed"
                    children.append(span_record(sc.SPAN_SEND, trace_id, _hex(rng, 16), req_id, s_start, s_end,
                                                attrs, status="ERROR" if bad else "UNSET", kind="CLIENT"))
            cursor = c_end
        r_end = max(max(c["end_time_unix_nano"] for c in children), cursor) + 200_000
        out.extend(children)
        attrs = {**ident, sc.ROLE: sc.ROLE_PREFILL}
        if failed:
            attrs[sc.ERROR_TYPE] = "TransferFailed"
        out.append(span_record(sc.SPAN_REQUEST, trace_id, req_id, None, start, r_end, attrs,
                               status="ERROR" if failed else "UNSET",
                               description="transfer failed" if failed else None))
        out.append(span_record(sc.SPAN_RECEIVE, trace_id, _hex(rng, 16), _hex(rng, 16), start + 100_000,
                               r_end + 300_000, {sc.REQUEST_KEY: key, sc.ROLE: sc.ROLE_DECODE}, resource=decode))
        start = r_end - rng.randint(0, 5) * 1_000_000  # requests overlap a little
    return out


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return str(path)


def _any_value(value) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    return AnyValue(string_value=str(value))


def _key_values(attributes: dict) -> list:
    return [KeyValue(key=k, value=_any_value(v)) for k, v in attributes.items()]


def otlp_request(records) -> dict:
    """One OTLP-JSON export request (a dict, ids in hex as OTLP/JSON writes them) holding `records`, built with
    the proto messages."""
    kinds = {"INTERNAL": 1, "SERVER": 2, "CLIENT": 3}
    codes = {"UNSET": 0, "OK": 1, "ERROR": 2}
    message = ExportTraceServiceRequest()
    by_resource = {}
    for r in records:
        by_resource.setdefault(json.dumps(r["resource"], sort_keys=True), (r["resource"], []))[1].append(r)
    for resource, recs in by_resource.values():
        resource_spans = ResourceSpans()
        resource_spans.resource.attributes.extend(_key_values(resource))
        scope_spans = ScopeSpans()
        scope_spans.scope.name = "otel_kvtransfer"
        for r in recs:
            scope_spans.spans.append(Span(
                trace_id=bytes.fromhex(r["trace_id"]), span_id=bytes.fromhex(r["span_id"]),
                parent_span_id=bytes.fromhex(r["parent_span_id"] or ""), name=r["name"], kind=kinds[r["kind"]],
                start_time_unix_nano=r["start_time_unix_nano"], end_time_unix_nano=r["end_time_unix_nano"],
                attributes=_key_values(r["attributes"]),
                status=Status(code=codes[r["status"]["code"]], message=r["status"]["description"] or "")))
        resource_spans.scope_spans.append(scope_spans)
        message.resource_spans.append(resource_spans)
    data = json_format.MessageToDict(message, use_integers_for_enums=True)
    for rs in data["resourceSpans"]:  # proto3 JSON writes bytes as base64; OTLP/JSON wants hex ids
        for span in rs["scopeSpans"][0]["spans"]:
            for field in ("traceId", "spanId", "parentSpanId"):
                if field in span:
                    span[field] = base64.b64decode(span[field]).hex()
    return data


def write_otlp(path, records, per_line=None):
    """`records` as OTLP-JSON, one export request per line (`per_line` spans each; default all in one)."""
    per_line = per_line or max(len(records), 1)
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(0, len(records), per_line):
            handle.write(json.dumps(otlp_request(records[i:i + per_line])) + "\n")
    return str(path)


# --------------------------------------------------------------------------------------------------- tests


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

