"""Drives vllm-ascend's own Mooncake connectors (kv_p2p/ of the release under test) between a prefill process and a
decode process, with this package instrumenting both, and prints what came out as one JSON
object on its last line (tests/frameworks/vllm_ascend/test_vllm_ascend_pull.py reads it). Run with the vLLM
virtualenv's python inside `unshare --net` with loopback up (the Mooncake engine's listener binds every interface),
with vllm-ascend's source (scripts/setup-vllm-ascend.sh) and the torch_npu stand-in (standin/) first on sys.path.

Real: vllm-ascend's `KVCacheRecvingThread` (its executor threads, `_handle_request`,
`_transfer_kv_cache_all_groups`, its ZMQ requests for the prefill's metadata and its done messages) in the decode
process; its `KVCacheSendingThread` (its ZMQ ROUTER on 127.0.0.1, answering the metadata request and the done
messages with vllm-ascend's own msgspec types) and `MooncakeConnectorWorker.start_load_kv` / `get_finished` in
the prefill process; the same classes of its hybrid connector (kv_p2p/mooncake_hybrid_connector.py, its
non-hybrid path `_transfer_kv_cache`) beside them, with a prefill rank of their own; each process's engine from
vllm-ascend's own `GlobalTE` (`TransferEngine.initialize(..., "ascend", ...)`, which MC_FORCE_TCP=1 turns into TCP
on a host without an NPU), buffers registered through it,
`batch_transfer_sync_read` moving the bytes over loopback; vLLM 0.32's own modules that vllm-ascend imports.
Stand-ins (what needs an NPU, a loaded model or a torch.distributed world): torch_npu (standin/torch_npu);
KV caches are host buffers (numpy, and torch CPU tensors over them where the hybrid thread wants tensors)
described by the layout the worker would compute from the model (a small Llama config of transformers); vLLM's
parallel groups (`get_pp_group`, `get_pcp_group`, `get_tensor_model_parallel_world_size`, read by the sending
thread's `__init__`) answer a world of one; the prefill worker is made with `object.__new__` and given the state
its `__init__` would compute, its rank split (`_prefill_get_remote_rank`, read from the model's layout) answering
this rank; the decode worker's split of a request into pulls (`_get_kv_split_metadata`, `_get_group_pulls_metadata`)
is given: one pull per request, `add_request` called as its `start_load_kv` calls it; vllm-ascend's own config
(`get_ascend_config`, built from a full VllmConfig at start-up) answers its defaults for the two switches the hybrid
connector reads after a read (no KV reformatting).

Usage: python pull_peers.py                  (the decode; starts the prefill as its child)
       python pull_peers.py prefill PORT     (the prefill: its side channels from PORT; its spans on its last line)
"""

import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import types

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

MODULE = "vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_connector"
HYBRID = "vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_hybrid_connector"
TIMEOUT_S = 30.0
STUCK_S = 5.0
LAYERS, BLOCKS, BLOCK = 2, 16, 64 << 10  # per layer a K and a V region of BLOCKS blocks
GROUP_SPEC = {"kv_cache_spec_type": "FullAttentionSpec", "kv_cache_group_id": 0}
# decode request -> (prefill request, decode blocks, prefill blocks); "p-X" is ready on the prefill, never read
REQUESTS = {"d-A": ("p-A", [0, 1, 2, 3], [4, 5, 6, 7]), "d-B": ("p-B", [8, 10], [1, 3])}
UNREAD = "p-X"
# A request whose prefill rank never answers (nothing listens on its side-channel port): its metadata query fails,
# and vllm-ascend's own error path then hangs that pull (the failed query's ZMQ context, collected in
# `_handle_request`, waits forever to deliver the done message queued to the silent port).
UNANSWERED = ("d-F", "p-F", [12], [9])
# A request whose prefill rank answers with an engine port nothing listens on (its engine is gone): the engine's
# read fails at once (connection refused) and vllm-ascend fails the request.
ENGINE_GONE = ("d-G", "p-G", [13], [10])
GONE_PORT = 1  # in a private network namespace nothing listens there
# A request of the hybrid connector (its non-hybrid path, `_transfer_kv_cache`), from its own prefill rank.
HYBRID_REQUEST = ("d-H", "p-H", [4, 5], [9, 10])
HYBRID_PORT_OFFSET = 4  # its prefill rank's side channel: the connector's port + this


def telemetry():
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    from otel_kvtransfer import KVTransferInstrumentor
    from otel_kvtransfer.frameworks import vllm_ascend

    KVTransferInstrumentor().instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    assert vllm_ascend.instrument()  # a no-op where the instrumentor already switched it on (registry)
    return exporter, tracer_provider


