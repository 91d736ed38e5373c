"""sglang's KV checksum and the decode's wait for KV memory, on a real deployment: one prefill and two decode
servers under `opentelemetry-instrument`, all with `--disaggregation-enable-kv-checksum`, two sglang-routers, real
requests, Mooncake over TCP on 127.0.0.1, one private network namespace, a real Prometheus scraping every engine
process (tests/sglang_serving/deployment.py).

- decode "decode": sglang's mismatch injector off (SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB=0); a KV pool of
  POOL_TOKENS tokens, so that a burst of concurrent prompts cannot all be reserved at once; sglang's own metrics
  and its per-request time log on.
- decode "decode-mismatch": the injector at 1 (sglang's own test switch flips a bit of the digest each request's
  decode computes), so sglang drops every request it serves.

Stand-ins, for what cannot run on this CPU-only machine (tests/sglang_serving/pythonpath): the serving suite's
import-only `sgl_kernel` and test plugin, and ONE method more: sglang's checksum class (`KvChecksumComputer` in
sglang/srt/disaggregation/checksum.py) digests KV pages with a CUDA kernel, so the plugin computes the same digest
(Adler-32 over the same items, in the same order) on the host buffers (KVT_TEST_KV_CHECKSUM_ON_CPU=1; checked once
against sglang's own kernels on a GPU, docs/sglang.md). Where the
prefill stores its digest, the metadata that carries it to the decode, the decode's verification, its verdict, its
drop of the request and its log line are sglang's own.
"""

import itertools
import math
import os
import re
import shutil
import tempfile
import time

import pytest
from support import sglang_runs
from support.parts import IN_CI, require_part
from support.sglang_runs import RECEIVE, REQUEST, Run

CHECKSUM = ["--disaggregation-enable-kv-checksum"]
INJECT = "SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB"
MISMATCH_PORT, MISMATCH_ROUTER_PORT = 30002, 8001
# The pressure decode's KV pool. sglang reserves a prompt's KV plus headroom for its output before it asks for the
# KV (pop_preallocated); with these sizes two of the burst's prompts fit at once, the others wait until a running
# one finishes and frees its pages.
POOL_TOKENS = 1024
RESERVED_DECODE_TOKENS = 128
BURST, BURST_TOKENS, BURST_NEW_TOKENS = 5, 300, 96


def _parts_ready():
    from support.observability.parts import prometheus_binary

    sglang_runs.require_parts("mooncake")
    require_part(bool(prometheus_binary()), "Prometheus (bash scripts/setup-observability.sh)")


@pytest.fixture(scope="module")
def deployment():
    _parts_ready()
    from sglang_serving import deployment as dep

    base = tempfile.mkdtemp(prefix="kvt-sglang-integrity-")
    servers = [
        dep.Server("prefill", flags=CHECKSUM),
        dep.Server("decode", env={INJECT: "0"},
                   flags=CHECKSUM + ["--max-total-tokens", str(POOL_TOKENS), "--num-reserved-decode-tokens",
                                     str(RESERVED_DECODE_TOKENS), "--enable-metrics",
                                     "--enable-request-time-stats-logging"]),
        dep.Server("decode-mismatch", "decode", port=MISMATCH_PORT, env={INJECT: "1"}, flags=CHECKSUM),
    ]
    routers = [dep.Router("router", dep.ROUTER_PORT, ["prefill"], ["decode"]),
               dep.Router("router-mismatch", MISMATCH_ROUTER_PORT, ["prefill"], ["decode-mismatch"])]
    # --sleep-on-idle: an idle scheduler busy-polls a core of the two this machine has (test_sglang_shapes.py)
    deployment = dep.Deployment(os.path.join(base, "integrity"), prometheus=True, servers=servers, routers=routers,
                                extra_env={"KVT_TEST_KV_CHECKSUM_ON_CPU": "1"}, server_flags=["--sleep-on-idle"])
    try:
        deployment.start()
        yield deployment
    finally:
        deployment.stop()
        if not IN_CI and os.environ.get("KVT_KEEP_SERVING_OUTPUT") != "1":
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def verified(deployment):
    """Three prompts through the router to the decode that verifies, one after another."""
    from sglang_serving import deployment as dep

    requests = dep.prompts(2, 300, 8, repeat_every=0, rid_prefix="verify") + dep.prompts(
        1, 130, 8, repeat_every=0, seed=11, rid_prefix="verify-short")
    return Run(deployment, requests, deployment.generate(requests)).wait_for_spans()


