"""collector/*: every Collector config parses, names only components that otelcol-contrib 0.159.0 ships (list in
collector/otelcol-contrib-components.yaml, read from the release manifest and the components' metadata.yaml),
and every pipeline reference resolves. No collector binary installs on these machines, so this is the check; the
compose file, Prometheus, Tempo and Grafana provisioning files are checked against each other the same way."""

import os
import re
import shutil
import subprocess

import pytest
import yaml

from _observability_parts import ROOT, SETUP
from conftest import require_part

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
    from otel_kvtransfer import semconv  # pylint: disable=import-outside-toplevel

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
