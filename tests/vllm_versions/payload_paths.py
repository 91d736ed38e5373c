"""Drives vLLM's own classes that move bytes which are not KV through the Mooncake and NIXL engines (its
encoder-cache connectors' data planes, its EPLB expert-weight mover), next to a KV transfer of its Mooncake
connector, with this package instrumenting them, and prints what came out as one JSON object
(tests/frameworks/vllm/test_vllm_payloads.py reads it). Run like connector_paths.py: the vLLM virtualenv's python,
inside `unshare --net` with loopback up, the release under test first on sys.path.

Real: vLLM's `MooncakeTransfer` (ec_connector/mooncake/transfer.py: its own TransferEngine, registrations and
`write`), `NixlDataTransport` (ec_connector/cpu/data/nixl.py: two of them, producer and consumer, on vLLM's
NixlWrapper), `NixlEplbCommunicator` (eplb/eplb_communicator.py: its descriptor building, `set_transfer_context`,
`add_recv`, `execute`), the Mooncake connector worker's KV path (connector_paths.prefill_paths), the Mooncake engine
over loopback TCP, NIXL agents over UCX on the loopback device; every transfer's bytes are checked at the target.
Stand-ins (what needs GPUs or a second rank): the two EPLB ranks live in this process as two communicators made
with `object.__new__` and the state `__init__` would compute (their agents and registrations are their own
methods'; the metadata exchange that `__init__` does with `all_gather_object` is done by hand, and the barrier
after the reads, a collective, is a no-op); memory is DRAM (vLLM's EPLB registers VRAM).

Usage: python payload_paths.py   (prints JSON on the last line of stdout)
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
import kvt_test_nixl_pacing  # noqa: E402  (four NIXL agents here: their progress threads must not busy-poll)

kvt_test_nixl_pacing.activate()

import connector_paths  # noqa: E402  (same folder: its telemetry, its Mooncake KV path)
import numpy as np  # noqa: E402

MIB = 1 << 20
TIMEOUT_S = 30.0
EC_BLOCK = 256 << 10


def _wait(check, handle) -> str:
    state, deadline = check(handle), time.monotonic() + TIMEOUT_S
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
        state = check(handle)
    return state


def ec_mooncake(transfer_module, engine) -> dict:
    """Two encoder-cache pushes with vLLM's MooncakeTransfer (its own engine) into a buffer the KV engine
    registered: the same peer session as the KV sends."""
    import torch

    target = np.zeros(4 * MIB, dtype=np.uint8)
    assert engine.register_memory(target.ctypes.data, target.nbytes) == 0
    session = f"127.0.0.1:{engine.get_rpc_port()}"
    ec = transfer_module.MooncakeTransfer("127.0.0.1", "tcp")
    sources = [torch.arange(2 * MIB, dtype=torch.int32).to(torch.uint8), torch.full((MIB + MIB // 2,), 7,
                                                                                     dtype=torch.uint8)]
    addresses = ec.acquire_sources(sources)
    offsets = [0, 2 * MIB]
    for address, tensor, offset in zip(addresses, sources, offsets):
        ec.write(session, [address], [target.ctypes.data + offset], [tensor.nbytes])
    moved = all(bytes(target[o:o + t.nbytes]) == bytes(t.numpy()) for t, o in zip(sources, offsets))
    ec.release_sources(addresses)
    return {"moved": moved, "lengths": [t.nbytes for t in sources], "session": session}


def ec_nixl(nixl_module) -> dict:
    """One encoder-cache read between two of vLLM's NixlDataTransport (consumer reads producer's blocks)."""
    blocks = 8
    producer_mem = np.random.default_rng(3).integers(0, 256, blocks * EC_BLOCK, dtype=np.uint8)
    consumer_mem = np.zeros(blocks * EC_BLOCK, dtype=np.uint8)
    producer = nixl_module.NixlDataTransport(f"ec-producer-{os.getpid()}", producer_mem.ctypes.data, blocks,
                                             EC_BLOCK, producer_mem.nbytes)
    consumer = nixl_module.NixlDataTransport(f"ec-consumer-{os.getpid()}", consumer_mem.ctypes.data, blocks,
                                             EC_BLOCK, consumer_mem.nbytes)
    agent = consumer.add_remote_peer(producer.get_agent_metadata(), producer.get_mem_descriptor())
    local, remote = [0, 1, 2], [5, 6, 7]
    handle = consumer.post_read(local, agent, remote, b"ec-read-1")
    state = _wait(consumer.check_xfer_state, handle)
    consumer.release_xfer_handle(handle)
    moved = all(bytes(consumer_mem[lo * EC_BLOCK:(lo + 1) * EC_BLOCK]) ==
                bytes(producer_mem[ro * EC_BLOCK:(ro + 1) * EC_BLOCK]) for lo, ro in zip(local, remote))
    return {"state": state, "moved": moved, "bytes": len(local) * EC_BLOCK, "descriptors": len(local)}


def _eplb_rank(eplb, nixl_utils, rank: int, weights, buffer):
    """One rank's NixlEplbCommunicator as `__init__` leaves it, on its own agent and registrations."""
    comm = object.__new__(eplb.NixlEplbCommunicator)
    state = dict(_world_size=2, _rank=rank, _all_expert_weights=weights, _expert_buffer=buffer,
                 _num_local_experts=weights[0][0].shape[0], _device=weights[0][0].device, _xfer_entries=[],
                 _expert_to_src_row=None, _layer_idx=None, _stream=None, _nixl_memory_type="DRAM",
                 _registered_descs=[], _remote_agents={}, _remote_send_meta={}, _cuda_device_id=0,
                 _nixl_wrapper=nixl_utils.NixlWrapper(f"eplb-{rank}-{os.getpid()}",
                                                      nixl_utils.nixl_agent_config(capture_telemetry=False)))
    for name, value in state.items():
        setattr(comm, name, value)
    comm._init_registered_buffers()
    return comm


