"""The shipped Collector configs and Jaeger, run for real: the agent (collector/agent.yaml), the gateway
(collector/gateway.yaml) and Jaeger (collector/jaeger.yaml), built from the Go module proxy by
`scripts/setup-observability.sh` (collector/builder-*.yaml list each Collector's components).

Each config is first checked by its binary's own `validate`, then started with only endpoints and ports set by
environment (the configs' own `${env:...}` placeholders). The Collectors and Jaeger bind every interface, so each
stack runs in a network namespace of its own (`unshare --net`, loopback up): its first process holds it, the
others and every request join it with `nsenter --net`; nothing listens or sends outside 127.0.0.1 there. Each
process is stopped by its PID.

- agent: OTLP/HTTP in; the span read back from Jaeger's query API with its attributes and the host the agent's
  `resourcedetection` added; the metric read back from the agent's Prometheus exporter under the names the
  dashboards use, with its exemplar and the resource labels; and the traces of real Mooncake transfers through the
  package (prefill and decode processes) read back from Jaeger, one trace per room.
- gateway: OTLP in, `loadbalancing` by trace id to its own sampling port, `tail_sampling` (an ERROR trace kept, a
  plain one dropped at a 0 % share), Jaeger; metrics by remote write into a real Prometheus.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
from support.observability.collectors import (
    COLLECTOR,
    JAEGER_PORTS,
    SETUP,
    Stack,
    attr,
    base_env,
    find_binary,
    jaeger_env,
    jaeger_trace,
    metric_sum,
    resource,
    self_metrics,
    start_jaeger,
    tags_of,
)
from support.observability.parts import mooncake_available, prometheus_binary, wait_until
from support.observability.workload import AUX_BYTES, CHUNK_BYTES, CHUNKS, FRAMEWORK, MODEL, RECV_BYTES, REPLICAS
from support.parts import require_part
from support.paths import ROOT, TESTS

from otel_kvtransfer import semconv

WORKLOAD = os.path.join(TESTS, "support", "observability", "workload.py")

# Inside each stack's own namespace, where nothing else listens (Jaeger's ports: collectors.JAEGER_PORTS). Nothing
# listens on TEMPO: Tempo is not run here (AGPL), and the agent's Tempo exporter only retries into it.
AGENT_PORTS = {"otlp_grpc": 4317, "otlp_http": 4318, "health": 13133, "zpages": 55679,
               "prometheus": 8889}  # the exporter's port is fixed in agent.yaml: prometheus.yml scrapes it
TEMPO = "127.0.0.1:14399"
PROMETHEUS_PORT = 19090
SERVICE = "kvt-collector-test"
HOST_LABEL_ENV = "deployment.environment.name=kvt-ci"  # what resourcedetection's env detector adds


@pytest.fixture(scope="module")
def binaries():
    found = {"jaeger": find_binary("jaeger", "KVT_JAEGER"), "agent": find_binary("otelcol-agent", "KVT_OTELCOL"),
             "gateway": find_binary("otelcol-gateway", "KVT_OTELCOL_GATEWAY")}
    for name, path in found.items():
        require_part(bool(path), f"the {name} binary built from the Go module proxy ({SETUP})")
    require_part(bool(shutil.which("unshare") and shutil.which("nsenter") and shutil.which("ip")),
                 "unshare/nsenter (util-linux) and ip (iproute2)")
    return found


def _collector_env(**extra) -> dict:
    p = AGENT_PORTS
    return base_env(OTELCOL_OTLP_GRPC_ENDPOINT=f"127.0.0.1:{p['otlp_grpc']}",
                    OTELCOL_OTLP_HTTP_ENDPOINT=f"127.0.0.1:{p['otlp_http']}",
                    OTELCOL_HEALTH_ENDPOINT=f"127.0.0.1:{p['health']}",
                    OTELCOL_ZPAGES_ENDPOINT=f"127.0.0.1:{p['zpages']}",
                    JAEGER_OTLP_ENDPOINT=f"127.0.0.1:{JAEGER_PORTS['otlp_grpc']}",
                    TEMPO_OTLP_ENDPOINT=TEMPO,
                    **extra)


def agent_env() -> dict:
    return _collector_env(OTELCOL_PROMETHEUS_HOST="127.0.0.1",
                          PROMETHEUS_REMOTE_WRITE_URL=f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/write",
                          OTEL_RESOURCE_ATTRIBUTES=HOST_LABEL_ENV)


def _gateway_env() -> dict:
    return _collector_env(GATEWAY_SAMPLING_HOSTNAME="127.0.0.1",  # `localhost` would resolve to ::1 as well
                          PROMETHEUS_REMOTE_WRITE_URL=f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/write",
                          KVT_SAMPLE_PERCENT=0, KVT_DECISION_WAIT="2s")


@pytest.fixture(scope="module")
def agent_stack(binaries):
    stack = Stack(tempfile.mkdtemp(prefix="kvt-agent-stack-"))
    try:
        start_jaeger(stack, binaries["jaeger"])
        stack.start("agent", [binaries["agent"], "--config", os.path.join(COLLECTOR, "agent.yaml")], agent_env())
        stack.wait_healthy("agent", f"http://127.0.0.1:{AGENT_PORTS['health']}/")
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(stack.workdir, ignore_errors=True)


# --- OTLP/HTTP payloads (JSON encoding: ids in hex, 64-bit integers as strings) --------------------------------

def _ids(seed: str):
    digest = hashlib.sha256(seed.encode()).hexdigest()
    return digest[:32], digest[32:48]


def _span_payload(service: str, trace_id: str, span_id: str, attributes: dict, error: bool = False) -> bytes:
    now = time.time_ns()
    span = {"traceId": trace_id, "spanId": span_id, "name": semconv.SPAN_SEND, "kind": 3,
            "startTimeUnixNano": str(now - 5_000_000), "endTimeUnixNano": str(now),
            "attributes": [attr(k, v) for k, v in attributes.items()]}
    if error:
        span["status"] = {"code": 2, "message": "transfer failed"}
    return json.dumps({"resourceSpans": [{"resource": resource(service, f"{service}-0"), "scopeSpans": [
        {"scope": {"name": "otel_kvtransfer"}, "spans": [span]}]}]}).encode()


def _metric_payload(service: str, trace_id: str, span_id: str, failures: int, throughput: float) -> bytes:
    now = time.time_ns()
    start_ns = str(now - 10_000_000_000)
    labels = [attr(semconv.BACKEND, "mooncake"), attr(semconv.ROLE, "prefill")]
    failures_metric = {"name": "kv_transfer.failures", "unit": "{transfer}", "sum": {
        "aggregationTemporality": 2, "isMonotonic": True, "dataPoints": [
            {"startTimeUnixNano": start_ns, "timeUnixNano": str(now), "asInt": str(failures), "attributes": labels}]}}
    throughput_metric = {"name": "kv_transfer.throughput", "unit": "By/s", "histogram": {
        "aggregationTemporality": 2, "dataPoints": [
            {"startTimeUnixNano": start_ns, "timeUnixNano": str(now), "count": "1", "sum": throughput,
             "bucketCounts": ["0", "1"], "explicitBounds": [1e9], "attributes": labels,
             "exemplars": [{"timeUnixNano": str(now), "asDouble": throughput, "traceId": trace_id,
                            "spanId": span_id}]}]}}
    return json.dumps({"resourceMetrics": [{"resource": resource(service, f"{service}-0"), "scopeMetrics": [
        {"scope": {"name": "otel_kvtransfer"}, "metrics": [failures_metric, throughput_metric]}]}]}).encode()


def _to_agent(stack: Stack, path: str, payload: bytes) -> None:
    stack.post_json(f"http://127.0.0.1:{AGENT_PORTS['otlp_http']}{path}", payload)


# --- the tests ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, binary, env", [
    ("agent.yaml", "agent", agent_env), ("gateway.yaml", "gateway", _gateway_env),
    ("jaeger.yaml", "jaeger", jaeger_env)])
def test_config_validates_with_its_binary(binaries, config, binary, env):
    """`validate` builds every component from the config (unknown keys, bad types, bad OTTL) without serving."""
    result = subprocess.run([binaries[binary], "validate", "--config", os.path.join(COLLECTOR, config)],
                            env=env(), capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_agent_carries_a_span_to_jaeger_and_a_metric_to_prometheus(agent_stack):
    stack = agent_stack
    trace_id, span_id = _ids("agent-span")
    nbytes = 4 << 20
    _to_agent(stack, "/v1/traces", _span_payload(SERVICE, trace_id, span_id, {
        semconv.BYTES: nbytes, semconv.PAYLOAD: "kv", semconv.BACKEND: "mooncake", semconv.REQUEST_KEY: "42"}))
    _to_agent(stack, "/v1/metrics", _metric_payload(SERVICE, trace_id, span_id, 3, 2.5e9))

    trace = jaeger_trace(stack, trace_id)
    (span,) = trace["spans"]
    assert span["operationName"] == semconv.SPAN_SEND and span["spanID"] == span_id
    tags = tags_of(span["tags"])
    assert tags[semconv.BYTES] == nbytes and tags[semconv.PAYLOAD] == "kv" and tags["span.kind"] == "client"
    process = trace["processes"][span["processID"]]
    assert process["serviceName"] == SERVICE
    resource = tags_of(process["tags"])
    # resourcedetection added the host (system) and OTEL_RESOURCE_ATTRIBUTES (env), and kept the engine's own
    assert resource.get("host.name") and resource["deployment.environment.name"] == "kvt-ci"
    assert resource["service.instance.id"] == f"{SERVICE}-0"
    services = stack.get_json(f"http://127.0.0.1:{JAEGER_PORTS['query']}/api/services")["data"]
    assert SERVICE in services

    url = f"http://127.0.0.1:{AGENT_PORTS['prometheus']}/metrics"

    def exposition():
        answer = stack.http("GET", url, accept="application/openmetrics-text;version=1.0.0")
        text = answer[1] if answer and answer[0] == 200 else ""
        return text if "kv_transfer_throughput_bytes_per_second_bucket" in text else None

    text = wait_until(exposition, 30, 0.5, what="the metrics on the agent's Prometheus exporter")
    lines = text.splitlines()
    (failures,) = [line for line in lines if line.startswith("kv_transfer_failures_total{")]
    assert f'job="{SERVICE}"' in failures and f'instance="{SERVICE}-0"' in failures
    assert 'kv_transfer_backend="mooncake"' in failures and float(failures.rsplit(" ", 1)[1]) == 3
    # resource_constant_labels: restart-stable resource attributes on every series
    assert 'host_name="' in failures and 'deployment_environment_name="kvt-ci"' in failures
    (inf_bucket,) = [line for line in lines
                     if line.startswith("kv_transfer_throughput_bytes_per_second_bucket{") and 'le="+Inf"' in line]
    # the exemplar (OpenMetrics only) names the send span: the dashboard's "click the dot, open the trace"
    assert f'trace_id="{trace_id}"' in inf_bucket and f'span_id="{span_id}"' in inf_bucket, inf_bucket


def test_agent_carries_real_transfer_traces_to_jaeger(agent_stack):
    """Real Mooncake transfers through the package, prefill and decode in two processes, OTLP/HTTP to the agent:
    each room's trace in Jaeger has the request with its sends (exact bytes) and computes under it, and the
    decode's receive, all in one trace."""
    require_part(mooncake_available(), "mooncake-transfer-engine-non-cuda + libibverbs1 (bash scripts/setup.sh)")
    stack = agent_stack
    rooms = 4
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    result = subprocess.run(
        stack.nsenter + [sys.executable, WORKLOAD, "traces", "--protocol", "http", "--endpoint",
                         f"127.0.0.1:{AGENT_PORTS['otlp_http']}", "--rooms", str(rooms), "--room-base", "7000",
                         "--evict-wait", "0", "--pause", "0"],
        capture_output=True, text=True, timeout=180, env=env, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (line,) = [text for text in result.stdout.splitlines() if text.startswith("DONE ")]
    done_rooms = json.loads(line[len("DONE "):])["rooms"]
    assert len(done_rooms) == rooms

    sends_per_room = CHUNKS * REPLICAS + 1
    for room in done_rooms:
        trace_id = hashlib.blake2b(room.to_bytes(8, "big"), digest_size=16, person=b"kv_transfer").hexdigest()
        trace = jaeger_trace(stack, trace_id, min_spans=sends_per_room + CHUNKS + 2)
        spans = trace["spans"]
        names = sorted(s["operationName"] for s in spans)
        assert names == sorted([semconv.SPAN_REQUEST, semconv.SPAN_RECEIVE] + [semconv.SPAN_SEND] * sends_per_room
                               + [semconv.SPAN_COMPUTE] * CHUNKS), (room, names)
        (request,) = [s for s in spans if s["operationName"] == semconv.SPAN_REQUEST]
        (receive,) = [s for s in spans if s["operationName"] == semconv.SPAN_RECEIVE]
        sends = [s for s in spans if s["operationName"] == semconv.SPAN_SEND]
        for child in sends + [s for s in spans if s["operationName"] == semconv.SPAN_COMPUTE]:
            assert [r["spanID"] for r in child["references"] if r["refType"] == "CHILD_OF"] == [request["spanID"]]
        services = {trace["processes"][s["processID"]]["serviceName"] for s in (request, receive)}
        assert len(services) == 2, services  # prefill and decode processes, one trace
        req = tags_of(request["tags"])
        assert req[semconv.REQUEST_KEY] == str(room) and req[semconv.FRAMEWORK] == FRAMEWORK
        assert req["gen_ai.request.model"] == MODEL
        kv = [tags_of(s["tags"]) for s in sends if tags_of(s["tags"])[semconv.PAYLOAD] == "kv"]
        aux = [tags_of(s["tags"]) for s in sends if tags_of(s["tags"])[semconv.PAYLOAD] == "aux"]
        assert [t[semconv.BYTES] for t in kv] == [CHUNK_BYTES] * (CHUNKS * REPLICAS)
        assert [t[semconv.BYTES] for t in aux] == [AUX_BYTES]
        assert req[semconv.BYTES] == sum(tags_of(s["tags"])[semconv.BYTES] for s in sends)
        assert tags_of(receive["tags"])["kv_transfer.expected_bytes"] == RECV_BYTES


@pytest.fixture(scope="module")
def gateway_stack(binaries):
    prometheus = prometheus_binary()
    require_part(bool(prometheus), f"Debian prometheus ({SETUP})")
    stack = Stack(tempfile.mkdtemp(prefix="kvt-gateway-stack-"))
    try:
        start_jaeger(stack, binaries["jaeger"])
        config = os.path.join(stack.workdir, "prometheus.yml")
        with open(config, "w", encoding="utf-8") as handle:
            handle.write("global:\n  scrape_interval: 15s\n")
        stack.start("prometheus", [prometheus, f"--config.file={config}",
                                   f"--storage.tsdb.path={os.path.join(stack.workdir, 'tsdb')}",
                                   f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}",
                                   "--web.enable-remote-write-receiver"], base_env())
        stack.wait_healthy("prometheus", f"http://127.0.0.1:{PROMETHEUS_PORT}/-/ready")
        stack.start("gateway", [binaries["gateway"], "--config", os.path.join(COLLECTOR, "gateway.yaml")],
                    _gateway_env())
        stack.wait_healthy("gateway", f"http://127.0.0.1:{AGENT_PORTS['health']}/")
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(stack.workdir, ignore_errors=True)


