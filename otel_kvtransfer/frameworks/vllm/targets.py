"""What the vLLM wrappers need from vLLM, per patched module: the gate checks it before patching (on any vLLM
release, tested or newer), and scripts/canary.py checks it in each new release's source.

Keep in step with mooncake.py, nixl.py, trace_context.py and payloads.py: every `patcher.wrap`, every parameter a
wrapper reads by name, every attribute it reads from vLLM's objects. `optional` marks what only newer releases have
(0.33's paths) or what only adds to the spans (the trace context): without it the wrappers do not see that path,
and nothing else changes.
"""

from otel_kvtransfer.wiring.targets import Target

_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"
MOONCAKE = f"{_V1}.mooncake.mooncake_connector"
NIXL_PULL = f"{_V1}.nixl.pull_worker"
NIXL_BASE = f"{_V1}.nixl.base_worker"
NIXL_METADATA = f"{_V1}.nixl.metadata"
NIXL_TP = f"{_V1}.nixl.tp_mapping"
NIXL_STATS = f"{_V1}.nixl.stats"
NIXL_PULL_SCHEDULER = f"{_V1}.nixl.pull_scheduler"
NIXL_BASE_SCHEDULER = f"{_V1}.nixl.base_scheduler"
CONNECTOR_BASE = f"{_V1}.base"
UTILS = "vllm.distributed.kv_transfer.kv_connector.utils"

_WORKER = "MooncakeConnectorWorker"

MOONCAKE_TARGETS = [
    Target(MOONCAKE, _WORKER, "start_load_kv", ("metadata",), ("is_kv_producer", "block_len_per_layer",
                                                               "vllm_config")),
    Target(MOONCAKE, _WORKER, "_build_transfer_params", ("ready_reqs", "agent_meta", "local_regions",
                                                         "remote_regions"), ("transfer_topo", "use_mla")),
    Target(MOONCAKE, _WORKER, "_send_blocks", ("remote_session", "src_ptrs")),
    Target(MOONCAKE, _WORKER, "fetch_finished_sending_reqs", (), ("finished_sending_reqs",)),
    Target(MOONCAKE, _WORKER, "_handle_failed_recv", ("pull_metas", "req_ids", "reason")),
    Target(MOONCAKE, _WORKER, "fetch_finished_recving_reqs"),
    Target(MOONCAKE, _WORKER, "process_pulling_result", ("response", "pull_metas")),
    Target(MOONCAKE, "MooncakeConnectorMetadata", attrs=("reqs_to_send", "reqs_to_recv")),
    Target(MOONCAKE, "PullReqMeta", attrs=("transfer_id", "local_block_ids", "failed")),
    Target(MOONCAKE, "SendBlockMeta", attrs=("transfer_id",)),
    Target(MOONCAKE, "MooncakeXferMetadata", attrs=("remote_tp_size", "remote_tp_rank", "req_blocks")),
    Target(MOONCAKE, "MooncakeXferResponse", attrs=("status",)),
    Target(MOONCAKE, "MooncakeXferResponseStatus", attrs=("FINISH",)),
    Target(UTILS, "TransferTopology", "handshake_target_ranks"),
    # 0.33: the peer-layout cache (a LAYOUT_MISS makes decode resend its layout) and sleep mode's re-registration.
    # The receiver fails what a FINISH left unreported.
    Target(MOONCAKE, _WORKER, "_lookup_peer_layout", ("meta",), optional=True),
    Target(MOONCAKE, _WORKER, "_build_pull_metadata", ("pull_metas",), optional=True),
    Target(MOONCAKE, _WORKER, "_complete_pull_task", optional=True),
    Target(MOONCAKE, "MooncakeXferMetadata", attrs=("layout_id", "kv_caches_base_addr"), optional=True),
    Target(MOONCAKE, _WORKER, "unregister_kv_caches", (), ("_kv_unregistered",), optional=True),
    Target(MOONCAKE, _WORKER, "restore_kv_caches", optional=True),
    # The worker's own rank (kv_transfer.tp_rank; dp_rank is read where vLLM has it), read once its __init__ ran.
    Target(MOONCAKE, _WORKER, "__init__", attrs=("tp_rank",)),
]

_PULL = "NixlPullConnectorWorker"
_BASE = "NixlBaseConnectorWorker"

