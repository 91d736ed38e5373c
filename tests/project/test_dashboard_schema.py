"""dashboards/*.json against Grafana's own schema (npm @grafana/schema, checked by TypeScript), plus what the
schema cannot see: units, variables, datasource references and the metric names the panels query."""

import copy
import glob
import json
import os
import re
import subprocess

import pytest
from support.observability.parts import NODE_DIR, ROOT, SETUP, node_ready
from support.observability.promnames import DESIGN_METRICS, series_names
from support.parts import require_part

DASHBOARDS = sorted(glob.glob(os.path.join(ROOT, "dashboards", "*.json")))
MAIN = os.path.join(ROOT, "dashboards", "kv_transfer.json")
CHECK = os.path.join(ROOT, "dashboards", "typecheck", "check.mjs")
KNOWN_SERIES = {name for metric in DESIGN_METRICS for name in series_names(*metric)}


def _typecheck(*paths):
    return subprocess.run(["node", CHECK, *paths], env={**os.environ, "NODE_PATH_ROOT": NODE_DIR},
                          capture_output=True, text=True, timeout=120, check=False)


def _panels(dashboard):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _exprs(dashboard):
    """(panel title, expression) of every query of ours (the engines' own series beside them: `_engine_exprs`)."""
    return [(panel["title"], target["expr"]) for panel in _panels(dashboard) for target in panel.get("targets", [])
            if not ENGINE_SERIES.search(target["expr"])]


# The engines' own series (SGLang's, vLLM's) that some panels show beside ours: a query of its own, which reads no
# series of ours and none of our labels (the engines' series carry theirs), and shows nothing where the engine is not
# scraped.
ENGINE_SERIES = re.compile(r"\b((?:sglang|vllm):[a-z_]+)")


def _engine_exprs(dashboard):
    return [(panel["title"], target["expr"]) for panel in _panels(dashboard) for target in panel.get("targets", [])
            if ENGINE_SERIES.search(target["expr"])]


def test_dashboards_exist():
    assert MAIN in DASHBOARDS


@pytest.fixture(scope="module")
def typecheck_ready():
    require_part(node_ready(), f"node + @grafana/schema + typescript in {NODE_DIR} ({SETUP})")


def test_dashboards_satisfy_grafana_schema(typecheck_ready):
    result = _typecheck(*DASHBOARDS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "satisfy Dashboard" in result.stdout


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["panels"][1]["fieldConfig"]["defaults"].__setitem__("unitt", "Bps"), "unitt"),
    (lambda d: d["panels"][1]["gridPos"].__setitem__("x", "0"), "not assignable to type 'number'"),
    (lambda d: d["panels"][6]["options"]["legend"].__setitem__("displayMode", "tables"), '"tables"'),
    (lambda d: d.pop("schemaVersion"), "schemaVersion"),
    (lambda d: [p for p in d["panels"] if p["type"] == "table"][0]["options"].__setitem__("cellHeight", "tiny"),
     '"tiny"'),  # table options are checked against the table plugin's own type
])
def test_typecheck_rejects_a_broken_dashboard(typecheck_ready, tmp_path, mutate, expected):
    """The check has teeth: a misspelt key, a wrong type, a bad enum value, a missing required field fail."""
    with open(MAIN, encoding="utf-8") as handle:
        dashboard = json.load(handle)
    broken = copy.deepcopy(dashboard)
    mutate(broken)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken, indent=2))
    result = _typecheck(str(path))
    assert result.returncode != 0
    assert expected in result.stdout + result.stderr


@pytest.fixture(scope="module")
def dashboard():
    with open(MAIN, encoding="utf-8") as handle:
        return json.load(handle)


def test_every_query_uses_only_the_collector_names(dashboard):
    for title, expr in _exprs(dashboard):
        names = set(re.findall(r"(?<![:\w])(kv_transfer_[a-z_]+)\b", expr))
        assert names, (title, expr)
        # label names (kv_transfer_payload, ...) follow `by (` / `{` ; metric names are the known series
        metric_names = {n for n in names if re.search(rf"\b{n}\s*(\{{|\[)", expr)}
        assert metric_names and metric_names <= KNOWN_SERIES, (title, metric_names - KNOWN_SERIES)


