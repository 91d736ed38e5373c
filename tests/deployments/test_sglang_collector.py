"""Real SGLang PD serving through the agent Collector, the way users run it: prefill and decode servers under
`opentelemetry-instrument` export traces and metrics over OTLP (gRPC) to the agent (collector/agent.yaml); the
agent exports the traces to Jaeger (collector/jaeger.yaml) and serves the metrics on its Prometheus endpoint,
which a real Prometheus scrapes (exemplar storage on, `honor_labels`, as collector/prometheus.yml does).

The deployment is the serving tests' harness (tests/sglang_serving/deployment.py: prefill + decode + router in one
private network namespace, Mooncake over TCP); its servers' OTLP endpoint is 127.0.0.1:4317 of that namespace,
where the agent listens, started there with Jaeger and Prometheus after the servers are up (no request is sent
before; the metrics are cumulative, so nothing of them is lost). The span files beside (kvtransfer_file) are the
reference: every span of ours that a server wrote for a request's trace is in Jaeger, with the same parent and
attributes, and the metrics in Prometheus count every send and every byte of them.
"""

import json
import math
import os
import re
import shutil
import tempfile
import time
import urllib.parse

import pytest
from support import sglang_runs
from support.observability.parts import prometheus_binary, wait_until
from support.parts import IN_CI, require_part
from support.sglang_runs import RECEIVE, SEND, Run
from test_collector_stack import COLLECTOR, Stack, agent_env, find_binary, jaeger_trace, start_jaeger, tags_of

from otel_kvtransfer import semconv

SETUP = "bash scripts/setup-observability.sh"
AGENT_HEALTH = "http://127.0.0.1:13133/"
PROMETHEUS = "http://127.0.0.1:19090"
DASHBOARD = os.path.join(COLLECTOR, "..", "dashboards", "kv_transfer.json")
RATE_INTERVAL = "4s"  # Grafana's $__rate_interval for a 1 s scrape interval
VARIABLES = {"service": ".*", "instance": ".*", "backend": ".*", "framework": ".*", "model": ".*", "role": ".*",
             "payload": "kv"}
# the families every served request feeds; the others (failures, stuck, late, drops, ...) need a fault to show
FED = {"kv_transfer_throughput_bytes_per_second", "kv_transfer_size_bytes", "kv_transfer_duration_seconds",
       "kv_transfer_descriptors", "kv_transfer_request_throughput_bytes_per_second", "kv_transfer_request_size_bytes",
       "kv_transfer_request_duration_seconds", "kv_transfer_receive_duration_seconds"}


@pytest.fixture(scope="module")
def collector_run():
    sglang_runs.require_parts("mooncake")
    jaeger, agent = find_binary("jaeger", "KVT_JAEGER"), find_binary("otelcol-agent", "KVT_OTELCOL")
    require_part(bool(jaeger and agent), f"Jaeger and the agent Collector built from the Go module proxy ({SETUP})")
    prometheus = prometheus_binary()
    require_part(bool(prometheus), f"Debian prometheus ({SETUP})")
    from sglang_serving import deployment as dep

    base = tempfile.mkdtemp(prefix="kvt-sglang-collector-")
    # one service.instance.id per server: the agent's exporter keeps one series per (job, instance, labels)
    servers = [dep.Server(name, env={"OTEL_RESOURCE_ATTRIBUTES": f"service.instance.id={name}-0"})
               for name in ("prefill", "decode")]
    deployment = dep.Deployment(os.path.join(base, "pd"), exporters=["otlp", "kvtransfer_file"], servers=servers,
                                # an exemplar leaves the SDK once, and the agent serves a series' latest point:
                                # it is scrapable until the next export, so export slower than Prometheus scrapes
                                extra_env={"OTEL_METRICS_EXPORTER": "otlp", "OTEL_METRIC_EXPORT_INTERVAL": "3000"},
                                server_flags=["--sleep-on-idle"])
    stack = None
    try:
        deployment.start()
        stack = Stack(base, nsenter=deployment.nsenter)
        start_jaeger(stack, jaeger)
        # the agent listens on 127.0.0.1:4317 (gRPC), the servers' OTLP endpoint in the deployment
        stack.start("agent", [agent, "--config", os.path.join(COLLECTOR, "agent.yaml")], agent_env())
        stack.wait_healthy("agent", AGENT_HEALTH)
        config = os.path.join(base, "prometheus.yml")
        with open(config, "w", encoding="utf-8") as handle:
            handle.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
                         "  - job_name: otel-collector-kvtransfer\n    honor_labels: true\n"
                         "    static_configs:\n      - targets: ['127.0.0.1:8889']\n")
        stack.start("prometheus", [prometheus, f"--config.file={config}",
                                   f"--storage.tsdb.path={os.path.join(base, 'tsdb')}",
                                   f"--web.listen-address={PROMETHEUS[len('http://'):]}",
                                   "--enable-feature=exemplar-storage"], {"PATH": os.environ.get("PATH", "")})
        stack.wait_healthy("prometheus", f"{PROMETHEUS}/-/ready")
        started = time.time()
        requests = dep.prompts(4, 200, 4, repeat_every=2, rid_prefix="collector")
        results = deployment.generate(requests[:2])
        # the rest once Prometheus holds the series: rate() sees only increases after a series' first sample
        wait_until(lambda: _total(stack, 'sum(kv_transfer_size_bytes_count{job="sglang-prefill"})') > 0, 60, 1.0,
                   what="the first scrape with the servers' metrics")
        results += deployment.generate(requests[2:])
        run = Run(deployment, requests, results).wait_for_spans()
        yield run, stack, started
    finally:
        if stack is not None:
            stack.stop()
        deployment.stop()
        if not IN_CI:
            shutil.rmtree(base, ignore_errors=True)