@pytest.fixture(scope="module")
def mismatched(deployment, verified):
    """Three prompts to the decode whose digests never match, all at once, straight to the pair as the router
    sends them (the router answers a dropped request with an error; this client keeps each server's status)."""
    from sglang_serving import deployment as dep

    requests = [dict(r, room=7_000_001 + i) for i, r in enumerate(
        dep.prompts(3, 200, 8, repeat_every=0, seed=5, rid_prefix="mismatch"))]
    answers = deployment.generate_on("prefill", "decode-mismatch", requests)
    return _settled(deployment, requests, answers, "decode-mismatch")


@pytest.fixture(scope="module")
def burst(deployment, mismatched):
    """BURST prompts at once to the decode whose KV pool holds two of them."""
    from sglang_serving import deployment as dep

    requests = [dict(r, room=8_000_001 + i) for i, r in enumerate(
        dep.prompts(BURST, BURST_TOKENS, BURST_NEW_TOKENS, repeat_every=0, seed=21, rid_prefix="burst"))]
    answers = deployment.generate_on("prefill", "decode", requests)
    return _settled(deployment, requests, answers, "decode")


def _settled(deployment, requests, answers, decode, timeout_s=60.0):
    """The run once the decode's span file holds a receive for every room (exporters batch every 0.5 s)."""
    run = Run(deployment, requests, answers)
    rooms = {r["room"] for r in requests}
    deadline = time.monotonic() + timeout_s
    while True:
        run.spans = run.read_spans()
        have = {s.attributes.get("kv_transfer.bootstrap_room") for s in run.named(RECEIVE, decode)}
        if rooms <= have or time.monotonic() > deadline:
            return run
        time.sleep(1)


def _events(deployment, name) -> dict:
    """span id -> [(event name, {attribute: value}, time ns)] from the server's span file (OTLP JSON lines; the
    span-file reader keeps no events)."""
    import json

    def value(v):
        return int(v["intValue"]) if "intValue" in v else next(iter(v.values()))

    found = {}
    with open(deployment.span_file(name), encoding="utf-8") as handle:
        for line in handle:
            for resource in json.loads(line).get("resourceSpans", []):
                for scope in resource.get("scopeSpans", []):
                    for span in scope.get("spans", []):
                        found[span["spanId"]] = [
                            (e["name"], {a["key"]: value(a["value"]) for a in e.get("attributes", [])},
                             int(e["timeUnixNano"])) for e in span.get("events", [])]
    return found


def _log(deployment, name) -> str:
    with open(deployment.log_path(name), encoding="utf-8", errors="replace") as handle:
        return handle.read()


