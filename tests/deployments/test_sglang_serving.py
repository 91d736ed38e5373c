"""Real sglang PD serving end to end: prefill server + decode server (both under
`opentelemetry-instrument`, standard OTEL_* variables), sglang-router in PD mode, real streaming /generate
requests through the router, a tiny config-only Llama with dummy weights, Mooncake over TCP on 127.0.0.1, all in
one private network namespace (tests/sglang_serving/deployment.py).

Stand-ins, for what cannot run on this CPU-only machine (tests/sglang_serving/pythonpath): an import-only
`sgl_kernel` (its CPU build is on no registry here; every kernel raises if called) and a test-only sglang plugin
that sets `MooncakeKVSender.supports_host_tensor_indices` False (True sends through pinned memory and a CUDA event)
and publishes each engine process's Prometheus port. Everything else is real.

One deployment for this module (its start is 1-3 minutes here): spans to span files (kvtransfer_file) AND over
OTLP to a real Phoenix; metrics from every engine process on an OpenTelemetry Prometheus endpoint, scraped by a
real Prometheus. sglang's own tracing, aux over TCP, the builder process and the production shapes (TP2, MLA,
two decodes behind a router) run on the shapes deployment (test_sglang_shapes.py).
Not covered here because sglang cannot take those paths on CPU: the staging buffer (heterogeneous TP with
device staging buffers), DCP (decode context parallel) and state payloads (hybrid/mamba models); the staging
back-pressure answer is tested on sglang's real method in test_sglang_serving_fixes.py.
"""

import os
import shutil
import tempfile
import time

import pytest
from support import sglang_runs
from support.parts import IN_CI, require_part
from support.sglang_runs import COMPUTE, REQUEST, SEND, Run
from support.waiting import wait_until

PROJECT = "kvt-sglang-serving"


def _parts_ready():
    from support.observability.parts import phoenix_binary, prometheus_binary

    sglang_runs.require_parts("mooncake")
    require_part(bool(phoenix_binary() and prometheus_binary()),
                 "Phoenix and Prometheus (bash scripts/setup-observability.sh)")


def _main_requests():
    from sglang_serving import deployment as dep

    # 300-token prompts; every second one repeats the one before (its cached prefix is sent early), and one
    # shorter prompt so the byte formula is checked at two lengths.
    return dep.prompts(4, 300, 8, repeat_every=2, rid_prefix="main") + dep.prompts(
        1, 130, 8, repeat_every=0, seed=11, rid_prefix="short")


@pytest.fixture(scope="module")
def main_run():
    """The servers hold ~4 GiB: up for this module's tests only; their span files and Prometheus stay readable."""
    _parts_ready()
    from sglang_serving import deployment as dep

    base = tempfile.mkdtemp(prefix="kvt-sglang-serving-")
    # --sleep-on-idle: an idle scheduler busy-polls a core of the two this machine has (see test_sglang_shapes.py)
    deployment = dep.Deployment(os.path.join(base, "main"), phoenix=True, prometheus=True,
                                extra_env={"OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={PROJECT}"},
                                server_flags=["--sleep-on-idle"])
    try:
        deployment.start()
        requests = _main_requests()
        run = Run(deployment, requests, deployment.generate(requests)).wait_for_spans()
        yield run
    finally:
        deployment.stop()
        if not IN_CI and os.environ.get("KVT_KEEP_SERVING_OUTPUT") != "1":
            shutil.rmtree(base, ignore_errors=True)


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


CONNECT = "kv_transfer.connect"


def test_the_decodes_bootstrap_is_set_up_once_in_the_first_requests_trace(main_run):
    """sglang's decode asks the prefill's bootstrap server for its parallel layout and its rank's address, and
    registers its KV layout with that rank, once per prefill (cached after): three `kv_transfer.connect` spans
    on the decode, all in the first request's trace before its receive opens, none for the later requests; the
    prefill sets up nothing apart (Mooncake opens a segment inside its first send)."""
    from sglang_serving import deployment as dep

    connects = main_run.named(CONNECT, "decode")
    operations = sorted(c.attributes["kv_transfer.connect.operation"] for c in connects)
    assert operations == ["fetch_bootstrap_info", "fetch_parallel_info", "register_kv_args"]
    assert main_run.named(CONNECT, "prefill") == []
    first = main_run.request_of(main_run.requests[0]["rid"])
    room = first.attributes["kv_transfer.bootstrap_room"]
    receive = main_run.receive_of(room)
    for span in connects:
        attrs = span.attributes
        assert span.kind == "CLIENT" and not span.is_error
        assert (attrs["kv_transfer.backend"], attrs["kv_transfer.framework"],
                attrs["kv_transfer.connect.outcome"]) == ("mooncake", "sglang", "ok")
        assert (attrs["server.address"], attrs["server.port"]) == ("127.0.0.1", dep.BOOTSTRAP_PORT)
        assert span.end_time_unix_nano <= receive.start_time_unix_nano
        assert attrs["kv_transfer.request_key"] == str(room) and span.trace_id == first.trace_id
        assert attrs["kv_transfer.tp_rank"] == 0
    # Counted where Prometheus scrapes the decode: three set-up calls, all ok.
    expr = 'sum by (kv_transfer_framework, kv_transfer_connect_outcome) (kv_transfer_connect_duration_seconds_count)'
    got = wait_until(lambda: _prom_value(main_run, expr), 60, "the decode's set-up calls in Prometheus",
                     interval_s=1)
    assert got == {(("kv_transfer_connect_outcome", "ok"), ("kv_transfer_framework", "sglang")): 3.0}
