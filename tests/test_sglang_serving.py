"""Real sglang PD serving end to end: prefill server + decode server (both under
`opentelemetry-instrument`, standard OTEL_* variables), sglang-router in PD mode, real streaming /generate
requests through the router, a tiny config-only Llama with dummy weights, Mooncake over TCP on 127.0.0.1, all in
one private network namespace (tests/sglang_serving/deployment.py).

Stand-ins, for what cannot run on this CPU-only machine (tests/sglang_serving/pythonpath): an import-only
`sgl_kernel` (its CPU build is on no registry here; every kernel raises if called) and a test-only sglang plugin
that sets `MooncakeKVSender.supports_host_tensor_indices` False (True sends through pinned memory and a CUDA event)
and publishes each engine process's Prometheus port. Everything else is real.

Two deployments per session, one after the other (each start is 1-3 minutes here):
- "main": spans to span files (kvtransfer_file) AND over OTLP to a real Phoenix; metrics from every engine
  process on an OpenTelemetry Prometheus endpoint, scraped by a real Prometheus.
- "traced": sglang's own tracing on (`--enable-trace`) and aux sent over ZMQ/TCP (SGLANG_MOONCAKE_SEND_AUX_TCP=1),
  with OTEL_KVTRANSFER_BUILDER=process: our spans are built in helper processes, and still land under sglang's
  request spans (the parent context crosses the pipe).
Not covered here because sglang cannot take those paths on CPU: the staging buffer (heterogeneous TP with
device staging buffers), DCP (decode context parallel) and state payloads (hybrid/mamba models); the staging
back-pressure answer is tested on sglang's real method in test_sglang_serving_fixes.py.
"""

import json
import os
import shutil
import sys
import tempfile
import time

import pytest
from conftest import IN_CI, require_part
from support import sglang_runs
from support.sglang_runs import COMPUTE, REQUEST, SEND, Run
from support.waiting import wait_until

HERE = os.path.dirname(os.path.abspath(__file__))

PROJECT = "kvt-sglang-serving"


def _parts_ready():
    from _observability_parts import phoenix_binary, prometheus_binary

    sglang_runs.require_parts("mooncake")
    require_part(bool(phoenix_binary() and prometheus_binary()),
                 "Phoenix and Prometheus (bash scripts/setup-observability.sh)")


class Serving:
    """At most one deployment up at a time (the machine has 2 cores); results of its requests kept per kind."""

    def __init__(self):
        self.current = None
        self.kind = None
        self.runs = {}
        self.base = tempfile.mkdtemp(prefix="kvt-sglang-serving-")

    def get(self, kind):
        if kind in self.runs:
            return self.runs[kind]
        self.stop()
        from sglang_serving import deployment as dep

        workdir = os.path.join(self.base, kind)
        if kind == "main":
            self.current = dep.Deployment(workdir, phoenix=True, prometheus=True,
                                          extra_env={"OTEL_RESOURCE_ATTRIBUTES":
                                                     f"openinference.project.name={PROJECT}"})
        else:
            aux_tcp = {"SGLANG_MOONCAKE_SEND_AUX_TCP": "1"}
            # process.pid / parent_pid on every span tell which process built it
            builder = {"OTEL_KVTRANSFER_BUILDER": "process", "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS": "otel,process"}
            self.current = dep.Deployment(workdir, enable_trace=True, prefill_env=aux_tcp,
                                          extra_env={**aux_tcp, **builder})
        self.kind = kind
        self.current.start()
        requests = REQUESTS[kind]()
        results = self.current.generate(requests)
        run = Run(self.current, requests, results)
        run.wait_for_spans()
        self.runs[kind] = run
        return run

    def stop(self):
        if self.current is not None:
            self.current.stop()
            self.current = None

    def close(self):
        self.stop()
        if not IN_CI and os.environ.get("KVT_KEEP_SERVING_OUTPUT") != "1":
            shutil.rmtree(self.base, ignore_errors=True)


