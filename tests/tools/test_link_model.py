"""`otel-kvtransfer summarize --links`: the fit itself on known lines, and the command on a span file of real
Mooncake sends of known shapes over a rate-limited link and a plain one (tests/support/observability/links.py, in a user
+ network namespace of its own: Mooncake binds all interfaces), whose fitted bandwidth must be the link's own rate."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from support.observability.parts import mooncake_available, run_namespace_script, veth_namespaces_work
from support.parts import require_part
from support.paths import TESTS

from otel_kvtransfer.tools.links import fit

SCRIPT = os.path.join(TESTS, "support", "observability", "links.py")


# --- the fit -----------------------------------------------------------------------------------------------------

def _line(fixed, bandwidth, per_descriptor, shapes):
    return [(b, d, fixed + b / bandwidth + per_descriptor * d) for b, d in shapes]


def test_the_fit_finds_the_fixed_cost_the_bandwidth_and_the_cost_per_descriptor():
    shapes = [(b, d) for b in (4096, 65536, 1 << 20, 8 << 20) for d in (1, 16, 256)]
    got = fit(_line(2e-4, 1.25e9, 3e-6, shapes))
    assert got["bandwidth"] == pytest.approx(1.25e9, rel=1e-9)
    assert got["fixed_s"] == pytest.approx(2e-4, rel=1e-9)
    assert got["per_descriptor_s"] == pytest.approx(3e-6, rel=1e-9)
    assert got["note"] is None


def test_descriptors_proportional_to_bytes_stay_in_the_bandwidth():
    shapes = [(b, b // 4096) for b in (4096, 65536, 1 << 20, 8 << 20)]  # fixed block size: one column, twice
    got = fit(_line(1e-4, 2e9, 5e-6, shapes))
    assert got["per_descriptor_s"] is None and "proportional" in got["note"]
    # what a descriptor costs is then part of the cost per byte: 1 / (1/2e9 + 5e-6/4096)
    assert got["bandwidth"] == pytest.approx(1 / (1 / 2e9 + 5e-6 / 4096), rel=1e-9)


def test_no_cost_comes_out_negative():
    # a token bucket's burst makes small sends faster than the line: the intercept would be negative
    points = [(b, 1, max(b - 32768, 0) / 6.25e6) for b in (65536, 131072, 1 << 20, 2 << 20)]
    got = fit(points)
    assert got["fixed_s"] == 0.0 and got["bandwidth"] == pytest.approx(6.25e6, rel=0.05)
    # descriptors that make a call faster cannot be a cost: left out
    got = fit([(1 << 20, d, 1e-3 - d * 1e-6) for d in (1, 10, 100)] + [(2 << 20, 1, 2e-3)])
    assert got["per_descriptor_s"] is None and got["bandwidth"] > 0


def test_too_few_calls_or_one_size_say_so():
    assert fit([(1, 1, 1.0), (2, 1, 2.0)])["note"] == "2 calls: too few to fit"
    got = fit([(1 << 20, 1, t) for t in (1e-3, 1.1e-3, 0.9e-3)])
    assert got["bandwidth"] is None and got["fixed_s"] == pytest.approx(1e-3)
    assert "one call size only" in got["note"]


# --- the command on real sends --------------------------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "otel_kvtransfer.cli", "summarize", *args],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def run():
    require_part(mooncake_available(), "mooncake-transfer-engine-non-cuda + libibverbs1 (bash scripts/setup.sh)")
    require_part(veth_namespaces_work(), "unshare -rn with veth and tc (util-linux, iproute2; user namespaces on)")
    out = tempfile.mkdtemp(prefix="kvt-links-")
    try:
        facts = run_namespace_script(SCRIPT, ["--out", out], timeout_s=180)
        spans = os.path.join(out, "spans.jsonl")
        as_json = _cli(spans, "--links", "--json")
        assert as_json.returncode == 0, as_json.stderr
        yield {"facts": facts, "model": json.loads(as_json.stdout), "spans": spans,
               "text": _cli(spans, "--links")}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _peer(run, role):
    address = run["facts"]["peers"][role]["address"]
    (peer,) = [p for p in run["model"]["peers"] if p["server.address"] == address]
    return peer


def test_every_send_is_fitted_on_its_own_link(run):
    facts, model = run["facts"], run["model"]
    assert facts["failed"] == 0 and model["failed_sends"] == 0
    assert model["send_count"] == len(facts["kinds"])  # one send per request, every one read
    kinds = list(facts["kinds"].values())
    assert _peer(run, "slow")["calls"] == kinds.count("slow")
    assert _peer(run, "fast")["calls"] == len(kinds) - kinds.count("slow")


def test_the_slow_links_fitted_bandwidth_is_its_own_measured_rate(run):
    slow, fast = _peer(run, "slow"), _peer(run, "fast")
    measured = run["facts"]["measured_rate"][slow["server.address"]]
    # on failure, what the fit saw and what the plain writes took, to tell a bad fit from a disturbed link
    assert slow["bandwidth"] == pytest.approx(measured, rel=0.2), (slow, run["facts"]["plain_write_s"])
    assert slow["fixed_s"] >= 0 and slow["spread"]["median_relative"] is not None
    # the plain link is far faster (loopback through a veth: CPU-bound, so only its order is asserted)
    assert fast["bandwidth"] > 5 * slow["bandwidth"]


def test_descriptor_counts_that_vary_apart_from_bytes_get_their_own_cost(run):
    fast = _peer(run, "fast")
    assert fast["per_descriptor_s"] is not None and fast["per_descriptor_s"] > 0
    assert _peer(run, "slow")["per_descriptor_s"] is None  # one descriptor per send: nothing to fit


def test_requests_are_marked_by_what_bounds_them(run):
    kinds = run["facts"]["kinds"]
    marked = run["model"]["requests"]
    per_descriptor, fixed = set(marked["per_descriptor"]["keys"]), set(marked["fixed_cost"]["keys"])
    # 256 descriptors of 64 B: the descriptors' cost; a lone 4 KiB write: not its bytes (its one descriptor and
    # the call's fixed cost cannot be told apart, so either may own it); the slow link's: its bytes
    assert {k for k, kind in kinds.items() if kind == "descriptors"} <= per_descriptor
    assert {k for k, kind in kinds.items() if kind == "fixed"} <= fixed | per_descriptor
    assert not {k for k, kind in kinds.items() if kind == "slow"} & (per_descriptor | fixed)
    counted = sum(marked[kind]["count"] for kind in ("per_descriptor", "fixed_cost", "bandwidth"))
    assert counted == len(kinds)


def test_the_text_table_has_a_row_per_peer(run):
    text = run["text"]
    assert text.returncode == 0, text.stderr
    for role in ("slow", "fast"):
        peer = run["facts"]["peers"][role]
        assert f"{peer['address']}:{peer['port']}" in text.stdout
    assert "requests whose modelled time is mostly the cost per descriptor" in text.stdout


def test_links_refuses_request_filters_and_files_without_peers(run, tmp_path):
    refused = _cli(run["spans"], "--links", "--key", "slow-131072-0")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "--links" in refused.stderr
    empty = tmp_path / "other.jsonl"
    with open(run["spans"], encoding="utf-8") as source:  # the same file with every peer attribute renamed
        empty.write_text(source.read().replace('"server.address"', '"peer.name"'), encoding="utf-8")
    none = _cli(str(empty), "--links")
    assert none.returncode == 2 and "no kv_transfer.send span with a peer" in none.stderr


def test_a_hostile_peer_name_is_escaped_and_bounded(run, tmp_path):
    slow = run["facts"]["peers"]["slow"]["address"]
    hostile = tmp_path / "hostile.jsonl"
    with open(run["spans"], encoding="utf-8") as source:
        hostile.write_text(source.read().replace(f'"{slow}"', '"\\u001b[2J' + "x" * 5000 + '"'), encoding="utf-8")
    text = _cli(str(hostile), "--links")
    assert text.returncode == 0, text.stderr
    assert "\x1b" not in text.stdout and "\\x1b[2J" in text.stdout
    assert max(len(line) for line in text.stdout.splitlines()) < 400
    as_json = json.loads(_cli(str(hostile), "--links", "--json").stdout)
    assert all(len(p["server.address"]) <= 200 for p in as_json["peers"])
