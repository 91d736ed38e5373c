"""What the instrumentation costs a real engine process (issue 12), measured on the real Mooncake engine.

One process, a receiver process on 127.0.0.1, a production-shaped SDK pipeline (BatchSpanProcessor with a no-op
exporter, MeterProvider with an in-memory reader and the default exemplar filter). instrument() and
uninstrument() alternate round by round; every figure is a median of per-round differences, printed beside the
A/A noise of the same run (the same difference between two uninstrumented rounds).

1. thread: time added on the calling thread per engine call (wall and that thread's CPU), for an 8 B
   `transfer_sync_write`, a 128-descriptor `batch_transfer_sync_write`, the same 8 B call inside a
   `transfer_scope`, and inside `scope.bind()` on an executor thread.
2. process: CPU per transfer summed over every thread of the process (/proc/self/task), while one thread makes
   paced 64 KiB writes; the transfers achieved per second unpaced; and the builder alone (records already queued,
   one drain, on one core).
3. neighbour: the slowdown of a CPU-bound pure-Python thread while real transfers run at 1,000/s.

With `--builder process` the same figures are taken with OTEL_KVTRANSFER_BUILDER=process: the engine process
only queues and hands records over; the helper process builds them on the same pipeline (`common.helper_setup`).
Its CPU is measured too (/proc/<helper pid>) and printed beside the engine process's, never folded into it.

    python bench/engine_cost.py [--builder thread|process] [--quick] [--out FILE]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import HELPER_TOTALS_DIR, Pipeline, machine  # noqa: E402

from otel_kvtransfer import KVTransferInstrumentor  # noqa: E402
from otel_kvtransfer import integration as kvt  # noqa: E402
from otel_kvtransfer.demo.loopback import Receiver, open_engine  # noqa: E402
from otel_kvtransfer.recorder import RECORDER  # noqa: E402


def _spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _cpu_ticks(stat_path) -> int:
    """utime + stime (clock ticks) from a /proc .../stat file; the command name may hold spaces and ')'."""
    with open(stat_path, encoding="ascii") as handle:
        stat = handle.read()
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def _process_cpu_ns(pid) -> float:
    """CPU (user + system) a whole process has used so far."""
    return _cpu_ticks(f"/proc/{pid}/stat") * 1e9 / os.sysconf("SC_CLK_TCK")


class Bench:
    def __init__(self, builder: str):
        import numpy as np  # pylint: disable=import-outside-toplevel

        self.builder = builder
        if builder == "process":  # set before the first instrument(): every helper inherits them
            os.environ["OTEL_KVTRANSFER_BUILDER"] = "process"
            os.environ["OTEL_KVTRANSFER_HELPER_SETUP"] = "common:helper_setup"
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [HERE, os.environ.get("PYTHONPATH")] if p)
            os.environ[HELPER_TOTALS_DIR] = tempfile.mkdtemp(prefix="kvt-bench-helpers-")

        self.receiver = Receiver(8 << 20, env={"MC_FORCE_TCP": "1"})
        self.engine = open_engine()
        self.source = np.ones(8 << 20, dtype=np.uint8)
        assert self.engine.register_memory(self.source.ctypes.data, self.source.nbytes) == 0
        self.base, self.session, self.peer = self.source.ctypes.data, self.receiver.session, self.receiver.base_address
        self.pipeline = Pipeline()
        self.instrumentor = KVTransferInstrumentor()
        self.transfers_on = 0  # real transfers made while instrumented: the metrics must count every one

    def on(self):
        if not self.instrumentor.is_instrumented_by_opentelemetry:
            self.instrumentor.instrument(tracer_provider=self.pipeline.tracer_provider,
                                     meter_provider=self.pipeline.meter_provider)
            if self.builder == "process":
                self.settle()  # starts the helper: its start-up (imports, SDK) is over before anything is measured
                assert self.helper_pid(), "the builder process did not start"

    def helper_pid(self):
        link = getattr(self.instrumentor, "_link", None)
        return link.pid() if link is not None else None

    def settle(self):
        """Everything recorded so far delivered and, with a builder process, built there and flushed."""
        RECORDER.drain()
        if self.builder == "process":
            assert self.pipeline.tracer_provider.force_flush(60000), "the builder process did not flush"

    def helper_cpu_ns(self) -> float:
        return _process_cpu_ns(self.helper_pid()) if self.builder == "process" else 0.0

    def off(self):
        if self.instrumentor.is_instrumented_by_opentelemetry:
            self.instrumentor.uninstrument()

    def mode(self, name):
        (self.on if name == "on" else self.off)()

    def stop(self):
        self.off()
        self.receiver.stop()

    # --- calls ------------------------------------------------------------------------------------------------
    def call_8b(self):
        return self.engine.transfer_sync_write(self.session, self.base, self.peer, 8)

    def call_batch(self):
        srcs = [self.base + 64 * i for i in range(128)]
        dsts = [self.peer + 64 * i for i in range(128)]
        return self.engine.batch_transfer_sync_write(self.session, srcs, dsts, [64] * 128)

    def call_scoped(self):
        with kvt.transfer_scope(7, chunk_index=0, payload="kv"):
            return self.call_8b()


def _block(call, n):
    """(wall ns, this thread's CPU ns) per call over n calls."""
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    for _ in range(n):
        call()
    return (time.perf_counter_ns() - wall) / n, (time.thread_time_ns() - cpu) / n


def thread_cost(b: Bench, rounds: int, calls: int) -> dict:
    """Goal 1: per round, blocks in modes off, off (A/A) and on, in rotating order."""
    from concurrent.futures import ThreadPoolExecutor  # pylint: disable=import-outside-toplevel

    pool = ThreadPoolExecutor(1)

    def bound_block(n):
        scope = kvt.transfer_scope(8, chunk_index=0, payload="kv")

        def run():
            with scope.bind():
                return _block(b.call_8b, n)

        with scope:
            return pool.submit(run).result()

    shapes = {"8 B sync write": lambda n: _block(b.call_8b, n),
              "128-descriptor batch write": lambda n: _block(b.call_batch, n),
              "8 B write in a transfer_scope": lambda n: _block(b.call_scoped, n),
              "8 B write via scope.bind() on an executor thread": bound_block}
    out = {}
    for shape, run in shapes.items():
        per = {"off": [], "off2": [], "on": []}
        run(calls)  # warm the connection and the code
        for r in range(rounds):
            order = ["off", "off2", "on"]
            order = order[r % 3:] + order[:r % 3]
            for mode in order:
                b.mode("on" if mode == "on" else "off")
                per[mode].append(run(calls))
                if mode == "on":  # one send per call, except calls bound to one scope: one send per block
                    b.transfers_on += 1 if shape.startswith("8 B write via") else calls
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
            "added_wall_us_rounds": [x / 1e3 for x in added_wall],
            "aa_wall_us_rounds": [x / 1e3 for x in aa_wall],
        }
    pool.shutdown()
    return out


