"""sglang's prefill forward on a device, in processes of their own: the real run_batch wrapper, real Mooncake sends.

What is real: sglang 0.5.23's `Scheduler` class instrumented as a deployment is (our wrapper on its `run_batch`),
its `MooncakeKVManager` / `MooncakeKVSender` (prefill) and `MooncakeKVReceiver` (decode, sglang_harness's
decode process, which checks every byte it was promised) over real Mooncake TCP on 127.0.0.1, our recorder,
builder and span-file exporter.

What is a STAND-IN, because these machines have no GPU: the device (tests/support/standin_cuda.py, shaped as
torch.cuda, given to the instrumentation through `device_clock.use_device_module`), and so the forward itself:
`run_batch`'s body is replaced, before instrumenting, by what sglang's does on a GPU in the part that matters
here: it enqueues the forward (a stand-in kernel of `kernel_s`) on `forward_stream` behind the scheduler's own
stream (overlap scheduler) or on the scheduler's stream (normal loop), and returns at once. Its result's
`copy_done` completes when the forward has run, as sglang's does.

The prefill drives the batches as sglang's loops do. Overlap: launch batch i, then process batch i-1 (wait for
its `copy_done`, send its KV chunk). To make the overlap certain rather than likely, batch i's kernel (i >= 1)
runs its `kernel_s` only once chunk i-1's send span exists (its bytes have left): the forward demonstrably
outlasts the transfer it overlaps. Normal: launch, wait, send, batch after batch.
"""

import os
import threading
import time
import traceback
from types import SimpleNamespace

from support import sglang_harness as harness
from support.telemetry import in_memory_metrics

HOST = harness.HOST
DEFAULTS = dict(harness.DEFAULTS, chunks=[16, 16, 16], kernel_s=0.05, overlap=True, timeout_s=90.0)


def _stand_in_run_batch(self, batch):
    """Stands for sglang's run_batch on a GPU (the real one needs a model): the forward enqueued, not run."""
    device = self.stand_in_device
    schedule = device.current_stream()
    if self.enable_overlap:
        self.forward_stream.wait_stream(schedule)  # sglang: forward_stream.wait_stream(schedule_stream)
        stream = self.forward_stream
    else:
        stream = schedule
    with device.stream(stream):
        kernel = device.launch(batch.kernel_s, gate=batch.gate)
        copy_done = device.Event(enable_timing=True)
        copy_done.record()
    return SimpleNamespace(copy_done=copy_done, kernel=kernel)


def _instrument(cfg, rank):
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_kvtransfer.building.file_exporter import OtlpJsonFileSpanExporter
    from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor

    provider = TracerProvider(resource=Resource.create({"service.name": f"prefill-{rank}"}))
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.add_span_processor(SimpleSpanProcessor(OtlpJsonFileSpanExporter(cfg["span_files"][rank])))
    meter_provider, reader = in_memory_metrics()
    KVTransferInstrumentor().instrument(tracer_provider=provider, meter_provider=meter_provider)

    def collect():
        harness._flush()
        provider.force_flush()
        return [harness.span_to_dict(s) for s in memory.get_finished_spans()]

    return collect, reader


