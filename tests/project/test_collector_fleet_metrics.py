"""bench/collector_metrics.py, the reader of the Collectors' own metrics that bench/collector_fleet.py trusts with
nothing: it reads the text format the Collectors serve, and answers anything else with one line that says where.
(The benchmark itself runs real Collectors and is not a test: its figures go to a results file.)"""

import importlib.util
import pathlib

import pytest
from support.paths import ROOT

SCRIPT = pathlib.Path(ROOT) / "bench" / "collector_metrics.py"
SPEC = importlib.util.spec_from_file_location("collector_metrics", SCRIPT)
assert SPEC is not None and SPEC.loader is not None
metrics = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(metrics)

# The shape otelcol 0.16x serves on its telemetry port (counters with _total, labels with escapes).
EXPOSITION = """\
# HELP otelcol_receiver_accepted_spans_total Number of spans successfully pushed into the pipeline. [Alpha]
# TYPE otelcol_receiver_accepted_spans_total counter
otelcol_receiver_accepted_spans_total{receiver="otlp",transport="grpc"} 1200
otelcol_receiver_accepted_spans_total{receiver="otlp",transport="http"} 34
otelcol_receiver_accepted_spans_total{receiver="otlp/sampling",transport="grpc"} 7
otelcol_exporter_sent_spans_total{exporter="loadbalancing",note="a \\"quoted\\", back\\\\slash\\nline",} 1234 17650
otelcol_process_uptime_seconds_total NaN
otelcol_exporter_queue_capacity{data_type="traces",exporter="otlp_grpc/jaeger"} +Inf
"""


def test_reads_the_collectors_text_format():
    samples = metrics.parse(EXPOSITION)
    assert len(samples) == 6
    assert metrics.total(samples, "otelcol_receiver_accepted_spans", receiver="otlp") == 1234
    assert metrics.total(samples, "otelcol_receiver_accepted_spans") == 1241
    assert metrics.total(samples, "otelcol_exporter_sent_spans", exporter="loadbalancing") == 1234
    assert metrics.total(samples, "otelcol_process_uptime_seconds") == 0  # NaN counts nothing
    assert metrics.total(samples, "otelcol_receiver_refused_spans") == 0
    (sent,) = [labels for name, labels, _ in samples if name == "otelcol_exporter_sent_spans_total"]
    assert sent["note"] == 'a "quoted", back\\slash\nline'
    assert metrics.label_values(samples, "otelcol_receiver_accepted_spans", "receiver") == ["otlp", "otlp/sampling"]


@pytest.mark.parametrize("bad, where", [
    ('otelcol_x{receiver="otlp"} many', "line 1: not a number"),
    ('otelcol_x{receiver="otlp} 1', "line 1: bad label set"),
    ('otelcol_x{receiver="otlp" transport="grpc"} 1', "line 1: bad label set"),
    ('otelcol_x{9bad="1"} 1', "line 1: bad label set"),
    ("ok 1\n<html>not metrics</html>", "line 2: no metric name"),
    ("otelcol-x 1", "line 1: bad metric name"),
    ("otelcol_x 1 2 3", "line 1: expected a value"),
    ("otelcol_x 1 soon", "line 1: not a number"),
    ("otelcol_x{" + ",".join(f'l{i}="v"' for i in range(65)) + "} 1", "line 1: more than 64 labels"),
    ("x" * 20_000 + " 1", "line 1: longer than"),
    ("x 1\n" * 200_001, "more than 200000 lines"),
])
def test_bad_input_is_one_line_that_says_where(bad, where):
    with pytest.raises(metrics.BadExposition) as caught:
        metrics.parse(bad)
    message = str(caught.value)
    assert message.startswith(where) and "\n" not in message and len(message) < 200, message


def test_nothing_listening_is_one_line():
    with pytest.raises(metrics.BadExposition) as caught:
        metrics.fetch(1)  # port 1 on 127.0.0.1: nothing there
    message = str(caught.value)
    assert message.startswith("http://127.0.0.1:1/metrics: no answer") and "\n" not in message
