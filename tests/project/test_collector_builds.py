"""collector/builder-*.yaml, the modules generated from them and collector/jaeger/: each Collector build holds
exactly the components its config uses, at one release, and the checked-in sources and go.mod say the same as
the manifest; Jaeger's version is the one compose pins and the set-up script names. (The binaries themselves run
in tests/deployments/test_collector_stack.py.)"""

import os
import re

import pytest
import yaml
from support.observability.parts import ROOT

COLLECTOR = os.path.join(ROOT, "collector")
KINDS = ("receivers", "processors", "exporters", "extensions", "connectors")
BUILDS = (("agent.yaml", "builder-agent.yaml"), ("gateway.yaml", "builder-gateway.yaml"))
CORE = "go.opentelemetry.io/collector/"
CONTRIB = "github.com/open-telemetry/opentelemetry-collector-contrib/"


def _load(path):
    with open(path, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def _read(path):
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def _modules_by_type():
    """config type (and deprecated type) -> module, from the components file the config test checks against."""
    types = _load(os.path.join(COLLECTOR, "otelcol-contrib-components.yaml"))["types"]
    found = {}
    for kind in KINDS:
        for type_name, entry in (types.get(kind) or {}).items():
            found[(kind, type_name)] = entry["module"]
            if entry.get("deprecated_type"):
                found[(kind, entry["deprecated_type"])] = entry["module"]
    return found


def _manifest_modules(manifest):
    """kind -> {module: version} of a builder manifest."""
    return {kind: dict(entry["gomod"].split() for entry in manifest.get(kind) or []) for kind in KINDS}


@pytest.fixture(params=BUILDS, ids=[config for config, _ in BUILDS])
def build(request):
    config_name, manifest_name = request.param
    manifest = _load(os.path.join(COLLECTOR, manifest_name))
    return _load(os.path.join(COLLECTOR, config_name)), manifest, os.path.join(ROOT, manifest["dist"]["output_path"])


def test_each_build_holds_exactly_the_components_its_config_uses(build):
    config, manifest, _ = build
    by_type = _modules_by_type()
    modules = _manifest_modules(manifest)
    for kind in KINDS:
        used = {by_type[(kind, component_id.split("/", 1)[0])] for component_id in config.get(kind) or {}}
        assert used == set(modules[kind]), (kind, used ^ set(modules[kind]))


def test_each_build_is_at_one_release(build):
    _, manifest, _ = build
    versions = {module: version for kind in KINDS for module, version in _manifest_modules(manifest)[kind].items()}
    contrib = {v for m, v in versions.items() if m.startswith(CONTRIB)}
    core = {v for m, v in versions.items() if m.startswith(CORE)}
    assert len(contrib) == 1 and len(core) == 1, versions
    assert contrib == core  # the contrib release built on that core release
    assert manifest["dist"]["version"] == contrib.pop().lstrip("v")
    providers = {entry["gomod"].split()[1] for entry in manifest["providers"]}
    assert len(providers) == 1 and providers.pop().startswith("v1.")  # the stable modules of the same release


def test_the_generated_sources_match_the_manifest(build):
    _, manifest, out = build
    wanted = {module: version for kind in KINDS for module, version in _manifest_modules(manifest)[kind].items()}
    components = _read(os.path.join(out, "components.go"))
    imported = set(re.findall(r'^\s*\w+ "([^"]+)"$', components, re.M)) - {
        "go.opentelemetry.io/collector/service/telemetry/otelconftelemetry"}
    assert imported == set(wanted), imported ^ set(wanted)
    for module, version in wanted.items():
        assert f'"{module} {version}"' in components, module
    go_mod = _read(os.path.join(out, "go.mod"))
    assert f"module {manifest['dist']['module']}\n" in go_mod
    for module, version in wanted.items():
        assert re.search(rf"^\s+{re.escape(module)} {re.escape(version)}$", go_mod, re.M), module
    for replace in manifest.get("replaces") or []:
        assert f"replace {replace}\n" in go_mod, replace
    assert os.path.getsize(os.path.join(out, "go.sum")) > 0


def test_jaeger_version_is_the_one_compose_pins():
    go_mod = _read(os.path.join(COLLECTOR, "jaeger", "go.mod"))
    (version,) = re.findall(r"^\s+github\.com/jaegertracing/jaeger (v\S+)", go_mod, re.M)
    assert "tool github.com/jaegertracing/jaeger/cmd/jaeger" in go_mod
    script = _read(os.path.join(ROOT, "scripts", "setup-go-binaries.sh"))
    assert f"JAEGER_VERSION={version}" in script
    # the module's v1.N tags carry Jaeger v2: v1.75.0 is 2.12.0
    (released,) = re.findall(r"latestVersion=v(2\.\d+\.\d+)", script)
    assert int(version.split(".")[1]) - int(released.split(".")[1]) == 63
    compose = _load(os.path.join(COLLECTOR, "compose.yaml"))
    assert compose["services"]["jaeger"]["image"] == f"jaegertracing/jaeger:{released}"