def _main_requests():
    from sglang_serving import deployment as dep

    # 300-token prompts; every second one repeats the one before (its cached prefix is sent early), and one
    # shorter prompt so the byte formula is checked at two lengths.
    return dep.prompts(4, 300, 8, repeat_every=2, rid_prefix="main") + dep.prompts(
        1, 130, 8, repeat_every=0, seed=11, rid_prefix="short")


def _traced_requests():
    from sglang_serving import deployment as dep

    requests = dep.prompts(2, 200, 8, repeat_every=0, seed=3, rid_prefix="traced")
    requests[1]["traceparent"] = f"00-{TRACEPARENT_TRACE_ID}-00f067aa0ba902b7-01"  # a client that traces
    return requests


TRACEPARENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


REQUESTS = {"main": _main_requests, "traced": _traced_requests}


@pytest.fixture(scope="session")
def serving():
    _parts_ready()
    holder = Serving()
    try:
        yield holder
    finally:
        holder.close()


@pytest.fixture(scope="module", autouse=True)
def _servers_down_after_this_module(serving):
    """The servers hold ~4 GiB: down as soon as this module's tests are done, not at the end of the session."""
    yield
    serving.stop()


@pytest.fixture
def main_run(serving):
    return serving.get("main")


@pytest.fixture
def traced_run(serving):
    return serving.get("traced")


def _model():
    from sglang_serving import deployment as dep

    return dep.model_config(), dep.expected_kv_bytes


# --- (a) per request: bytes, aux, compute, overlap, receive in the same trace; early prefix send -------------


def test_every_request_answered_through_the_router(main_run):
    assert [r["rid"] for r in main_run.results] == [q["rid"] for q in main_run.requests]
    for request, result in zip(main_run.requests, main_run.results):
        assert result["tokens"] == request["max_new_tokens"], result


def test_request_spans_bytes_compute_overlap_and_receive(main_run):
    config, expected_kv_bytes = _model()
    aux_sizes = set()
    for request in main_run.requests:
        span = main_run.request_of(request["rid"])
        attrs = span.attributes
        assert not span.is_error, attrs
        assert attrs["kv_transfer.role"] == "prefill" and attrs["kv_transfer.framework"] == "sglang"
        assert attrs["kv_transfer.backend"] == "mooncake"
        sends = main_run.children(span, SEND)
        kv = [s for s in sends if s.attributes["kv_transfer.payload"] == "kv"]
        aux = [s for s in sends if s.attributes["kv_transfer.payload"] == "aux"]
        assert kv and len(aux) == 1, [s.attributes for s in sends]
        assert sum(s.attributes["kv_transfer.bytes"] for s in kv) == expected_kv_bytes(len(request["input_ids"]),
                                                                                       config)
        assert aux[0].attributes["kv_transfer.bytes"] > 0
        aux_sizes.add(aux[0].attributes["kv_transfer.bytes"])
        assert attrs["kv_transfer.bytes"] == sum(s.attributes["kv_transfer.bytes"] for s in sends)
        assert not any(s.is_error for s in sends)
        assert [s.attributes["kv_transfer.is_last_chunk"] for s in kv].count(True) == 1
        for send in sends:
            assert send.attributes["network.transport"] == "tcp"
            assert send.attributes["server.address"] == "127.0.0.1"
            assert span.start_time_unix_nano <= send.start_time_unix_nano <= send.end_time_unix_nano \
                <= span.end_time_unix_nano
        computes = main_run.children(span, COMPUTE)
        assert len(computes) >= 1
        assert attrs["kv_transfer.compute_overlap_s"] >= 0
        assert 0.0 <= attrs["kv_transfer.compute_overlap_ratio"] <= 1.0
        receive = main_run.receive_of(attrs["kv_transfer.bootstrap_room"])
        assert receive.trace_id == span.trace_id and not receive.is_error
        assert receive.attributes["kv_transfer.role"] == "decode"
    assert len(aux_sizes) == 1  # the same metadata record for every request


