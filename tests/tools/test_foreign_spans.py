"""A Collector's file holds every service's spans, and only our own spans' attributes are ours to judge: another
service's span with a string `server.port`, a `kv_transfer.bytes` of the wrong type or a NaN double makes
`summarize`, `summarize --links` and `timeline` leave those attributes out of that span and say so in one
warning line, and read the rest of the file as if the span were not there. The same values in one of our spans
still refuse the file (exit 2, one line).

No engine: generated files of both formats (OTLP-JSON, as the Collector's file exporter writes it, and the older
JSON lines), the command run from the package the tests import.
"""

import json
import os
import subprocess
import sys

import pytest
from support.span_files import T0, otlp_request, span_record, synthetic_records, write_jsonl

import otel_kvtransfer
from otel_kvtransfer import semconv as sc

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(otel_kvtransfer.__file__)))


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "otel_kvtransfer", *args], capture_output=True, timeout=300,
                          check=False, cwd=cwd, env=dict(os.environ, PYTHONPATH=PACKAGE_ROOT))


def _foreign_otlp(scope="io.opentelemetry.okhttp-3.0", name="GET /v1/health") -> dict:
    """Another service's span as the Collector writes it: three attributes our spans could not carry."""
    return {"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "gateway"}}]},
            "scopeSpans": [{"scope": {"name": scope}, "spans": [{
                "traceId": "0af7651916cd43dd8448eb211c80319c", "spanId": "b7ad6b7169203331", "name": name,
                "kind": 3, "startTimeUnixNano": str(T0), "endTimeUnixNano": str(T0 + 5_000_000),
                "attributes": [{"key": "server.port", "value": {"stringValue": "8080"}},
                               {"key": "kv_transfer.bytes", "value": {"stringValue": "lots"}},
                               {"key": "app.ratio", "value": {"doubleValue": "NaN"}},
                               {"key": "http.method", "value": {"stringValue": "GET"}}]}]}]}


def _collector_file(tmp_path, foreign=None) -> str:
    data = otlp_request(synthetic_records(requests=3))
    data["resourceSpans"].append(foreign or _foreign_otlp())
    path = tmp_path / "collector.jsonl"
    path.write_text(json.dumps(data) + "\n")
    return str(path)


def _warnings(proc) -> list:
    return [line for line in proc.stderr.decode().splitlines() if line.strip()]


def test_a_foreign_spans_bad_attributes_are_left_out_and_said_once(tmp_path):
    path = _collector_file(tmp_path)
    alone = tmp_path / "alone.jsonl"
    alone.write_text(json.dumps(otlp_request(synthetic_records(requests=3))) + "\n")
    proc = _cli("summarize", path, "--json")
    assert proc.returncode == 0, proc.stderr
    (warning,) = _warnings(proc)
    assert "left out 3 attributes of spans not written by otel_kvtransfer" in warning and "(line 1)" in warning
    summary = json.loads(proc.stdout)
    assert summary.pop("left_out")["foreign_attributes"] == 3
    expected = json.loads(_cli("summarize", str(alone), "--json").stdout)
    expected.pop("left_out")
    summary.pop("file"), expected.pop("file")
    assert summary.pop("span_count") == expected.pop("span_count") + 1  # the foreign span is read, and counted
    assert summary == expected  # every figure as if the foreign span were not there
    text = _cli("summarize", path)
    assert text.returncode == 0 and b"1000" in text.stdout


def test_links_and_timeline_read_a_file_with_a_foreign_span(tmp_path):
    path = _collector_file(tmp_path)
    links = _cli("summarize", path, "--links", "--json")
    assert links.returncode == 0, links.stderr
    assert json.loads(links.stdout)["left_out"]["foreign_attributes"] == 3
    assert len(_warnings(links)) == 1
    timeline = _cli("timeline", path, "--no-png", "--html", "t.html", "--perfetto", "t.json", cwd=tmp_path)
    assert timeline.returncode == 0, timeline.stderr
    assert (tmp_path / "t.html").read_text().count('<section class="request') == 3


def test_the_older_json_lines_format_judges_only_our_spans_too(tmp_path):
    records = synthetic_records(requests=2)
    foreign = span_record("GET /v1/health", "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", None, T0,
                          T0 + 5_000_000, {"server.port": "8080", "kv_transfer.busy_s": -1.0})
    foreign["scope"] = {"name": "io.opentelemetry.okhttp-3.0"}
    path = write_jsonl(tmp_path / "old.jsonl", records + [foreign])
    proc = _cli("summarize", path, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["left_out"]["foreign_attributes"] == 2


@pytest.mark.parametrize("ours", ["by_name", "by_scope"])
def test_the_same_values_in_our_own_span_still_refuse_the_file(tmp_path, ours):
    """A span named kv_transfer.* (whoever wrote it: the tools compute with it), or one of our scope."""
    foreign = _foreign_otlp(name=sc.SPAN_SEND) if ours == "by_name" else _foreign_otlp(scope=sc.INSTRUMENTATION_NAME)
    proc = _cli("summarize", _collector_file(tmp_path, foreign))
    err = _warnings(proc)
    assert proc.returncode == 2 and len(err) == 1 and b"Traceback" not in proc.stderr, err
    assert "server.port" in err[0] or "kv_transfer.bytes" in err[0] or "app.ratio" in err[0]
