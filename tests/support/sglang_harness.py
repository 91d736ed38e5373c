"""Drive sglang's real PD-disaggregation classes (Mooncake backend) on CPU over loopback, in processes of their own
(spawned, or forked from a fork server that imported sglang once: `start_method`).

One scenario = one prefill process (it also hosts sglang's real `MooncakeKVBootstrapServer`) and N decode
processes, each building a real `MooncakeKVManager` over numpy buffers described by a `KVArgs`, with real
Mooncake TCP between them (../shared/SGLANG-ON-CPU.md). The prefill sends one request in chunks through
`MooncakeKVSender.send`; each decode receives it through `MooncakeKVReceiver` and verifies every byte of KV
and aux it was promised. No stand-in modules: sglang's own torch/torchvision pins are imported as sglang wants.

Instrumentation per process, chosen by the scenario's "instrument":
- "api":  an SDK TracerProvider with an in-memory exporter, `KVTransferInstrumentor().instrument(...)`; the
          finished spans come back to the parent as dicts.
- "plugin": nothing from the test: the process calls sglang's own `load_plugins()` (as sglang's scheduler
          does), which must activate us through the `sglang.srt.plugins` entry point; spans go wherever the
          OTEL_* environment says (the test reads the console exporter's JSON on stdout).
- "none": no instrumentation (a baseline).

`python tests/support/sglang_harness.py '<scenario json>'` runs one scenario and prints `HARNESS_RESULT <json>`, so a
test can run it under `opentelemetry-instrument`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:  # run as a program: support/ importable here and in the processes it spawns
    sys.path.insert(0, TESTS)

HOST = "127.0.0.1"

# Small, fast defaults: 4 layers, 96 pages of 32 KiB per buffer -> 3 MiB per buffer.
DEFAULTS: Dict[str, Any] = {
    "layers": 4,
    "pages": 96,
    "item_len": 32 * 1024,
    "aux_len": 256,
    "aux_slots": 4,
    "mla": False,
    "decodes": 1,
    "chunks": [16, 16, 16],  # pages per chunk; their sum is the request's pages
    "compute_gap_s": 0.05,  # simulated prefill forward between chunks
    "early_send_prefix": 0,  # pages sent through sglang's maybe_send_cached_prefix_chunk first
    "instrument": "api",
    "fail": None,  # "decode_gone": decode killed after its metadata reached prefill; "no_decode": see below
    "room": None,
    "timeout_s": 60.0,
    "startup_timeout_s": 300.0,  # importing sglang takes ~3 s on a quiet machine, minutes on a loaded one
    "sglang_trace": False,  # sglang's own tracing (--enable-trace), exporting to a closed port
    "register_order": None,  # decode ranks in the order their metadata must reach the prefill, e.g. [1, 0]
    "prefills": 1,  # prefill TP ranks, one process each (rank 0 hosts the bootstrap server); MHA: head slices
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _fill_value(buf_index: int, page: int, item_len: int):
    import numpy as np

    return ((np.arange(item_len, dtype=np.uint32) + buf_index * 31 + page * 7) % 251).astype(np.uint8)


def _head_sliced(cfg) -> bool:
    """MHA with more decode ranks than prefill ranks: sglang's head-sliced path (send_kvcache_slice)."""
    return not cfg["mla"] and cfg["decodes"] > 1


def _local_item_len(cfg, mode: str) -> int:
    if mode == "decode" and _head_sliced(cfg):
        return cfg["item_len"] // cfg["decodes"]  # this rank's heads of a page
    if mode == "prefill" and cfg["prefills"] > 1 and not cfg["mla"]:
        return cfg["item_len"] // cfg["prefills"]  # this prefill rank's heads of a page
    return cfg["item_len"]


def _src_pages(cfg) -> List[int]:
    return list(range(sum(cfg["chunks"])))


def _dst_pages(cfg) -> List[int]:
    # Reversed and offset: every page becomes its own block, and a wrong mapping shows up in verification.
    n = sum(cfg["chunks"])
    return [cfg["pages"] - 1 - p for p in range(n)]