def eplb_nixl(eplb, nixl_utils) -> dict:
    """Rank 0 reads experts 2 and 3 of layer 0 from rank 1 (2 tensors per expert), through vLLM's add_recv and
    execute; rank 1 only holds its registered weights (NIXL READ is receiver-initiated)."""
    import torch

    experts, shapes = 2, ((MIB,), (MIB // 4,))
    generator = torch.Generator().manual_seed(5)

    def layer():
        return [torch.randint(0, 256, (experts, *shape), dtype=torch.uint8, generator=generator) for shape in shapes]

    receiver = _eplb_rank(eplb, nixl_utils, 0, [layer()], [torch.zeros((experts, *s), dtype=torch.uint8)
                                                             for s in shapes])
    sender = _eplb_rank(eplb, nixl_utils, 1, [layer()], [torch.zeros((experts, *s), dtype=torch.uint8)
                                                           for s in shapes])
    # What __init__ exchanges with all_gather_object: the peer's agent metadata and its per-tensor layout.
    receiver._remote_agents[1] = receiver._nixl_wrapper.add_remote_agent(sender._nixl_wrapper.get_agent_metadata())
    receiver._remote_send_meta[1] = {(0, t): (w.data_ptr(), w.nbytes // experts, 0)
                                     for t, w in enumerate(sender._all_expert_weights[0])}
    receiver._post_read_barrier = lambda: None  # a collective across the ranks
    receiver.set_transfer_context(np.array([0, 1, 2, 3]), 0)  # rank 0 held experts 0, 1; rank 1 held 2, 3
    for slot, expert_id in enumerate((2, 3)):
        receiver.add_recv([b[slot] for b in receiver._expert_buffer], 1, expert_id)
    receiver.execute()
    moved = all(torch.equal(receiver._expert_buffer[t][slot], sender._all_expert_weights[0][t][slot])
                for t in range(len(shapes)) for slot in range(experts))
    per_expert = sum(int(np.prod(s)) for s in shapes)
    return {"moved": moved, "bytes_per_expert": per_expert, "experts": experts, "tensors": len(shapes),
            "entries_left": len(receiver._xfer_entries)}


def metric_points(reader) -> list:
    points = []
    data = reader.get_metrics_data()
    for resource_metrics in (data.resource_metrics if data else []):
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if not metric.name.startswith("kv_transfer."):
                    continue
                for point in metric.data.data_points:
                    points.append({"name": metric.name, "attributes": dict(point.attributes),
                                   "count": getattr(point, "count", None), "sum": getattr(point, "sum", None),
                                   "value": getattr(point, "value", None)})
    return points


def main() -> None:
    import importlib

    exporter, tracer_provider, reader = connector_paths.telemetry()
    from otel_kvtransfer.frameworks.vllm import HOOKS
    from otel_kvtransfer.frameworks.vllm.common import patcher

    ec = "vllm.distributed.ec_transfer.ec_connector"
    transfer_module = importlib.import_module(f"{ec}.mooncake.transfer")
    nixl_module = importlib.import_module(f"{ec}.cpu.data.nixl")
    eplb = importlib.import_module("vllm.distributed.eplb.eplb_communicator")
    nixl_utils = importlib.import_module("vllm.distributed.nixl_utils")
    mc = importlib.import_module(f"{connector_paths.V1}.mooncake.mooncake_connector")
    utils = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.utils")
    result = {"version": HOOKS.installed_version(), "blocked": HOOKS.blocked, "transfer_file": transfer_module.__file__,
              "patched": sorted(f"{owner.__name__}.{attr}" for owner, attr in patcher.patched())}
    engine = connector_paths.mooncake_engine()
    # Non-KV traffic before and after the KV requests, to the KV sends' own peer: none of it may count as theirs.
    result["ec_mooncake"] = ec_mooncake(transfer_module, engine)
    result["ec_nixl"] = ec_nixl(nixl_module)
    connector_paths.BLOCK = MIB  # KV sends of 2 and 3 MiB: above the per-peer throughput's 1 MiB floor
    result["kv"] = connector_paths.prefill_paths(mc, utils, engine)
    result["eplb"] = eplb_nixl(eplb, nixl_utils)
    result["kv_session"] = f"127.0.0.1:{engine.get_rpc_port()}"
    result["spans"] = connector_paths.spans(exporter, tracer_provider)
    result["metrics"] = metric_points(reader)
    print(json.dumps(result, default=repr), flush=True)
    os._exit(0)  # NIXL and Mooncake threads can crash at interpreter shutdown; everything is printed


if __name__ == "__main__":
    sys.exit(main())
