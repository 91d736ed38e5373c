"""Span files for the tool tests, and the records in them: `demo_span_file()` (a span file from a real
`otel-kvtransfer demo` run, made once per session), `synthetic_records()` and `span_record()` (spans of the JSON-lines
format, for the sizes and faults a demo run does not produce), `write_jsonl()`, and `otlp_request()` / `write_otlp()`
(the same records as OTLP-JSON, built with the proto messages)."""

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

from otel_kvtransfer import semconv as sc
from support.parts import require_part

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