def _prom_total(deployment, expr, want, timeout_s=60.0) -> float:
    """The sum of a PromQL expression's series, once it reached `want` (Prometheus scrapes every second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = sum(float(r["value"][1]) for r in deployment.prometheus_query(expr))
        if got >= want or time.monotonic() > deadline:
            return got
        time.sleep(1)


# --- integrity ---------------------------------------------------------------------------------------------------

def test_with_the_injector_off_every_request_is_verified(verified):
    for request, result in zip(verified.requests, verified.results):
        assert result["tokens"] == request["max_new_tokens"], result
        room = verified.request_of(request["rid"]).attributes["kv_transfer.bootstrap_room"]
        receive = verified.receive_of(room)
        assert receive.attributes["kv_transfer.integrity"] == "verified", dict(receive.attributes)
        assert not receive.is_error and not _events(verified.deployment, "decode")[receive.span_id]
    log = _log(verified.deployment, "decode")
    assert "KV checksum mismatch" not in log and "integrity_mismatch" not in log
    assert "KV checksum skipped" not in log  # both sides digested the same layout: sglang compared every digest


def test_with_the_injector_at_one_every_request_is_dropped_and_shows_the_mismatch(mismatched):
    deployment = mismatched.deployment
    for answer in mismatched.results:
        assert answer["prefill"] == 200, answer  # the prefill sent its KV; only the decode refused it
        assert str(answer["decode"]).startswith("500"), answer
    sglang_lines = {int(m.group(1)): (m.group(2), m.group(3)) for m in re.finditer(
        r"KV checksum mismatch req=\S+ bootstrap_room=(\d+) expected=(0x[0-9a-f]+) got=(0x[0-9a-f]+)",
        _log(deployment, "decode-mismatch"))}
    ours = _log(deployment, "decode-mismatch").splitlines()
    events = _events(deployment, "decode-mismatch")
    for request in mismatched.requests:
        room = request["room"]
        receive = mismatched.receive_of(room)
        assert receive.attributes["kv_transfer.integrity"] == "mismatch", dict(receive.attributes)
        assert not receive.is_error  # the transfer itself succeeded; sglang refused what arrived
        ((name, event, at_ns),) = events[receive.span_id]
        assert name == "kv_transfer.integrity_mismatch"
        expected = event["kv_transfer.integrity.expected_digest"]
        computed = event["kv_transfer.integrity.computed_digest"]
        # sglang's injector flips the lowest bit of the digest the decode computed: the KV itself was intact
        assert int(computed, 16) == int(expected, 16) ^ 1
        assert sglang_lines[room] == (expected, computed)  # the digests sglang logged for the request
        assert (event["server.address"], event["server.port"]) == ("127.0.0.1", 8998)
        assert at_ns >= receive.end_time_unix_nano  # verified when the request entered a batch, after the receive
        lines = [line for line in ours if "otel_kvtransfer: sglang's KV checksum rejected" in line
                 and f"request {room} " in line]
        assert len(lines) == 1, lines
        assert f"rid {request['rid']}" in lines[0] and "from prefill 127.0.0.1:8998" in lines[0]
        assert f"expected {expected}, computed {computed}" in lines[0]
    counted = _prom_total(deployment, 'kv_transfer_integrity_mismatches_total{service="sglang-decode-mismatch"}',
                          len(mismatched.requests))
    assert counted == len(mismatched.requests)
    assert _prom_total(deployment, 'kv_transfer_integrity_mismatches_total{service="sglang-decode"}', 0) == 0


def test_the_mismatch_counter_carries_backend_and_framework_only(mismatched):
    series = mismatched.deployment.prometheus_query("kv_transfer_integrity_mismatches_total")
    assert series
    for found in series:
        labels = {k: v for k, v in found["metric"].items() if k.startswith("kv_transfer_")}
        assert labels == {"kv_transfer_backend": "mooncake", "kv_transfer_framework": "sglang"}


# --- allocation wait -----------------------------------------------------------------------------------------

def _sglang_stages(deployment) -> dict:
    """room -> (bootstrap, alloc wait, transfer) in seconds, from the decode's own per-request time log (room 0:
    sglang's warm-up and health checks, which transfer nothing; the last of them)."""
    found = {}
    for m in re.finditer(r"ReqTimeStats\(rid=\S+, bootstrap_room=(\d+),.*?type=decode\): "
                         r"bootstrap_duration=([\d.]+)ms, alloc_wait_duration=([\d.]+)ms, "
                         r"transfer_duration=([\d.]+)ms", _log(deployment, "decode")):
        found[int(m.group(1))] = tuple(float(m.group(i)) / 1e3 for i in (2, 3, 4))
    return found


