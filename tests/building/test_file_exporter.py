"""`OtlpJsonFileSpanExporter`: one OTLP-JSON export request per line that opentelemetry-proto parses, hex ids equal
to the SDK's, whole lines across forked processes, and the `kvtransfer_file` entry point working under
`opentelemetry-instrument` with no Collector, its file read by `otel-kvtransfer summarize` and `timeline`."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import set_span_in_context

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.building.file_exporter import ENV_SPAN_FILE, OtlpJsonFileSpanExporter
from otel_kvtransfer.tools.spanfile import read_spans

T = 1_700_000_000_000_000_000


def _provider(path):
    provider = TracerProvider(resource=Resource.create({"service.name": "kv-test"}))
    provider.add_span_processor(SimpleSpanProcessor(OtlpJsonFileSpanExporter(str(path))))
    return provider


def _request(tracer, key, t0=T):
    request = tracer.start_span(sc.SPAN_REQUEST, start_time=t0, attributes={sc.REQUEST_KEY: key})
    send = tracer.start_span(sc.SPAN_SEND, context=set_span_in_context(request), start_time=t0 + 1000,
                             attributes={sc.REQUEST_KEY: key, sc.BYTES: 4096, sc.PAYLOAD: "kv",
                                         sc.THROUGHPUT: 2.5e9, sc.IS_LAST_CHUNK: True})
    send.end(end_time=t0 + 5000)
    request.end(end_time=t0 + 9000)
    return request, send


def test_lines_are_otlp_json_with_the_sdks_hex_ids(tmp_path):
    path = tmp_path / "spans.jsonl"
    provider = _provider(path)
    request, send = _request(provider.get_tracer("otel_kvtransfer"), "k1")
    provider.shutdown()
    lines = path.read_text().splitlines()
    assert len(lines) == 2  # one export batch per line (SimpleSpanProcessor: one span a batch)
    first = json.loads(lines[0])["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert first["traceId"] == format(send.context.trace_id, "032x")
    assert first["spanId"] == format(send.context.span_id, "016x")
    assert first["parentSpanId"] == format(request.context.span_id, "016x")
    assert first["kind"] == 1 and first["startTimeUnixNano"] == str(T + 1000)
    message = ExportTraceServiceRequest()
    json_format.Parse(lines[1], message)  # every line is a valid message (ids as hex parse as bytes too)
    assert message.resource_spans[0].scope_spans[0].spans[0].name == sc.SPAN_REQUEST
    spans = read_spans(path)
    assert [s.name for s in spans] == [sc.SPAN_SEND, sc.SPAN_REQUEST]
    assert spans[0].attributes == {sc.REQUEST_KEY: "k1", sc.BYTES: 4096, sc.PAYLOAD: "kv", sc.THROUGHPUT: 2.5e9,
                                   sc.IS_LAST_CHUNK: True}
    assert spans[0].parent_span_id == spans[1].span_id and spans[0].resource["service.name"] == "kv-test"
    assert (spans[0].start_time_unix_nano, spans[0].end_time_unix_nano) == (T + 1000, T + 5000)


def test_path_comes_from_the_environment_or_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_SPAN_FILE, str(tmp_path / "env.jsonl"))
    assert OtlpJsonFileSpanExporter().path == str(tmp_path / "env.jsonl")
    monkeypatch.delenv(ENV_SPAN_FILE)
    app = tmp_path / "app.py"
    app.write_text("print('app ran')\n")
    env = {k: v for k, v in os.environ.items() if k != ENV_SPAN_FILE}
    env.update(OTEL_TRACES_EXPORTER="kvtransfer_file", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none",
               OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="kv_transfer")
    proc = subprocess.run([_instrument(), sys.executable, str(app)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0 and "app ran" in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and ENV_SPAN_FILE in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def _instrument():
    path = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    assert os.path.exists(path), "opentelemetry-distro / opentelemetry-instrumentation are not installed"
    return path


def test_unwritable_file_is_a_failed_export_not_an_exception(tmp_path):
    from opentelemetry.sdk.trace.export import SpanExportResult

    exporter = OtlpJsonFileSpanExporter(str(tmp_path / "no" / "such" / "dir.jsonl"))
    provider = TracerProvider()
    span = provider.get_tracer("t").start_span("x")
    span.end()
    assert exporter.export([span]) == SpanExportResult.FAILURE


def test_forked_children_append_whole_lines(tmp_path):
    path = tmp_path / "fork.jsonl"
    provider = _provider(path)
    tracer = provider.get_tracer("otel_kvtransfer")
    _request(tracer, "parent-before")
    children = []
    for number in range(3):
        pid = os.fork()
        if pid == 0:  # child: export through the inherited exporter, then leave without cleanup
            try:
                _request(tracer, f"child-{number}", T + 10**6 * (number + 1))
            finally:
                os._exit(0)
        children.append(pid)
    for pid in children:
        assert os.waitpid(pid, 0)[1] == 0
    _request(tracer, "parent-after")
    provider.shutdown()
    keys = sorted({s.attributes[sc.REQUEST_KEY] for s in read_spans(path)})
    assert keys == ["child-0", "child-1", "child-2", "parent-after", "parent-before"]
    assert len(path.read_text().splitlines()) == 10


APP = textwrap.dedent("""
    from opentelemetry import trace
    from opentelemetry.trace import set_span_in_context

    tracer = trace.get_tracer("otel_kvtransfer")
    t0 = 1_700_000_000_000_000_000
    for number in range(3):
        key = str(500 + number)
        request = tracer.start_span("kv_transfer.request", start_time=t0,
                                    attributes={"kv_transfer.request_key": key, "kv_transfer.framework": "app"})
        context = set_span_in_context(request)
        for chunk in range(2):
            send = tracer.start_span("kv_transfer.send", context=context, start_time=t0 + chunk * 2_000_000,
                                     attributes={"kv_transfer.request_key": key, "kv_transfer.bytes": 1 << 20,
                                                 "kv_transfer.chunk_index": chunk, "kv_transfer.payload": "kv"})
            send.end(end_time=t0 + chunk * 2_000_000 + 1_000_000)
        request.end(end_time=t0 + 5_000_000)
        t0 += 10_000_000
    print("app done")