def _task_cpu_ticks():
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            ticks[tid] = _cpu_ticks(f"/proc/self/task/{tid}/stat")
        except (OSError, ValueError, IndexError):
            pass
    return ticks


def process_cost(b: Bench, rounds: int, seconds: float) -> dict:
    """Goal 2: CPU of every thread per paced 64 KiB transfer, and the unpaced rate, on vs off (+ A/A)."""
    tick_ns = 1e9 / os.sysconf("SC_CLK_TCK")
    stop = threading.Event()

    def paced(rate, counter):
        step = 1.0 / rate
        nxt = time.perf_counter()
        while not stop.is_set():
            b.engine.transfer_sync_write(b.session, b.base, b.peer, 64 << 10)
            counter[0] += 1
            nxt += step
            delay = nxt - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            else:
                nxt = time.perf_counter()

    def measure(mode, rate):
        b.mode("on" if mode == "on" else "off")
        counter = [0]
        stop.clear()
        worker = threading.Thread(target=paced, args=(rate, counter), name="transfers")
        before = _task_cpu_ticks()
        helper_before = b.helper_cpu_ns() if mode == "on" else 0.0
        worker.start()
        time.sleep(seconds)
        stop.set()
        worker.join()
        if mode == "on":
            b.settle()  # the round's span building belongs to the round (in the helper too)
            b.transfers_on += counter[0]
            helper_cpu[0] = (b.helper_cpu_ns() - helper_before) / max(counter[0], 1) / 1e3
        after = _task_cpu_ticks()
        cpu_ns = sum(after[t] - before.get(t, 0) for t in after) * tick_ns
        return cpu_ns / max(counter[0], 1) / 1e3, counter[0] / seconds

    per = {"off": [], "off2": [], "on": []}
    rate = {"off": [], "off2": [], "on": []}
    helper_cpu, helper_per = [0.0], []
    for r in range(rounds):
        order = ["off", "off2", "on"]
        for mode in order[r % 3:] + order[:r % 3]:
            cpu_us, _ = measure(mode, 700)
            per[mode].append(cpu_us)
            if mode == "on":
                helper_per.append(helper_cpu[0])
            _, achieved = measure(mode, 1e9)  # unpaced: as fast as the engine goes
            rate[mode].append(achieved)
    b.off()
    return {
        "helper_cpu_us_per_transfer": _spread(helper_per) if b.builder == "process" else None,
        "paced_rate_per_s": 700,
        "cpu_us_per_transfer_off": _spread(per["off"]),
        "cpu_us_per_transfer_on": _spread(per["on"]),
        "added_cpu_us_per_transfer": statistics.median(on - off for on, off in zip(per["on"], per["off"])),
        "aa_cpu_us_per_transfer": statistics.median(o2 - o1 for o1, o2 in zip(per["off"], per["off2"])),
        "unpaced_rate_off": _spread(rate["off"]),
        "unpaced_rate_on": _spread(rate["on"]),
        "rate_change": statistics.median((on - off) / off for on, off in zip(rate["on"], rate["off"])),
        "rate_change_aa": statistics.median((o2 - o1) / o1 for o1, o2 in zip(rate["off"], rate["off2"])),
    }