# --------------------------------------------------------------------------------------------------------------
# Per-process set-up


def _process_env(cfg) -> None:
    environ = cfg.get("environ")
    if environ is not None:  # forked from the fork server: the parent's environment of this run, as spawn gives
        os.environ.clear()
        os.environ.update(environ)
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")  # bounds the fault tests
    os.environ.setdefault("MC_FORCE_TCP", "1")
    os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
    os.environ.setdefault("SGLANG_HOST_IP", HOST)


def _model_dir() -> str:
    d = tempfile.mkdtemp(prefix="kvt-model-")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": 256,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


class _PP:
    rank_in_group = 0
    world_size = 1
    is_first_rank = True
    is_last_rank = True


def _setup_sglang(cfg, mode: str, rank: int):
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    kwargs = dict(
        model_path=cfg["model_dir"],
        device="cpu",
        skip_tokenizer_init=True,
        disaggregation_mode=mode,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=cfg["bootstrap_port"],
        host=HOST,
    )
    if mode == "decode" and cfg["decodes"] > 1:
        kwargs["tp_size"] = cfg["decodes"]
    if mode == "prefill" and cfg["prefills"] > 1:
        kwargs["tp_size"] = cfg["prefills"]
    if cfg["sglang_trace"]:
        kwargs.update(enable_trace=True, trace_modules="request,mooncake", otlp_traces_endpoint=f"{HOST}:9")
    server_args = ServerArgs(**kwargs)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=rank, dp_rank=None))
    if cfg["sglang_trace"]:
        # What sglang's scheduler process does at start when --enable-trace is on.
        from sglang.srt.observability.trace import process_tracing_init

        process_tracing_init(server_args.otlp_traces_endpoint, f"harness-{mode}", trace_modules="request,mooncake")
    get_parallel().override_permanently(pp_group=_PP())
    init_mooncake_transfer_engine(hostname=HOST, gpu_id=rank, ib_device=None)
    return server_args