def test_repeated_prompt_sends_its_cached_prefix_early(main_run):
    by_ids = {}
    for request in main_run.requests:
        key = tuple(request["input_ids"])
        span = main_run.request_of(request["rid"])
        kv = sorted((s.attributes for s in main_run.children(span, SEND)
                     if s.attributes["kv_transfer.payload"] == "kv"), key=lambda a: a["kv_transfer.chunk_index"])
        if key in by_ids:  # a repeat: chunk 0 is the cached prefix, sent early; the rest follows
            assert kv[0]["kv_transfer.chunk_index"] == 0 and kv[0]["kv_transfer.prefix_early_send"] is True, kv
            assert len({a["kv_transfer.chunk_index"] for a in kv}) >= 2
        else:
            assert not any(a["kv_transfer.prefix_early_send"] for a in kv), kv
        by_ids.setdefault(key, request["rid"])
    assert len(by_ids) < len(main_run.requests)  # the workload has repeats at all


def test_warm_up_and_health_requests_make_no_orphan_trace(main_run):
    spans = [s for _, s in main_run.spans if s.name.startswith("kv_transfer.")]
    assert not [s for s in spans if s.attributes.get("kv_transfer.bootstrap_room") == 0]
    assert not [s for s in spans if s.attributes.get("kv_transfer.request_key") == "0"]
    requests = {(s.trace_id, s.span_id) for s in main_run.named(REQUEST)}
    for compute in main_run.named(COMPUTE):
        assert (compute.trace_id, compute.parent_span_id) in requests
    # every trace that holds our spans holds its request span: nothing hangs alone
    traces_with_request = {s.trace_id for s in main_run.named(REQUEST)}
    assert {s.trace_id for s in spans} == traces_with_request
    assert len(main_run.named(REQUEST)) == len(main_run.requests)


# --- (b) over OTLP into Phoenix; metrics from the engine processes scraped by Prometheus ---------------------


def _phoenix_spans(run, trace_ids, expected):
    from sglang_serving.deployment import PHOENIX_HTTP_PORT

    url = f"http://127.0.0.1:{PHOENIX_HTTP_PORT}/v1/projects/{PROJECT}/spans/otlpv1"
    deadline = time.monotonic() + 60
    while True:
        body = run.deployment.http_get(url, {"limit": "1000", "trace_id": list(trace_ids)})
        spans = body.get("data") or []
        if len(spans) >= expected or time.monotonic() > deadline:
            return spans
        time.sleep(1)


def test_spans_reach_phoenix_over_otlp(main_run):
    ours = [s for _, s in main_run.spans if s.name.startswith("kv_transfer.")]
    stored = _phoenix_spans(main_run, {s.trace_id for s in ours}, len(ours))
    stored_ids = {(s["trace_id"], s["span_id"]) for s in stored}
    assert {(s.trace_id, s.span_id) for s in ours} <= stored_ids
    by_id = {s["span_id"]: s for s in stored}
    for span in main_run.named(REQUEST):
        attrs = {kv["key"]: kv["value"] for kv in by_id[span.span_id].get("attributes") or []}
        assert int(attrs["kv_transfer.bytes"]["int_value"]) == span.attributes["kv_transfer.bytes"]


def _prom_value(run, expr):
    result = run.deployment.prometheus_query(expr)
    return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in result}


def test_prometheus_scrapes_metrics_from_the_engine_processes(main_run):
    sends = main_run.named(SEND, "prefill")
    total = sum(s.attributes["kv_transfer.bytes"] for s in sends)
    expected = {
        "sum(kv_transfer_size_bytes_count)": len(sends),
        "sum(kv_transfer_size_bytes_sum)": total,
        "sum(kv_transfer_request_size_bytes_count)": len(main_run.requests),
        "sum(kv_transfer_receive_duration_seconds_count)": len(main_run.requests),
    }
    deadline = time.monotonic() + 60
    while True:
        got = {expr: sum(_prom_value(main_run, expr).values()) for expr in expected}
        if got == expected or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert got == expected
    # from the scheduler processes (where the transfers happen), not the HTTP front process
    for metric, service in (("kv_transfer_size_bytes_count", "sglang-prefill"),
                            ("kv_transfer_receive_duration_seconds_count", "sglang-decode")):
        series = main_run.deployment.prometheus_query(metric)
        assert series and all(s["metric"]["sglang_process"] == "scheduler" for s in series), series
        assert {s["metric"]["service"] for s in series} == {service}
        pids = {int(s["metric"]["pid"]) for s in series}
        role = "prefill" if service == "sglang-prefill" else "decode"
        assert pids <= set(main_run.deployment.server_pids(role)[1:])


