"""collector/*: every Collector config parses, names only components that otelcol-contrib 0.159.0 ships (list in
collector/otelcol-contrib-components.yaml, read from the release manifest and the components' metadata.yaml),
and every pipeline reference resolves (the compose file's image); the compose file, Prometheus, Tempo and Grafana
provisioning files are checked against each other the same way. The Collectors built here run the configs for real:
tests/deployments/test_collector_stack.py."""

import os
import re
import shutil
import subprocess

import pytest
import yaml
from support.observability.parts import ROOT, SETUP
from support.parts import require_part

COLLECTOR = os.path.join(ROOT, "collector")
PROVISIONING = os.path.join(ROOT, "dashboards", "provisioning")
KINDS = ("receivers", "processors", "exporters", "extensions", "connectors")
SIGNALS = ("traces", "metrics", "logs", "profiles")
CONFIGS = ("agent.yaml", "gateway.yaml")


def _load(path):
    with open(path, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


@pytest.fixture(scope="module")
def components():
    return _load(os.path.join(COLLECTOR, "otelcol-contrib-components.yaml"))


@pytest.fixture(scope="module", params=CONFIGS)
def config(request):
    return request.param, _load(os.path.join(COLLECTOR, request.param))


def _type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def test_component_list_is_consistent(components):
    assert components["distribution"] == "otelcol-contrib"
    for kind in KINDS:
        modules = components["modules"][kind]
        assert modules == sorted(set(modules))
        for type_name, entry in components["types"][kind].items():
            assert entry["module"] in modules, (kind, type_name)
    # a few anchors of the real manifest: a complete list has >100 receivers and the usual exporters
    assert len(components["modules"]["receivers"]) > 100
    assert "github.com/open-telemetry/opentelemetry-collector-contrib/processor/tailsamplingprocessor" in \
        components["modules"]["processors"]


def test_every_component_ships_in_otelcol_contrib(config, components):
    name, cfg = config
    for kind in KINDS:
        for component_id in (cfg.get(kind) or {}):
            known = components["types"][kind]
            type_name = _type(component_id)
            deprecated = {e.get("deprecated_type"): t for t, e in known.items() if e.get("deprecated_type")}
            assert type_name in known, f"{name}: {kind}.{component_id}: no such component in otelcol-contrib " \
                                       f"{components['version']} (or not yet listed in the components file)"
            assert type_name not in deprecated, f"{name}: {component_id} uses a deprecated type"


def test_pipelines_reference_defined_components(config):
    name, cfg = config
    service = cfg["service"]
    defined = {kind: set(cfg.get(kind) or {}) for kind in KINDS}
    for extension in service.get("extensions", []):
        assert extension in defined["extensions"], (name, extension)
    used = {kind: set() for kind in KINDS}
    for pipeline_id, pipeline in service["pipelines"].items():
        signal = pipeline_id.split("/", 1)[0]
        assert signal in SIGNALS, (name, pipeline_id)
        assert pipeline.get("receivers") and pipeline.get("exporters"), (name, pipeline_id)
        for kind in ("receivers", "processors", "exporters"):
            for ref in pipeline.get(kind, []):
                ok = ref in defined[kind] or (kind != "processors" and ref in defined["connectors"])
                assert ok, f"{name}: pipeline {pipeline_id} names undefined {kind[:-1]} {ref}"
                used[kind].add(ref)
        assert len(set(pipeline.get("processors", []))) == len(pipeline.get("processors", []))
        processors = pipeline.get("processors", [])
        if "memory_limiter" in processors:
            assert processors[0] == "memory_limiter", (name, pipeline_id)
        if "batch" in processors and "tail_sampling" in processors:
            assert processors.index("tail_sampling") < processors.index("batch"), (name, pipeline_id)
    assert used["receivers"] == defined["receivers"], (name, defined["receivers"] - used["receivers"])
    assert used["processors"] == defined["processors"], (name, defined["processors"] - used["processors"])
    # exporters may be defined as documented alternatives (remote write, debug) without being used
    assert defined["exporters"] - used["exporters"] <= {"prometheusremotewrite", "debug"}, name


def test_env_references_have_the_collector_syntax(config):
    name, _ = config
    with open(os.path.join(COLLECTOR, name), encoding="utf-8") as handle:
        text = handle.read()
    for ref in re.findall(r"\$\{[^}]*\}", text):
        assert re.fullmatch(r"\$\{env:[A-Z_][A-Z0-9_]*(:-[^}]*)?\}", ref), (name, ref)


def _pipelines(cfg, signal):
    return {pid: p for pid, p in cfg["service"]["pipelines"].items() if pid.split("/", 1)[0] == signal}


def test_agent_sends_traces_to_jaeger_and_tempo_and_metrics_to_prometheus():
    cfg = _load(os.path.join(COLLECTOR, "agent.yaml"))
    assert set(cfg["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    traces = _pipelines(cfg, "traces")
    exporters = {e for p in traces.values() for e in p["exporters"]}
    assert {"otlp_grpc/jaeger", "otlp_grpc/tempo"} <= exporters
    for pipeline in list(traces.values()) + list(_pipelines(cfg, "metrics").values()):
        assert pipeline["processors"][0] == "memory_limiter"
        assert "batch" in pipeline["processors"] and "resourcedetection" in pipeline["processors"]
    metrics = {e for p in _pipelines(cfg, "metrics").values() for e in p["exporters"]}
    assert "prometheus" in metrics
    assert cfg["exporters"]["prometheus"]["enable_open_metrics"] is True  # exemplars need OpenMetrics
    assert cfg["exporters"]["prometheusremotewrite"]["endpoint"].endswith("/api/v1/write}")
    assert not cfg["processors"]["resourcedetection"].get("override", True)  # never clobber service.name


def test_gateway_routes_by_trace_id_before_tail_sampling():
    from otel_kvtransfer import semconv

    cfg = _load(os.path.join(COLLECTOR, "gateway.yaml"))
    pipelines = cfg["service"]["pipelines"]
    lb = cfg["exporters"]["loadbalancing"]
    assert lb["routing_key"] == "traceID"
    route = [p for p in pipelines.values() if "loadbalancing" in p["exporters"]]
    sample = [p for p in pipelines.values() if "tail_sampling" in p.get("processors", [])]
    assert len(route) == 1 and len(sample) == 1
    assert "tail_sampling" not in route[0].get("processors", [])
    # the sampling tier receives only what the load balancer routed to it, on the port the resolver uses
    (sample_receiver,) = sample[0]["receivers"]
    assert sample_receiver not in route[0]["receivers"]
    endpoint = cfg["receivers"][sample_receiver]["protocols"]["grpc"]["endpoint"]
    assert endpoint.rsplit(":", 1)[1] == str(lb["resolver"]["dns"]["port"])
    policies = {p["type"]: p for p in cfg["processors"]["tail_sampling"]["policies"]}
    assert policies["status_code"]["status_code"]["status_codes"] == ["ERROR"]
    conditions = " ".join(policies["ottl_condition"]["ottl_condition"]["span"])
    assert f'name == "{semconv.SPAN_SEND}"' in conditions
    assert f'attributes["{semconv.THROUGHPUT}"]' in conditions
    assert "probabilistic" in policies and "latency" in policies
    # metrics pass through unsampled
    for pipeline in _pipelines(cfg, "metrics").values():
        assert "tail_sampling" not in pipeline.get("processors", [])


@pytest.fixture(scope="module")
def compose():
    return _load(os.path.join(COLLECTOR, "compose.yaml"))


def test_compose_runs_the_stack_on_loopback(compose, components):
    services = compose["services"]
    assert {"otel-collector", "jaeger", "tempo", "prometheus", "grafana"} <= set(services)
    image = services["otel-collector"]["image"]
    assert image == f"otel/opentelemetry-collector-contrib:{components['version']}"
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert os.path.exists(os.path.normpath(os.path.join(COLLECTOR, source))), (name, source)
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    command = " ".join(services["otel-collector"]["command"])
    assert "agent.yaml" in command
    for key, value in services["otel-collector"]["environment"].items():
        host = re.sub(r"^https?://", "", value).split(":", 1)[0].split("/", 1)[0]
        assert host in services, (key, value)


def test_prometheus_config_scrapes_the_collector_exporter():
    cfg = _load(os.path.join(COLLECTOR, "prometheus.yml"))
    agent = _load(os.path.join(COLLECTOR, "agent.yaml"))
    port = agent["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "otel-collector-kvtransfer"]
    assert job["honor_labels"] is True  # keep job/instance from service.name/service.instance.id
    assert job["static_configs"][0]["targets"] == [f"otel-collector:{port}"]


def test_promtool_accepts_the_prometheus_config():
    promtool = shutil.which("promtool")
    require_part(bool(promtool), f"promtool (Debian prometheus; {SETUP})")
    result = subprocess.run([promtool, "check", "config", "--syntax-only", os.path.join(COLLECTOR, "prometheus.yml")],
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_tempo_receives_otlp_where_the_agent_sends():
    tempo = _load(os.path.join(COLLECTOR, "tempo.yaml"))
    agent = _load(os.path.join(COLLECTOR, "agent.yaml"))
    grpc = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert grpc.startswith("0.0.0.0:")  # Tempo >= 2.7 binds receivers to localhost unless told
    target = agent["exporters"]["otlp_grpc/tempo"]["endpoint"]
    assert target.rstrip("}").rsplit(":", 1)[1] == grpc.rsplit(":", 1)[1]


def test_grafana_provisioning_links_exemplars_to_traces(compose):
    datasources = _load(os.path.join(PROVISIONING, "datasources", "otel-kvtransfer.yaml"))["datasources"]
    by_uid = {d["uid"]: d for d in datasources}
    assert by_uid["prometheus"]["type"] == "prometheus" and by_uid["prometheus"].get("isDefault")
    destinations = by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert destinations and all(d["name"] == "trace_id" for d in destinations)  # the exporter's exemplar label
    assert {d["datasourceUid"] for d in destinations} <= set(by_uid)
    for uid in ("tempo", "jaeger"):
        host = by_uid[uid]["url"].split("//", 1)[1].split(":", 1)[0]
        assert host in compose["services"], uid
    providers = _load(os.path.join(PROVISIONING, "dashboards", "otel-kvtransfer.yaml"))["providers"]
    mounts = [v.split(":")[1] for v in compose["services"]["grafana"]["volumes"]]
    for provider in providers:
        path = provider["options"]["path"]
        assert any(m.startswith(path) for m in mounts), path


# --- tail sampling: what the policies keep ----------------------------------------------------------------------

_OTTL_TOKEN = re.compile(r'\s*(?:(?P<attr>attributes\["(?P<key>[^"\\]+)"\])|(?P<str>"[^"\\]*")|(?P<num>-?\d+(?:\.\d+)?)'
                         r'|(?P<op>==|!=|<=|>=|<|>|\(|\))|(?P<word>[A-Za-z_]+))')


class _Value:
    """An OTTL value: comparisons with nil, or between a number and a string, are false (never an error)."""

    def __init__(self, value):
        self.value = value

    def cmp(self, op, other):
        a, b = self.value, other.value
        if op == "==":
            return a == b
        if op == "!=":
            return a != b
        if a is None or b is None or isinstance(a, str) != isinstance(b, str):
            return False
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]


def _ottl_span_condition(condition: str, env=None):
    """A predicate over (span name, attributes) for the subset of OTTL the gateway's conditions use (comparisons of
    `name`, `attributes["k"]`, strings, numbers and nil, joined by and / or / not with parentheses). Environment
    references are resolved the Collector's way (`${env:NAME:-default}`). Anything else fails the test loudly."""
    env = env or {}
    condition = re.sub(r"\$\{env:([A-Z_][A-Z0-9_]*)(?::-([^}]*))?\}",
                       lambda m: env.get(m.group(1), m.group(2) or ""), condition)
    operands, source, pos = [], [], 0
    while pos < len(condition.rstrip()):
        match = _OTTL_TOKEN.match(condition, pos)
        assert match and match.end() > pos, f"unsupported OTTL at {condition[pos:pos + 30]!r}"
        pos = match.end()
        if match.group("attr"):
            source.append(f"_v(attrs.get({match.group('key')!r}))")
        elif match.group("str"):
            source.append(f"_v({match.group('str')})")
        elif match.group("num"):
            source.append(f"_v({match.group('num')})")
        elif match.group("op") in ("(", ")"):
            source.append(match.group("op"))
        elif match.group("op"):
            source.append(f".cmp({match.group('op')!r}, ")
            operands.append(len(source))
        else:
            word = match.group("word")
            assert word in ("name", "nil", "and", "or", "not"), f"unsupported OTTL word {word}"
            source.append({"name": "_v(name)", "nil": "_v(None)"}.get(word, f" {word} "))
    # `a OP b` -> `a.cmp(OP, b)`: close each comparison right after its right operand
    for index in reversed(operands):
        source[index] = source[index] + ")"
    code = "".join(source)

    def keep(name, attrs):
        return eval(code, {"__builtins__": {}}, {"_v": _Value, "name": name, "attrs": attrs})

    return keep


def _send(payload, nbytes, seconds):
    return {"kv_transfer.payload": payload, "kv_transfer.bytes": nbytes,
            "kv_transfer.throughput": nbytes / seconds if nbytes else None}


def test_slow_transfer_policy_keeps_only_large_slow_kv_sends():
    """Every aux send (a few KiB, latency-bound) was 'slow' by bytes/s, so the policy kept ~100% of traces: it now
    looks only at KV sends of >= 1 MiB (the default), slower than the floor."""
    cfg = _load(os.path.join(COLLECTOR, "gateway.yaml"))
    (policy,) = [p for p in cfg["processors"]["tail_sampling"]["policies"] if p["name"] == "keep-slow-transfers"]
    (condition,) = policy["ottl_condition"]["span"]
    keep = _ottl_span_condition(condition)
    assert not keep("kv_transfer.send", _send("aux", 4 << 10, 0.005))          # 0.8 MB/s aux: not a slow transfer
    assert not keep("kv_transfer.send", _send("state", 64 << 10, 0.01))
    assert not keep("kv_transfer.send", _send("kv", (1 << 20) - 1, 0.01))      # a small KV tail
    assert not keep("kv_transfer.send", _send("kv", 64 << 20, 0.01))           # 6.7 GB/s: fast
    assert not keep("kv_transfer.send", {"kv_transfer.payload": "kv", "kv_transfer.bytes": 8 << 20})  # failed
    assert not keep("kv_transfer.request", _send("kv", 64 << 20, 1.0))
    assert keep("kv_transfer.send", _send("kv", 1 << 20, 0.01))                # 105 MB/s on 1 MiB: slow
    assert keep("kv_transfer.send", _send("kv", 64 << 20, 1.0))
    # the thresholds follow their environment variables
    strict = _ottl_span_condition(condition, {"KVT_SLOW_TRANSFER_MIN_BYTES": "4096",
                                              "KVT_SLOW_TRANSFER_BYTES_PER_SECOND": "1000000"})
    assert strict("kv_transfer.send", _send("kv", 4096, 0.01))
    assert not strict("kv_transfer.send", _send("kv", 4096, 1e-4))


def test_tail_sampling_remembers_decisions_for_late_spans():
    """Decode spans can end long after decision_wait: without a decision cache a late span starts a new partial
    trace that the policies judge alone."""
    sampling = _load(os.path.join(COLLECTOR, "gateway.yaml"))["processors"]["tail_sampling"]
    cache = sampling["decision_cache"]
    assert set(cache) == {"sampled_cache_size", "non_sampled_cache_size"}
    # at least as many decided traces remembered as are held undecided
    assert cache["sampled_cache_size"] >= sampling["num_traces"]
    assert cache["non_sampled_cache_size"] >= sampling["num_traces"]


# --- compose: every Prometheus target is reachable, every variable means something ------------------------------

def test_collector_self_metrics_listen_where_prometheus_scrapes():
    """The Collector serves its own metrics on localhost:8888 unless told otherwise: the scrape of otel-collector:8888
    from the Prometheus container would be down."""
    prometheus = _load(os.path.join(COLLECTOR, "prometheus.yml"))
    (job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == "otel-collector-self"]
    (target,) = job["static_configs"][0]["targets"]
    host, port = target.rsplit(":", 1)
    assert host == "otel-collector"
    for name in CONFIGS:
        readers = _load(os.path.join(COLLECTOR, name))["service"]["telemetry"]["metrics"]["readers"]
        exporters = [r["pull"]["exporter"]["prometheus"] for r in readers if "pull" in r]
        assert any(_default(e["host"]) == "0.0.0.0" and _default(e["port"]) == port
                   for e in exporters), (name, exporters)


def _default(value) -> str:
    """What `${env:NAME:-default}` gives when NAME is unset (compose sets none of these); any other value as is."""
    found = re.fullmatch(r"\$\{env:[A-Z_][A-Z0-9_]*:-([^}]*)\}", str(value))
    return found.group(1) if found else str(value)


def test_jaeger_gets_no_v1_variables(compose):
    """COLLECTOR_OTLP_ENABLED was Jaeger v1's switch; Jaeger v2 receives OTLP by default and ignores it."""
    jaeger = compose["services"]["jaeger"]
    assert jaeger["image"].split(":", 1)[1].startswith("2.")
    assert not [k for k in (jaeger.get("environment") or {}) if k.startswith(("COLLECTOR_", "SPAN_STORAGE_"))]


def test_resource_attributes_become_metric_labels():
    """Resource attributes such as host.name reach only `target_info` unless the exporter copies them: a short,
    restart-stable list (never a wildcard: process.pid would make a new series per restart)."""
    exporter = _load(os.path.join(COLLECTOR, "agent.yaml"))["exporters"]["prometheus"]
    assert "resource_to_telemetry_conversion" not in exporter  # deprecated in favour of resource_constant_labels
    included = exporter["resource_constant_labels"]["included"]
    assert "host.name" in included
    assert not [k for k in included if "*" in k or "?" in k or k.startswith(("process.", "service."))]


def test_compose_prometheus_loads_the_alert_rules(compose):
    """The stack evaluates the alert rules users import: prometheus.yml names the file compose mounts."""
    rule_files = _load(os.path.join(COLLECTOR, "prometheus.yml"))["rule_files"]
    mounts = {}  # container path -> host path
    for volume in compose["services"]["prometheus"]["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = source
    for path in rule_files:
        assert path in mounts, path
        source = os.path.normpath(os.path.join(COLLECTOR, mounts[path]))
        assert source == os.path.join(ROOT, "dashboards", "alerts.yaml")
