"""The span-file reader: both formats into one model, and one clear error naming the line for bad input.

Also home of the helpers the other report tests share: `demo_span_file()` (a span file from a real
`otel-kvtransfer demo` run, made once per session) and `synthetic_records()` (unit-test data of the same format,
for the sizes and faults a demo run does not produce).
"""

import atexit
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import pytest
from conftest import require_part

from otel_kvtransfer import intervals
from otel_kvtransfer import semconv as sc
from otel_kvtransfer.spanfile_reader import Span, SpanFileError, iter_spans, read_spans

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEMO = {}


def demo_span_file() -> str:
    """Path of a span file written by a real demo run (`--requests 3`), made once per test session.

    This is the one switch between synthetic data and the real demo: every end-to-end report test uses it."""
    if "path" in _DEMO:
        return _DEMO["path"]
    if "error" in _DEMO:
        require_part(False, _DEMO["error"])
    try:
        import otel_kvtransfer.demo  # noqa: F401
    except ImportError as exc:
        _DEMO["error"] = f"otel_kvtransfer.demo ({exc})"
        require_part(False, _DEMO["error"])
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
    _DEMO["output"] = output
    return path


def demo_output() -> str:
    demo_span_file()
    return _DEMO.get("output", "")


# --------------------------------------------------------------------------------------------------- synthetic


def _hex(rng, digits):
    return "".join(rng.choice("0123456789abcdef") for _ in range(digits))


def synthetic_records(requests=3, destinations=2, chunks=3, seed=7, fail_room=None, t0=1_700_000_000_000_000_000):
    """Span records in the demo's JSON-lines format with self-consistent request attributes."""
    rng = random.Random(seed)
    resource = {"service.name": "prefill", "service.instance.id": "prefill-0", "process.pid": 4242}
    decode_resource = {"service.name": "decode", "service.instance.id": "decode-0", "process.pid": 4343}
    scope = {"name": "otel_kvtransfer", "version": "0.1.0"}
    out = []
    start = t0
    for index in range(requests):
        room = 1000 + index
        trace_id, req_id = _hex(rng, 32), _hex(rng, 16)
        cursor = start
        sends, computes = [], []
        for chunk in range(chunks):
            c_start = cursor
            c_end = c_start + rng.randint(2, 6) * 1_000_000
            computes.append((c_start, c_end, chunk))
            for dest in range(destinations):
                for payload in ("kv", "aux") if chunk == chunks - 1 else ("kv",):
                    s_start = c_end - 1_000_000 + rng.randint(0, 500_000) if chunk == 0 else c_start + 500_000
                    dur = rng.randint(1, 4) * 1_000_000
                    nbytes = rng.randint(1, 8) * 1_048_576 if payload == "kv" else 4096
                    failed = fail_room == room and chunk == chunks - 1 and dest == 0 and payload == "kv"
                    sends.append(dict(start=s_start, end=s_start + dur, bytes=nbytes, payload=payload, chunk=chunk,
                                      dest=dest, failed=failed))
            cursor = c_end
        r_start = min(c[0] for c in computes)
        r_end = max(max(s["end"] for s in sends), cursor) + 200_000
        busy = intervals.union((s["start"], s["end"]) for s in sends)
        busy_ns = intervals.length(busy)
        comp = intervals.union((c[0], c[1]) for c in computes)
        overlap_ns = intervals.intersection_length(busy, comp)
        total = sum(s["bytes"] for s in sends)
        kv = sum(s["bytes"] for s in sends if s["payload"] == "kv")
        failed = any(s["failed"] for s in sends)
        attrs = {
            sc.BOOTSTRAP_ROOM: room, sc.ROLE: sc.ROLE_PREFILL, sc.BACKEND: sc.BACKEND_MOONCAKE,
            sc.BYTES: total, sc.LOGICAL_BYTES: kv // destinations + (total - kv),
            sc.TRANSFER_COUNT: len(sends), sc.CHUNK_COUNT: chunks, sc.REPLICA_FACTOR: destinations,
            sc.BUSY_S: busy_ns / 1e9, sc.THROUGHPUT: total / (busy_ns / 1e9),
            sc.COMPUTE_OVERLAP_S: overlap_ns / 1e9, sc.COMPUTE_OVERLAP_RATIO: overlap_ns / busy_ns,
        }
        if failed:
            attrs[sc.ERROR_TYPE] = "TransferFailed"
        out.append({"name": sc.SPAN_REQUEST, "trace_id": trace_id, "span_id": req_id, "parent_span_id": None,
                    "kind": "INTERNAL", "start_time_unix_nano": r_start, "end_time_unix_nano": r_end,
                    "status": {"code": "ERROR" if failed else "OK",
                               "description": "transfer failed" if failed else None},
                    "attributes": attrs, "resource": resource, "scope": scope})
        for c_start, c_end, chunk in computes:
            out.append({"name": sc.SPAN_COMPUTE, "trace_id": trace_id, "span_id": _hex(rng, 16),
                        "parent_span_id": req_id, "kind": "INTERNAL", "start_time_unix_nano": c_start,
                        "end_time_unix_nano": c_end, "status": {"code": "UNSET", "description": None},
                        "attributes": {sc.CHUNK_INDEX: chunk}, "resource": resource, "scope": scope})
        for s in sends:
            a = {sc.BYTES: s["bytes"], sc.PAYLOAD: s["payload"], sc.OP: sc.OP_WRITE, sc.BOOTSTRAP_ROOM: room,
                 sc.CHUNK_INDEX: s["chunk"], sc.IS_LAST_CHUNK: s["chunk"] == chunks - 1,
                 sc.PREFIX_EARLY_SEND: False, sc.REPLICA_FACTOR: destinations, sc.DESTINATION_INDEX: s["dest"],
                 sc.THROUGHPUT: s["bytes"] / ((s["end"] - s["start"]) / 1e9),
                 sc.SERVER_ADDRESS: "127.0.0.1", sc.SERVER_PORT: 15000 + s["dest"]}
            if s["failed"]:
                a[sc.ERROR_TYPE] = "TransferFailed"
            out.append({"name": sc.SPAN_SEND, "trace_id": trace_id, "span_id": _hex(rng, 16),
                        "parent_span_id": req_id, "kind": "CLIENT", "start_time_unix_nano": s["start"],
                        "end_time_unix_nano": s["end"],
                        "status": {"code": "ERROR" if s["failed"] else "UNSET", "description": None},
                        "attributes": a, "resource": resource, "scope": scope})
        out.append({"name": sc.SPAN_RECEIVE, "trace_id": trace_id, "span_id": _hex(rng, 16),
                    "parent_span_id": _hex(rng, 16), "kind": "SERVER", "start_time_unix_nano": r_start + 100_000,
                    "end_time_unix_nano": r_end + 300_000, "status": {"code": "OK", "description": None},
                    "attributes": {sc.BOOTSTRAP_ROOM: room, sc.ROLE: sc.ROLE_DECODE}, "resource": decode_resource,
                    "scope": scope})
        start = r_end - rng.randint(0, 5) * 1_000_000  # requests overlap a little
    return out


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return str(path)