# --- (c) sglang's own tracing on: our spans under sglang's request spans; (d) aux over TCP -------------------


def test_with_sglang_tracing_our_spans_are_children_of_sglang_request_spans(traced_run):
    for request in traced_run.requests:
        span = traced_run.request_of(request["rid"])
        parents = [s for _, s in traced_run.spans if s.span_id == span.parent_span_id
                   and s.trace_id == span.trace_id]
        assert len(parents) == 1, "the request span's parent is not in the trace"
        parent = parents[0]
        assert not parent.name.startswith("kv_transfer."), parent.name
        assert parent.attributes.get("rid") == request["rid"], parent.attributes
        room = span.attributes["kv_transfer.bootstrap_room"]
        assert parent.attributes.get("bootstrap_room") == hex(room)
        receive = traced_run.receive_of(room)
        decode_parent = [s for _, s in traced_run.spans if s.span_id == receive.parent_span_id]
        assert len(decode_parent) == 1 and not decode_parent[0].name.startswith("kv_transfer.")
        # the trace shows both: sglang's spans and ours
        names = {s.name for _, s in traced_run.spans if s.trace_id == span.trace_id}
        assert {REQUEST, SEND, COMPUTE} <= names and any(not n.startswith("kv_transfer.") for n in names)
        if request.get("traceparent"):  # the client's trace holds prefill and decode, sglang's spans and ours
            assert span.trace_id == receive.trace_id == TRACEPARENT_TRACE_ID
        else:  # no caller context: sglang roots each side's request span in a trace of its own
            assert span.trace_id != receive.trace_id


def test_aux_over_tcp_gives_an_aux_send_with_its_bytes(traced_run):
    config, expected_kv_bytes = _model()
    for request in traced_run.requests:
        span = traced_run.request_of(request["rid"])
        assert not span.is_error
        sends = traced_run.children(span, SEND)
        aux = [s for s in sends if s.attributes["kv_transfer.payload"] == "aux"]
        kv = [s for s in sends if s.attributes["kv_transfer.payload"] == "kv"]
        assert len(aux) >= 1 and not any(s.is_error for s in sends)
        assert all(a.attributes["kv_transfer.protocol" if "kv_transfer.protocol" in a.attributes
                                else "network.transport"] == "tcp" for a in aux)
        assert sum(s.attributes["kv_transfer.bytes"] for s in kv) == expected_kv_bytes(len(request["input_ids"]),
                                                                                       config)
        assert sum(a.attributes["kv_transfer.bytes"] for a in aux) > 0
        assert span.attributes["kv_transfer.bytes"] == sum(s.attributes["kv_transfer.bytes"] for s in sends)