def prefill_main(cfg, events, go, stop, rank=0) -> None:
    out = {"role": "prefill", "rank": rank}
    device = None
    try:
        harness._process_env(cfg)
        import numpy as np
        from sglang.srt.managers.scheduler import Scheduler

        from otel_kvtransfer.recording import device_clock
        from otel_kvtransfer.recording.clock import now_ns
        from support.standin_cuda import StandInCuda
        from support.telemetry import dropped_by_reason

        Scheduler.run_batch = _stand_in_run_batch  # before instrumenting: our wrapper goes around it
        device = StandInCuda()
        clock = device_clock.use_device_module(device)  # the seam: this process's CUDA is the stand-in
        collect, reader = _instrument(cfg, rank)

        server_args = harness._setup_sglang(cfg, "prefill", rank)
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.mooncake.conn import (
            MooncakeKVBootstrapServer,
            MooncakeKVManager,
            MooncakeKVSender,
        )
        from sglang.srt.disaggregation.utils import DisaggregationMode

        _bootstrap = MooncakeKVBootstrapServer(HOST, cfg["bootstrap_port"]) if rank == 0 else None
        args, kv, aux = harness._make_buffers(cfg, "prefill", rank)
        mgr = MooncakeKVManager(args, DisaggregationMode.PREFILL, server_args, cfg["mla"])
        events.put(("prefill_ready", rank))
        room = cfg["room"]
        sender = MooncakeKVSender(mgr, f"{HOST}:{cfg['bootstrap_port']}", room)
        deadline = time.monotonic() + cfg["startup_timeout_s"]
        while sender.poll() == KVPoll.Bootstrapping:
            if time.monotonic() > deadline:
                raise TimeoutError("sender stayed in Bootstrapping")
            time.sleep(0.01)
        events.put(("prefill_bootstrapped", None))
        if not harness._wait_flag(go, cfg["startup_timeout_s"]):
            raise TimeoutError("no go from the parent")

        sched = Scheduler.__new__(Scheduler)  # the real class, without the model it would load
        sched.disaggregation_mode = DisaggregationMode.PREFILL
        sched.device = "cuda"
        sched.enable_overlap = cfg["overlap"]
        sched.forward_stream = device.Stream()
        sched.stand_in_device = device
        pages = np.asarray(harness._src_pages(cfg), dtype=np.int32)
        bounds = np.cumsum([0] + list(cfg["chunks"]))
        sender.init(num_kv_indices=len(pages), aux_index=0)
        batches = []
        deadline = time.monotonic() + cfg["timeout_s"]

        def launch(i):
            gate = threading.Event() if cfg["overlap"] and i > 0 else None
            batch = SimpleNamespace(reqs=[SimpleNamespace(bootstrap_room=room, bootstrap_host=HOST)],
                                    kernel_s=cfg["kernel_s"], gate=gate)
            t0 = now_ns()
            result = sched.run_batch(batch)
            batches.append({"launch": (t0, now_ns()), "result": result, "gate": gate})

        def process(i):  # sglang's process_batch_result_disagg_prefill: the forward's result, then the chunk
            done = batches[i]["result"].copy_done
            while not done.query():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"batch {i} never completed")
                time.sleep(0.001)
            sender.send(pages[bounds[i]:bounds[i + 1]])

        def sent(i):
            while not any(s["name"] == "kv_transfer.send" and s["attributes"].get("kv_transfer.chunk_index") == i
                          and s["attributes"].get("kv_transfer.payload") == "kv" for s in collect()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"chunk {i} never sent")
                time.sleep(0.01)

        with device.stream(device.Stream()):  # sglang runs its loop inside its schedule stream
            for i in range(len(cfg["chunks"])):
                launch(i)
                if not cfg["overlap"]:
                    process(i)
                    continue
                if i > 0:
                    process(i - 1)
                    sent(i - 1)
                    batches[i]["gate"].set()
            if cfg["overlap"]:
                process(len(cfg["chunks"]) - 1)
        status = harness._poll_until_concluded(sender, KVPoll, deadline)
        out["status"] = "Success" if status == KVPoll.Success else str(status)
        out["kv_item_lens_sum"] = int(mgr.kv_item_lens_sum)
        out["batches"] = [{"launch": b["launch"], "kernel_start": b["result"].kernel.started_at,
                           "done_at": b["result"].copy_done.at} for b in batches]
        sender.clear()
        out["spans"] = collect()
        out["dropped"] = dropped_by_reason(reader)
        out["clock"] = clock.stats()
    except BaseException:
        out["error"] = traceback.format_exc()
    finally:
        if device is not None:
            device.close()
    events.put(("prefill_done", out))
    harness._wait_flag(stop, cfg["timeout_s"])


def run(folder: str, **overrides) -> dict:
    """One request through `prefills` prefill ranks (stand-in device) to one decode rank (sglang_harness's); each
    prefill rank's span file goes into `folder`."""
    import multiprocessing as mp
    import shutil

    cfg = dict(DEFAULTS, **overrides)
    cfg["room"] = cfg["room"] if cfg["room"] is not None else int.from_bytes(os.urandom(7), "big")
    cfg["bootstrap_port"] = harness.free_port()
    cfg["model_dir"] = harness._model_dir()
    cfg["span_files"] = [os.path.join(folder, f"prefill-{r}.jsonl") for r in range(cfg["prefills"])]
    cfg["environ"] = dict(os.environ)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(harness.FORKSERVER_PRELOAD + ["sglang.srt.managers.scheduler"])
    events, go, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    prefills = [ctx.Process(target=prefill_main, args=(cfg, events, go, stop, r), daemon=True)
                for r in range(cfg["prefills"])]
    decode = ctx.Process(target=harness.decode_main, args=(cfg, 0, events, stop), daemon=True)
    result = {"prefill": None, "prefills": [], "decodes": [], "cfg": cfg, "registered": 0}
    try:
        for p in prefills:
            p.start()
            if not harness._wait_event(events, "prefill_ready", cfg["startup_timeout_s"], result):
                raise TimeoutError(f"prefill not ready: {result}")
        decode.start()
        metadata, bootstrapped = 0, 0
        while metadata < 1 or bootstrapped < cfg["prefills"]:
            kind = harness._next_event(events, cfg["startup_timeout_s"], result)
            if kind is None or kind == "prefill_done":
                raise TimeoutError(f"not set up: {result}")
            metadata += kind == "decode_metadata_sent"
            bootstrapped += kind == "prefill_bootstrapped"
        go.set()
        deadline = time.monotonic() + cfg["timeout_s"] + 10
        while (len(result["prefills"]) < cfg["prefills"] or not result["decodes"]) and time.monotonic() < deadline:
            if harness._next_event(events, max(0.1, deadline - time.monotonic()), result) is None:
                break
    finally:
        stop.set()
        for p in prefills + [decode]:
            if p.pid is None:
                continue
            p.join(timeout=5)
            if p.is_alive():
                os.kill(p.pid, 9)
                p.join(timeout=5)
        shutil.rmtree(cfg["model_dir"], ignore_errors=True)
    result["prefills"].sort(key=lambda p: p.get("rank", 0))
    return result