def _any(value):
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    return {"stringValue": str(value)}


def to_otlp_line(records, numeric_enums=True):
    """One OTLP-JSON export request (as the Collector's file exporter writes) holding `records`."""
    kinds = {"INTERNAL": 1, "SERVER": 2, "CLIENT": 3, "PRODUCER": 4, "CONSUMER": 5}
    codes = {"UNSET": 0, "OK": 1, "ERROR": 2}
    by_resource = {}
    for r in records:
        key = json.dumps(r["resource"], sort_keys=True)
        by_resource.setdefault(key, (r["resource"], []))[1].append(r)
    resource_spans = []
    for resource, recs in by_resource.values():
        spans = []
        for r in recs:
            span = {"traceId": r["trace_id"], "spanId": r["span_id"], "parentSpanId": r["parent_span_id"] or "",
                    "name": r["name"],
                    "kind": kinds[r["kind"]] if numeric_enums else f"SPAN_KIND_{r['kind']}",
                    "startTimeUnixNano": str(r["start_time_unix_nano"]),
                    "endTimeUnixNano": str(r["end_time_unix_nano"]),
                    "attributes": [{"key": k, "value": _any(v)} for k, v in r["attributes"].items()],
                    "status": {}}
            code = r["status"]["code"]
            if code != "UNSET":
                span["status"]["code"] = codes[code] if numeric_enums else f"STATUS_CODE_{code}"
            if r["status"].get("description"):
                span["status"]["message"] = r["status"]["description"]
            spans.append(span)
        resource_spans.append({
            "resource": {"attributes": [{"key": k, "value": _any(v)} for k, v in resource.items()]},
            "scopeSpans": [{"scope": {"name": "otel_kvtransfer", "version": "0.1.0"}, "spans": spans}]})
    return json.dumps({"resourceSpans": resource_spans})


# --------------------------------------------------------------------------------------------------- tests


def test_native_format_round_trips(tmp_path):
    records = synthetic_records(requests=2)
    spans = read_spans(write_jsonl(tmp_path / "s.jsonl", records))
    assert len(spans) == len(records)
    for span, record in zip(spans, records):
        assert isinstance(span, Span)
        assert span.name == record["name"]
        assert span.trace_id == record["trace_id"]
        assert span.span_id == record["span_id"]
        assert span.parent_span_id == record["parent_span_id"]
        assert span.kind == record["kind"]
        assert span.start_time_unix_nano == record["start_time_unix_nano"]
        assert span.end_time_unix_nano == record["end_time_unix_nano"]
        assert span.status_code == record["status"]["code"]
        assert span.attributes == record["attributes"]
        assert span.resource == record["resource"]
        assert span.scope_name == "otel_kvtransfer"


