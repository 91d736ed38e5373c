"""What the vLLM-Ascend wrappers need from vllm-ascend, per patched module: the gate checks it before patching, and
tests/support/version_canary.py checks it in each new release's source.

Keep in step with pull.py: every `patcher.wrap`, every parameter a wrapper reads by name, every attribute it reads
from vllm-ascend's objects. The connector (`kv_p2p.mooncake_connector`) and the hybrid connector
(`kv_p2p.mooncake_hybrid_connector`) share the names of their sending and receiving threads.
"""

from otel_kvtransfer.wiring.targets import Target

_P2P = "vllm_ascend.distributed.kv_transfer.kv_p2p"
CONNECTOR = f"{_P2P}.mooncake_connector"
HYBRID = f"{_P2P}.mooncake_hybrid_connector"
LAYERWISE = f"{_P2P}.mooncake_layerwise_connector"  # push, layer by layer: not instrumented (raw sends)

_RECV = "KVCacheRecvingThread"
_SEND = "KVCacheSendingThread"


def _pull_targets(module: str, transfer_calls: tuple) -> list:
    return [
        Target(module, _RECV, "add_request", ("request_id", "remote_request_id", "remote_handshake_port"),
               ("tp_rank",)),
        Target(module, _RECV, "_handle_request", ("req_meta",)),
        Target(module, _RECV, "_mark_request_task_done", ("request_id",)),
        *(Target(module, _RECV, call, ("req_meta",)) for call in transfer_calls),
        Target(module, _RECV, "_get_remote_metadata", ("remote_host", "remote_handshake_port")),
        Target(module, _SEND, "add_delayed_request", ("request_id",), ("task_tracker", "tp_rank")),
        Target(module, _SEND, "get_and_clear_finished_requests"),
        Target(module, "KVCacheTaskTracker", "_retrieve_expired_requests", (), ("reqs_to_process",)),
    ]


CONNECTOR_TARGETS = _pull_targets(CONNECTOR, ("_transfer_kv_cache_all_groups",)) + [
    # a pull skipped because an earlier pull of the same request failed, or whose reformat failed
    Target(CONNECTOR, _RECV, "_mark_failed_recv_request", ("request_id",), optional=True),
]
HYBRID_TARGETS = _pull_targets(HYBRID, ("_transfer_kv_cache_all_groups", "_transfer_kv_cache"))

ALL = CONNECTOR_TARGETS + HYBRID_TARGETS


def by_module() -> dict:
    """Patched module -> the targets checked when it is imported (the gate's `targets`)."""
    return {CONNECTOR: CONNECTOR_TARGETS, HYBRID: HYBRID_TARGETS}