def test_requests_that_waited_for_kv_memory_show_the_wait_the_decode_logged(burst):
    """sglang stamps a request's admission just after it made its receiver, the end of its wait for KV memory
    just after the receiver asked for its KV; we stamp both as they happen. So per request our wait is sglang's
    bootstrap + alloc wait give or take the time of those calls, and our wait + our receive (which begins where
    our wait ends) is sglang's bootstrap + alloc wait + transfer, both ending at the same poll."""
    for answer in burst.results:
        assert answer == {"room": answer["room"], "prefill": 200, "decode": 200}, answer
    sglang = _sglang_stages(burst.deployment)
    ours = {}
    for request in burst.requests:
        receive = burst.receive_of(request["room"])
        assert not receive.is_error and receive.attributes["kv_transfer.integrity"] == "verified"
        ours[request["room"]] = (receive.attributes["kv_transfer.allocation_wait_s"], receive.duration_ns / 1e9)
    assert set(sglang) >= set(ours)
    # The pool holds two of the prompts: sglang reserved two at once; the others waited for a running one to
    # finish its BURST_NEW_TOKENS tokens (seconds here), each longer than the one before.
    by_sglang = sorted(ours, key=lambda room: sglang[room][1])
    quick, waited = by_sglang[:2], by_sglang[2:]
    assert max(sglang[r][1] for r in quick) < 0.1 * min(sglang[r][1] for r in waited), sglang
    # ours: the same two near zero, the same three waiting, in the order of sglang's own waits (its bootstrap +
    # alloc, what ours measures), where those differ by more than the give of either measurement: requests given
    # memory at one scheduler poll wait alike, and either may come first (their alloc parts alone, which `waited`
    # is sorted by, can order them otherwise than their whole waits)
    assert max(ours[r][0] for r in quick) < 0.1 * min(ours[r][0] for r in waited), ours

    def theirs(room):
        return sglang[room][0] + sglang[room][1]

    for a, b in itertools.combinations(waited, 2):
        if abs(theirs(a) - theirs(b)) > 0.2 * max(theirs(a), theirs(b)):
            assert (ours[a][0] < ours[b][0]) == (theirs(a) < theirs(b)), (a, b, ours, sglang)
    for room in ours:
        wait, receive = ours[room]
        bootstrap, alloc, transfer = sglang[room]
        assert wait >= 0
        assert abs((wait + receive) - (bootstrap + alloc + transfer)) <= max(0.02, 0.02 * (bootstrap + alloc)), \
            (room, ours[room], sglang[room])
        if room in waited:
            assert abs(wait - (bootstrap + alloc)) <= 0.1 * (bootstrap + alloc), (room, ours[room], sglang[room])


def _buckets(exposition, name) -> dict:
    """le -> cumulative count of one sglang histogram (summed over its label sets)."""
    found = {}
    for m in re.finditer(rf'^{re.escape(name)}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} ([\d.e+-]+)$', exposition,
                         re.MULTILINE):
        found[float(m.group(1))] = found.get(float(m.group(1)), 0.0) + float(m.group(2))
    return found


def test_the_allocation_wait_histogram_agrees_with_sglangs_own(burst, verified):
    """Our histogram counts every receive's wait; sglang's `sglang:kv_transfer_alloc_ms` (its alloc part) puts
    the waits that waited for memory above the same bucket boundary as ours (its warm-up and health checks, which
    transfer nothing and wait for nothing, below it)."""
    deployment = burst.deployment
    receives = burst.named(RECEIVE, "decode")
    waits = [s.attributes["kv_transfer.allocation_wait_s"] for s in receives]
    count = _prom_total(deployment, 'kv_transfer_receive_allocation_wait_seconds_count{service="sglang-decode"}',
                        len(waits))
    total = _prom_total(deployment, 'kv_transfer_receive_allocation_wait_seconds_sum{service="sglang-decode"}', 0)
    assert count == len(waits) and total == pytest.approx(sum(waits), rel=1e-9)
    buckets = _buckets(deployment.metrics_text("decode"), "sglang:kv_transfer_alloc_ms")
    # the boundary of sglang's that lies farthest from every wait (in ratio): the two kinds stay on their sides
    boundary = max((b for b in buckets if 100 <= b < float("inf")),
                   key=lambda b: min(abs(math.log(max(w, 1e-6) * 1e3 / b)) for w in waits))
    assert min(abs(math.log(max(w, 1e-6) * 1e3 / boundary)) for w in waits) > math.log(1.5)
    above_sglang = buckets[float("inf")] - buckets[boundary]
    assert above_sglang == sum(1 for w in waits if w * 1e3 > boundary) >= BURST - 2


