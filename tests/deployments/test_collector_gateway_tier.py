"""The gateway tier of collector/README.md run for real: two agents (collector/agent.yaml) -> two gateways
(collector/gateway.yaml: `loadbalancing` by trace id over both replicas' sampling receivers, then `tail_sampling`)
-> Jaeger (collector/jaeger.yaml), the binaries `scripts/setup-observability.sh` builds.

The gateways find each other the way the shipped config does in a fleet: the `dns` resolver looks up one name
that lists every replica, and the agents export to that name (gRPC's round robin over its addresses). The DNS
resolver gives every address one port, so each Collector has a loopback address of its own (127.0.0.2-5; Jaeger
on 127.0.0.1) with the usual ports, as on separate hosts. All of it runs in one private network namespace with a
private mount namespace whose /etc/hosts names the replicas; the test rewrites that file as an orchestrator
would change a headless service's answer (the one stand-in here: for Kubernetes' DNS). Every setting comes from
the configs' own `${env:...}` placeholders.

Spans are shaped like the package's (kv_transfer.request and its kv and aux kv_transfer.send children from the
prefill service through agent A; kv_transfer.receive from the decode service through agent B; one trace per
bootstrap room, the trace id derived from it), posted as OTLP/HTTP JSON. The tests assert counts and structure:
which traces Jaeger's query API returns, with which spans, and the Collectors' own counters (each Collector's
telemetry endpoint on its own address). Waits are bounded polls on those counters and on Jaeger.
"""

import json
import math
import os
import shutil
import signal
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
    jaeger_traces,
    metric_sum,
    resource,
    self_metrics,
    start_jaeger,
)
from support.observability.parts import wait_until
from support.parts import require_part

from otel_kvtransfer import semconv
from otel_kvtransfer.building.stitching import key_span_id, key_trace_id

GATEWAYS = {"gateway-a": "127.0.0.2", "gateway-b": "127.0.0.3"}
AGENTS = {"agent-a": "127.0.0.4", "agent-b": "127.0.0.5"}  # A carries the prefill spans, B the decode spans
GATEWAY_NAME = "otel-gateway"  # the headless service: every gateway's address
TEMPO = "127.0.0.1:14399"  # nothing listens: Tempo is not run here (AGPL); its exporters only retry into it
SAMPLE_PERCENT = 25
DECISION_WAIT = "4s"  # above the spread of a trace's two sides at the gateway: the agents batch for 1 s
PREFILL, DECODE = "kvt-prefill", "kvt-decode"
MODEL = "kvt-test-model"
KV_BYTES, AUX_BYTES = 4 << 20, 4096
SPANS_PER_TRACE = 4  # request, kv send, aux send (prefill); receive (decode)

# Phase one: each kind's count. The plain ones are the sampled rest.
KINDS = {"plain": 2000, "error_send": 50, "error_receive": 50, "slow_transfer": 50, "slow_trace": 20,
         "late_error": 40, "late_plain": 60}
KEPT_BY_POLICY = ("error_send", "error_receive", "error_both", "slow_transfer", "slow_trace", "late_error")


def _hosts_text(gateways) -> str:
    return "127.0.0.1 localhost\n" + "".join(f"{GATEWAYS[g]} {GATEWAY_NAME}\n" for g in gateways)


def _collector_env(address: str, **extra) -> dict:
    return base_env(OTELCOL_OTLP_GRPC_ENDPOINT=f"{address}:4317", OTELCOL_OTLP_HTTP_ENDPOINT=f"{address}:4318",
                    OTELCOL_HEALTH_ENDPOINT=f"{address}:13133", OTELCOL_ZPAGES_ENDPOINT=f"{address}:55679",
                    OTELCOL_TELEMETRY_HOST=address, TEMPO_OTLP_ENDPOINT=TEMPO, **extra)