def test_gateway_routes_by_trace_id_and_tail_samples_into_jaeger(gateway_stack):
    stack = gateway_stack
    kept_trace, kept_span = _ids("gateway-error")
    dropped_trace, dropped_span = _ids("gateway-plain")
    attrs = {semconv.BYTES: 4096, semconv.PAYLOAD: "aux", semconv.BACKEND: "mooncake"}
    _to_agent(stack, "/v1/traces", _span_payload(SERVICE, kept_trace, kept_span, attrs, error=True))
    _to_agent(stack, "/v1/traces", _span_payload(SERVICE, dropped_trace, dropped_span, attrs))
    # loadbalancing -> 127.0.0.1:4417 -> tail_sampling decides after decision_wait: keep-errors keeps it
    wait_until(lambda: metric_sum(self_metrics(stack, "http://127.0.0.1:8888/metrics"),
                                  "otelcol_processor_tail_sampling_global_count_traces_sampled") >= 2, 90, 0.5,
               what="the gateway's decisions on both traces")
    trace = jaeger_trace(stack, kept_trace, timeout=30)
    assert [s["spanID"] for s in trace["spans"]] == [kept_span]
    assert tags_of(trace["spans"][0]["tags"])["otel.status_code"] == "ERROR"
    # both were decided; at KVT_SAMPLE_PERCENT=0 the plain, fast, small one is dropped
    body = stack.get_json(f"http://127.0.0.1:{JAEGER_PORTS['query']}/api/traces/{dropped_trace}")
    assert not (body or {}).get("data"), body
    stack.alive("gateway")


def test_gateway_forwards_metrics_by_remote_write(gateway_stack):
    stack = gateway_stack
    trace_id, span_id = _ids("gateway-metric")
    _to_agent(stack, "/v1/metrics", _metric_payload(SERVICE, trace_id, span_id, 5, 1.5e9))
    url = (f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/query?query=kv_transfer_failures_total"
           f"%7Bjob%3D%22{SERVICE}%22%7D")

    def value():
        body = stack.get_json(url)
        result = (body or {}).get("data", {}).get("result") or []
        return result[0] if result else None

    series = wait_until(value, 60, 1.0, what="kv_transfer_failures_total in Prometheus by remote write")
    assert series["value"][1] == "5"
    assert series["metric"]["instance"] == f"{SERVICE}-0"
    assert series["metric"]["kv_transfer_backend"] == "mooncake"
