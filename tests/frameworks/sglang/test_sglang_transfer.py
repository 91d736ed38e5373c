"""sglang 0.5.23's real PD classes (Mooncake backend) in processes of their own, CPU, loopback TCP.

Each test runs one scenario of sglang_harness: a prefill process (with sglang's bootstrap server) and one or two
decode processes over numpy KV buffers, forked from a fork server that imported sglang once for the session; the
decode side verifies every byte it was promised. The spans come back from the processes' in-memory exporters.
"""

import importlib.util

import pytest
from support import sglang_harness as harness
from support.parts import require_part

from otel_kvtransfer import semconv as sc


def _require_sglang():
    ok = importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("mooncake") is not None
    require_part(ok, "sglang 0.5.23 and mooncake-transfer-engine-non-cuda")


def _run(**cfg):
    _require_sglang()
    result = harness.run_scenario(start_method="forkserver", **cfg)
    prefill = result["prefill"]
    assert prefill is not None, result
    assert "error" not in prefill, prefill.get("error")
    for d in result["decodes"]:
        assert "error" not in d, d.get("error")
    return result


def _by_name(spans, name):
    return [s for s in spans if s["name"] == name]


def _request(prefill):
    requests = _by_name(prefill["spans"], sc.SPAN_REQUEST)
    assert len(requests) == 1, [s["name"] for s in prefill["spans"]]
    return requests[0]


def test_chunked_request_exact_bytes_and_decode_in_same_trace():
    result = _run(chunks=[16, 16, 16])
    prefill, (decode,) = result["prefill"], result["decodes"]
    assert prefill["status"] == "Success" and decode["status"] == "Success"
    assert decode["verified"] == {"bad_pages": 0, "pages_checked": 8 * 48, "aux_ok": True}

    item_sum = prefill["kv_item_lens_sum"]  # 8 buffers x 32 KiB: one page's KV across all layers
    sends = sorted(_by_name(prefill["spans"], sc.SPAN_SEND), key=lambda s: s["start"])
    kv = [s for s in sends if s["attributes"][sc.PAYLOAD] == sc.PAYLOAD_KV]
    aux = [s for s in sends if s["attributes"][sc.PAYLOAD] == sc.PAYLOAD_AUX]
    assert [s["attributes"][sc.CHUNK_INDEX] for s in kv] == [0, 1, 2]
    assert [s["attributes"][sc.BYTES] for s in kv] == [16 * item_sum] * 3
    assert [s["attributes"][sc.IS_LAST_CHUNK] for s in kv] == [False, False, True]
    assert len(aux) == 1 and aux[0]["attributes"][sc.BYTES] == 256 and aux[0]["attributes"][sc.CHUNK_INDEX] == 2
    first = kv[0]
    assert first["kind"] == "CLIENT" and first["status"] == "UNSET"
    attrs = first["attributes"]
    assert attrs[sc.ENGINE_CALLS] == 1
    assert attrs[sc.DESCRIPTOR_COUNT] == 16 * 8  # reversed destination pages: one block per page and buffer
    assert attrs[sc.REPLICA_FACTOR] == 1 and attrs[sc.DESTINATION_INDEX] == 0
    assert attrs[sc.PREFIX_EARLY_SEND] is False
    assert attrs[sc.SERVER_ADDRESS] == "127.0.0.1" and attrs[sc.NETWORK_TRANSPORT] == "tcp"
    assert attrs[sc.OP] == sc.OP_WRITE

    request = _request(prefill)
    ra = request["attributes"]
    assert request["status"] == "UNSET"
    assert ra[sc.BYTES] == 48 * item_sum + 256
    # sglang's own count (KV indices x item lengths x replica factor) leaves the aux payload out.
    assert ra[sc.LOGICAL_BYTES] - 256 == prefill["transfer_total_bytes"] == 48 * item_sum
    assert ra[sc.CHUNK_COUNT] == 3 and ra[sc.TRANSFER_COUNT] == 4
    assert 0 < ra[sc.BUSY_S] <= (request["end"] - request["start"]) / 1e9
    assert ra[sc.THROUGHPUT] == pytest.approx(ra[sc.BYTES] / ra[sc.BUSY_S], rel=1e-6)
    assert sc.COMPUTE_OVERLAP_RATIO in ra
    for s in sends:
        assert s["parent_id"] == request["span_id"] and s["trace_id"] == request["trace_id"]
        assert request["start"] <= s["start"] <= s["end"] <= request["end"]

    (receive,) = _by_name(decode["spans"], sc.SPAN_RECEIVE)
    assert receive["trace_id"] == request["trace_id"]
    assert receive["parent_id"] == request["parent_id"]  # the room's synthetic parent, on both sides
    assert receive["attributes"][sc.EXPECTED_BYTES] == ra[sc.BYTES]
    assert receive["attributes"][sc.ROLE] == sc.ROLE_DECODE and receive["status"] == "UNSET"
    assert prefill["metrics"].get(sc.METRIC_FAILURES, 0) == 0