def gateway_env(address: str) -> dict:
    return _collector_env(address, OTELCOL_SAMPLING_HOST=address, GATEWAY_SAMPLING_HOSTNAME=GATEWAY_NAME,
                          GATEWAY_RESOLVER_INTERVAL="1s", KVT_DECISION_WAIT=DECISION_WAIT,
                          KVT_SAMPLE_PERCENT=SAMPLE_PERCENT,
                          JAEGER_OTLP_ENDPOINT=f"127.0.0.1:{JAEGER_PORTS['otlp_grpc']}",
                          PROMETHEUS_REMOTE_WRITE_URL="http://127.0.0.1:19090/api/v1/write")


def agent_env(address: str) -> dict:
    # In the tier the agent's trace exporter points at the gateways' name (its other one, Tempo's, at nothing)
    return _collector_env(address, OTELCOL_PROMETHEUS_HOST=address, JAEGER_OTLP_ENDPOINT=f"{GATEWAY_NAME}:4317",
                          PROMETHEUS_REMOTE_WRITE_URL="http://127.0.0.1:19090/api/v1/write")


@pytest.fixture(scope="module")
def tier():
    found = {"jaeger": find_binary("jaeger", "KVT_JAEGER"), "agent": find_binary("otelcol-agent", "KVT_OTELCOL"),
             "gateway": find_binary("otelcol-gateway", "KVT_OTELCOL_GATEWAY")}
    for name, path in found.items():
        require_part(bool(path), f"the {name} binary built from the Go module proxy ({SETUP})")
    require_part(bool(shutil.which("unshare") and shutil.which("nsenter") and shutil.which("ip")
                      and shutil.which("mount")), "unshare/nsenter/mount (util-linux) and ip (iproute2)")
    workdir = tempfile.mkdtemp(prefix="kvt-gateway-tier-")
    hosts = os.path.join(workdir, "hosts")
    with open(hosts, "w", encoding="utf-8") as handle:
        handle.write(_hosts_text(GATEWAYS))
    stack = Stack(workdir, hosts=hosts)
    try:
        start_jaeger(stack, found["jaeger"])
        for name, address in GATEWAYS.items():
            stack.start(name, [found["gateway"], "--config", os.path.join(COLLECTOR, "gateway.yaml")],
                        gateway_env(address))
        for name, address in AGENTS.items():
            stack.start(name, [found["agent"], "--config", os.path.join(COLLECTOR, "agent.yaml")], agent_env(address))
        for name, address in {**GATEWAYS, **AGENTS}.items():
            stack.wait_healthy(name, f"http://{address}:13133/")
        for name in GATEWAYS:
            wait_until(lambda name=name: backends(stack, name) == len(GATEWAYS), 30, 0.5,
                       what=f"{name}'s resolver lists both gateways")
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# --- the Collectors' own counters ---------------------------------------------------------------------------------

def counters(stack: Stack, name: str) -> list:
    return self_metrics(stack, f"http://{({**GATEWAYS, **AGENTS})[name]}:8888/metrics")


def decisions(stack: Stack, name: str, **labels) -> float:
    """Traces `name`'s tail_sampling has decided (sampled="true": kept, "false": dropped)."""
    return metric_sum(counters(stack, name), "otelcol_processor_tail_sampling_global_count_traces_sampled", **labels)


def sampling_accepted(stack: Stack, name: str) -> float:
    return metric_sum(counters(stack, name), "otelcol_receiver_accepted_spans", receiver="otlp/sampling")


def backends(stack: Stack, name: str) -> float:
    return metric_sum(counters(stack, name), "otelcol_loadbalancer_num_backends", resolver="dns")


def cache_releases(stack: Stack, sampled: str) -> float:
    """Spans that arrived after their trace's decision and followed it (the decision cache), over both gateways."""
    return sum(metric_sum(counters(stack, g), "otelcol_processor_tail_sampling_early_releases_from_cache_decision",
                          sampled=sampled) for g in GATEWAYS if stack.proc(g).poll() is None)


# --- spans shaped like the package's ------------------------------------------------------------------------------

def trace_id(room: int) -> str:
    return f"{key_trace_id(room):032x}"


def _span_id(room: int, part: str) -> str:
    """A span id per room and part, derived like the trace id (distinct across rooms and parts)."""
    return trace_id(room * 8 + {"request": 1, "kv": 2, "aux": 3, "receive": 4, "receive-late": 5}[part])[:16]