@pytest.mark.parametrize("numeric_enums", [True, False])
def test_otlp_json_reads_like_the_native_format(tmp_path, numeric_enums):
    records = synthetic_records(requests=3)
    path = tmp_path / "otlp.json"
    # Two export requests on two lines, as a file exporter appends them.
    path.write_text(to_otlp_line(records[:5], numeric_enums) + "\n" + to_otlp_line(records[5:], numeric_enums)
                    + "\n")
    native = read_spans(write_jsonl(tmp_path / "n.jsonl", records))
    otlp = read_spans(path)
    def key(span):
        return span.span_id

    assert len(otlp) == len(native)
    for a, b in zip(sorted(native, key=key), sorted(otlp, key=key)):
        assert (a.name, a.trace_id, a.parent_span_id, a.kind) == (b.name, b.trace_id, b.parent_span_id, b.kind)
        assert (a.start_time_unix_nano, a.end_time_unix_nano) == (b.start_time_unix_nano, b.end_time_unix_nano)
        assert a.status_code == b.status_code
        assert a.attributes == b.attributes
        assert a.resource == b.resource
    assert {s.line for s in otlp} == {1, 2}


def test_otlp_base64_ids_are_accepted(tmp_path):
    import base64

    record = synthetic_records(requests=1)[0]
    line = json.loads(to_otlp_line([record]))
    span = line["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["traceId"] = base64.b64encode(bytes.fromhex(record["trace_id"])).decode()
    span["spanId"] = base64.b64encode(bytes.fromhex(record["span_id"])).decode()
    path = tmp_path / "b64.json"
    path.write_text(json.dumps(line) + "\n")
    (parsed,) = read_spans(path)
    assert parsed.trace_id == record["trace_id"] and parsed.span_id == record["span_id"]


def _error_of(path):
    with pytest.raises(SpanFileError) as info:
        read_spans(path)
    return info.value


def test_empty_file_is_a_clear_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    error = _error_of(path)
    assert str(path) in str(error) and "empty" in str(error)
    path.write_text("\n\n  \n")
    assert "empty" in str(_error_of(path))


def test_truncated_file_names_the_line(tmp_path):
    records = synthetic_records(requests=1)
    text = "".join(json.dumps(r) + "\n" for r in records)
    path = tmp_path / "cut.jsonl"
    path.write_text(text[: len(text) - 40])  # cut inside the last record
    error = _error_of(path)
    assert error.line == len(records)
    assert f"{path}:{len(records)}:" in str(error)
    assert "truncated" in str(error)
    assert "\n" not in str(error)


def test_foreign_json_names_the_line(tmp_path):
    path = tmp_path / "foreign.jsonl"
    records = synthetic_records(requests=1)
    path.write_text(json.dumps(records[0]) + "\n" + json.dumps({"hello": "world"}) + "\n")
    error = _error_of(path)
    assert error.line == 2 and "not a span" in str(error)
    path.write_text("[1, 2, 3]\n")
    assert _error_of(path).line == 1


def test_foreign_text_and_binary(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("just some notes\nnothing else\n")
    error = _error_of(path)
    assert error.line == 1 and "invalid JSON" in str(error)
    path = tmp_path / "blob.bin"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    error = _error_of(path)
    assert error.line == 1


def test_bad_fields_name_the_line(tmp_path):
    records = synthetic_records(requests=1)
    bad = dict(records[1])
    bad["end_time_unix_nano"] = bad["start_time_unix_nano"] - 1
    path = write_jsonl(tmp_path / "bad.jsonl", [records[0], bad])
    error = _error_of(path)
    assert error.line == 2 and "ends" in str(error)
    bad = dict(records[1])
    bad["trace_id"] = "xyz"
    error = _error_of(write_jsonl(tmp_path / "bad2.jsonl", [records[0], bad]))
    assert error.line == 2 and "trace_id" in str(error)
    bad = dict(records[1])
    del bad["span_id"]
    assert _error_of(write_jsonl(tmp_path / "bad3.jsonl", [bad])).line == 1


def test_missing_file_and_directory(tmp_path):
    assert "no such file" in str(_error_of(tmp_path / "nope.jsonl"))
    assert "directory" in str(_error_of(tmp_path))


def test_progress_is_reported(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", synthetic_records(requests=2))
    calls = []
    spans = list(iter_spans(path, progress=lambda done, total, n: calls.append((done, total, n))))
    assert calls and calls[-1] == (os.path.getsize(path), os.path.getsize(path), len(spans))


def test_demo_span_file_reads(demo_spans):
    spans = read_spans(demo_spans)
    names = {s.name for s in spans}
    assert {sc.SPAN_REQUEST, sc.SPAN_SEND} <= names
    for span in spans:
        assert len(span.trace_id) == 32 and len(span.span_id) == 16
        assert span.end_time_unix_nano >= span.start_time_unix_nano
    requests = [s for s in spans if s.name == sc.SPAN_REQUEST]
    assert len(requests) >= 3


@pytest.fixture(scope="session")
def demo_spans():
    return demo_span_file()