def test_every_design_metric_has_a_panel(dashboard):
    used = " ".join(expr for _, expr in _exprs(dashboard))
    for name, unit, kind in DESIGN_METRICS:
        family = series_names(name, unit, kind)[0].rsplit("_bucket", 1)[0]
        assert family in used, name


def test_units_make_grafana_show_rates_bytes_and_seconds(dashboard):
    units = {}
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit") or \
            panel.get("options", {}).get("yAxis", {}).get("unit")
        assert unit, panel["title"]
        units[panel["title"]] = unit
        exprs = " ".join(t["expr"] for t in panel["targets"])
        if "descriptors_bucket" in exprs:
            assert unit == "short", (panel["title"], unit)  # a count (bytes per descriptor: an override)
        elif "throughput_bytes_per_second" in exprs or ("size_bytes_sum" in exprs and "rate(" in exprs):
            assert unit == "Bps", (panel["title"], unit)  # bytes/sec (SI): GB/s
        elif "_seconds" in exprs and "histogram_quantile" in exprs:
            assert unit == "s", (panel["title"], unit)
        elif "size_bytes_bucket" in exprs:
            assert unit == "bytes", (panel["title"], unit)
        elif "compute_overlap" in exprs:
            assert unit == "percentunit", (panel["title"], unit)
        elif "inflight_oldest_age_seconds" in exprs:
            assert unit == "s", (panel["title"], unit)
        elif "kv_transfer_inflight" in exprs or "kv_transfer_stuck_total" in exprs:
            assert unit == "short", (panel["title"], unit)


FILTERS = {"service": "job", "instance": "instance", "backend": "kv_transfer_backend",
           "framework": "kv_transfer_framework", "model": "gen_ai_request_model", "role": "kv_transfer_role"}