def _make_buffers(cfg, mode: str, rank: int):
    """KV buffers (2 x layers for MHA, layers for MLA) and aux buffers, plus the KVArgs describing them."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVArgs

    n_bufs = cfg["layers"] if cfg["mla"] else 2 * cfg["layers"]
    item_len = _local_item_len(cfg, mode)
    kv = [np.zeros(cfg["pages"] * item_len, dtype=np.uint8) for _ in range(n_bufs)]
    aux = [np.zeros(cfg["aux_slots"] * cfg["aux_len"], dtype=np.uint8)]
    if mode == "prefill":
        lo = rank * item_len if item_len != cfg["item_len"] else 0  # a prefill rank's head slice of each page
        for b, buf in enumerate(kv):
            view = buf.reshape(cfg["pages"], item_len)
            for p in range(cfg["pages"]):
                view[p] = _fill_value(b, p, cfg["item_len"])[lo : lo + item_len]
        aux[0].reshape(cfg["aux_slots"], cfg["aux_len"])[0] = _fill_value(99, 0, cfg["aux_len"])
    total_heads = 1 if cfg["mla"] else 4
    heads = total_heads // cfg["decodes"] if (_head_sliced(cfg) and mode == "decode") else total_heads
    if mode == "prefill" and item_len != cfg["item_len"]:
        heads = total_heads // cfg["prefills"]
    args = KVArgs()
    args.engine_rank = rank
    args.kv_data_ptrs = [b.ctypes.data for b in kv]
    args.kv_data_lens = [b.nbytes for b in kv]
    args.kv_item_lens = [item_len] * n_bufs
    args.kv_layer_ids = []
    args.kv_cache_dtype_str = "bfloat16"
    args.kv_layout = None
    args.aux_data_ptrs = [a.ctypes.data for a in aux]
    args.aux_data_lens = [a.nbytes for a in aux]
    args.aux_item_lens = [cfg["aux_len"]]
    args.state_types = []
    args.state_data_ptrs = []
    args.state_data_lens = []
    args.state_item_lens = []
    args.state_layer_ids = []
    args.state_dim_per_tensor = []
    args.state_slice_outer_counts = []
    args.is_hybrid_mla_backend = False
    args.state_conv_shard_groups = []
    args.swa_kv_cache_layout = None
    args.ib_device = ""
    args.gpu_id = rank
    args.kv_head_num = heads
    args.total_kv_head_num = total_heads
    args.page_size = 1
    args.system_dp_rank = 0
    args.rust_http_port = None
    args.pp_rank = 0
    args.prefill_start_layer = 0
    args.prefill_end_layer = cfg["layers"]
    args.mla_compression_ratios = None
    args.kv_buf_groups = 1
    args.hidden_kv_layers = cfg["layers"]
    args.draft_kv_layers = 0
    args.num_draft_entries = 0
    return args, kv, aux


def _setup_instrumentation(cfg):
    """Returns a collect() function giving the finished spans as dicts (api mode), or None."""
    mode = cfg["instrument"]
    if mode == "plugin":
        from sglang.srt.plugins import load_plugins

        load_plugins()
        return None
    if mode != "api":
        return None
    from opentelemetry.test.test_base import TestBase

    from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor
    from support.telemetry import in_memory_metrics

    provider, exporter = TestBase.create_tracer_provider()  # spans into memory through a SimpleSpanProcessor
    meters, reader = in_memory_metrics()
    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument(tracer_provider=provider, meter_provider=meters)

    def collect():
        _flush()
        provider.force_flush()
        return [span_to_dict(s) for s in exporter.get_finished_spans()], _metric_sums(reader)

    return collect


def _flush() -> None:
    """Let the background recorder turn every pending record into spans."""
    try:
        from otel_kvtransfer.recording.recorder import RECORDER

        RECORDER.drain()
    except Exception:  # pragma: no cover - the package is not importable: nothing was recorded
        pass


def _metric_sums(reader) -> Dict[str, Any]:
    """name -> total (counter sums, histogram counts), over all points."""
    totals: Dict[str, Any] = {}
    data = reader.get_metrics_data()
    for rm in getattr(data, "resource_metrics", None) or ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    value = getattr(point, "value", None)
                    if value is None:
                        value = getattr(point, "count", 0)
                    totals[metric.name] = totals.get(metric.name, 0) + value
    return totals


def span_to_dict(span) -> Dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(parent.span_id, "016x") if parent is not None else None,
        "parent_trace_id": format(parent.trace_id, "032x") if parent is not None else None,
        "start": span.start_time,
        "end": span.end_time,
        "kind": span.kind.name,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }


# --------------------------------------------------------------------------------------------------------------
# The processes


def prefill_main(cfg, events, go, stop, rank=0) -> None:
    out: Dict[str, Any] = {"role": "prefill", "rank": rank}
    try:
        _process_env(cfg)
        collect = _setup_instrumentation(cfg)
        import numpy as np

        server_args = _setup_sglang(cfg, "prefill", rank)
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.mooncake.conn import (
            MooncakeKVBootstrapServer,
            MooncakeKVManager,
            MooncakeKVSender,
        )
        from sglang.srt.disaggregation.utils import DisaggregationMode

        _bootstrap = MooncakeKVBootstrapServer(HOST, cfg["bootstrap_port"]) if rank == 0 else None
        args, kv, aux = _make_buffers(cfg, "prefill", rank)
        mgr = MooncakeKVManager(args, DisaggregationMode.PREFILL, server_args, cfg["mla"])
        events.put(("prefill_ready", rank))

        room = cfg["room"]
        if cfg["fail"] == "no_decode":
            out.update(_rooms_without_decode(cfg, mgr, MooncakeKVSender, KVPoll))
            out["spans"], out["metrics"] = _collect_until_ended(collect, room + 3, cfg["timeout_s"])
            events.put(("prefill_done", out))
            return
        sender = MooncakeKVSender(mgr, f"{HOST}:{cfg['bootstrap_port']}", room)
        if cfg["sglang_trace"]:
            root = sender.trace_ctx.root_span
            ctx = root.get_span_context()
            out["sglang_span"] = {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}
        deadline = time.monotonic() + cfg["startup_timeout_s"]  # until the decode processes have imported sglang
        # decode_gone: a second room to the same decode, sent after the first failed (its session is then known dead)
        second = MooncakeKVSender(mgr, f"{HOST}:{cfg['bootstrap_port']}", room + 1) if cfg["fail"] else None
        registered = 0
        for s in (sender, second):
            while s is not None and s.poll() == KVPoll.Bootstrapping:
                if time.monotonic() > deadline:
                    raise TimeoutError("sender stayed in Bootstrapping")
                if cfg["register_order"] and len(mgr.transfer_infos.get(room) or ()) > registered:
                    registered = len(mgr.transfer_infos[room])
                    events.put(("prefill_registered", registered))  # the parent lets the next decode in
                time.sleep(0.01)
        out["registered_ranks"] = [getattr(mgr.decode_kv_args_table.get(k), "dst_tp_rank", None)
                                   for k in mgr.transfer_infos.get(room, ())]
        events.put(("prefill_bootstrapped", None))
        if not _wait_flag(go, cfg["startup_timeout_s"]):
            raise TimeoutError("no go from the parent")

        pages = np.asarray(_src_pages(cfg), dtype=np.int32)
        sender.init(num_kv_indices=len(pages), aux_index=0)
        start = 0
        t_first = time.perf_counter()
        for i, n in enumerate(cfg["chunks"]):
            if i == 0 and cfg["early_send_prefix"]:
                _early_send(sender, pages[: cfg["early_send_prefix"]])
                start = cfg["early_send_prefix"]
                n -= cfg["early_send_prefix"]
                if n <= 0:
                    continue
            _simulated_forward(mgr, room, cfg["compute_gap_s"])
            sender.send(pages[start : start + n])
            start += n
        # sglang stamps prefill_transfer_queue_entry_time after the last chunk is handed over (prefill.py) ...
        t_entry = time.perf_counter()
        status = _poll_until_concluded(sender, KVPoll, deadline)
        if status not in (KVPoll.Success, KVPoll.Failed):
            raise TimeoutError(f"sender stuck in {status}")
        # ... and its completion time when the scheduler first polls Success.
        t_done = time.perf_counter()
        metric = sender.get_transfer_metric()
        total_bytes = int(metric.transfer_total_bytes)
        legacy_latency = t_done - t_entry
        out.update(
            status="Success" if status == KVPoll.Success else "Failed",
            transfer_total_bytes=total_bytes,
            replica_factor=int(mgr.get_kv_replica_factor()),
            kv_item_lens_sum=int(mgr.kv_item_lens_sum),
            legacy_latency_s=legacy_latency,
            legacy_speed_gb_s=(total_bytes / 2**30 / legacy_latency) if legacy_latency > 0 else None,
            enqueue_to_done_s=t_done - t_first,
        )
        sender.clear()
        if second is not None:
            second.init(num_kv_indices=len(pages), aux_index=1)
            second.send(pages)
            status2 = _poll_until_concluded(second, KVPoll, deadline)
            out["second_status"] = "Success" if status2 == KVPoll.Success else "Failed"
            second.clear()
        _report(out, collect)
    except BaseException:
        out["error"] = traceback.format_exc()
    events.put(("prefill_done", out))
    # Up until every decode concluded, as a server stays: a decode learns its KV arrived from a message this
    # process sends after its own poll said Success, and it takes a prefill that stops answering its bootstrap
    # server's heartbeats for gone (sglang then fails the decode's request: "Lost connection with prefill").
    _wait_flag(stop, cfg["timeout_s"])


def _report(out: dict, collect) -> None:
    """What this process recorded: its spans and metrics into `out` (api mode), else flushed to the exporters
    the OTEL_* environment chose."""
    if collect is not None:
        out["spans"], out["metrics"] = collect()
    else:
        _flush()


def _poll_until_concluded(poller, KVPoll, deadline: float):
    """Poll a sender or receiver until Success or Failed, or the deadline; returns the last status."""
    status = poller.poll()
    while status not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
        time.sleep(0.001)
        status = poller.poll()
    return status


def _rooms_without_decode(cfg, mgr, sender_class, KVPoll) -> Dict[str, Any]:
    """No decode ever comes: room+1 is aborted, room+2 times out in Bootstrapping (sglang's own bootstrap
    timeout, SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT), room+3 is never polled again (only our TTL ends it)."""
    addr = f"{HOST}:{cfg['bootstrap_port']}"
    room = cfg["room"]
    aborted = sender_class(mgr, addr, room + 1)
    timed_out = sender_class(mgr, addr, room + 2)
    sender_class(mgr, addr, room + 3)  # forgotten
    aborted.abort()
    deadline = time.monotonic() + cfg["timeout_s"]
    status = timed_out.poll()
    while status != KVPoll.Failed and time.monotonic() < deadline:
        time.sleep(0.05)
        status = timed_out.poll()
    return {"status": {"aborted": aborted.poll(), "timed_out": int(status)}}


def _collect_until_ended(collect, room: int, timeout_s: float):
    """What `collect()` returns once `room`'s request span is among the spans (a forgotten room: only our TTL,
    OTEL_KVTRANSFER_REQUEST_TTL_S, ends it), or once `timeout_s` passed (the test then says what is missing)."""
    from otel_kvtransfer import semconv

    deadline = time.monotonic() + timeout_s
    while True:
        spans, metrics = collect()
        if time.monotonic() > deadline or any(
                s["name"] == semconv.SPAN_REQUEST and s["attributes"].get(semconv.BOOTSTRAP_ROOM) == room
                for s in spans):
            return spans, metrics
        time.sleep(0.05)


def _simulated_forward(mgr, room: int, gap_s: float) -> None:
    """Stands for one prefill forward of the batch holding `room` (the real one is a model forward, not here)."""
    t0 = time.time_ns()
    time.sleep(gap_s)
    t1 = time.time_ns()
    try:
        from otel_kvtransfer import integration

        integration.record_compute([room], t0, t1)
    except Exception:
        pass


def _early_send(sender, pages) -> None:
    """Send the cached prefix through sglang's own `maybe_send_cached_prefix_chunk` (the real method body)."""
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    class _Alloc:
        page_size = 1

    class _Req:
        pending_bootstrap = False
        prefix_len = len(pages)
        host_hit_length = 0
        start_send_idx = 0
        early_send_prefix_end = None
        disagg_kv_sender = sender

    class _Sched(SchedulerDisaggregationPrefillMixin):
        enable_staging = False
        enable_overlap = False
        token_to_kv_pool_allocator = _Alloc()

        def send_kv_chunk(self, req, last_chunk=False, end_idx=None):
            # Stands for prefill.py's _send_kv_chunk page lookup (which needs a req_to_token pool):
            # the cached prefix's pages are exactly `pages`.
            req.disagg_kv_sender.send(pages[req.start_send_idx : end_idx])
            req.start_send_idx = end_idx

    _Sched().maybe_send_cached_prefix_chunk(_Req())


