"""SGLang HiCache's NIXL storage backend, instrumented: KV pages written to a storage tier and read back through
NIXL's POSIX plugin are `offload` sends of no request; the request figures and the per-peer throughput stay the KV's.

Runs tests/apps/sglang_hicache_app.py in a process of its own, inside a private network namespace: sglang 0.5.23's
own `HiCacheNixl`, its host pool over its device pool (on the CPU), NIXL 1.5.1's POSIX plugin writing real files,
and one KV request over a real Mooncake pair beside it. Nothing is stood in.
"""

import functools
import json
import os
import shutil
import sys
import tempfile

import pytest
from support import netns
from support.parts import mooncake_importable, require_part
from support.paths import APPS, ROOT, TESTS

APP = os.path.join(APPS, "sglang_hicache_app.py")
MIB = 1 << 20


@functools.lru_cache(maxsize=None)
def _run() -> dict:
    import importlib.util

    require_part(all(importlib.util.find_spec(m) is not None for m in ("sglang", "nixl")) and mooncake_importable(),
                 "sglang, nixl and the Mooncake engine")
    netns.require_tools()
    storage = tempfile.mkdtemp(prefix="kvt-hicache-")
    env = netns.with_pythonpath({k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "UCX_"))},
                                ROOT, TESTS)
    env.update({"MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "ERROR", "SGLANG_HICACHE_NIXL_BACKEND_PLUGIN": "POSIX"})
    try:
        done = netns.run([sys.executable, APP, storage], env, timeout_s=300)
    finally:
        shutil.rmtree(storage, ignore_errors=True)  # the pages the backend wrote
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _sends(result, payload) -> list:
    return [s["attributes"] for s in result["spans"] if s["name"] == "kv_transfer.send"
            and s["attributes"].get("kv_transfer.payload") == payload]


def _points(result, name) -> list:
    return [p for p in result["metrics"] if p["name"] == name]


def test_pages_go_to_storage_and_come_back_whole():
    result = _run()
    pages = result["pages"]
    assert result["set"] == [True] * pages and result["get"] == [True] * pages
    assert result["same"] == [True] * pages and result["untouched_differs"]
    assert result["files"] == 2 * pages  # zero copy, page-first layout: a K file and a V file per page


def test_each_storage_transfer_is_an_offload_send_of_no_request():
    result = _run()
    offload = _sends(result, "offload")
    assert sorted(s["kv_transfer.op"] for s in offload) == ["read", "write"]  # batch_set_v1, then batch_get_v1
    for send in offload:
        assert send["kv_transfer.bytes"] == result["pages"] * result["page_bytes"]
        assert send["kv_transfer.descriptor_count"] == 2 * result["pages"]
        assert send["kv_transfer.backend"] == "nixl" and send["kv_transfer.framework"] == "sglang"
        assert send["kv_transfer.protocol"] == "posix" and send["nixl.remote_agent"].startswith("hicache_nixl_")
        assert "kv_transfer.request_key" not in send and "server.address" not in send
    assert [s for s in result["spans"] if s["name"] == "kv_transfer.send"
            and "kv_transfer.payload" not in s["attributes"]] == []  # nothing became a raw send


def test_request_figures_and_per_peer_throughput_are_the_kv_alone():
    result = _run()
    (request,) = [s["attributes"] for s in result["spans"] if s["name"] == "kv_transfer.request"]
    assert request["kv_transfer.request_key"] == "42" and request["kv_transfer.bytes"] == result["kv"]["bytes"] == MIB
    (size,) = _points(result, "kv_transfer.request.size")
    assert (size["count"], size["sum"]) == (1, MIB)
    (peer,) = _points(result, "kv_transfer.peer.throughput")
    assert peer["count"] == 1 and peer["attributes"]["server.address"] == "127.0.0.1"
    assert not _points(result, "kv_transfer.request.tail")
    assert not _points(result, "kv_transfer.instrumentation.dropped")


def test_per_send_histograms_keep_the_offload_label():
    result = _run()
    by_payload = {}
    for point in _points(result, "kv_transfer.size"):
        attributes = point["attributes"]
        by_payload[attributes.get("kv_transfer.payload")] = (point["count"], point["sum"],
                                                             attributes.get("kv_transfer.framework"))
    moved = 2 * result["pages"] * result["page_bytes"]
    assert by_payload == {"kv": (1, MIB, "sglang"), "offload": (2, moved, "sglang")}


@pytest.mark.parametrize("present", [True, False])
def test_the_entry_is_gated_on_its_class_and_method(present):
    """A release whose module lacks HiCacheNixl._xfer_and_wait: nothing wrapped, nothing raised. No sglang needed:
    the module is made here."""
    import types

    from otel_kvtransfer.frameworks.sglang import common, hicache

    assert common.patcher.patched() == []  # sglang is not patched in this process
    module = types.ModuleType(hicache.MODULE)
    body = {"_xfer_and_wait": lambda self, *a: ("moved", a)} if present else {"_xfer": lambda self: None}
    module.HiCacheNixl = type("HiCacheNixl", (), body)
    try:
        hicache.patch_hicache_nixl(module)
        patched = [(owner.__name__, attr) for owner, attr in common.patcher.patched()]
        assert patched == ([("HiCacheNixl", "_xfer_and_wait")] if present else [])
        if present:
            assert module.HiCacheNixl()._xfer_and_wait(1, 2, "WRITE") == ("moved", (1, 2, "WRITE"))
    finally:
        common.patcher.unwrap_all()