def spans(exporter, tracer_provider) -> list:
    from otel_kvtransfer.recording.recorder import RECORDER

    tracer_provider.force_flush()
    RECORDER.drain(5)
    tracer_provider.force_flush()
    return [{"name": s.name, "status": s.status.status_code.name, "attributes": dict(s.attributes or {}),
             "trace_id": format(s.context.trace_id, "032x"), "span_id": format(s.context.span_id, "016x"),
             "parent": format(s.parent.span_id, "016x") if s.parent else None,
             "start": s.start_time, "end": s.end_time} for s in exporter.get_finished_spans()]


def kv_regions(fill: bool):
    """[[K, V] per layer]: host buffers standing in for the NPU KV cache; the prefill's hold a known pattern."""
    regions = []
    for layer in range(LAYERS):
        pair = []
        for cache in range(2):
            if fill:
                seed = np.random.default_rng(100 * layer + cache)
                pair.append(seed.integers(0, 256, BLOCKS * BLOCK, dtype=np.uint8))
            else:
                pair.append(np.zeros(BLOCKS * BLOCK, dtype=np.uint8))
        regions.append(pair)
    return regions


def register(mc, regions):
    engine = mc.global_te.get_transfer_engine("127.0.0.1", device_name=None)
    flat = [r for pair in regions for r in pair]
    mc.global_te.register_buffer([r.ctypes.data for r in flat], [r.nbytes for r in flat])
    return engine


def layout(regions):
    return ([[r.ctypes.data for r in pair] for pair in regions], [[BLOCK, BLOCK] for _ in regions],
            [[BLOCK, BLOCK] for _ in regions])


def model_config():
    from transformers import LlamaConfig

    # a real Hugging Face config of a small text model (vllm-ascend reads it as a dict too)
    hf = LlamaConfig(num_hidden_layers=LAYERS, hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                     head_dim=64)
    model = types.SimpleNamespace(is_deepseek_mla=False, hf_text_config=hf, hf_config=hf)
    return types.SimpleNamespace(model_config=model, speculative_config=None,
                                 cache_config=types.SimpleNamespace(block_size=16),
                                 parallel_config=types.SimpleNamespace(pipeline_parallel_size=1,
                                                                       decode_context_parallel_size=1,
                                                                       prefill_context_parallel_size=1))


def _world_of_one(module):
    group = types.SimpleNamespace(rank_in_group=0, world_size=1)
    module.get_pp_group = lambda: group
    module.get_pcp_group = lambda: group
    module.get_tensor_model_parallel_world_size = lambda: 1


def _ascend_config_defaults(module):
    """vllm-ascend's config (`get_ascend_config`, set up from a full VllmConfig at start-up): its defaults for what
    the hybrid connector reads after a read (no KV reformatting)."""
    config = types.SimpleNamespace(enable_kv_nz=False, enable_transpose_kv_cache_by_block=False)
    module.get_ascend_config = lambda: config


def _prefill_worker(module, sender, requests, unread_since=None):
    """The module's worker on the prefill side (its state from `__init__`), handed the requests as vLLM's scheduler
    hands them: scheduled (`reqs_in_batch`), then finished with their KV ready (`requests_to_send`)."""
    worker = object.__new__(module.MooncakeConnectorWorker)
    for name, value in dict(kv_send_thread=sender, kv_recv_thread=None, kv_role="kv_producer", tp_rank=0,
                            pcp_size=1, dcp_size=1, _prefill_get_remote_rank=lambda req_id: [0]).items():
        setattr(worker, name, value)
    scheduled = module.MooncakeConnectorMetadata()
    scheduled.reqs_in_batch = set(requests) | ({UNREAD} if unread_since else set())
    worker.start_load_kv(scheduled)
    finished = module.MooncakeConnectorMetadata()
    finished.requests_to_send = {p: time.time() for p in requests}
    if unread_since:
        finished.requests_to_send[UNREAD] = unread_since
    worker.start_load_kv(finished)
    return worker