def _span(room, part, name, kind, start_ns, end_ns, attributes, parent=None, error=None) -> dict:
    span = {"traceId": trace_id(room), "spanId": _span_id(room, part),
            "parentSpanId": parent or f"{key_span_id(room):016x}", "traceState": "kvt=synthetic", "name": name,
            "kind": kind, "startTimeUnixNano": str(start_ns), "endTimeUnixNano": str(end_ns),
            "attributes": [attr(k, v) for k, v in attributes.items()]}
    if error:
        span["status"] = {"code": 2, "message": error}
        span["attributes"].append(attr(semconv.ERROR_TYPE, error))
    return span


def prefill_spans(room: int, kind: str, t0: int) -> list:
    """The prefill side of one room: the request and its kv and aux sends (CLIENT), as the package ends them."""
    slow = kind == "slow_transfer"
    kv_s = KV_BYTES / (2e8 if slow else 4e9)  # 2e8 B/s: under the policy's 1 GB/s floor
    request_s = 3.0 if kind == "slow_trace" else 0.012 + kv_s  # 3 s: past the policy's 2000 ms
    key = {semconv.REQUEST_KEY: str(room), semconv.BOOTSTRAP_ROOM: room, semconv.BACKEND: semconv.BACKEND_MOONCAKE,
           semconv.FRAMEWORK: "sglang"}
    error = "TransferError" if kind in ("error_send", "error_both", "late_error") else None
    sends = []
    for part, payload, nbytes, start_s, seconds in (("kv", semconv.PAYLOAD_KV, KV_BYTES, 0.001, kv_s),
                                                    ("aux", semconv.PAYLOAD_AUX, AUX_BYTES, 0.002 + kv_s, 0.0008)):
        attributes = {**key, semconv.BYTES: nbytes, semconv.DESCRIPTOR_COUNT: 16 if payload == "kv" else 1,
                      semconv.ENGINE_CALLS: 1, semconv.PAYLOAD: payload, semconv.OP: semconv.OP_WRITE,
                      semconv.CHUNK_INDEX: 0, semconv.IS_LAST_CHUNK: True, semconv.PREFIX_EARLY_SEND: False,
                      semconv.REPLICA_FACTOR: 1, semconv.DESTINATION_INDEX: 0,
                      semconv.THROUGHPUT: nbytes / seconds, semconv.SERVER_ADDRESS: "127.0.0.1",
                      semconv.SERVER_PORT: 17001, semconv.NETWORK_TRANSPORT: "tcp",
                      semconv.NETWORK_IO_DIRECTION: semconv.DIRECTION_TRANSMIT}
        if payload == "kv" and error:
            attributes[semconv.RETURN_CODE] = -1
        start_ns = t0 + int(start_s * 1e9)
        sends.append(_span(room, part, semconv.SPAN_SEND, 3, start_ns, start_ns + int(seconds * 1e9), attributes,
                           parent=_span_id(room, "request"), error=error if payload == "kv" else None))
    busy_s = kv_s + 0.0008
    request = _span(room, "request", semconv.SPAN_REQUEST, 1, t0, t0 + int(request_s * 1e9), {
        **key, semconv.ROLE: semconv.ROLE_PREFILL, "sglang.rid": f"rid-{room}", semconv.GEN_AI_REQUEST_MODEL: MODEL,
        semconv.BYTES: KV_BYTES + AUX_BYTES, semconv.LOGICAL_BYTES: KV_BYTES + AUX_BYTES,
        semconv.TRANSFER_COUNT: 2, semconv.CHUNK_COUNT: 1, semconv.REPLICA_FACTOR: 1, semconv.BUSY_S: busy_s,
        semconv.THROUGHPUT: (KV_BYTES + AUX_BYTES) / busy_s}, error=error)
    return [request, *sends]


