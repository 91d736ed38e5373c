"""The alerts "a peer far below the fleet" and "a link saturated" on data scraped from real transfers: two real
Mooncake receivers, one behind a rate-limited link (a veth pair with a `tc` token bucket) kept busy from a thread of
its own, a real Prometheus that scrapes the sender's `kv_transfer.peer.throughput` and `kv_transfer.peer.busy_time`
and evaluates dashboards/alerts.yaml, unmodified, every second.

Everything runs in a user + network namespace of the test's own (`unshare -rn`; tests/support/observability/peers.py):
Mooncake binds all interfaces, so its listeners, the veth links (a private 10.231.N.0/24 each) and Prometheus live
only there, and the test reads the result from the script's stdout. That is why this test starts its own
Prometheus instead of sharing the one of tests/deployments/test_prometheus_dashboard.py (which scrapes the host's
loopback); the parts and their start/stop are the same (support/observability/parts.py). promtool's unit tests of the
same rule (dashboards/alerts.test.yaml) cover its 10-minute window and `for`; here the window holds the whole run
(rate() over 10 minutes of a series a few seconds old is its rate over those seconds), and `for: 5m` is not waited for:
the sick peer's alert is active (pending), the healthy peer's is absent.

The utilisation record is the one rule whose window matters on its own: rate() divides by its window, so over 5
minutes a series a few seconds old shows its seconds of use over 300 s. The run's copy of the rules shortens that
one window to 4 s (promtool's unit tests check the file's own window and `for`); every other rule is the file's.
"""

import json
import os
import shutil
import tempfile

import pytest
from support.observability.parts import (
    ROOT,
    SETUP,
    mooncake_available,
    prometheus_binary,
    run_namespace_script,
    veth_namespaces_work,
)
from support.parts import require_part
from support.paths import TESTS

SCRIPT = os.path.join(TESTS, "support", "observability", "peers.py")
ALERTS = os.path.join(ROOT, "dashboards", "alerts.yaml")
DASHBOARD = os.path.join(ROOT, "dashboards", "kv_transfer.json")
ALERT = "KVTransferPeerFarBelowFleet"
UTILISATION_WINDOW = 'rate(kv_transfer_peer_busy_time_seconds_total{server_address!="other"}[5m])'
# what 50mbit lets through, with its 32 KiB burst on top of one 1 MiB send: no send can be faster than this
SLOW_CEILING = (1 << 20) / (((1 << 20) - (32 << 10)) / 6.25e6)


def _panel_query() -> str:
    """The dashboard's slowest-peers query, every filter at "All"."""
    with open(DASHBOARD, encoding="utf-8") as handle:
        panels = json.load(handle)["panels"]
    (expr,) = [t["expr"] for p in panels for t in p.get("targets", [])
               if "kv_transfer_peer_throughput_bytes_per_second_bucket" in t["expr"]]
    return expr.replace("$service", ".*").replace("$instance", ".*")


@pytest.fixture(scope="module")
def result():
    binary = prometheus_binary()
    require_part(bool(binary), f"Debian prometheus ({SETUP})")
    require_part(mooncake_available(), "mooncake-transfer-engine-non-cuda + libibverbs1 (bash scripts/setup.sh)")
    require_part(veth_namespaces_work(), "unshare -rn with veth and tc (util-linux, iproute2; user namespaces on)")
    workdir = tempfile.mkdtemp(prefix="kvt-peers-")
    try:
        rules = os.path.join(workdir, "alerts.yaml")
        with open(ALERTS, encoding="utf-8") as source, open(rules, "w", encoding="utf-8") as copy:
            text = source.read()
            assert UTILISATION_WINDOW in text
            copy.write(text.replace(UTILISATION_WINDOW, UTILISATION_WINDOW.replace("[5m]", "[4s]")))
        yield run_namespace_script(SCRIPT, ["--prometheus", binary, "--rules", rules, "--workdir", workdir,
                                            "--panel-query", _panel_query()], timeout_s=240)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _peer(result, role):
    (peer,) = [p for p in result["peers"] if p["role"] == role]
    return peer


def test_every_send_to_each_peer_is_in_the_metric(result):
    assert result["failed"] == 0
    assert result["held"] == {address: float(count) for address, count in result["sent"].items()}
    assert sorted(result["sent"]) == sorted(p["address"] for p in result["peers"])
    assert result["sent"] == {_peer(result, "fast")["address"]: 40, _peer(result, "slow")["address"]: 56}


def test_the_slow_link_stands_out(result):
    slow, fast = _peer(result, "slow")["address"], _peer(result, "fast")["address"]
    # the token bucket bounds what any send to the slow peer can show; the metric measures the link
    assert result["means"][slow] <= SLOW_CEILING
    assert result["means"][fast] > 3 * result["means"][slow]
    # both peers have enough sends for the rule's median; the slow one is under half the median of the two
    medians = result["medians"]
    assert set(medians) == {slow, fast}
    assert medians[slow] < 0.5 * (medians[slow] + medians[fast]) / 2 < medians[fast]


def test_the_slowest_peers_panel_puts_the_slow_link_first(result):
    slow, fast = _peer(result, "slow")["address"], _peer(result, "fast")["address"]
    assert [row[0] for row in result["panel"]] == [slow, fast]
    assert result["panel"][0][1] < result["panel"][1][1]


def test_the_alert_names_the_slow_peer_only(result):
    slow = _peer(result, "slow")
    assert all(health == "ok" for health in result["rule_health"].values()), result["rule_health"]
    (alert,) = result["alerts"]
    assert alert["labels"] == {"alertname": ALERT, "job": result["job"], "server_address": slow["address"],
                               "server_port": str(slow["port"]), "severity": "warning"}
    assert alert["state"] in ("pending", "firing")  # `for: 5m` is longer than the run
    assert alert["value"] == pytest.approx(result["medians"][slow["address"]], rel=0.01)


def test_each_links_busy_time_is_the_union_of_its_sends(result):
    """What Prometheus holds of each peer's busy time, and of the process's over all peers, is the time covered by
    the send spans (to that peer; to any), as the spans themselves say."""
    for address, seconds in result["busy_from_spans"].items():
        assert seconds > 0
        assert result["busy_held"][address] == pytest.approx(seconds, rel=1e-6)
    assert result["process_busy_held"] == [pytest.approx(result["process_busy_from_spans"], rel=1e-6)]
    slow, fast = _peer(result, "slow")["address"], _peer(result, "fast")["address"]
    # the two links were in use at the same moments: the process was busy no longer than their sum (the slow link's
    # sends, back to back, may cover every fast one), no shorter than either
    assert max(result["busy_from_spans"].values()) <= result["process_busy_from_spans"] < \
        result["busy_from_spans"][slow] + result["busy_from_spans"][fast]


def test_the_slow_link_in_use_all_the_time_is_the_one_saturated(result):
    slow, fast = _peer(result, "slow")["address"], _peer(result, "fast")["address"]
    # the highest recorded: its sends followed each other without a pause; the fast link's came in rounds (how
    # long each took depends on what else the two cores run: the alert must not care, its throughput is the fleet's)
    assert result["utilisation"][slow] > 0.9
    assert result["utilisation"][fast] < result["utilisation"][slow]
    assert result["saturated"] == [slow]
