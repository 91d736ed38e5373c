"""Two real Mooncake receivers, one behind a rate-limited link; a real Prometheus scrapes the sender's per-peer
throughput and busy time and evaluates dashboards/alerts.yaml over them. Run by tests/deployments/test_peer_alert.py
(never imported by pytest):

    unshare -rn python tests/support/observability/peers.py --outer-netns NETNS --prometheus BIN --rules ALERTS
    --workdir DIR

`unshare -rn` gives this process a user namespace in which it is root and a network namespace of its own; it refuses
to run in the namespace named by --outer-netns (the caller's), so it never touches a real network. In it: loopback
up; each receiver runs in a further network namespace of its own (`unshare -n`), joined to this one by a veth pair
on a private /24 (10.231.N.0/24, only inside these namespaces); the slow receiver's veth end here has a `tc`
token-bucket rate limit (the sick link), the fast one none. The sender (this process, instrumented) pushes requests
of 1 MiB KV sends to both over Mooncake TCP (to the slow one back to back, from a thread of its own) and serves its
metrics on 127.0.0.1 in the Collector's exposition; Prometheus, on 127.0.0.1 of this namespace, scrapes them every
second and evaluates the rules every second. Mooncake binds all interfaces: all of them are inside these namespaces.
Every wait is bounded; every process started here is stopped by its PID before the script exits.

Protocol on stdout: one line `RESULT {json}` (peers, sends, what Prometheus holds, the alerts), or `ERROR <one line>`.
"""

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `support` is in it
ROOT = os.path.dirname(TESTS)
for _path in (ROOT, TESTS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

SEND_BYTES = 1 << 20  # the smallest send kv_transfer.peer.throughput takes
CHUNKS = 4  # sends per request
ROUNDS = 10  # requests to the fast peer: 40 sends, above the alert's minimum of 20 in its window
SLOW_ROUNDS = 14  # to the slow peer, back to back: ~9 s, so the saturated-link alert holds for several evaluations
ROUND_S = 0.7  # a round lasts at least this: the sends span several scrapes, so rate() sees them arrive
SLOW_RATE = "50mbit"  # 6.25 MB/s; the unlimited veth moves several hundred MB/s or more here
PEER_IFNAME = "kvtpeer"
ALERT = "KVTransferPeerFarBelowFleet"
RECORD = "kv_transfer:peer_throughput_bytes_per_second:p50_10m"
UTILISATION = "kv_transfer:peer_utilisation:ratio_rate5m"
SATURATED = "KVTransferLinkSaturated"
SERVICE, INSTANCE = "kvt-prefill", "prefill-0"


def _netns(pid="self") -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _ip(*args) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def receiver(args) -> int:
    """A decode engine in its own network namespace: waits for its veth end, brings it up, registers a buffer."""
    import numpy as np

    from support.observability.parts import mooncake_tcp_engine

    ready, _, _ = select.select([sys.stdin], [], [], 30)
    if not ready or sys.stdin.readline().strip() != "go":
        return 1
    _ip("link", "set", "lo", "up")
    _ip("addr", "add", f"{args.address}/24", "dev", PEER_IFNAME)
    _ip("link", "set", PEER_IFNAME, "up")
    engine = mooncake_tcp_engine(args.address)
    buffer = np.zeros(CHUNKS * SEND_BYTES, dtype=np.uint8)
    rc = engine.register_memory(buffer.ctypes.data, buffer.nbytes)
    print("READY " + json.dumps({"port": engine.get_rpc_port(), "buffer": buffer.ctypes.data, "rc": rc}), flush=True)
    select.select([sys.stdin], [], [], args.linger)  # until the sender closes our stdin (or linger passes)
    return 0


def _start(argv, **kwargs) -> subprocess.Popen:
    """A child in this script's process group: if the test has to kill this script's group, it ends them too."""
    return subprocess.Popen(argv, **kwargs)


def _stop(proc) -> None:
    """Close its stdin (a receiver exits on that), then SIGTERM and, after 10 s, SIGKILL, by its PID."""
    if proc is None or proc.poll() is not None:
        return
    try:
        if proc.stdin:
            proc.stdin.close()
    except OSError:
        pass
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _start_receiver(index: int, rate, env) -> tuple:
    """A receiver behind veth kvt<index> (rate-limited when `rate`); (process, address, READY payload)."""
    from support.observability.parts import read_line_with_prefix, wait_until

    ours, address = _netns(), f"10.231.{index + 1}.2"
    proc = _start(["unshare", "-n", sys.executable, os.path.abspath(__file__), "receiver", "--address", address],
                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        wait_until(lambda: _netns(proc.pid) != ours, 10, 0.05, what="receiver in its own network namespace")
        link = f"kvt{index}"
        _ip("link", "add", link, "type", "veth", "peer", "name", PEER_IFNAME, "netns", str(proc.pid))
        _ip("addr", "add", f"10.231.{index + 1}.1/24", "dev", link)
        _ip("link", "set", link, "up")
        if rate:
            # the sender's egress towards this peer: every byte of its KV crosses the token bucket
            subprocess.run(["tc", "qdisc", "add", "dev", link, "root", "tbf", "rate", rate, "burst", "32kb",
                            "latency", "400ms"], check=True, capture_output=True, text=True, timeout=10)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        ready = json.loads(read_line_with_prefix(proc, "READY ", 60))
        if ready["rc"] != 0:
            raise RuntimeError(f"receiver register_memory returned {ready['rc']}")
        return proc, address, ready
    except BaseException:
        _stop(proc)
        raise


def _prometheus(args, metrics_port: int):
    from support.observability.parts import free_port, http_json, wait_until

    port = free_port()
    config = os.path.join(args.workdir, "prometheus.yml")
    with open(config, "w", encoding="utf-8") as handle:
        handle.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
                     f"rule_files:\n  - {json.dumps(os.path.abspath(args.rules))}\n"
                     "scrape_configs:\n  - job_name: otel-collector-kvtransfer\n    honor_labels: true\n"
                     f"    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n")
    log = open(os.path.join(args.workdir, "prometheus.log"), "w", encoding="utf-8")
    proc = _start([args.prometheus, f"--config.file={config}", f"--storage.tsdb.path={args.workdir}/data",
                  f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
                 stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_json(f"{base}/api/v1/status/buildinfo")["status"] == "success", 30,
               what="prometheus ready")
    return proc, base, log


def _query(base: str, expr: str) -> list:
    from support.observability.parts import http_json

    return [({k: v for k, v in s["metric"].items()}, float(s["value"][1]))
            for s in http_json(f"{base}/api/v1/query", {"query": expr})["data"]["result"]]


def _send_requests(engine, source, peer, first_room: int, rounds: int, began) -> tuple:
    """`rounds` requests of CHUNKS 1 MiB sends to `peer`: one every ROUND_S from `began`, or back to back when it
    is None. (sends that succeeded, sends that failed)."""
    from otel_kvtransfer import integration

    session = f"{peer['address']}:{peer['port']}"
    ok = failed = 0
    for round_index in range(rounds):
        if began is not None:
            time.sleep(max(0.0, began + round_index * ROUND_S - time.monotonic()))
        room = first_room + round_index
        integration.begin_request(room, backend="mooncake", framework="test_peers")
        for chunk in range(CHUNKS):
            offset = chunk * SEND_BYTES
            with integration.transfer_scope(room, chunk_index=chunk, payload="kv", is_last_chunk=chunk == CHUNKS - 1):
                rc = engine.transfer_sync_write(session, source.ctypes.data + offset, peer["buffer"] + offset,
                                                SEND_BYTES)
            if rc == 0:
                ok += 1
            else:
                failed += 1
        integration.end_request(room, error_type=None if rc == 0 else "transfer_failed")
    return ok, failed


def _union_s(intervals) -> float:
    """Seconds covered by the (start_ns, end_ns) intervals."""
    covered, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            covered, reach = covered + end - start, end
        elif end > reach:
            covered, reach = covered + end - reach, end
    return covered / 1e9


def run(args) -> dict:
    import numpy as np
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_kvtransfer import KVTransferInstrumentor
    from support.observability.exposition import ScrapeEndpoint
    from support.observability.parts import http_json, mooncake_tcp_engine, wait_until
    from support.telemetry import in_memory_metrics

    _ip("link", "set", "lo", "up")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    receivers, prometheus, log, endpoint = [], None, None, None
    resource = Resource.create({"service.name": SERVICE, "service.instance.id": INSTANCE})
    tracer_provider = TracerProvider(resource=resource)
    spans = InMemorySpanExporter()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    meter_provider, reader = in_memory_metrics(resource=resource)
    try:
        for index, (role, rate) in enumerate((("fast", None), ("slow", SLOW_RATE))):
            proc, address, ready = _start_receiver(index, rate, env)
            receivers.append({"proc": proc, "role": role, "address": address, "port": ready["port"],
                              "buffer": ready["buffer"], "rate": rate})
        KVTransferInstrumentor().instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
        endpoint = ScrapeEndpoint(reader)
        prometheus, base, log = _prometheus(args, endpoint.port)
        engine = mooncake_tcp_engine("127.0.0.1")
        source = np.random.default_rng(1).integers(0, 255, CHUNKS * SEND_BYTES, dtype=np.uint8)
        if engine.register_memory(source.ctypes.data, source.nbytes) != 0:
            raise RuntimeError("sender register_memory failed")
        # Prometheus has scraped the endpoint once before the first send: a series' first sample comes before
        # most of its sends, so increase() and rate() see them (an OTel counter has no zero sample of its own)
        wait_until(lambda: any(t["health"] == "up" for t in
                               http_json(f"{base}/api/v1/targets")["data"]["activeTargets"]), 20,
                   what="first scrape")
        # the fast link paced (a round every ROUND_S), the slow one back to back from its own thread: a link in
        # use all the time, as a sick link under load is
        fast, slow = receivers
        slow_done = {}

        def slow_sender():
            slow_done["counts"] = _send_requests(engine, source, slow, 6000, SLOW_ROUNDS, None)

        began = time.monotonic()
        slow_thread = threading.Thread(target=slow_sender, name="kvt-slow-link")
        slow_thread.start()
        fast_counts = _send_requests(engine, source, fast, 5000, ROUNDS, began)
        slow_thread.join(120)
        if "counts" not in slow_done:
            raise RuntimeError("the slow link's sends did not finish within 120 s")
        sent = {fast["address"]: fast_counts[0], slow["address"]: slow_done["counts"][0]}
        failed = fast_counts[1] + slow_done["counts"][1]
        sent_at = time.monotonic()
        tracer_provider.force_flush(10_000)
        sends = [span for span in spans.get_finished_spans() if span.name == "kv_transfer.send"]
        busy_from_spans = {peer["address"]: _union_s([(span.start_time, span.end_time) for span in sends
                                                      if span.attributes.get("server.address") == peer["address"]])
                           for peer in receivers}

        def scraped():
            held = {m.get("server_address"): v for m, v in _query(
                base, "sum by (server_address) (kv_transfer_peer_throughput_bytes_per_second_count)")}
            return held if held == {a: float(n) for a, n in sent.items()} else None

        held = wait_until(scraped, 30, what="Prometheus holding every peer send")
        complete_at = time.time()
        # the rules are evaluated every second: what is read below comes from evaluations over the complete data
        # (the test judges what the alert says; a rule that never fires is a result, not an error here)
        try:
            wait_until(lambda: any(a["labels"].get("alertname") == ALERT
                                   for a in http_json(f"{base}/api/v1/alerts")["data"]["alerts"]), 15,
                       what=f"{ALERT} active")
        except TimeoutError:
            pass

        def evaluated_since_complete():  # each group (its recording rules, then its alerts) began after it
            groups = http_json(f"{base}/api/v1/rules")["data"]["groups"]
            return bool(groups) and all(datetime.fromisoformat(g["lastEvaluation"]).timestamp() > complete_at
                                        for g in groups)

        wait_until(evaluated_since_complete, 30, what="every rule group evaluated over the complete data")
        alerts = [{"labels": a["labels"], "state": a["state"], "value": float(a["value"])}
                  for a in http_json(f"{base}/api/v1/alerts")["data"]["alerts"]
                  if a["labels"].get("alertname") == ALERT]
        medians = {m["server_address"]: v for m, v in _query(base, RECORD)}
        direct = {m["server_address"]: v for m, v in _query(
            base, "histogram_quantile(0.5, sum by (server_address, le) "
                  "(rate(kv_transfer_peer_throughput_bytes_per_second_bucket[10m])))")}
        rules = http_json(f"{base}/api/v1/rules")["data"]["groups"]
        # the dashboard's slowest-peers query, rows in the order Prometheus returns them
        panel = [[m.get("server_address"), v] for m, v in _query(base, args.panel_query)] if args.panel_query else None
        busy_held = {m["server_address"]: v for m, v in _query(
            base, "sum by (server_address) (kv_transfer_peer_busy_time_seconds_total)")}
        process_busy_held = [v for _, v in _query(base, "kv_transfer_busy_time_seconds_total")]
        # the highest utilisation recorded during the run, and the saturated-link alert over the run (pending while
        # both its conditions held, gone once the links went idle: the ALERTS series keeps it)
        utilisation = {m["server_address"]: v for m, v in _query(base, f"max_over_time({UTILISATION}[10m])")}
        saturated = sorted({m["server_address"] for m, _ in _query(
            base, f'max_over_time(ALERTS{{alertname="{SATURATED}"}}[10m])')})
        means = {m["server_address"]: v for m, v in _query(
            base, "sum by (server_address) (kv_transfer_peer_throughput_bytes_per_second_sum)"
                  " / sum by (server_address) (kv_transfer_peer_throughput_bytes_per_second_count)")}
        return {"means": means, "send_s": round(sent_at - began, 3),
                "peers": [{k: peer[k] for k in ("role", "address", "port", "rate")} for peer in receivers],
                "sent": sent, "failed": failed, "held": held, "alerts": alerts, "medians": medians,
                "direct_medians": direct, "job": SERVICE, "panel": panel,
                "busy_from_spans": busy_from_spans, "busy_held": busy_held,
                "process_busy_from_spans": _union_s([(span.start_time, span.end_time) for span in sends]),
                "process_busy_held": process_busy_held, "utilisation": utilisation, "saturated": saturated,
                "rule_health": {r.get("name"): r.get("health") for g in rules for r in g["rules"]}}
    finally:
        for peer in receivers:
            _stop(peer["proc"])
        if endpoint is not None:
            endpoint.close()
        _stop(prometheus)
        if log is not None:
            log.close()
        tracer_provider.shutdown()
        meter_provider.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", nargs="?", choices=["sender", "receiver"], default="sender")
    parser.add_argument("--address")
    parser.add_argument("--linger", type=float, default=120.0)
    parser.add_argument("--outer-netns")
    parser.add_argument("--prometheus")
    parser.add_argument("--rules")
    parser.add_argument("--workdir")
    parser.add_argument("--panel-query", help="a PromQL expression evaluated at the end, rows kept in order")
    args = parser.parse_args(argv)
    os.environ.setdefault("MC_FORCE_TCP", "1")
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("OTEL_KVTRANSFER_FLUSH_INTERVAL_MS", "100")
    if args.mode == "receiver":
        return receiver(args)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="kvt-peers-")
    return answer(run, args)


def answer(run, args) -> int:
    """The protocol on stdout: `run(args)`'s result as one RESULT line, or one ERROR line; refused (exit 2) in the
    caller's own network namespace."""
    if not args.outer_netns or _netns() == args.outer_netns:
        print("ERROR refusing to run outside a network namespace of its own (run it under `unshare -rn`)",
              flush=True)
        return 2
    try:
        result = run(args)
    except Exception as exc:
        print(f"ERROR {type(exc).__name__}: {str(exc)[:500]}", flush=True)
        return 1
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
