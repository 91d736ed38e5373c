"""The synthetic stitching parent never decides sampling (the design contract's "Trace stitching", docs/telemetry.md).

Under each standard sampler, chosen the way deployments choose it (OTEL_TRACES_SAMPLER / _ARG), a prefill
process (request spans with a send each) and a decode process (receive spans), each with its own TracerProvider
and instrumentation, see the same 2,000 request keys. Both must export exactly the keys whose trace id the
root sampler keeps, computed here from stitching.key_trace_id and TraceIdRatioBased's bound, and the metrics of
both must still count all 2,000. Before the fix the synthetic parent was marked sampled, so
parentbased_traceidratio(0.01) exported 2,000 of 2,000 keys.
"""

import json
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

from otel_kvtransfer.building.stitching import key_trace_id

KEYS = list(range(10**6, 10**6 + 1000)) + [f"xfer-{i:04x}" for i in range(1000)]
RATIO = 0.01
SAMPLERS = [("always_on", None), ("always_off", None), ("traceidratio", str(RATIO)),
            ("parentbased_always_on", None), ("parentbased_always_off", None),
            ("parentbased_traceidratio", str(RATIO))]

_SIDE = r"""
import json, os, sys
from opentelemetry.test.test_base import TestBase
from otel_kvtransfer import KVTransferInstrumentor, semconv
from otel_kvtransfer.recording import records
from otel_kvtransfer import integration as kvt

side, samplers, keys = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
os.environ["OTEL_KVTRANSFER_FLUSH_INTERVAL_MS"] = "60000"  # force_flush delivers
out = {}
for name, arg in samplers:
    os.environ["OTEL_TRACES_SAMPLER"] = name
    if arg is None:
        os.environ.pop("OTEL_TRACES_SAMPLER_ARG", None)
    else:
        os.environ["OTEL_TRACES_SAMPLER_ARG"] = arg
    # the provider reads the sampler from the environment
    provider, exporter = TestBase.create_tracer_provider(shutdown_on_exit=False)
    meter_provider, reader = TestBase.create_meter_provider(shutdown_on_exit=False)
    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument(tracer_provider=provider, meter_provider=meter_provider)
    for key in keys:
        if side == "prefill":
            kvt.begin_request(key, backend="eng")
            with kvt.transfer_scope(key, chunk_index=0):
                kvt.deliver((1, 2, 8, 1, "write", None, "tcp", 0, None, "eng", None))
            kvt.end_request(key)
        else:
            kvt.begin_receive(key, backend="eng")
            kvt.end_receive(key)
    provider.force_flush()
    metric = semconv.METRIC_REQUEST_SIZE if side == "prefill" else semconv.METRIC_RECEIVE_DURATION
    counted = sum(p.count for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                  for m in sm.metrics if m.name == metric for p in m.data.data_points)
    instrumentor.uninstrument()
    exported = {}
    for span in exporter.get_finished_spans():
        exported.setdefault(span.name, []).append(
            [span.attributes[semconv.REQUEST_KEY], f"{span.context.trace_id:032x}", span.context.trace_flags.sampled])
    out[name] = {"exported": exported, "counted": counted}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """{side: {sampler: {"exported": {span name: [[key, trace id, sampled]]}, "counted": n}}}, both sides run
    as separate processes at once."""
    script = tmp_path_factory.mktemp("sampling") / "side.py"
    script.write_text(_SIDE)
    procs = {side: subprocess.Popen([sys.executable, str(script), side, json.dumps(SAMPLERS), json.dumps(KEYS)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for side in ("prefill", "decode")}
    results = {}
    try:
        for side, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-2000:]
            results[side] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def kept_by_root_sampler(name):
    """The keys a root span with the key's trace id is sampled for, by the sampler's own rule."""
    root = name.replace("parentbased_", "")
    if root == "always_on":
        return {str(k) for k in KEYS}
    if root == "always_off":
        return set()
    bound = TraceIdRatioBased(RATIO).bound
    return {str(k) for k in KEYS if key_trace_id(k) & TraceIdRatioBased.TRACE_ID_LIMIT < bound}


@pytest.mark.parametrize("name", [name for name, _ in SAMPLERS])
def test_both_sides_export_exactly_what_the_root_sampler_keeps(sides, name):
    expected = kept_by_root_sampler(name)
    prefill, decode = sides["prefill"][name]["exported"], sides["decode"][name]["exported"]
    requests = prefill.get("kv_transfer.request", [])
    sends = prefill.get("kv_transfer.send", [])
    receives = decode.get("kv_transfer.receive", [])
    assert set(prefill) | set(decode) <= {"kv_transfer.request", "kv_transfer.send", "kv_transfer.receive"}
    for spans in (requests, sends, receives):
        assert sorted(key for key, _, _ in spans) == sorted(expected)  # once each, on both sides
        assert all(sampled for _, _, sampled in spans)
        for key, trace_id, _ in spans:  # one trace per request, the same on both sides
            assert trace_id == f"{key_trace_id(int(key) if key.isdigit() else key):032x}"


def test_the_ratio_holds(sides):
    kept = kept_by_root_sampler("parentbased_traceidratio")
    assert 5 <= len(kept) <= 45  # 1% of 2,000 is 20 (the set itself is fixed by the keys' hashes)
    assert len(sides["prefill"]["parentbased_traceidratio"]["exported"]["kv_transfer.request"]) == len(kept)


@pytest.mark.parametrize("name", [name for name, _ in SAMPLERS])
def test_metrics_count_every_request_under_any_sampler(sides, name):
    assert sides["prefill"][name]["counted"] == len(KEYS)
    assert sides["decode"][name]["counted"] == len(KEYS)