def _query(stack, path, **params):
    body = stack.get_json(f"{PROMETHEUS}{path}?{urllib.parse.urlencode(params)}")
    assert body is not None and body["status"] == "success", (path, params, body)
    return body["data"]


def _total(stack, expr) -> float:
    result = _query(stack, "/api/v1/query", query=expr)["result"]
    return float(result[0]["value"][1]) if result else -1.0


def test_each_request_trace_in_jaeger_has_both_servers_and_exact_bytes(collector_run):
    run, stack, _ = collector_run
    from sglang_serving import deployment as dep

    config = dep.model_config()
    for request in run.requests:
        span = run.request_of(request["rid"])
        ours = [s for _, s in run.spans if s.trace_id == span.trace_id]
        trace = jaeger_trace(stack, span.trace_id, min_spans=len(ours), timeout=90)
        by_id = {s["spanID"]: s for s in trace["spans"]}
        # every span of ours in the servers' span files is in Jaeger, under the same parent, with the same name
        for mine in ours:
            got = by_id.get(mine.span_id)
            assert got is not None, (request["rid"], mine.name)
            assert got["operationName"] == mine.name
            parents = [r["spanID"] for r in got["references"] if r["refType"] == "CHILD_OF"]
            assert parents == ([mine.parent_span_id] if mine.parent_span_id else []), (mine.name, parents)
        assert sum(1 for s in trace["spans"] if s["operationName"].startswith("kv_transfer.")) == len(ours)

        services = {trace["processes"][s["processID"]]["serviceName"] for s in trace["spans"]}
        assert {"sglang-prefill", "sglang-decode"} <= services, services
        request_span = by_id[span.span_id]
        assert trace["processes"][request_span["processID"]]["serviceName"] == "sglang-prefill"

        # request -> send children, each with the exact bytes the span file has; the KV adds up to the model's
        sends = run.children(span, SEND)
        assert sends
        for send in sends:
            got = tags_of(by_id[send.span_id]["tags"])
            assert got["kv_transfer.bytes"] == send.attributes["kv_transfer.bytes"]
            assert got["kv_transfer.payload"] == send.attributes["kv_transfer.payload"]
        kv = sum(tags_of(by_id[s.span_id]["tags"])["kv_transfer.bytes"] for s in sends
                 if s.attributes["kv_transfer.payload"] == "kv")
        assert kv == dep.expected_kv_bytes(len(request["input_ids"]), config)
        assert tags_of(request_span["tags"])["kv_transfer.bytes"] == sum(
            s.attributes["kv_transfer.bytes"] for s in sends)

        # the decode's receive, in the same trace, from the decode server
        receive = run.receive_of(span.attributes["kv_transfer.bootstrap_room"])
        assert receive.trace_id == span.trace_id and receive.name == RECEIVE
        got = by_id[receive.span_id]
        assert trace["processes"][got["processID"]]["serviceName"] == "sglang-decode"
        assert tags_of(got["tags"])["kv_transfer.role"] == "decode"