def decode_main(cfg, rank, events, stop, gate=None) -> None:
    out: Dict[str, Any] = {"role": "decode", "rank": rank}
    try:
        _process_env(cfg)
        collect = _setup_instrumentation(cfg)
        import numpy as np

        server_args = _setup_sglang(cfg, "decode", rank)
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVReceiver
        from sglang.srt.disaggregation.utils import DisaggregationMode

        args, kv, aux = _make_buffers(cfg, "decode", rank)
        mgr = MooncakeKVManager(args, DisaggregationMode.DECODE, server_args, cfg["mla"])
        addr = f"{HOST}:{cfg['bootstrap_port']}"
        deadline = time.monotonic() + cfg["timeout_s"]
        while not mgr.try_ensure_parallel_info(addr):
            if time.monotonic() > deadline:
                raise TimeoutError("no parallel info from the bootstrap server")
            time.sleep(0.05)
        room = cfg["room"]
        receiver = MooncakeKVReceiver(mgr, addr, room)
        receiver.init(prefill_dp_rank=0)
        dst = np.asarray(_dst_pages(cfg), dtype=np.int32)
        if gate is not None and not _wait_flag(gate, cfg["startup_timeout_s"]):  # register_order: our turn
            raise TimeoutError("not let in to register")
        receiver.send_metadata(dst, aux_index=1)
        if cfg["fail"] == "decode_gone":
            second = MooncakeKVReceiver(mgr, addr, room + 1)
            second.init(prefill_dp_rank=0)
            second.send_metadata(dst, aux_index=2)
        events.put(("decode_metadata_sent", rank))
        if cfg["fail"] == "decode_gone":
            _wait_flag(stop, cfg["timeout_s"])  # the parent kills this process once prefill holds its metadata
            return
        status = _poll_until_concluded(receiver, KVPoll, deadline)
        if status not in (KVPoll.Success, KVPoll.Failed):
            raise TimeoutError(f"receiver stuck in {status}")
        out["status"] = "Success" if status == KVPoll.Success else "Failed"
        if status == KVPoll.Success:
            out["verified"] = _verify(cfg, kv, aux, rank)
        _report(out, collect)
    except BaseException:
        out["error"] = traceback.format_exc()
    events.put(("decode_done", out))
    _wait_flag(stop, cfg["timeout_s"])  # keep the engine alive until the prefill is done with it