def prefill() -> None:
    exporter, tracer_provider = telemetry()
    mc = importlib.import_module(MODULE)
    _world_of_one(mc)
    regions = kv_regions(fill=True)
    engine = register(mc, regions)
    bases, lens, strides = layout(regions)
    metadata = mc.MooncakeAgentMetadata(
        engine_id="prefill0", te_rpc_port=engine.get_rpc_port(), kv_group2layeridx={0: (GROUP_SPEC, [0, 1])},
        block_size=16, kv_caches_base_addr=bases, block_size_scale=[[1, 1]] * LAYERS, num_blocks=BLOCKS,
        block_lens=lens, block_strides=strides, local_ip="127.0.0.1")
    side_port = int(sys.argv[2])
    gone = mc.MooncakeAgentMetadata(**{**{f: getattr(metadata, f) for f in metadata.__struct_fields__},
                                       "engine_id": "prefill1", "te_rpc_port": GONE_PORT})
    senders = []
    for engine_id, port, meta in (("prefill0", side_port, metadata), ("prefill1", side_port + 2, gone)):
        ready = threading.Event()
        senders.append(mc.KVCacheSendingThread(model_config(), tp_rank=0, prefill_tp_size=1, local_engine_id=engine_id,
                                               side_channel_host="127.0.0.1", side_channel_port=port, metadata=meta,
                                               ready_event=ready, kv_caches={}, pcp_rank=0))
        senders[-1].start()
        assert ready.wait(TIMEOUT_S)
    # The hybrid connector's prefill rank: its own sending thread and metadata (one flat list of regions), the same
    # registered KV cache (GlobalTE registers a process's buffers once).
    hy = importlib.import_module(HYBRID)
    _world_of_one(hy)
    hybrid_meta = hy.MooncakeAgentMetadata(
        engine_id="prefill-h", te_rpc_port=engine.get_rpc_port(), block_size=16,
        kv_caches_base_addr=[a for pair in bases for a in pair], num_blocks=BLOCKS,
        block_lens=[n for pair in lens for n in pair], ssm_sizes=(0, 0), local_ip="127.0.0.1")
    ready = threading.Event()
    hybrid_sender = hy.KVCacheSendingThread(model_config(), tp_rank=0, prefill_tp_size=1, local_engine_id="prefill-h",
                                            side_channel_host="127.0.0.1",
                                            side_channel_port=side_port + HYBRID_PORT_OFFSET, metadata=hybrid_meta,
                                            ready_event=ready, kv_caches={})
    hybrid_sender.start()
    assert ready.wait(TIMEOUT_S)
    # UNREAD's delay started longer ago than vLLM's abort timeout: the first get_finished frees it unread.
    abort_s = int(os.environ.get("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "480"))
    workers = [(_prefill_worker(mc, senders[0], [p for p, _, _ in REQUESTS.values()], time.time() - 10 * abort_s),
                {p for p, _, _ in REQUESTS.values()} | {UNREAD}),
               (_prefill_worker(hy, hybrid_sender, [HYBRID_REQUEST[1]]), {HYBRID_REQUEST[1]})]
    print(json.dumps({"ready": True}), flush=True)
    done, deadline = set(), time.monotonic() + TIMEOUT_S
    want = set().union(*(w for _, w in workers))
    while not want <= done and time.monotonic() < deadline:
        for worker, _ in workers:
            sending, recving = worker.get_finished()
            done |= sending
        time.sleep(0.01)
    print(json.dumps({"done_sending": sorted(done), "spans": spans(exporter, tracer_provider)}), flush=True)


class StuckLines(logging.Handler):
    """The instrumentation's stuck reports (WARNING lines of the `otel_kvtransfer` logger), kept."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        message = record.getMessage()
        if "is stuck" in message:
            self.lines.append(message)


def decode() -> dict:
    # The pull that hangs (UNANSWERED) is reported stuck once this old; the others end long before.
    os.environ["OTEL_KVTRANSFER_STUCK_S"] = str(STUCK_S)
    stuck = StuckLines()
    logging.getLogger("otel_kvtransfer").addHandler(stuck)
    side_port = 25600 + os.getpid() % 2000  # inside a private network namespace: free
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "prefill", str(side_port)],
                             stdout=subprocess.PIPE, text=True)
    try:
        exporter, tracer_provider = telemetry()
        mc = importlib.import_module(MODULE)
        regions = kv_regions(fill=False)
        engine = register(mc, regions)
        bases, lens, strides = layout(regions)
        line = child.stdout.readline()
        assert line and json.loads(line)["ready"], "the prefill process did not start"
        ready = threading.Event()
        receiver = mc.KVCacheRecvingThread(
            tp_rank=0, tp_size=1, _prefill_pp_size=1, engine=engine, local_engine_id="decode0",
            local_handshake_port=side_port + 1000, side_channel_port=side_port + 1000,
            local_kv_caches_base_addr=bases, block_len_per_addr=lens, block_stride_per_addr=strides,
            ready_event=ready, vllm_config=model_config(), kv_caches={},
            kv_group2layeridx={0: (GROUP_SPEC, [0, 1])}, block_size_scale=[[1, 1]] * LAYERS)
        receiver.start()
        assert ready.wait(TIMEOUT_S)
        hy = importlib.import_module(HYBRID)
        _ascend_config_defaults(hy)
        ready = threading.Event()
        hybrid_receiver = hy.KVCacheRecvingThread(
            tp_rank=0, tp_size=1, _prefill_pp_size=1, engine=engine, local_engine_id="decode-h",
            local_handshake_port=side_port + 1001, side_channel_port=side_port + 1001,
            local_kv_caches_base_addr=[a for pair in bases for a in pair],
            block_len_per_addr=[n for pair in lens for n in pair],
            block_stride_per_addr=[n for pair in strides for n in pair], addr_group_idx=[0] * 2 * LAYERS,
            mamba_ssm_size=(0, 0), use_hybrid=False, has_mamba=False, hma_group_size=1, ready_event=ready,
            vllm_config=model_config(), kv_cache_config=types.SimpleNamespace(kv_cache_groups=[]),
            kv_caches={f"model.layers.{layer}": tuple(torch.from_numpy(r) for r in regions[layer])
                       for layer in range(LAYERS)})
        hybrid_receiver.start()
        assert ready.wait(TIMEOUT_S)
        d_req, p_req, local, remote = HYBRID_REQUEST
        hybrid_receiver.task_tracker.add_req_to_process(d_req)
        hybrid_receiver.add_request(request_id=d_req, remote_request_id=p_req, local_block_ids=(local,),
                                    remote_block_ids=(remote,), remote_engine_id="prefill-h",
                                    remote_host="127.0.0.1", remote_handshake_port=side_port + HYBRID_PORT_OFFSET,
                                    offset=0, tp_num_need_pulls=1, all_task_done=True)
        pull = mc.GroupPull(group_id=0, remote_tp_offset=0, num_group_pulls=1, prefill_pp_rank=0,
                            is_group_transfer_end=False)
        pulls = [(d_req, p_req, local, remote, side_port) for d_req, (p_req, local, remote) in REQUESTS.items()]
        pulls.append((*UNANSWERED, side_port + 1))
        pulls.append((*ENGINE_GONE, side_port + 2))
        for d_req, p_req, local, remote, port in pulls:
            receiver.task_tracker.add_req_to_process(d_req)  # what the worker's start_load_kv does first
            receiver.add_request(request_id=d_req, remote_request_id=p_req, local_block_ids=(local,),
                                 remote_block_ids=(remote,), group_pulls=[pull],
                                 remote_engine_id="prefill1" if d_req == ENGINE_GONE[0] else "prefill0",
                                 remote_host="127.0.0.1", remote_handshake_port=port, all_task_done=True)
        done, deadline = set(), time.monotonic() + TIMEOUT_S
        # Every pull but the one that hangs ends (the hang is checked for: it never does).
        wanted = {p[0] for p in pulls} - {UNANSWERED[0]} | {HYBRID_REQUEST[0]}
        while time.monotonic() < deadline and not (wanted <= done
                                                   and receiver._is_failed_recv_request(UNANSWERED[0])):
            done |= receiver.get_and_clear_finished_requests() | hybrid_receiver.get_and_clear_finished_requests()
            time.sleep(0.01)
        done |= receiver.get_and_clear_finished_requests() | hybrid_receiver.get_and_clear_finished_requests()
        deadline = time.monotonic() + STUCK_S + TIMEOUT_S
        while not any(f"request key {UNANSWERED[1]}," in line for line in stuck.lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        out, _ = child.communicate(timeout=TIMEOUT_S * 2)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    source = kv_regions(fill=True)
    moved = {d_req: all(bytes(regions[layer][cache][lo * BLOCK:(lo + 1) * BLOCK]) ==
                        bytes(source[layer][cache][ro * BLOCK:(ro + 1) * BLOCK])
                        for layer in range(LAYERS) for cache in range(2) for lo, ro in zip(local, remote))
             for d_req, (_, local, remote) in [*REQUESTS.items(), (HYBRID_REQUEST[0], HYBRID_REQUEST[1:])]}
    from otel_kvtransfer.frameworks import vllm_ascend

    return {"version": vllm_ascend.HOOKS.installed_version(), "connector_file": mc.__file__,
            "hybrid_file": hy.__file__,
            "patched": sorted(f"{owner.__module__}.{owner.__name__}.{attr}"
                              for owner, attr in vllm_ascend.patcher.patched()),
            "done_recving": sorted(done), "failed_blocks": sorted(receiver.get_and_clear_invalid_block_ids()),
            "stuck": stuck.lines, "moved": moved, "block": BLOCK, "layers": LAYERS, "side_port": side_port,
            "decode": spans(exporter, tracer_provider), "prefill": json.loads(out.strip().splitlines()[-1])}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "prefill":
        prefill()
    else:
        print(json.dumps(decode()), flush=True)
    # Not the interpreter's exit: it would wait for vllm-ascend's hung pull (UNANSWERED) and its ZMQ contexts.
    os._exit(0)