# --- a request the router retries -------------------------------------------------------------------------------

RETRIED_RID = "retried-0"
# The counters the docs say count attempts (docs/telemetry.md, "Retried requests"), as Prometheus names them, and the
# spans each counts per attempt: (server, span name, which of those spans).
ATTEMPT_COUNTERS = {
    "kv_transfer.request.duration": ("kv_transfer_request_duration_seconds_count", "prefill", "kv_transfer.request"),
    "kv_transfer.receive.duration": ("kv_transfer_receive_duration_seconds_count", "decode-mismatch",
                                     "kv_transfer.receive"),
    "kv_transfer.integrity_mismatches": ("kv_transfer_integrity_mismatches_total", "decode-mismatch",
                                         "kv_transfer.receive"),
}
# One /generate inside the namespace: its status, and its body (streamed: the last data chunk before [DONE]).
_POST = """
import json, sys, urllib.error, urllib.request
url = sys.argv[1]
assert url.startswith("http://127.0.0.1:")
http = urllib.request.Request(url, data=sys.stdin.read().encode(), headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(http, timeout=300) as answer:
        status, lines = answer.status, answer.read(1 << 20).decode(errors="replace").splitlines()
except urllib.error.HTTPError as failed:
    status, lines = failed.code, failed.read(65536).decode(errors="replace").splitlines()
chunks = [line[5:].strip() for line in lines if line.startswith("data:") and line[5:].strip() != "[DONE]"]
print(json.dumps({"status": status, "body": chunks[-1] if chunks else "\\n".join(lines)}))
"""


def _router_counter(deployment, port, name) -> float:
    """The sum of a counter's series in an sglang-router's own Prometheus exposition."""
    text = deployment.client("text", f"http://127.0.0.1:{port}/metrics")["text"]
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([\d.e+-]+)$", text, re.MULTILINE))


