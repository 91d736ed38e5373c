"""Real sglang PD serving over NIXL: prefill server + decode server (both under `opentelemetry-instrument`),
sglang-router in PD mode, real streaming /generate requests, `--disaggregation-transfer-backend nixl` with UCX over
TCP and shared memory on 127.0.0.1, all in one private network namespace (tests/sglang_serving/deployment.py).

Stand-ins, for what cannot run on this CPU-only machine (tests/sglang_serving/pythonpath): the import-only
`sgl_kernel`, and the test-only sglang plugin, which here also declares sglang's KV pool DRAM before
`NixlKVManager.__init__` runs (sglang registers it as VRAM, which UCX built without CUDA refuses). Everything else
is real: sglang's NIXL manager posts real NIXL writes between the two servers.

What the package must show: one `kv_transfer.request` per bootstrap room whose sends are its NIXL handles (never
bare NIXL sends), bytes exact against the model's formula, compute spans, and the decode side's receive in the
same trace. One deployment for this module, a few requests (each start is 1-3 minutes here).
"""

import os
import shutil
import tempfile

import pytest
from conftest import IN_CI
from support import sglang_runs
from support.sglang_runs import COMPUTE, RECEIVE, REQUEST, SEND, Run


def _requests():
    from sglang_serving import deployment as dep

    # Two 300-token prompts, the second repeating the first (its cached prefix is sent early), and a shorter one
    # so the byte formula is checked at two lengths.
    return dep.prompts(2, 300, 8, repeat_every=2, rid_prefix="nixl") + dep.prompts(
        1, 130, 8, repeat_every=0, seed=11, rid_prefix="nixl-short")


@pytest.fixture(scope="module")
def nixl_run():
    sglang_runs.require_parts("nixl")
    from sglang_serving import deployment as dep

    base = tempfile.mkdtemp(prefix="kvt-sglang-nixl-")
    deployment = dep.Deployment(os.path.join(base, "nixl"), transfer_backend="nixl")
    try:
        deployment.start()
        requests = _requests()
        results = deployment.generate(requests)
        run = Run(deployment, requests, results).wait_for_spans()
    finally:
        deployment.stop()  # the servers hold ~4 GiB: down before the assertions, the span files stay
    yield run
    if not IN_CI and os.environ.get("KVT_KEEP_SERVING_OUTPUT") != "1":
        shutil.rmtree(base, ignore_errors=True)


def test_every_request_answered_through_the_router(nixl_run):
    assert [r["rid"] for r in nixl_run.results] == [q["rid"] for q in nixl_run.requests]
    for request, result in zip(nixl_run.requests, nixl_run.results):
        assert result["tokens"] == request["max_new_tokens"], result


def test_one_request_span_per_room_with_its_nixl_sends_compute_and_receive(nixl_run):
    from sglang_serving import deployment as dep

    config = dep.model_config()
    rooms = set()
    for request in nixl_run.requests:
        span = nixl_run.request_of(request["rid"])
        attrs = span.attributes
        assert not span.is_error, attrs
        assert (attrs["kv_transfer.role"], attrs["kv_transfer.framework"], attrs["kv_transfer.backend"]) == (
            "prefill", "sglang", "nixl")
        room = attrs["kv_transfer.bootstrap_room"]
        assert attrs["kv_transfer.request_key"] == str(room) and room not in rooms
        rooms.add(room)
        sends = nixl_run.children(span, SEND)
        kv = [s for s in sends if s.attributes["kv_transfer.payload"] == "kv"]
        aux = [s for s in sends if s.attributes["kv_transfer.payload"] == "aux"]
        assert kv and len(aux) == 1, [s.attributes for s in sends]
        assert sum(s.attributes["kv_transfer.bytes"] for s in kv) == dep.expected_kv_bytes(
            len(request["input_ids"]), config)
        assert aux[0].attributes["kv_transfer.bytes"] > 0
        assert attrs["kv_transfer.bytes"] == sum(s.attributes["kv_transfer.bytes"] for s in sends)
        assert attrs["kv_transfer.transfer_count"] == len(sends)
        assert [s.attributes["kv_transfer.is_last_chunk"] for s in kv].count(True) == 1
        for send in sends:
            a = send.attributes
            assert not send.is_error, a
            assert (a["kv_transfer.backend"], a["kv_transfer.op"], a["kv_transfer.protocol"]) == ("nixl", "write",
                                                                                                  "ucx")
            assert a["nixl.remote_agent"]  # the decode server's NIXL agent
            assert a["kv_transfer.request_key"] == str(room) and a["kv_transfer.descriptor_count"] > 0
            assert span.start_time_unix_nano <= send.start_time_unix_nano <= send.end_time_unix_nano \
                <= span.end_time_unix_nano
        assert nixl_run.children(span, COMPUTE)
        assert 0.0 <= attrs["kv_transfer.compute_overlap_ratio"] <= 1.0
        (receive,) = [s for s in nixl_run.named(RECEIVE) if s.attributes.get("kv_transfer.bootstrap_room") == room]
        assert receive.trace_id == span.trace_id and not receive.is_error
        assert (receive.attributes["kv_transfer.role"], receive.attributes["kv_transfer.backend"]) == ("decode",
                                                                                                      "nixl")


def test_no_bare_nixl_sends_and_no_orphan_traces(nixl_run):
    """Every NIXL handle sglang posted belongs to a request (no raw send), and warm-up requests (room 0) leave
    no span at all."""
    requests = {(s.trace_id, s.span_id) for s in nixl_run.named(REQUEST)}
    assert len(requests) == len(nixl_run.requests)
    for send in nixl_run.named(SEND):
        assert (send.trace_id, send.parent_span_id) in requests, send.attributes
    for compute in nixl_run.named(COMPUTE):
        assert (compute.trace_id, compute.parent_span_id) in requests
    ours = [s for _, s in nixl_run.spans if s.name.startswith("kv_transfer.")]
    assert not [s for s in ours if s.attributes.get("kv_transfer.request_key") == "0"]
    assert {s.trace_id for s in ours} == {trace_id for trace_id, _ in requests}


def test_repeated_prompt_sends_its_cached_prefix_early(nixl_run):
    first, repeat = nixl_run.requests[0], nixl_run.requests[1]
    assert first["input_ids"] == repeat["input_ids"]
    kv = sorted((s.attributes for s in nixl_run.children(nixl_run.request_of(repeat["rid"]), SEND)
                 if s.attributes["kv_transfer.payload"] == "kv"), key=lambda a: a["kv_transfer.chunk_index"])
    assert kv[0]["kv_transfer.chunk_index"] == 0 and kv[0]["kv_transfer.prefix_early_send"] is True, kv
    assert len({a["kv_transfer.chunk_index"] for a in kv}) >= 2
    first_kv = [s.attributes for s in nixl_run.children(nixl_run.request_of(first["rid"]), SEND)]
    assert not any(a["kv_transfer.prefix_early_send"] for a in first_kv)