def decode_span(room: int, kind: str, t0: int, late: bool = False) -> dict:
    """The decode side: the receive span of one receiving rank (rank 1 is the late one)."""
    seconds = 3.0 if kind == "slow_trace" else 0.02
    return _span(room, "receive-late" if late else "receive", semconv.SPAN_RECEIVE, 1, t0, t0 + int(seconds * 1e9), {
        semconv.REQUEST_KEY: str(room), semconv.BOOTSTRAP_ROOM: room, semconv.ROLE: semconv.ROLE_DECODE,
        semconv.BACKEND: semconv.BACKEND_MOONCAKE, semconv.FRAMEWORK: "sglang",
        semconv.EXPECTED_BYTES: KV_BYTES + AUX_BYTES, semconv.TP_RANK: 1 if late else 0},
        error="KVTransferTimeout" if kind in ("error_receive", "error_both") else None)


def post_spans(stack: Stack, agent: str, service: str, spans: list) -> None:
    """OTLP/HTTP JSON to an agent."""
    payload = {"resourceSpans": [{"resource": resource(service, f"{service}-0"), "scopeSpans": [
        {"scope": {"name": semconv.INSTRUMENTATION_NAME}, "spans": spans}]}]}
    stack.post_json(f"http://{AGENTS[agent]}:4318/v1/traces", json.dumps(payload).encode())


def send_rooms(stack: Stack, rooms: dict, t0: int, per_post: int = 200) -> None:
    """Each room's prefill spans through agent A, its decode span through agent B, a bounded number of rooms per
    request, both sides of the same rooms one after the other (as the two engines end them at about one time)."""
    items = list(rooms.items())
    for first in range(0, len(items), per_post):
        chunk = items[first:first + per_post]
        post_spans(stack, "agent-a", PREFILL, [s for room, kind in chunk for s in prefill_spans(room, kind, t0)])
        post_spans(stack, "agent-b", DECODE, [decode_span(room, kind, t0) for room, kind in chunk])


def _rooms(base: int, kinds: dict) -> dict:
    rooms, room = {}, base
    for kind, count in kinds.items():
        for _ in range(count):
            rooms[room] = kind
            room += 1
    return rooms


def read_back(stack: Stack, rooms) -> dict:
    """room -> sorted span ids Jaeger holds for that room's trace (rooms without a trace left out)."""
    by_trace = {trace_id(room): room for room in rooms}
    found = {}
    for tid, trace in jaeger_traces(stack, (PREFILL, DECODE), 100000).items():
        if tid in by_trace:
            found[by_trace[tid]] = sorted(s["spanID"] for s in trace["spans"])
    return found


def whole(room: int, late: bool = False) -> list:
    parts = ["request", "kv", "aux", "receive"] + (["receive-late"] if late else [])
    return sorted(_span_id(room, p) for p in parts)


def spans_in_jaeger(stack: Stack, rooms) -> int:
    return sum(len(ids) for ids in read_back(stack, rooms).values())


# --- phase one: every kind of trace, both gateways up -------------------------------------------------------------

@pytest.fixture(scope="module")
def phase_one(tier):
    stack = tier
    rooms = _rooms(10_000, KINDS)
    before = {g: decisions(stack, g) for g in GATEWAYS}
    kept_before = sum(decisions(stack, g, sampled="true") for g in GATEWAYS)
    send_rooms(stack, rooms, _now_ns())
    # every trace decided once, by one gateway
    wait_until(lambda: sum(decisions(stack, g) - before[g] for g in GATEWAYS) >= len(rooms), 60, 0.5,
               what=f"{len(rooms)} tail-sampling decisions over both gateways")
    kept = sum(decisions(stack, g, sampled="true") for g in GATEWAYS) - kept_before
    # every kept trace released whole (its spans may reach Jaeger in two batches)
    wait_until(lambda: spans_in_jaeger(stack, rooms) >= kept * SPANS_PER_TRACE, 60, 0.5,
               what=f"the spans of {kept:g} kept traces in Jaeger")
    return {"rooms": rooms, "found": read_back(stack, rooms), "kept": kept,
            "decided": {g: decisions(stack, g) - before[g] for g in GATEWAYS}}


def _now_ns() -> int:
    return time.time_ns() - 5_000_000_000  # ended a few seconds ago, as an exported span has