def builder_alone(b: Bench, n: int) -> dict:
    """Records already queued (the background thread asleep), one drain timed on this thread's CPU.

    With a builder process the drain only hands the records over (its CPU is the engine process's share); the
    building is the helper's CPU from that drain until it has flushed them all."""
    os.environ["OTEL_KVTRANSFER_FLUSH_INTERVAL_MS"] = "60000"
    try:
        b.on()
        for _ in range(n):
            b.call_8b()
        b.transfers_on += n
        queued = RECORDER.pending()
        helper = b.helper_cpu_ns()
        cpu = time.thread_time_ns()
        RECORDER.drain()
        cpu = time.thread_time_ns() - cpu
        b.settle()
        helper = b.helper_cpu_ns() - helper
        b.off()
    finally:
        del os.environ["OTEL_KVTRANSFER_FLUSH_INTERVAL_MS"]
    if b.builder == "process":
        return {"records": queued, "records_per_cpu_s": queued / (helper / 1e9),
                "cpu_us_per_record": helper / queued / 1e3, "handoff_cpu_us_per_record": cpu / queued / 1e3}
    return {"records": queued, "records_per_cpu_s": queued / (cpu / 1e9), "cpu_us_per_record": cpu / queued / 1e3}


def neighbour(b: Bench, rounds: int, seconds: float) -> dict:
    """Goal 3: a CPU-bound Python thread's work rate, with real transfers at 1,000/s beside it, on vs off."""
    stop = threading.Event()

    def spin(result):
        count, x = 0, 0
        while not stop.is_set():
            for i in range(1000):
                x = (x * 31 + i) % 1000003
            count += 1
        result.append(count)

    def transfers(counter):
        nxt = time.perf_counter()
        while not stop.is_set():
            b.call_8b()
            counter[0] += 1
            nxt += 0.001
            delay = nxt - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            else:
                nxt = time.perf_counter()

    def measure(mode):
        b.mode("on" if mode == "on" else "off")
        stop.clear()
        result, counter = [], [0]
        threads = [threading.Thread(target=spin, args=(result,)), threading.Thread(target=transfers, args=(counter,))]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        if mode == "on":
            b.transfers_on += counter[0]
        return result[0] / seconds

    per = {"off": [], "off2": [], "on": []}
    for r in range(rounds):
        order = ["off", "off2", "on"]
        for mode in order[r % 3:] + order[:r % 3]:
            per[mode].append(measure(mode))
    b.off()
    slow = [(off - on) / off for on, off in zip(per["on"], per["off"])]
    aa = [(o1 - o2) / o1 for o1, o2 in zip(per["off"], per["off2"])]
    return {"slowdown": _spread(slow), "slowdown_aa": _spread(aa), "work_per_s_off": _spread(per["off"])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builder", choices=("thread", "process"), default="thread",
                        help="where spans are built: this process's thread (the default) or a helper process")
    parser.add_argument("--quick", action="store_true", help="fewer rounds: a smoke run, not for quoting")
    parser.add_argument("--out", help="write the JSON here as well as to stdout")
    args = parser.parse_args()
    quick = args.quick
    b = Bench(args.builder)
    try:
        result = {
            "builder": args.builder,
            "engine": "real Mooncake TransferEngine, TCP on 127.0.0.1, receiver in its own process",
            "machine": machine(),
            "load_average_before": os.getloadavg()[0],
            "thread": thread_cost(b, rounds=4 if quick else 12, calls=100 if quick else 400),
            "process": process_cost(b, rounds=2 if quick else 6, seconds=1.0 if quick else 3.0),
            "builder_alone": builder_alone(b, 2000 if quick else 20000),
            "neighbour": neighbour(b, rounds=2 if quick else 10, seconds=1.0 if quick else 3.0),
            "load_average_after": os.getloadavg()[0],
        }
        b.pipeline.tracer_provider.force_flush()
        if args.builder == "process":
            b.off()  # the last helper ends and writes its totals
            totals = helper_totals()
        else:
            points = b.pipeline.metric_points()
            totals = {"transfers_in_metrics": sum(p.count for p in points.get("kv_transfer.size", [])),
                      "exemplars": sum(len(p.exemplars) for p in points.get("kv_transfer.size", []))}
        result["metrics_complete"] = dict(transfers_made_instrumented=b.transfers_on, **totals)
    finally:
        b.stop()
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)
    print(text)


def helper_totals() -> dict:
    """The metrics of every builder process of the run (each wrote its totals when it ended)."""
    folder = os.environ[HELPER_TOTALS_DIR]
    found = {"transfers_in_metrics": 0, "exemplars": 0, "helpers": 0}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), encoding="utf-8") as handle:
            one = json.load(handle)
        found["transfers_in_metrics"] += one["transfers_in_metrics"]
        found["exemplars"] += one["exemplars"]
        found["helpers"] += 1
    return found


if __name__ == "__main__":
    main()