def _wait_flag(event, timeout: float) -> bool:
    """Poll an mp.Event instead of Event.wait(): a process killed while waiting would leave the Event's condition
    counting a sleeper that never wakes, and the next set() would block forever."""
    deadline = time.monotonic() + timeout
    while not event.is_set():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _verify(cfg, kv, aux, rank) -> Dict[str, Any]:
    item_len = _local_item_len(cfg, "decode")
    lo = rank * item_len if _head_sliced(cfg) else 0  # page_size 1: a page is heads x head bytes
    bad = 0
    for b, buf in enumerate(kv):
        view = buf.reshape(cfg["pages"], item_len)
        for s, d in zip(_src_pages(cfg), _dst_pages(cfg)):
            if not (view[d] == _fill_value(b, s, cfg["item_len"])[lo : lo + item_len]).all():
                bad += 1
    aux_ok = bool((aux[0].reshape(cfg["aux_slots"], cfg["aux_len"])[1] == _fill_value(99, 0, cfg["aux_len"])).all())
    return {"bad_pages": bad, "pages_checked": len(kv) * len(_src_pages(cfg)), "aux_ok": aux_ok}


# --------------------------------------------------------------------------------------------------------------
# The parent


# What every scenario process imports; a fork server imports it once (sglang's imports cost ~15 s of CPU a process).
FORKSERVER_PRELOAD = ["numpy", "sglang.srt.server_args", "sglang.srt.disaggregation.base.conn",
                      "sglang.srt.disaggregation.mooncake.conn", "sglang.srt.disaggregation.prefill",
                      "sglang.srt.disaggregation.decode"]