def test_each_trace_is_kept_or_dropped_whole(phase_one):
    """Prefill spans through agent A, decode spans through agent B, entering either gateway: the load balancers
    send all of a trace to one sampler, so every trace in Jaeger has all four spans. A trace whose only ERROR is
    its decode span (or whose only slow part is a prefill send) would otherwise lose the other half."""
    found, rooms = phase_one["found"], phase_one["rooms"]
    partial = {room: ids for room, ids in found.items() if ids != whole(room)}
    assert not partial, list(partial.items())[:5]
    assert len(found) == phase_one["kept"], (len(found), phase_one["kept"])
    assert sum(phase_one["decided"].values()) == len(rooms)  # one decision per trace, never two halves apart
    assert all(count > 0 for count in phase_one["decided"].values()), phase_one["decided"]  # both samplers worked


def test_every_error_and_slow_trace_is_kept(phase_one):
    """keep-errors (an ERROR send, or an ERROR receive alone), keep-slow-transfers (a 4 MiB KV send at 200 MB/s)
    and keep-slow-traces (a 3 s request), at their shipped thresholds: every such trace is in Jaeger."""
    found, rooms = phase_one["found"], phase_one["rooms"]
    for kind in KEPT_BY_POLICY:
        missing = [room for room, k in rooms.items() if k == kind and room not in found]
        assert not missing, (kind, missing[:10])


def test_the_rest_is_sampled_near_the_configured_share(phase_one):
    """KVT_SAMPLE_PERCENT of the plain traces. The probabilistic policy hashes the trace id, so for these fixed ids
    the outcome is fixed; over fresh ids the kept count is binomial(n, p). The bound is its 6-sigma interval:
    n = 2060 (plain and late_plain), p = 0.25 -> mean 515, sigma = sqrt(n p (1 - p)) = 19.7, [397, 633] (19.3 % to
    30.7 %); a fresh set of ids would leave it with probability about 2e-9."""
    found, rooms = phase_one["found"], phase_one["rooms"]
    plain = [room for room, kind in rooms.items() if kind in ("plain", "late_plain")]
    kept = sum(1 for room in plain if room in found)
    n, p = len(plain), SAMPLE_PERCENT / 100
    sigma = math.sqrt(n * p * (1 - p))
    assert n * p - 6 * sigma <= kept <= n * p + 6 * sigma, (kept, n, p, sigma)
    assert 0 < n - kept  # some dropped: the late-span test needs dropped traces too


def test_a_late_decode_span_follows_its_traces_decision(tier, phase_one):
    """A decode rank's receive span that ends after decision_wait (its trace already decided): the owner's
    decision cache sends it after a kept trace and drops it after a dropped one, instead of judging it alone."""
    stack = tier
    found, rooms = phase_one["found"], phase_one["rooms"]
    late = {room: kind for room, kind in rooms.items() if kind.startswith("late_")}
    kept = [room for room in late if room in found]
    dropped = [room for room in late if room not in found]
    assert kept and dropped, (len(kept), len(dropped))
    released = {s: cache_releases(stack, s) for s in ("true", "false")}
    post_spans(stack, "agent-b", DECODE, [decode_span(room, "late", _now_ns(), late=True) for room in late])
    wait_until(lambda: sum(cache_releases(stack, s) - released[s] for s in released) >= len(late), 60, 0.5,
               what=f"{len(late)} late spans through the decision cache")
    assert cache_releases(stack, "true") - released["true"] == len(kept)
    assert cache_releases(stack, "false") - released["false"] == len(dropped)
    wait_until(lambda: all(len(ids) == SPANS_PER_TRACE + 1 for room, ids in read_back(stack, kept).items()), 60, 0.5,
               what="the late spans of the kept traces in Jaeger")
    now = read_back(stack, late)
    assert {room: now[room] for room in kept} == {room: whole(room, late=True) for room in kept}
    assert not set(now) & set(dropped), sorted(set(now) & set(dropped))[:5]


# --- one sampling gateway killed --------------------------------------------------------------------------------