NIXL_TARGETS = [
    Target(NIXL_PULL, _PULL, "start_load_kv", ("metadata",), ("_TRANSFER_MODE", "vllm_config")),
    Target(NIXL_PULL, _PULL, "_read_blocks", ("read_spec", "dst_engine_id", "remote_request_id"),
           ("tp_mappings",)),
    Target(NIXL_BASE, _BASE, "_reap_expired_send_leases", ("done_sending",)),
    Target(NIXL_BASE, _BASE, "get_transfer_results"),
    Target(NIXL_BASE, _BASE, "_nixl_handshake", ("host", "port")),
    Target(NIXL_METADATA, "NixlConnectorMetadata", attrs=("reqs_to_recv", "reqs_to_send")),
    Target(NIXL_METADATA, "ReqMeta", attrs=("local_block_ids", "remote")),
    Target(NIXL_METADATA, "RemoteMeta", attrs=("request_id", "engine_id")),
    Target(NIXL_TP, "ReadSpec", attrs=("remote_rank",)),
    Target(NIXL_TP, "TPMapping", attrs=("all_source_ranks",)),
    Target(CONNECTOR_BASE, "KVConnectorTransferResults", attrs=("finished_sending", "finished_recving",
                                                                "failed_recving")),
    # 0.33: a remote whose registration generation grew (it slept and registered again) is handshaken anew.
    Target(NIXL_PULL, _PULL, "_read_blocks_for_req", ("req_id", "meta"),
           ("_remote_registration_generations", "_remote_agents"), optional=True),
    Target(NIXL_METADATA, "RemoteMeta", attrs=("registration_generation",), optional=True),
    Target(NIXL_BASE, _BASE, "unregister_kv_caches", (), ("_kv_unregistered",), optional=True),
    Target(NIXL_BASE, _BASE, "restore_kv_caches", optional=True),
    Target(NIXL_PULL, _PULL, "__init__"),
    Target(NIXL_BASE, _BASE, attrs=("tp_rank",)),
]

# A notification for a request whose lease expired: late KV seen by the prefill (nixl.py reads the caller's
# `req_id`). Optional: without it, nothing else changes.
NIXL_STATS_TARGETS = [
    Target(NIXL_STATS, "NixlKVConnectorStats", "record_notification_after_expiry", optional=True),
]


# The client's trace context, carried from the connector's scheduler side to its worker (trace_context.py): the
# scheduler's hooks that see a request (its `trace_headers`, `kv_transfer_params`, `request_id`) and the builder of the
# metadata the worker reads. Optional: without them, every request keeps its synthetic per-key trace.
TRACE_CONTEXT_TARGETS = [
    Target(MOONCAKE, "MooncakeConnectorScheduler", "update_state_after_alloc", ("request",), optional=True),
    Target(MOONCAKE, "MooncakeConnectorScheduler", "request_finished", ("request",), optional=True),
    Target(MOONCAKE, "MooncakeConnectorScheduler", "build_connector_meta", optional=True),
    Target(NIXL_PULL_SCHEDULER, "NixlPullConnectorScheduler", "update_state_after_alloc", ("request",),
           optional=True),
    Target(NIXL_PULL_SCHEDULER, "NixlPullConnectorScheduler", "request_finished", ("request",), optional=True),
    Target(NIXL_BASE_SCHEDULER, "NixlBaseConnectorScheduler", "build_connector_meta", optional=True),
]

# Traffic that is not KV (payloads.py; 0.32, 0.33 and 0.34 have all five): each entry method opens a payload scope. All
# optional: a release without one keeps its KV wrappers, and those bytes show as raw sends.
_EC = "vllm.distributed.ec_transfer.ec_connector"
EC_MOONCAKE = f"{_EC}.mooncake.transfer"
EC_NIXL = f"{_EC}.cpu.data.nixl"
EPLB = "vllm.distributed.eplb.eplb_communicator"
# KV offloading's secondary tiers (the OffloadingConnector's tiering): a peer's offload tier over NIXL, an object store
# through NIXL's OBJ plugin.
OFFLOAD_P2P_NIXL = "vllm.v1.kv_offload.tiering.p2p.data.nixl"
OFFLOAD_OBJ = "vllm.v1.kv_offload.tiering.obj.manager"

PAYLOAD_TARGETS = [
    Target(EC_MOONCAKE, "MooncakeTransfer", "write", optional=True),
    Target(EC_NIXL, "NixlDataTransport", "post_read", optional=True),
    Target(EPLB, "NixlEplbCommunicator", "add_recv", optional=True),
    Target(OFFLOAD_P2P_NIXL, "NixlTransport", "write_blocks", optional=True),
    Target(OFFLOAD_OBJ, "ObjectStoreSecondaryTierManager", "_submit_transfer", optional=True),
]


def by_module() -> dict:
    """Patched module -> the targets checked when it is imported (the gate's `targets`)."""
    found = {MOONCAKE: MOONCAKE_TARGETS + [t for t in TRACE_CONTEXT_TARGETS if t.module == MOONCAKE],
             NIXL_PULL: NIXL_TARGETS, NIXL_STATS: NIXL_STATS_TARGETS,
             NIXL_PULL_SCHEDULER: [t for t in TRACE_CONTEXT_TARGETS if t.module != MOONCAKE]}
    for target in PAYLOAD_TARGETS:
        found.setdefault(target.module, []).append(target)
    return found


# the KV connectors' (tests/frameworks/vllm/test_vllm_connector_paths.py patches them all)
ALL = MOONCAKE_TARGETS + NIXL_TARGETS + NIXL_STATS_TARGETS + TRACE_CONTEXT_TARGETS