def test_mla_fanout_to_two_decode_ranks():
    result = _run(mla=True, decodes=2, chunks=[16, 16, 16])
    prefill = result["prefill"]
    assert prefill["status"] == "Success"
    assert prefill["replica_factor"] == 2
    for d in result["decodes"]:
        assert d["status"] == "Success"
        assert d["verified"] == {"bad_pages": 0, "pages_checked": 4 * 48, "aux_ok": True}
    item_sum = prefill["kv_item_lens_sum"]
    sends = _by_name(prefill["spans"], sc.SPAN_SEND)
    kv = [s["attributes"] for s in sends if s["attributes"][sc.PAYLOAD] == sc.PAYLOAD_KV]
    assert sorted((a[sc.CHUNK_INDEX], a[sc.DESTINATION_INDEX]) for a in kv) == [
        (c, d) for c in range(3) for d in range(2)
    ]
    assert all(a[sc.REPLICA_FACTOR] == 2 and a[sc.BYTES] == 16 * item_sum for a in kv)
    aux = [s["attributes"] for s in sends if s["attributes"][sc.PAYLOAD] == sc.PAYLOAD_AUX]
    assert sorted(a[sc.DESTINATION_INDEX] for a in aux) == [0, 1]

    ra = _request(prefill)["attributes"]
    assert ra[sc.REPLICA_FACTOR] == 2
    wire_kv = sum(a[sc.BYTES] for a in kv)
    # sglang's metric counts wire bytes (x replica factor); logical bytes count the KV once.
    assert wire_kv == prefill["transfer_total_bytes"] == 2 * 48 * item_sum
    assert ra[sc.BYTES] == wire_kv + 2 * 256
    assert ra[sc.LOGICAL_BYTES] == 48 * item_sum + 256
    assert ra[sc.TRANSFER_COUNT] == 8 and ra[sc.CHUNK_COUNT] == 3


def test_decode_gone_gives_error_spans_and_a_concluded_request():
    result = _run(fail="decode_gone", chunks=[16, 16, 16], compute_gap_s=0.0, timeout_s=30.0)
    prefill = result["prefill"]
    assert prefill["status"] == "Failed"
    sends = _by_name(prefill["spans"], sc.SPAN_SEND)
    failed = [s for s in sends if s["status"] == "ERROR"]
    assert failed, sends
    first = [s for s in failed if s["attributes"][sc.BOOTSTRAP_ROOM] == result["cfg"]["room"]][0]["attributes"]
    assert first[sc.ERROR_TYPE]
    assert first[sc.PAYLOAD] == sc.PAYLOAD_KV and first[sc.CHUNK_INDEX] == 0
    if first[sc.ENGINE_CALLS]:
        assert first[sc.RETURN_CODE] != 0  # the engine's own code, unchanged
    room = result["cfg"]["room"]
    requests = {s["attributes"][sc.BOOTSTRAP_ROOM]: s for s in _by_name(prefill["spans"], sc.SPAN_REQUEST)}
    request = requests[room]
    assert request["status"] == "ERROR"
    assert request["attributes"][sc.ERROR_TYPE] == "kv_send_failed"
    # A second room to the same decode: sglang skips the session it now knows dead, without an engine call.
    assert prefill["second_status"] == "Failed"
    (skipped,) = [s for s in failed if s["attributes"][sc.BOOTSTRAP_ROOM] == room + 1]
    assert skipped["attributes"][sc.ERROR_TYPE] == "decode_session_failed"
    assert skipped["attributes"][sc.BYTES] == 0 and skipped["attributes"][sc.ENGINE_CALLS] == 0
    assert skipped["attributes"][sc.IS_LAST_CHUNK] is True and skipped["parent_id"] == requests[room + 1]["span_id"]
    assert requests[room + 1]["status"] == "ERROR"
    assert requests[room + 1]["attributes"][sc.ERROR_TYPE] == "decode_session_failed"
    assert prefill["metrics"].get(sc.METRIC_FAILURES, 0) == len(failed) == 2