""")


def test_opentelemetry_instrument_writes_a_file_the_cli_reads(tmp_path):
    """The real path users take: `OTEL_TRACES_EXPORTER=kvtransfer_file opentelemetry-instrument python app.py`
    (the distro configures the SDK from the environment, the entry point names our exporter), no Collector."""
    instrument = _instrument()
    app, spans = tmp_path / "app.py", tmp_path / "spans.jsonl"
    app.write_text(APP)
    env = dict(os.environ, OTEL_TRACES_EXPORTER="kvtransfer_file", OTEL_KVTRANSFER_SPAN_FILE=str(spans),
               OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none", OTEL_SERVICE_NAME="app-under-test",
               OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="kv_transfer")
    proc = subprocess.run([instrument, sys.executable, str(app)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0 and "app done" in proc.stdout, proc.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "otel_kvtransfer", "summarize", str(spans), "--json"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert [r["request_key"] for r in summary["requests"]] == ["500", "501", "502"]
    for row in summary["requests"]:
        assert row["engine"].startswith("app-under-test") and row["framework"] == "app"
        assert row["bytes"] == 2 << 20 and row["busy_s"] == pytest.approx(0.002, abs=1e-12)
        assert row["throughput"] == pytest.approx((2 << 20) / 0.002)
    html = tmp_path / "t.html"
    tl = subprocess.run([sys.executable, "-m", "otel_kvtransfer", "timeline", str(spans), "--html", str(html),
                         "--no-png"], capture_output=True, text=True, timeout=120, check=False)
    assert tl.returncode == 0 and html.read_text().count('<section class="request') == 3, tl.stderr
