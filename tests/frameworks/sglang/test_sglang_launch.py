"""Instrumentation that comes only from the launch: `opentelemetry-instrument` or sglang's own plugin loader.

The test process calls no instrument(): it runs sglang_harness.py as a program, whose spawned prefill and decode
processes drive sglang's real classes. The spans are read back from the console exporter's JSON, which the
processes print to the stdout they inherit.
"""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.console import console_json_objects
from support.parts import require_part
from support.paths import ROOT, TESTS

from otel_kvtransfer import semconv as sc

HARNESS = Path(TESTS) / "support" / "sglang_harness.py"


def _require_sglang():
    ok = importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("mooncake") is not None
    require_part(ok, "sglang 0.5.23 and mooncake-transfer-engine-non-cuda")


def _env(**extra):
    env = dict(os.environ)
    env.update(
        OTEL_TRACES_EXPORTER="console",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_SERVICE_NAME="sglang-harness",
        PYTHONPATH=os.pathsep.join([TESTS, ROOT, env.get("PYTHONPATH", "")]),
    )
    env.update(extra)
    return env


def _console_spans(stdout: str):
    """Every span JSON object the console exporter printed (other output is skipped)."""
    return [o for o in console_json_objects(stdout) if isinstance(o, dict) and "name" in o and "context" in o]


def _harness(argv_prefix, scenario, env):
    cmd = list(argv_prefix) + [str(HARNESS), json.dumps(scenario)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("HARNESS_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("HARNESS_RESULT "):])
    assert result["prefill"] and "error" not in result["prefill"], result
    return result, _console_spans(proc.stdout)


def _assert_stitched_transfer(result, spans):
    assert result["prefill"]["status"] == "Success" and result["decodes"][0]["verified"]["bad_pages"] == 0
    room = result["cfg"]["room"]
    mine = [s for s in spans if s["attributes"].get(sc.BOOTSTRAP_ROOM) == room]
    (request,) = [s for s in mine if s["name"] == sc.SPAN_REQUEST]
    (receive,) = [s for s in mine if s["name"] == sc.SPAN_RECEIVE]
    sends = [s for s in mine if s["name"] == sc.SPAN_SEND]
    item_sum = result["prefill"]["kv_item_lens_sum"]
    kv = sorted((s["attributes"] for s in sends if s["attributes"][sc.PAYLOAD] == "kv"),
                key=lambda a: a[sc.CHUNK_INDEX])
    assert [a[sc.BYTES] for a in kv] == [16 * item_sum] * 3
    assert request["attributes"][sc.LOGICAL_BYTES] - 256 == result["prefill"]["transfer_total_bytes"]
    assert receive["context"]["trace_id"] == request["context"]["trace_id"]
    for s in sends:
        assert s["parent_id"] == request["context"]["span_id"]
    return request


def test_opentelemetry_instrument_reaches_spawned_processes():
    _require_sglang()
    tool = Path(sys.executable).with_name("opentelemetry-instrument")
    require_part(tool.exists(), "opentelemetry-instrument (opentelemetry-instrumentation) beside the interpreter")
    result, spans = _harness([str(tool), sys.executable], {"instrument": "none", "timeout_s": 60.0}, _env())
    request = _assert_stitched_transfer(result, spans)
    assert request["resource"]["attributes"]["service.name"] == "sglang-harness"


def _plugin_declared() -> bool:
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    return any(ep.value.startswith("otel_kvtransfer") for ep in eps)


def test_sglang_plugin_loader_activates_instrumentation():
    _require_sglang()
    require_part(_plugin_declared(), "the sglang.srt.plugins entry point of otel_kvtransfer (pip install -e .)")
    result, spans = _harness([sys.executable], {"instrument": "plugin", "timeout_s": 60.0}, _env())
    _assert_stitched_transfer(result, spans)


@pytest.mark.parametrize("value", ["kv_transfer", "foo, kv_transfer"])
def test_plugin_respects_disabled_instrumentations(monkeypatch, value):
    from otel_kvtransfer.frameworks.sglang import plugin
    from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor

    # The instrumentor is a singleton, and activate() does nothing when it is already on: an earlier test that
    # left it on would make this pass whatever activate() does with the setting. So it starts off, always.
    instrumentor = KVTransferInstrumentor()
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    assert not instrumentor.is_instrumented_by_opentelemetry
    monkeypatch.setenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", value)
    assert plugin.is_disabled()
    try:
        plugin.activate()
        assert not KVTransferInstrumentor().is_instrumented_by_opentelemetry  # left off, as asked
    finally:
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