def test_variables_filter_every_query(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(FILTERS) | {"datasource", "payload"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in list(FILTERS) + ["payload"]:
        # "All" is `.*`, which also matches a series without the label (a raw engine call has no framework)
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
        assert variables[name]["query"]["query"].endswith(f", {FILTERS.get(name, 'kv_transfer_payload')})")
    for title, expr in _exprs(dashboard):
        assert 'job=~"$service"' in expr and 'instance=~"$instance"' in expr, title
        # a filter on a label the metric never has would hide everything once a value is picked: only those the
        # metric carries (job and instance come from the resource, on every metric)
        applicable = next((names for family, names in FILTERS_OF.items() if family in expr), FILTERS)
        for name, label in FILTERS.items():
            assert (f'{label}=~"${name}"' in expr) == (name in applicable), (title, name)


# The metrics that do not carry the request's attributes, and the filters they do carry.
FILTERS_OF = {
    "instrumentation_dropped": ("service", "instance"),
    "peer_throughput": ("service", "instance"),  # only the peer
    "peer_busy_time": ("service", "instance"),
    "kv_transfer_busy_time_seconds_total{": ("service", "instance", "backend", "role"),  # only the process's
    "kv_transfer_inflight{": ("service", "instance"),  # only the kind
    "kv_transfer_inflight_oldest_age_seconds{": ("service", "instance"),
    "kv_transfer_stuck_total{": ("service", "instance", "backend", "role"),
    "connect_duration": ("service", "instance", "backend", "framework"),  # only the set-up call's own
    "receive_allocation_wait": ("service", "instance", "backend", "framework"),  # a receive's framework's own
    "integrity_mismatches": ("service", "instance", "backend", "framework"),
}


def test_the_engines_own_series_beside_ours_read_nothing_of_ours(dashboard):
    engine = _engine_exprs(dashboard)
    assert {title for title, _ in engine} >= {  # the questions an engine now answers in part (docs/telemetry.md)
        "Decode wait for KV memory p50 / p99 (allocation wait)",
        "Set-up call duration p50 / p99 (kv_transfer.connect)", "Posting time per send p50 / p99 by payload",
        "Late completions since start (KV landing after its request ended)",
        "Integrity mismatches since start (received KV that failed its check)"}
    for title, expr in engine:
        assert not re.search(r"(?<![:\w])kv_transfer_", expr) and "$" not in expr.replace("$__rate_interval", ""), \
            (title, expr)
        ours = [t for t in _exprs(dashboard) if t[0] == title]
        assert ours, title  # beside a query of ours, never alone


def _engine_sources():
    """Where the engines' own metric names are defined: the installed SGLang, and vLLM (its virtualenv's build and
    the newer releases the canary unpacked)."""
    import importlib.util
    import sys

    roots = []
    spec = importlib.util.find_spec("sglang")
    if spec and spec.submodule_search_locations:
        roots += list(spec.submodule_search_locations)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from vllm_serving import harness

    python = harness.vllm_python()
    venv = os.path.dirname(os.path.dirname(python))
    roots += glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "vllm"))
    cache = os.environ.get("KVT_CANARY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "otel-kvtransfer", "canary")
    roots += glob.glob(os.path.join(cache, "vllm", "*", "src", "vllm"))
    return roots


def test_the_engines_series_are_names_the_engines_define(dashboard):
    """Each engine series a panel reads is defined in that engine's source (a metric's name, as its Prometheus
    client exposes it: histograms with _bucket, counters with _total)."""
    roots = _engine_sources()
    require_part(any("sglang" in r for r in roots) and any("vllm" in r for r in roots),
                 f"sglang and vLLM sources ({SETUP})")
    wanted = {name for _, expr in _engine_exprs(dashboard) for name in ENGINE_SERIES.findall(expr)}
    defined = {}
    for root in roots:
        for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
            with open(path, encoding="utf-8", errors="replace") as handle:
                for name in re.findall(r"[\"']((?:sglang|vllm):[a-z_]+)[\"']", handle.read()):
                    defined.setdefault(name, set()).add(root)
    for series in wanted:
        family = re.sub(r"_(bucket|total)$", "", series)
        assert family in defined or series in defined, series


def test_throughput_quantiles_and_heatmap_are_kv_only_by_default(dashboard):
    """A 4 KiB aux send is latency-bound (0.8-25 MB/s in one demo, KV 90-1,118 MB/s): mixed into one histogram
    the quantiles describe neither. Per-transfer speed, duration, size and descriptor panels follow $payload,
    whose default is kv; panels that break down by payload (bytes/s, transfers/s by payload) show every payload."""
    (payload,) = [v for v in dashboard["templating"]["list"] if v["name"] == "payload"]
    assert payload["current"]["value"] == ["kv"]
    per_send = ("throughput_bytes_per_second_bucket", "duration_seconds_bucket", "size_bytes_bucket",
                "descriptors_bucket")
    checked = set()
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            if "kv_transfer_request_" in expr or "kv_transfer_receive_" in expr:
                continue
            if any(f"kv_transfer_{name}" in expr for name in per_send):
                assert 'kv_transfer_payload=~"$payload"' in expr, (panel["title"], expr)
                checked.add(panel["type"])
            if "by (kv_transfer_payload)" in expr:
                assert "$payload" not in expr, panel["title"]
    assert {"heatmap", "timeseries", "stat"} <= checked


def _panel_with(dashboard, series):
    found = [p for p in _panels(dashboard) if any(series in t["expr"] for t in p.get("targets", []))]
    assert found, series
    return found


def test_peer_wait_and_descriptor_panels(dashboard):
    """The decode side had no metric and no panel; nor did descriptors per transfer."""
    wait = _panel_with(dashboard, "kv_transfer_receive_duration_seconds_bucket")
    assert any(p["fieldConfig"]["defaults"]["unit"] == "s" and
               any("histogram_quantile(0.99" in t["expr"] for t in p["targets"]) for p in wait)
    assert _panel_with(dashboard, "kv_transfer_receive_duration_seconds_count")
    descriptors = _panel_with(dashboard, "kv_transfer_descriptors_bucket")
    assert any(p["fieldConfig"]["defaults"]["unit"] == "short" for p in descriptors)


def test_tail_panel_shows_the_wait_and_its_queued_part(dashboard):
    """What the first decode step waited for after prefill compute: p50 and p99 of the tail and of its queued part."""
    (panel,) = [p for p in _panels(dashboard) if p["title"] == "Time to first token spent waiting for KV"]
    assert panel["type"] == "timeseries" and panel["fieldConfig"]["defaults"]["unit"] == "s"
    exprs = [t["expr"] for t in panel["targets"]]
    for series in ("kv_transfer_request_tail_seconds_bucket", "kv_transfer_request_tail_queued_seconds_bucket"):
        for quantile in ("0.5", "0.99"):
            assert any(e.startswith(f"histogram_quantile({quantile}, sum by (le) (rate({series}{{") for e in exprs), \
                (series, quantile)


def test_slowest_peers_panel_lists_peers_lowest_first(dashboard):
    """One row per peer (address and port, per sending service), its median throughput, the slowest on top: the
    query sorts ascending and the table keeps that order; the window is the alert's (10 minutes)."""
    (panel,) = _panel_with(dashboard, "kv_transfer_peer_throughput_bytes_per_second_bucket")
    assert panel["type"] == "table" and panel["fieldConfig"]["defaults"]["unit"] == "Bps"
    (target,) = panel["targets"]
    assert target["instant"] and not target["range"] and target["format"] == "table"
    assert target["expr"].startswith("sort(histogram_quantile(0.5, sum by (job, server_address, server_port, le) (")
    assert "[10m]" in target["expr"]
    (sort_by,) = panel["options"]["sortBy"]
    renamed = panel["transformations"][0]["options"]["renameByName"]
    assert sort_by == {"displayName": renamed["Value"], "desc": False}
    assert panel["transformations"][0]["options"]["excludeByName"] == {"Time": True}


def test_link_utilisation_panel_shows_each_peers_share_of_time_in_use(dashboard):
    """Per peer, the rate of its busy time (a share of time, 0..1), the busiest process of each service (shares of
    two processes do not add up); and per process over all its peers."""
    (panel,) = _panel_with(dashboard, "kv_transfer_peer_busy_time_seconds_total")
    defaults = panel["fieldConfig"]["defaults"]
    assert panel["type"] == "timeseries" and defaults["unit"] == "percentunit"
    assert (defaults["min"], defaults["max"]) == (0, 1)
    peer, process = (t["expr"] for t in panel["targets"])
    assert peer.startswith("max by (job, server_address, server_port) (rate(kv_transfer_peer_busy_time_seconds_total{")
    assert process.startswith("max by (job, instance, kv_transfer_backend, kv_transfer_role) "
                              "(rate(kv_transfer_busy_time_seconds_total{")
    assert all("[$__rate_interval]))" in expr for expr in (peer, process))


def test_one_panel_per_engine(dashboard):
    """A panel per engine, i.e. Grafana repeats it for each value of $backend (multi-value, All)."""
    repeated = [p for p in _panels(dashboard) if p.get("repeat")]
    assert [p["repeat"] for p in repeated] == ["backend"]
    (panel,) = repeated
    assert "$backend" in panel["title"] and panel["repeatDirection"] == "h"
    exprs = " ".join(t["expr"] for t in panel["targets"])
    assert "kv_transfer_size_bytes_sum" in exprs and "kv_transfer_failures_total" in exprs
    assert "kv_transfer_throughput_bytes_per_second_bucket" in exprs


def test_datasource_is_the_variable_and_exemplars_are_on(dashboard):
    exemplar_titles = set()
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            if target.get("exemplar"):
                exemplar_titles.add(panel["title"])
    assert any("Transfer throughput" in t for t in exemplar_titles)
    assert any("Request throughput" in t for t in exemplar_titles)
    assert any(p["type"] == "heatmap" for p in _panels(dashboard))


def test_panel_ids_unique_and_grid_fits(dashboard):
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in _panels(dashboard):
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