def test_with_a_builder_process_every_kv_span_is_built_outside_the_engine(traced_run):
    """OTEL_KVTRANSFER_BUILDER=process on a real server: each sglang process that transfers KV started one helper;
    every kv_transfer span was built by a helper of the same server (it has that server's environment), none by
    an sglang process, and sglang's own spans by sglang's processes (the test above checks that ours still sit
    under them). A helper is not in its server's process tree: a starter forks it and ends, so a supervisor that
    kills the server's tree leaves it to export what it holds."""
    import psutil

    def helpers_of(service):
        found = set()
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if "otel_kvtransfer.building.helper_process" in " ".join(proc.info["cmdline"] or ()) \
                        and proc.environ().get("OTEL_SERVICE_NAME") == service:
                    found.add(proc.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    for role in ("prefill", "decode"):
        tree = set(traced_run.deployment.server_pids(role))
        helpers = helpers_of(f"sglang-{role}")
        assert helpers, f"no builder process of the {role} server"
        assert not helpers & tree  # out of the server's tree
        ours = [s for r, s in traced_run.spans if r == role and s.name.startswith("kv_transfer.")]
        sglang_own = [s for r, s in traced_run.spans if r == role and not s.name.startswith("kv_transfer.")]
        assert ours and sglang_own
        assert {s.resource["process.pid"] for s in ours} <= helpers
        assert {s.resource["process.pid"] for s in sglang_own} <= tree


def test_the_tail_is_what_the_spans_own_intervals_say(main_run):
    """On the real deployment, every request with compute carries the tail, and it is exactly what its own send
    and compute spans say: from the last compute end to the last byte, the part of it some send moved bytes in,
    and the rest. Both shapes occur: a first prompt whose KV all leaves after compute, and a repeated one whose
    cached prefix left early, during compute."""
    shapes = set()
    for span in main_run.named(REQUEST, "prefill"):
        computes = main_run.children(span, COMPUTE)
        sends = main_run.children(span, SEND)
        if not computes or not sends:
            continue
        compute_end = max(c.end_time_unix_nano for c in computes)
        last_byte = max(s.end_time_unix_nano for s in sends)
        tail = max(last_byte - compute_end, 0)
        # the union of the send intervals, clipped to [compute_end, last_byte), by brute force over the edges
        edges = sorted({compute_end, last_byte} | {t for s in sends for t in (s.start_time_unix_nano,
                                                                              s.end_time_unix_nano)
                                                  if compute_end <= t <= last_byte})
        busy = sum(b - a for a, b in zip(edges, edges[1:])
                   if any(s.start_time_unix_nano <= a and b <= s.end_time_unix_nano for s in sends))
        attrs = span.attributes
        assert attrs["kv_transfer.tail_s"] == pytest.approx(tail / 1e9, abs=1e-9)
        assert attrs["kv_transfer.tail_busy_s"] == pytest.approx(busy / 1e9, abs=1e-9)
        assert attrs["kv_transfer.tail_queued_s"] == pytest.approx((tail - busy) / 1e9, abs=1e-9)
        early = any(s.attributes.get("kv_transfer.prefix_early_send") for s in sends)
        shapes.add("early" if early else "after")
    assert shapes == {"early", "after"}


# --- ranks and the start-up line, on the real servers ----------------------------------------------------------


def _startup_lines(deployment, name):
    with open(deployment.log_path(name), encoding="utf-8", errors="replace") as handle:
        return [line.rstrip("\n") for line in handle if "otel_kvtransfer: on (" in line]


def test_each_servers_log_says_the_instrumentation_is_on_with_its_role_and_rank(traced_run):
    """sglang's scheduler prints the start-up line through sglang's own root logging config when its KV manager
    is built (TP1 here: one scheduler per server, rank 0); the other processes say they have no role, later."""
    for role in ("prefill", "decode"):
        lines = _startup_lines(traced_run.deployment, role)
        with_role = [line for line in lines if "; role " in line]
        assert len(with_role) == 1, lines
        (line,) = with_role
        assert line.startswith("[")  # sglang's own log format: "[time prefix] message"
        assert f"; role {role}, kv_transfer.tp_rank 0 (sglang); " in line
        assert "patched: sglang 0.5.23" in line and "engines: mooncake " in line
        assert "; builder: process; " in line  # OTEL_KVTRANSFER_BUILDER=process in this deployment
        assert "; spans: kvtransfer_file (" in line and "; metrics: none (" in line


def test_every_span_kind_carries_the_rank_and_every_send_its_peers(traced_run):
    kinds = {}
    for role, span in traced_run.spans:
        if "kv_transfer.request_key" in span.attributes:  # ours, of a request (no raw engine call here)
            kinds.setdefault(span.name, []).append(span)
            assert span.attributes.get("kv_transfer.tp_rank") == 0, (role, span.name, dict(span.attributes))
            assert "kv_transfer.dp_rank" not in span.attributes  # no data-parallel attention here
    assert {REQUEST, SEND, COMPUTE, "kv_transfer.receive"} <= set(kinds), sorted(kinds)
    for send in kinds[SEND]:
        assert send.attributes["kv_transfer.peer_rank"] == 0
        assert send.attributes["kv_transfer.destination_index"] == 0


# --- a client's hostile rid, on the same deployment --------------------------------------------------------------

HOSTILE_RID = "\ud800"  # what the JSON escape "\ud800" in a client's body decodes to: a lone surrogate


def test_a_hostile_rid_leaves_every_other_requests_spans_whole(serving, traced_run):
    """A client controls `rid` (the package puts it on the request span as `sglang.rid`). One request with a lone
    surrogate for its rid, sent at the same moment as two normal ones straight to both servers as the router sends
    them (tests/support/pd_direct_client.py: a client that reaches the servers sends any rid). sglang 0.5.23 parses
    a body with orjson, which refuses a lone surrogate: both servers answer 400 before a request exists, so nothing
    of it may be made; a release that admits it must show the rid repaired (U+FFFD). Either way the other
    requests' spans arrive whole. (The repair itself, and the whole OTLP batches it saves, are shown through the
    real OTLP/HTTP and gRPC exporters in test_encoder_validity.py.)"""
    from sglang_serving import deployment as dep

    assert serving.kind == "traced" and serving.current is traced_run.deployment, "the traced deployment is down"
    requests = dep.prompts(3, 120, 4, repeat_every=0, seed=21, rid_prefix="calm")
    for n, request in enumerate(requests):
        request["room"] = 7_000_000 + n
    hostile = requests[1]
    hostile["rid"] = HOSTILE_RID
    code, out, err = traced_run.deployment.run_in_namespace(
        [sys.executable, os.path.join(HERE, "support", "pd_direct_client.py"),
         f"http://127.0.0.1:{dep.PREFILL_PORT}/generate", f"http://127.0.0.1:{dep.DECODE_PORT}/generate",
         str(dep.BOOTSTRAP_PORT)], timeout=600, input_text=json.dumps(requests))
    assert code == 0, err[-2000:]
    answers = {a["room"]: a for a in json.loads(out)}
    for request in requests:
        if request is not hostile:
            assert answers[request["room"]]["prefill"] == 200 and answers[request["room"]]["decode"] == 200, answers
    admitted = answers[hostile["room"]]["prefill"] == 200
    if not admitted:
        assert all(str(answers[hostile["room"]][role]).startswith("400") for role in ("prefill", "decode")), answers
    expected = [r for r in requests if r is not hostile or admitted]
    wanted_rids = {"\ufffd" if r is hostile else r["rid"] for r in expected}

    def arrived():
        spans = sglang_runs.Run(traced_run.deployment, [], []).read_spans()
        rids = {s.attributes.get("sglang.rid") for _, s in spans if s.name == REQUEST}
        rooms = {s.attributes.get("kv_transfer.bootstrap_room") for _, s in spans if s.name == "kv_transfer.receive"}
        return spans if wanted_rids <= rids and {r["room"] for r in expected} <= rooms else None

    spans = wait_until(arrived, 120, "the normal requests' request and receive spans in the span files",
                       interval_s=1.0)  # the exporters write every 0.5 s
    for request in expected:
        rid = "\ufffd" if request is hostile else request["rid"]
        (top,) = [s for _, s in spans if s.name == REQUEST and s.attributes.get("sglang.rid") == rid]
        sends = [s for _, s in spans if s.name == SEND and s.parent_span_id == top.span_id]
        assert sends and all(s.attributes["kv_transfer.bootstrap_room"] == request["room"] for s in sends)
    if not admitted:  # nothing half-made of a request that never existed
        assert not [s for _, s in spans if s.attributes.get("kv_transfer.bootstrap_room") == hostile["room"]]