def test_cached_prefix_early_send_is_flagged(monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX", "1")
    result = _run(chunks=[24, 12, 12], early_send_prefix=24, compute_gap_s=0.02)
    prefill, (decode,) = result["prefill"], result["decodes"]
    assert prefill["status"] == "Success" and decode["verified"]["bad_pages"] == 0
    kv = sorted(
        (s["attributes"] for s in _by_name(prefill["spans"], sc.SPAN_SEND)
         if s["attributes"][sc.PAYLOAD] == sc.PAYLOAD_KV),
        key=lambda a: a[sc.CHUNK_INDEX],
    )
    assert [(a[sc.CHUNK_INDEX], a[sc.PREFIX_EARLY_SEND], a[sc.IS_LAST_CHUNK]) for a in kv] == [
        (0, True, False), (1, False, False), (2, False, True)]
    assert kv[0][sc.BYTES] == 24 * prefill["kv_item_lens_sum"]


def test_head_sliced_path_counts_every_per_layer_engine_call():
    # MHA, 1 prefill rank -> 2 decode ranks: sglang's send_kvcache_slice, one engine call per layer buffer on the
    # worker's executor threads, each rank receiving half of every page's heads.
    result = _run(decodes=2, chunks=[16, 16, 16])
    prefill = result["prefill"]
    assert prefill["status"] == "Success" and prefill["replica_factor"] == 1
    for d in result["decodes"]:
        assert d["status"] == "Success"
        assert d["verified"] == {"bad_pages": 0, "pages_checked": 8 * 48, "aux_ok": True}
    item_sum = prefill["kv_item_lens_sum"]
    kv = [s["attributes"] for s in _by_name(prefill["spans"], sc.SPAN_SEND) if s["attributes"][sc.PAYLOAD] == "kv"]
    assert sorted((a[sc.CHUNK_INDEX], a[sc.DESTINATION_INDEX]) for a in kv) == [
        (c, d) for c in range(3) for d in range(2)]
    for a in kv:
        assert a[sc.ENGINE_CALLS] == 8  # K and V of 4 layers, each its own call on an executor thread
        assert a[sc.BYTES] == 16 * item_sum // 2  # half the heads of 16 pages
        assert a[sc.DESCRIPTOR_COUNT] == 8 * 16
    ra = _request(prefill)["attributes"]
    # Disjoint head slices: no replica, the wire bytes are the logical bytes and match sglang's count.
    assert ra[sc.REPLICA_FACTOR] == 1
    assert ra[sc.BYTES] - 2 * 256 == prefill["transfer_total_bytes"] == 48 * item_sum


def test_request_goes_under_sglangs_own_span_when_its_tracing_is_on():
    result = _run(sglang_trace=True, chunks=[16, 16])
    prefill = result["prefill"]
    assert prefill["status"] == "Success"
    sglang_span = prefill["sglang_span"]  # sglang's span of this request (its Mooncake sender's root span)
    request = _request(prefill)
    assert request["trace_id"] == sglang_span["trace_id"]
    assert request["parent_id"] == sglang_span["span_id"]
    for s in _by_name(prefill["spans"], sc.SPAN_SEND):
        assert s["trace_id"] == sglang_span["trace_id"] and s["parent_id"] == request["span_id"]


def test_aborted_timed_out_and_forgotten_rooms_conclude(monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "2")
    monkeypatch.setenv("OTEL_KVTRANSFER_REQUEST_TTL_S", "3")
    result = _run(fail="no_decode", timeout_s=20.0)
    prefill = result["prefill"]
    room = result["cfg"]["room"]
    assert prefill["status"] == {"aborted": 0, "timed_out": 0}  # KVPoll.Failed for both
    requests = {s["attributes"][sc.BOOTSTRAP_ROOM]: s for s in _by_name(prefill["spans"], sc.SPAN_REQUEST)}
    assert set(requests) == {room + 1, room + 2, room + 3}
    assert {r: (s["status"], s["attributes"].get(sc.ERROR_TYPE)) for r, s in requests.items()} == {
        room + 1: ("ERROR", "aborted"),
        room + 2: ("ERROR", "bootstrap_timeout"),
        room + 3: ("ERROR", "evicted"),
    }
    assert requests[room + 3]["attributes"][sc.EVICTED] is True
    assert prefill["metrics"].get(sc.METRIC_DROPPED, 0) >= 1  # the evicted room is counted
    assert not _by_name(prefill["spans"], sc.SPAN_SEND)