def _context(start_method, cfg):
    """spawn (a program run under opentelemetry-instrument: each process starts as a fresh interpreter would), or
    forkserver (a test process: the processes fork from one that imported sglang once, and each takes the
    parent's environment of this run; nothing of our package is preloaded, so each instruments afresh)."""
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method: spawn or forkserver, not {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        cfg["environ"] = dict(os.environ)
    return ctx


def run_scenario(**overrides) -> Dict[str, Any]:
    """Run one scenario; returns {"prefill": {...}, "decodes": [{...}, ...], "wall_s": float}."""
    cfg = dict(DEFAULTS)
    cfg.update(overrides)
    if cfg["room"] is None:
        cfg["room"] = int.from_bytes(os.urandom(7), "big")
    cfg["bootstrap_port"] = free_port()
    cfg["model_dir"] = _model_dir()
    ctx = _context(cfg.pop("start_method", "spawn"), cfg)
    events = ctx.Queue()
    go = ctx.Event()
    stop = ctx.Event()
    t0 = time.monotonic()
    procs = [ctx.Process(target=prefill_main, args=(cfg, events, go, stop), name="kvt-prefill", daemon=True)]
    # More prefill ranks: started once rank 0's bootstrap server is up, the decodes once every rank registered.
    more = [ctx.Process(target=prefill_main, args=(cfg, events, go, stop, r), name=f"kvt-prefill{r}", daemon=True)
            for r in range(1, cfg["prefills"])]
    if cfg["fail"] == "no_decode":
        cfg["decodes"] = 0
    order = list(cfg["register_order"] or ())
    gates = {r: ctx.Event() for r in order}
    for r in range(cfg["decodes"]):
        procs.append(ctx.Process(target=decode_main, args=(cfg, r, events, stop, gates.get(r)), name=f"kvt-decode{r}",
                                 daemon=True))
    result: Dict[str, Any] = {"prefill": None, "prefills": [], "decodes": [], "cfg": cfg, "registered": 0}
    try:
        procs[0].start()
        if not _wait_event(events, "prefill_ready", cfg["startup_timeout_s"], result):
            raise TimeoutError(f"prefill not ready: {result}")
        for p in more:
            p.start()
            if not _wait_event(events, "prefill_ready", cfg["startup_timeout_s"], result):
                raise TimeoutError(f"prefill {p.name} not ready: {result}")
        for p in procs[1:]:
            p.start()
        if order:
            gates[order[0]].set()
        metadata, bootstrapped, senders = 0, cfg["fail"] == "no_decode", 0
        while metadata < cfg["decodes"] or not bootstrapped:
            kind = _next_event(events, cfg["startup_timeout_s"], result)  # decode processes import sglang too
            if kind == "decode_metadata_sent":
                metadata += 1
            elif kind == "prefill_bootstrapped":
                senders += 1
                bootstrapped = senders >= cfg["prefills"]
            elif kind == "prefill_registered" and result["registered"] < len(order):
                gates[order[result["registered"]]].set()  # the previous decode's metadata is in: the next one
            elif kind is None:
                raise TimeoutError(f"decode metadata not sent: {result}")
            elif kind == "prefill_done":
                break
        if cfg["fail"] == "decode_gone":
            # The decode engine dies (SIGKILL, by PID) with its metadata already in the prefill's hands.
            for p in procs[1:]:
                os.kill(p.pid, 9)
                p.join(timeout=10)
        go.set()
        expected_done = 1 + (0 if cfg["fail"] == "decode_gone" else cfg["decodes"])
        deadline = time.monotonic() + cfg["timeout_s"] + 10
        while ((result["prefill"] is None or len(result["prefills"]) < cfg["prefills"]
                or len(result["decodes"]) < expected_done - 1) and time.monotonic() < deadline):
            if _next_event(events, max(0.1, deadline - time.monotonic()), result) is None:
                break
    finally:
        stop.set()
        for p in procs + more:
            if p.pid is None:
                continue
            p.join(timeout=5)
            if p.is_alive():
                os.kill(p.pid, 9)
                p.join(timeout=5)
        shutil.rmtree(cfg["model_dir"], ignore_errors=True)
    result["wall_s"] = time.monotonic() - t0
    return result


def _next_event(events, timeout, result) -> Optional[str]:
    try:
        kind, payload = events.get(timeout=timeout)
    except queue_mod.Empty:
        return None
    if kind == "prefill_done":
        result["prefills"].append(payload)
        if payload.get("rank", 0) == 0:
            result["prefill"] = payload
    elif kind == "prefill_registered":
        result["registered"] = payload
    elif kind == "decode_done":
        result["decodes"].append(payload)
    return kind


def _wait_event(events, want, timeout, result) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kind = _next_event(events, deadline - time.monotonic(), result)
        if kind == want:
            return True
        if kind == "prefill_done":
            return False
    return False


def main(argv: List[str]) -> int:
    overrides = json.loads(argv[1]) if len(argv) > 1 else {}
    result = run_scenario(**overrides)
    print("HARNESS_RESULT " + json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
