"""Drives vLLM's KV offload tier over NIXL (the OffloadingConnector's P2P tier: `NixlTransport` in
v1/kv_offload/tiering/p2p/data/nixl.py) with this package instrumenting it, next to a KV transfer of vLLM's
Mooncake connector, and prints what came out as one JSON object (tests/frameworks/vllm/test_vllm_offload.py reads it).
Run like connector_paths.py: the vLLM virtualenv's python, inside `unshare --net` with loopback up, the release under
test first on sys.path.

Real: two of vLLM's `NixlTransport` (its agents on vLLM's NixlWrapper, its registrations, `add_remote_peer`,
`write_blocks`, `poll`, `close`) over NIXL's UCX backend on the loopback device, each over its own block region
(host memory: the offload tier is a CPU tier); the Mooncake connector worker's KV path (connector_paths
.prefill_paths) over the real Mooncake engine. The bytes of every written block are checked at the peer. The
object-store tier (`ObjectStoreSecondaryTierManager`, NIXL's OBJ plugin) needs an object store: only imported here,
so its entry is shown patched.

Usage: python offload_paths.py   (prints JSON on the last line of stdout)
"""

import json
import os
import sys
import time

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_TLS", "tcp,self")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nixl_pacing"))
import kvt_test_nixl_pacing  # noqa: E402  (NIXL agents here: their progress threads must not busy-poll)

kvt_test_nixl_pacing.activate()

import connector_paths  # noqa: E402  (same folder: its telemetry, its Mooncake KV path)
import numpy as np  # noqa: E402
from payload_paths import metric_points  # noqa: E402

MIB = 1 << 20
BLOCK, BLOCKS = 256 << 10, 8
TIMEOUT_S = 30.0


def p2p_offload(tier) -> dict:
    """Blocks 0, 3 and 5 of one node's offload region written to blocks 1, 2 and 7 of its peer's."""
    local = np.random.default_rng(9).integers(0, 256, (BLOCKS, BLOCK), dtype=np.uint8)
    remote = np.zeros((BLOCKS, BLOCK), dtype=np.uint8)
    node = tier.NixlTransport(f"offload-node-{os.getpid()}", memoryview(local))
    peer = tier.NixlTransport(f"offload-peer-{os.getpid()}", memoryview(remote))
    node.add_remote_peer("peer-1", peer.get_agent_metadata(), peer.base_addr, peer.num_blocks, peer.block_len)
    local_idxs, remote_idxs = [0, 3, 5], [1, 2, 7]
    transfer_id = node.write_blocks("peer-1", local_idxs, remote_idxs)
    done, deadline = [], time.monotonic() + TIMEOUT_S
    while transfer_id not in done and time.monotonic() < deadline:
        result = node.poll("peer-1")
        done += list(result.done)
        if result.failed:
            break
        time.sleep(0.001)
    moved = all(bytes(remote[r]) == bytes(local[lo]) for lo, r in zip(local_idxs, remote_idxs))
    untouched = not remote[0].any()  # a block nobody wrote to
    node.close()
    peer.close()
    return {"done": transfer_id in done, "moved": moved, "untouched": untouched, "blocks": len(local_idxs),
            "bytes": len(local_idxs) * BLOCK}


def main() -> None:
    import importlib

    exporter, tracer_provider, reader = connector_paths.telemetry()
    from otel_kvtransfer.frameworks.vllm import HOOKS
    from otel_kvtransfer.frameworks.vllm.common import patcher

    tier = importlib.import_module("vllm.v1.kv_offload.tiering.p2p.data.nixl")
    importlib.import_module("vllm.v1.kv_offload.tiering.obj.manager")
    mc = importlib.import_module(f"{connector_paths.V1}.mooncake.mooncake_connector")
    utils = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.utils")
    result = {"version": HOOKS.installed_version(), "blocked": HOOKS.blocked, "tier_file": tier.__file__,
              "patched": sorted(f"{owner.__name__}.{attr}" for owner, attr in patcher.patched())}
    engine = connector_paths.mooncake_engine()
    result["offload"] = p2p_offload(tier)
    connector_paths.BLOCK = MIB  # KV sends of 2 and 3 MiB: above the per-peer throughput's 1 MiB floor
    result["kv"] = connector_paths.prefill_paths(mc, utils, engine)
    result["spans"] = connector_paths.spans(exporter, tracer_provider)
    result["metrics"] = metric_points(reader)
    print(json.dumps(result, default=repr), flush=True)
    os._exit(0)  # NIXL and Mooncake threads can crash at interpreter shutdown; everything is printed


if __name__ == "__main__":
    sys.exit(main())