def test_prometheus_counts_every_send_through_the_collector(collector_run):
    """The metrics the servers pushed over OTLP, scraped from the agent: every send and byte of the span files."""
    run, stack, _ = collector_run
    sends = [s for name, s in run.spans if name == "prefill" and s.name == SEND]
    requests = [s for name, s in run.spans if name == "prefill" and s.name == semconv.SPAN_REQUEST]
    receives = [s for name, s in run.spans if name == "decode" and s.name == RECEIVE]
    wanted = {
        'sum(kv_transfer_size_bytes_count{job="sglang-prefill"})': len(sends),
        'sum(kv_transfer_size_bytes_sum{job="sglang-prefill"})': sum(s.attributes[semconv.BYTES] for s in sends),
        'sum(kv_transfer_request_size_bytes_count{job="sglang-prefill"})': len(requests),
        'sum(kv_transfer_receive_duration_seconds_count{job="sglang-decode"})': len(receives),
    }

    def all_counted():
        got = {expr: _total(stack, expr) for expr in wanted}
        return got if got == {k: float(v) for k, v in wanted.items()} else None

    wait_until(all_counted, 60, 1.0, what=f"Prometheus counting {wanted}")  # export every 3 s, batch 1 s, scrape 1 s
    series = _query(stack, "/api/v1/series", **{"match[]": 'kv_transfer_size_bytes_count{job="sglang-prefill"}'})
    assert {s["instance"] for s in series} == {"prefill-0"}
    assert {s[semconv.BACKEND.replace(".", "_")] for s in series} == {"mooncake"}
    assert all(s.get("host_name") for s in series)  # the agent's resourcedetection, a constant label


def _dashboard_queries():
    with open(DASHBOARD, encoding="utf-8") as handle:
        dashboard = json.load(handle)
    queries = [(panel["title"], target["expr"]) for panel in dashboard["panels"]
               for target in panel.get("targets", [])]
    variables = [(v["name"], v["query"]["query"]) for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return queries, variables


def _substitute(expr: str) -> str:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    for name, value in VARIABLES.items():
        expr = expr.replace(f"${name}", value)
    assert "$" not in expr, expr
    return expr


def test_dashboard_queries_answer_over_the_collector(collector_run):
    """Every dashboard query evaluates over what Prometheus scraped from the agent; each one over the families that
    served requests feed returns data, and every variable has values (the model one: the models the spans name)."""
    run, stack, started = collector_run
    sends = sum(1 for name, s in run.spans if name == "prefill" and s.name == SEND)
    wait_until(lambda: _total(stack, 'sum(kv_transfer_size_bytes_count{job="sglang-prefill"})') == sends, 60, 1.0,
               what="every send scraped")
    time.sleep(2)  # a step past the last scrape
    end = time.time()
    queries, variables = _dashboard_queries()
    fed = 0
    for title, expr in queries:
        concrete = _substitute(expr)
        data = _query(stack, "/api/v1/query_range", query=concrete, start=f"{started:.3f}", end=f"{end:.3f}",
                      step="1")
        values = [float(v) for series in data["result"] for _, v in series["values"]]
        finite = [v for v in values if not math.isnan(v) and not math.isinf(v)]
        # metric names only: label matchers, by/without lists and strings name labels too (kv_transfer_payload)
        bare = re.sub(r'"[^"]*"|\{[^}]*\}|\b(?:by|without)\s*\([^)]*\)', " ", concrete)
        families = {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"\bkv_transfer_\w+", bare)}
        if families and families <= FED:
            fed += 1
            assert finite, f"{title}: no data for {concrete}"
    assert fed >= 10, fed
    # a model variable has values only where the request spans name the model
    models = {s.attributes.get("gen_ai.request.model") for _, s in run.spans if s.name == semconv.SPAN_REQUEST}
    for name, query in variables:
        match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query)
        values = _query(stack, f"/api/v1/label/{match.group(2)}/values", **{"match[]": _substitute(match.group(1))})
        if match.group(2) == "gen_ai_request_model":
            assert set(values) == models - {None}, (values, models)
            continue
        assert values, (name, query)
        if name == "service":
            assert "sglang-prefill" in values, values


def test_an_exemplar_opens_its_send_span_in_jaeger(collector_run):
    """The dashboard's "click the dot, open the trace": each stored exemplar names a send span that Jaeger has."""
    run, stack, started = collector_run

    def exemplars():
        data = _query(stack, "/api/v1/query_exemplars", query="kv_transfer_throughput_bytes_per_second_bucket",
                      start=f"{started:.3f}", end=f"{time.time():.3f}")
        return [e["labels"] for series in data for e in series["exemplars"]]

    try:
        found = wait_until(exemplars, 60, 1.0, what="exemplars in Prometheus")
    except TimeoutError:
        answer = stack.http("GET", "http://127.0.0.1:8889/metrics", accept="application/openmetrics-text;version=1.0.0")
        lines = [line for line in (answer or (0, ""))[1].splitlines() if " # {" in line]
        raise AssertionError(f"no exemplar in Prometheus; the agent serves these: {lines[:6]}") from None
    ours = {s.span_id: s for _, s in run.spans if s.name == SEND}
    for labels in found:
        assert labels["span_id"] in ours, labels
        trace = jaeger_trace(stack, labels["trace_id"])
        (span,) = [s for s in trace["spans"] if s["spanID"] == labels["span_id"]]
        assert span["operationName"] == SEND
        assert tags_of(span["tags"])[semconv.BYTES] == ours[labels["span_id"]].attributes[semconv.BYTES]
