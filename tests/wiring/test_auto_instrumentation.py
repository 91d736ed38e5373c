"""`opentelemetry-instrument python app.py` with standard OTEL_* variables only: spans and metrics from the
process and from its multiprocessing spawn child, with nothing in the app that mentions OpenTelemetry."""

import os
import shutil
import subprocess
import sys

from support.console import console_json_objects
from support.parts import mooncake_importable, require_part
from support.paths import APPS, ROOT

from otel_kvtransfer import semconv

APP = os.path.join(APPS, "auto_app.py")


def _run(extra_env):
    require_part(mooncake_importable(), "the Mooncake engine")
    instrument = shutil.which("opentelemetry-instrument", path=os.path.dirname(sys.executable))
    require_part(instrument is not None, "opentelemetry-instrument (opentelemetry-instrumentation)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({
        "OTEL_SERVICE_NAME": "auto-app",
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_METRICS_EXPORTER": "console",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "otel,process",  # process.pid tells the processes apart
        "MC_FORCE_TCP": "1",
        "PYTHONPATH": os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH", "")] if p),
    })
    env.update(extra_env)
    result = subprocess.run([instrument, sys.executable, APP], env=env, capture_output=True, text=True,
                            timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    objects = console_json_objects(result.stdout)
    spans = [o for o in objects if o.get("name") == semconv.SPAN_SEND and "context" in o]
    metrics = [o for o in objects if "resource_metrics" in o]
    return spans, metrics


def _size_sums(metric_dumps):
    """(count, sum) of kv_transfer.size over all processes; a process may export its cumulative state more
    than once (flush at exit, then shutdown), so its last export counts."""
    per_process = {}
    for dump in metric_dumps:
        for rm in dump["resource_metrics"]:
            count = total = 0
            for sm in rm["scope_metrics"]:
                for metric in sm["metrics"]:
                    if metric["name"] == semconv.METRIC_SIZE:
                        for point in metric["data"]["data_points"]:
                            count += point["count"]
                            total += point["sum"]
            per_process[rm["resource"]["attributes"]["process.pid"]] = (count, total)
    return tuple(map(sum, zip(*per_process.values()))) if per_process else (0, 0)


def test_spans_and_metrics_from_the_process_and_its_spawn_child():
    spans, metrics = _run({})
    assert sorted(s["attributes"][semconv.BYTES] for s in spans) == [1111] * 3 + [2222] * 2
    assert all(s["resource"]["attributes"]["service.name"] == "auto-app" for s in spans)
    assert all(s["kind"] == "SpanKind.CLIENT" for s in spans)
    assert len({s["resource"]["attributes"]["process.pid"] for s in spans}) == 2
    # Each process exports its own cumulative metrics once at exit: parent 3 x 1111, child 2 x 2222.
    assert _size_sums(metrics) == (5, 3 * 1111 + 2 * 2222)


def test_disabled_instrumentation_records_nothing():
    spans, metrics = _run({"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "kv_transfer"})
    assert spans == []
    assert _size_sums(metrics) == (0, 0)


def test_builder_process_builds_the_same_spans_and_metrics_outside_the_engine():
    """OTEL_KVTRANSFER_BUILDER=process: the app and its spawn child each start one helper that builds their spans
    and metrics; the same bytes and counts arrive, and every span comes from a helper, not from the app."""
    spans, metrics = _run({"OTEL_KVTRANSFER_BUILDER": "process"})
    assert sorted(s["attributes"][semconv.BYTES] for s in spans) == [1111] * 3 + [2222] * 2
    assert all(s["resource"]["attributes"]["service.name"] == "auto-app" for s in spans)
    builders = {s["resource"]["attributes"]["process.pid"]: s["resource"]["attributes"] for s in spans}
    assert len(builders) == 2
    # The process detector describes the process that built the spans: two helpers, neither of them this test
    # nor its child (the app is). A helper is no engine's descendant (offloading/lifecycle): an orphan, adopted.
    parents = {attributes["process.parent_pid"] for attributes in builders.values()}
    assert os.getpid() not in builders and os.getpid() not in parents, builders
    assert _size_sums(metrics) == (5, 3 * 1111 + 2 * 2222)