def _through_the_mismatch_router(deployment, rid, stream):
    """One 64-token prompt with this rid through the router whose only decode refuses every KV: (the answer, the
    rooms of its attempts, in sglang's own mismatch lines)."""
    import json
    import sys

    from sglang_serving import deployment as dep

    (request,) = dep.prompts(1, 64, 4, repeat_every=0, seed=31, rid_prefix="unused")
    body = {"rid": rid, "input_ids": request["input_ids"], "stream": stream,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    code, out, err = deployment.run_in_namespace(
        [sys.executable, "-c", _POST, f"http://127.0.0.1:{MISMATCH_ROUTER_PORT}/generate"], timeout=600,
        input_text=json.dumps(body))
    assert code == 0, err[-2000:]
    line = rf"KV checksum mismatch req={re.escape(rid)} bootstrap_room=(\d+) "
    return json.loads(out), [int(m.group(1)) for m in re.finditer(line, _log(deployment, "decode-mismatch"))]


@pytest.fixture(scope="module")
def retried(deployment, burst):
    """One client request with its own rid, not streamed, through the router whose only decode drops every
    request: sglang-router retries the decode's 5xx with the same body (the same rid) and a new bootstrap room,
    until its attempts run out. The attempts are read from sglang's own mismatch lines (rid and room)."""
    from sglang_serving import deployment as dep

    metrics_port = dep.ROUTER_METRICS_PORT + 1  # the second router's (tests/sglang_serving/deployment.py)
    answer, rooms = _through_the_mismatch_router(deployment, RETRIED_RID, stream=False)
    run = _settled(deployment, [{"room": room} for room in rooms], [answer], "decode-mismatch")
    deadline = time.monotonic() + 30
    while len(_rid_spans(run, REQUEST, "prefill")) < len(rooms) and time.monotonic() < deadline:
        time.sleep(1)  # the prefill's request spans, exported every 0.5 s
        run.spans = run.read_spans()
    run.rooms = rooms
    run.router = {name: _router_counter(deployment, metrics_port, name)
                  for name in ("smg_router_requests_total", "smg_worker_retries_total")}
    return run


def _rid_spans(run, name, role):
    return [s for s in run.named(name, role) if s.attributes.get("sglang.rid") == RETRIED_RID]


def test_the_router_retried_the_request_with_a_new_room_per_attempt(retried):
    assert retried.results[0]["status"] == 500, retried.results  # the last attempt's answer
    attempts = len(retried.rooms)
    assert attempts >= 2 and len(set(retried.rooms)) == attempts, retried.rooms
    # the router's own view: one client request, each attempt after the first a retry (of both workers)
    assert retried.router["smg_router_requests_total"] == 1, retried.router
    assert retried.router["smg_worker_retries_total"] == 2 * (attempts - 1), retried.router


def test_every_attempt_carries_the_clients_rid_on_both_sides(retried):
    rooms = set(retried.rooms)
    requests = _rid_spans(retried, REQUEST, "prefill")
    assert sorted(s.attributes["kv_transfer.bootstrap_room"] for s in requests) == sorted(rooms)
    for request in requests:
        sends = retried.children(request, "kv_transfer.send")
        assert sends and all(s.attributes.get("sglang.rid") == RETRIED_RID for s in sends), request.attributes
        assert request.is_error is False  # the prefill's transfer succeeded; the decode refused what arrived
    receives = _rid_spans(retried, RECEIVE, "decode-mismatch")
    assert sorted(s.attributes["kv_transfer.bootstrap_room"] for s in receives) == sorted(rooms)
    for receive in receives:
        assert receive.attributes["kv_transfer.integrity"] == "mismatch"
        # each attempt's two sides are stitched by its room into one trace
        (request,) = [s for s in requests if s.attributes["kv_transfer.bootstrap_room"]
                      == receive.attributes["kv_transfer.bootstrap_room"]]
        assert receive.trace_id == request.trace_id
    # nothing of another request carries the rid (the spans found by it are this request's attempts, all of them)
    assert {s.attributes["kv_transfer.bootstrap_room"] for _, s in retried.spans
            if s.attributes.get("sglang.rid") == RETRIED_RID} == rooms


def _documented_as_attempts() -> str:
    """docs/telemetry.md's "Retried requests" paragraph."""
    from support.paths import ROOT

    with open(os.path.join(ROOT, "docs", "telemetry.md"), encoding="utf-8") as handle:
        text = handle.read()
    found = re.search(r"^## Retried requests\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert found, "docs/telemetry.md has no '## Retried requests' section"
    return found.group(1)


def test_the_counters_count_attempts_as_the_docs_say(retried):
    """Each counter the docs name as counting attempts moved once per attempt span of its server (all of that
    server's spans so far: the earlier requests' and the retried request's attempts), not once per client request."""
    doc = _documented_as_attempts()
    attempts = len(retried.rooms)
    for otel_name, (prom_name, server, span_name) in ATTEMPT_COUNTERS.items():
        assert f"`{otel_name}`" in doc, otel_name
        spans = retried.named(span_name, server)
        if otel_name == "kv_transfer.integrity_mismatches":
            spans = [s for s in spans if s.attributes.get("kv_transfer.integrity") == "mismatch"]
        assert len([s for s in spans if s.attributes.get("sglang.rid") == RETRIED_RID]) == attempts
        counted = _prom_total(retried.deployment, f'{prom_name}{{service="sglang-{server}"}}', len(spans))
        assert counted == len(spans), (otel_name, counted, len(spans))


def test_a_streamed_request_is_one_attempt_that_ends_in_abort(retried):
    """The router retries on the decode's status, which a streamed request has sent (200) before the decode verifies
    its KV: the mismatch reaches the client inside the stream, and there is no second attempt."""
    import json

    answer, rooms = _through_the_mismatch_router(retried.deployment, "retried-streamed-0", stream=True)
    assert answer["status"] == 200, answer
    assert json.loads(answer["body"])["meta_info"]["finish_reason"]["type"] == "abort", answer
    assert len(rooms) == 1, rooms