def test_a_killed_gateway_is_routed_around_and_its_loss_counted(tier, phase_one):
    """SIGKILL gateway B while it holds undecided traces, then (as the orchestrator would) drop it from the
    gateways' name. What B held is gone, at most what its counters showed it had accepted; traces routed to B
    after its death come back to A's load balancer (its retry) and go to A once the resolver has dropped B; new
    traces arrive whole; the agents and A's load balancer gave up on nothing."""
    stack = tier
    dead, live = "gateway-b", "gateway-a"
    accepted = {g: sampling_accepted(stack, g) for g in GATEWAYS}
    decided = decisions(stack, live)

    # 1. traces in B's memory: all ERROR, so any that reached a live sampler is kept
    held = _rooms(20_000, {"error_send": 100})
    send_rooms(stack, held, _now_ns())
    total = len(held) * SPANS_PER_TRACE
    wait_until(lambda: sum(sampling_accepted(stack, g) - accepted[g] for g in GATEWAYS) >= total, 60, 0.2,
               what="every span of the held traces at a sampler")
    on_dead = sampling_accepted(stack, dead) - accepted[dead]
    on_live = total - on_dead
    proc = stack.proc(dead)
    with open(f"/proc/{proc.pid}/comm", encoding="utf-8") as handle:
        assert handle.read().strip() == "otelcol-gateway"  # the PID is the Collector itself (nsenter exec'd it)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)

    # 2. traces routed while B is still in the name: A's load balancer fails on B and retries
    failed_on_dead = _outcome(stack, live, GATEWAYS[dead], "false")
    # ERROR on both sides: re-routed halves may reach A apart, and each half alone is kept (the other then follows
    # the decision cache)
    window = _rooms(21_000, {"error_both": 60})
    send_rooms(stack, window, _now_ns())
    wait_until(lambda: _outcome(stack, live, GATEWAYS[dead], "false") > failed_on_dead, 60, 0.2,
               what="A's load balancer failing on the dead gateway")
    with open(stack.hosts, "w", encoding="utf-8") as handle:  # in place: the namespace's bind mount holds the inode
        handle.write(_hosts_text([live]))
    wait_until(lambda: backends(stack, live) == 1, 60, 0.5, what="A's resolver dropping the dead gateway")

    # 3. new traces, after the resolver's update
    after = _rooms(22_000, {"plain": 200, "error_send": 20, "error_receive": 20, "slow_transfer": 20})
    send_rooms(stack, after, _now_ns())
    expected = on_live / SPANS_PER_TRACE + len(window) + len(after)
    wait_until(lambda: decisions(stack, live) - decided >= expected, 90, 0.5,
               what=f"{expected:g} decisions at the live gateway")
    must_keep = [*window, *(room for room, kind in after.items() if kind in KEPT_BY_POLICY)]
    wait_until(lambda: all(room in found for found in [read_back(stack, must_keep)] for room in must_keep), 60, 0.5,
               what="every ERROR and slow trace routed after the kill in Jaeger")
    found = read_back(stack, [*held, *window, *after])
    assert not [room for room, ids in found.items() if ids != whole(room)], "partial traces"
    # new traces: routed around the dead gateway, each whole, every policy upheld
    assert all(room in found for room in must_keep)
    # what B held: lost whole, never more than B's own counter said it had accepted; A's share all there
    lost = total - sum(len(found.get(room, ())) for room in held)
    assert 0 <= lost <= on_dead, (lost, on_dead)
    assert sum(1 for room in held if room in found) * SPANS_PER_TRACE >= on_live
    # nothing given up by anyone alive: A's load balancer re-routed, the agents reached the live gateway
    assert metric_sum(counters(stack, live), "otelcol_exporter_send_failed_spans", exporter="loadbalancing") == 0
    for agent in AGENTS:
        assert metric_sum(counters(stack, agent), "otelcol_exporter_send_failed_spans",
                          exporter="otlp_grpc/jaeger") == 0, agent
    stack.alive(live)


def _outcome(stack: Stack, gateway: str, endpoint_address: str, success: str) -> float:
    return metric_sum(counters(stack, gateway), "otelcol_loadbalancer_backend_outcome",
                      endpoint=f"{endpoint_address}:4417", success=success)
