"""Who owns the engine process's CPU per transfer: each thread of it, instrumentation on vs off, real engine.

The process is set up as `bench/engine_cost.py` sets it up (the SDK from OTEL_* through the distro's
configurator, OTLP exporters to bench/otlp_receiver.py, real Mooncake 64 KiB writes to a receiver process on
127.0.0.1, the package's default builder). Every round reads each thread's time on the CPU from
/proc/self/task/<tid>/schedstat and files it under one owner:

  calling      the thread making the paced engine calls (its own thread_time_ns, read inside it)
  recorder     our threads in this process (named otel-kvtransfer-*)
  sdk          the SDK's export threads (OtelBatch*Processor, OtelPeriodicExportingMetricReader)
  mooncake     threads Python did not start: the Mooncake engine's own (and, over OTLP/gRPC, gRPC's)
  python_other this script's other Python threads (the main thread waiting out the round)
  ended        what threads that ended within the round used (process CPU minus the threads above)
  helper       the builder processes this process started (another process: beside, not in, the engine's),
               and split in two: its main thread, which builds (helper_builder), and its other threads, the
               SDK's exporters (helper_export)
And beside them the calling thread's wall time inside its engine calls: a sync call that waits by polling spends
its wall time on the CPU, so CPU and wall inside the calls move together.

Per owner: the median over rounds of (on - off) per transfer, beside the A/A noise (off2 - off). At two rates
(700/s and 2,800/s by default) the marginal cost of our threads is the slope between them; with nothing
transferred, our threads' CPU per second. And on the calling thread, the wrapper's own cost where the engine's
work is smallest (0 B writes). Each under each placement of the run's processes (`Placement`): Mooncake's sync
calls wait by polling, so whatever delays the receiver (a helper sharing its core) shows up as more CPU on the
calling thread, which is this machine's contention and not a cost a deployment (its decode engine elsewhere) pays.

    python bench/engine_threads.py [--rates 700,2800] [--metric-interval-ms 1000|0]
                                   [--placements shared,apart,receiver_alone] [--quick] [--out FILE]

`--metric-interval-ms 0` leaves OTEL_METRIC_EXPORT_INTERVAL unset (the SDK's default, 60 s). Runs inside a
network namespace of its own.
"""

import argparse
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cpu
from common import emit_json, in_private_network, machine, stop_all
from engine_cost import _rotations, _spread

OWNERS = ("calling", "recorder", "sdk", "mooncake", "python_other", "ended", "helper")
HELPER_PARTS = ("helper_builder", "helper_export")  # the helper's CPU, split: beside, not in, OWNERS
OURS_PREFIX = "otel-kvtransfer-"
SDK_PREFIXES = ("OtelBatch", "OtelPeriodicExportingMetricReader")


def _owner_of(tid: int, python_names: dict) -> str:
    name = python_names.get(tid)
    if name is None:
        return "mooncake"
    if name.startswith(OURS_PREFIX):
        return "recorder"
    if name.startswith(SDK_PREFIXES):
        return "sdk"
    return "python_other"


class Round:
    """CPU by owner between start() and stop(); the calling thread's own figure is added by the caller."""

    def __init__(self, helpers):
        self._helpers = helpers  # () -> pids of the builder processes started so far

    def start(self):
        self._threads, self._process = cpu.threads_ns(os.getpid()), time.process_time_ns()
        self._helper = cpu.Snapshot(pids=self._helpers())
        self._helper_main = _main_threads_ns(self._helpers())

    def stop(self, calling_tid: int, calling_ns: int) -> dict:
        threads, process = cpu.threads_ns(os.getpid()), time.process_time_ns()
        # A helper's thread that ended within the round takes its schedstat with it: cpu.used() counts that
        # helper in clock ticks instead, and one started within the round whole.
        helper = cpu.used(self._helper, cpu.Snapshot(pids=self._helpers()))
        names = {t.native_id: t.name for t in threading.enumerate()}
        owners = dict.fromkeys(OWNERS, 0)
        owners["calling"] = calling_ns
        counted = calling_ns
        for tid, ns in threads.items():
            if tid == calling_tid:
                continue
            used = ns - self._threads.get(tid, 0)  # a thread started within the round: all of it
            owners[_owner_of(tid, names)] += used
            counted += used
        owners["ended"] = max(process - self._process - counted, 0)
        owners["helper"] = helper["others_ns"]
        # The helper's main thread is its frame loop, which builds; its other threads are the SDK's exporters
        # (and a flush's own thread): what building costs, apart from what exporting does.
        main = _main_threads_ns(self._helpers())
        owners["helper_builder"] = sum(ns - self._helper_main.get(pid, 0) for pid, ns in main.items())
        owners["helper_export"] = max(owners["helper"] - owners["helper_builder"], 0)
        return owners


def _main_threads_ns(pids) -> dict:
    """pid -> its main thread's nanoseconds on the CPU (schedstat), for the processes still there."""
    found = {}
    for pid in pids:
        try:
            ns = cpu.threads_ns(pid).get(pid)
        except OSError:  # it ended
            continue
        if ns is not None:
            found[pid] = ns
    return found


def _paced(call, rate: float, seconds: float) -> tuple:
    """`call` at `rate` per second for `seconds` on a thread of its own: (calls made, its tid, its CPU ns, its
    wall ns inside the calls)."""
    stop, out = threading.Event(), {}

    def run():
        out["tid"], start, made, inside = threading.get_native_id(), time.thread_time_ns(), 0, 0
        step, nxt = 1.0 / rate, time.perf_counter()
        clock = time.perf_counter_ns
        while not stop.is_set():
            before = clock()
            call()
            inside += clock() - before
            made += 1
            nxt += step
            delay = nxt - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            else:
                nxt = time.perf_counter()
        out["made"], out["ns"], out["inside"] = made, time.thread_time_ns() - start, inside

    worker = threading.Thread(target=run, name="transfers")
    worker.start()
    time.sleep(seconds)
    stop.set()
    worker.join()
    return out["made"], out["tid"], out["ns"], out["inside"]


def _until_drained(timeout_s: float = 10.0) -> None:
    from otel_kvtransfer.recording.recorder import RECORDER

    deadline = time.monotonic() + timeout_s
    while RECORDER.pending() and time.monotonic() < deadline:
        time.sleep(0.01)


def _idle(seconds: float) -> tuple:
    """Nothing transferred: (0, no tid, 0, 0) after `seconds`."""
    time.sleep(seconds)
    return 0, -1, 0, 0


class Placement:
    """Where the processes of the run may run (sched_setaffinity of every thread of each):
      shared          as the machine schedules them
      apart           this process on CPU 0; the Mooncake receiver, the OTLP receiver and the helper on the others
      receiver_alone  the Mooncake receiver on the last CPU; this process, the helper and the OTLP receiver on the
                      others (as a deployment has it: the decode engine is another machine)"""

    KINDS = ("shared", "apart", "receiver_alone")

    def __init__(self, bench, otlp):
        self._bench, self._otlp = bench, otlp
        self._all = sorted(os.sched_getaffinity(0))
        self.kind = "shared"

    def _helper(self):
        helper = self._bench.helper_pid()
        return [helper] if helper else []

    @staticmethod
    def _set(pids, cpus):
        for pid in pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue  # ended
            for tid in tids:
                try:
                    os.sched_setaffinity(int(tid), cpus)
                except OSError:
                    pass  # ended meanwhile

    def apply(self):
        """Again after each instrument(): a new helper starts on this process's CPUs."""
        everything, first, last = set(self._all), {self._all[0]}, {self._all[-1]}
        engine, receiver, otlp = [os.getpid()], [self._bench.receiver.pid], [self._otlp.pid]
        if self.kind == "shared":
            self._set(engine + receiver + otlp + self._helper(), everything)
        elif self.kind == "apart":
            self._set(engine, first)
            self._set(receiver + otlp + self._helper(), everything - first)
        else:
            self._set(receiver, last)
            self._set(engine + otlp + self._helper(), everything - last)

    def place(self, kind: str):
        if kind != "shared" and len(self._all) < 2:
            raise SystemExit("bench: keeping processes on cores of their own needs 2 CPUs or more")
        self.kind = kind
        self.apply()


def attribute(b, placement, call, rate, rounds, seconds) -> dict:
    """Per owner, us of CPU per transfer (per second when idle, rate 0): on, off, on - off and its A/A."""
    helpers = (lambda: sorted(b.helpers)) if b is not None else (lambda: [])
    per = {"off": [], "off2": [], "on": []}
    made_on = 0
    for order in _rotations(rounds):
        for mode in order:
            b.mode("on" if mode == "on" else "off")
            b.settle()
            meter = Round(helpers)
            meter.start()
            made, tid, calling_ns, inside_ns = _paced(call, rate, seconds) if rate else _idle(seconds)
            if rate:
                _until_drained()  # by the recorder's thread, as in a deployment (settle() drains on this one)
                b.settle()  # what the round recorded is built and exported within it (the helper's flush too)
            owners = meter.stop(tid, calling_ns)
            owners["calling_wall_in_calls"] = inside_ns  # beside, not in, the CPU owners
            if mode == "on":
                made_on += made
            scale = made if rate else seconds  # per transfer, or per second with nothing transferred
            per[mode].append({k: v / scale / 1e3 for k, v in owners.items()}
                             | {"made": made, "per_s": {k: v / seconds / 1e3 for k, v in owners.items()}})
    b.off()
    b.transfers_on += made_on
    out = {"rate_per_s": rate, "rounds": rounds, "round_s": seconds, "unit": "us per transfer" if rate else
           "us per second", "transfers_per_round": _spread([x["made"] for m in per.values() for x in m]),
           # the rates reached (a paced thread falls behind when the engine is slower than its pace)
           "achieved_per_s": {m: [x["made"] / seconds for x in per[m]] for m in per}}
    for owner in OWNERS + HELPER_PARTS + ("engine_process", "ours_in_engine", "calling_wall_in_calls"):
        def value(x, owner=owner):
            if owner == "engine_process":
                return sum(x[k] for k in OWNERS if k != "helper")
            if owner == "ours_in_engine":
                return x["recorder"]
            return x[owner]
        on, off, off2 = ([value(x) for x in per[m]] for m in ("on", "off", "off2"))
        on_s, off_s, off2_s = ([value(x["per_s"]) for x in per[m]] for m in ("on", "off", "off2"))
        added, aa = [a - z for a, z in zip(on, off)], [a - z for a, z in zip(off2, off)]
        out[owner] = {"off": statistics.median(off), "on": statistics.median(on),
                      "added": statistics.median(added), "aa": statistics.median(aa),
                      "added_per_s_rounds": [a - z for a, z in zip(on_s, off_s)],
                      "aa_per_s_rounds": [a - z for a, z in zip(off2_s, off_s)]}
    return out


def slope(low: dict, high: dict, owner: str) -> dict:
    """Marginal us per transfer of `owner` between two rates: the change in its added CPU per second over the
    change in the rate its instrumented rounds reached (what does not grow with the rate, a timer's wake-ups,
    drops out); round by round (the i-th round at each rate), and the same of the A/A differences beside it."""
    def per_round(key):
        pairs = zip(low[owner][key], high[owner][key], low["achieved_per_s"]["on"], high["achieved_per_s"]["on"])
        return [(h - lo) / (rate_h - rate_lo) for lo, h, rate_lo, rate_h in pairs if rate_h > rate_lo]

    found = _spread(per_round("added_per_s_rounds")) or {"median": None, "min": None, "max": None}
    aa = per_round("aa_per_s_rounds")
    found["aa"] = statistics.median(aa) if aa else None
    return found


def run(b, placement, rates, rounds, seconds) -> dict:
    from engine_cost import thread_cost

    found = {"by_rate": {str(rate): attribute(b, placement, b.call_64k, rate, rounds, seconds) for rate in rates},
             "idle": attribute(b, placement, None, 0, rounds, seconds)}
    low, high = (found["by_rate"][str(r)] for r in (min(rates), max(rates)))
    found["marginal_us_per_transfer"] = {owner: slope(low, high, owner) for owner in
                                         ("ours_in_engine", "calling", "engine_process", "helper")
                                         + HELPER_PARTS}
    # The wrapper's own cost on the calling thread, where the engine's own work is smallest (0 B writes), in
    # the same placement: what the calling thread adds beyond it is the engine's polling while it waits.
    found["zero_length_call"] = thread_cost(b, rounds=max(rounds, 3), calls=400, shapes=("0 B sync write",))[
        "0 B sync write"]
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="700,2800", help="two or more paced rates, comma-separated")
    parser.add_argument("--metric-interval-ms", type=int, default=1000,
                        help="OTEL_METRIC_EXPORT_INTERVAL (0: unset, the SDK's default)")
    parser.add_argument("--placements", default=",".join(Placement.KINDS),
                        help=f"comma-separated, of {', '.join(Placement.KINDS)}")
    parser.add_argument("--quick", action="store_true", help="fewer rounds: a smoke run, not for quoting")
    parser.add_argument("--out", help="write the JSON here as well as to stdout")
    args = parser.parse_args()
    try:
        rates = sorted({int(r) for r in args.rates.split(",") if r.strip()})
    except ValueError:
        parser.error("--rates: whole numbers, comma-separated")
    if len(rates) < 2 or rates[0] <= 0 or rates[-1] > 20000:
        parser.error("--rates: two or more rates between 1 and 20,000 per second")
    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    if not placements or any(p not in Placement.KINDS for p in placements):
        parser.error(f"--placements: comma-separated, of {', '.join(Placement.KINDS)}")
    if args.metric_interval_ms < 0:
        parser.error("--metric-interval-ms: 0 (unset) or more")
    in_private_network()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("MC_FORCE_TCP", "1")
    from engine_cost import Bench, deployment_environment
    from otlp_receiver import ReceiverProcess

    rounds, seconds = (3, 1.0) if args.quick else (6, 2.0)
    otlp = ReceiverProcess()
    b = None
    try:
        env = deployment_environment("http/protobuf", otlp.endpoint("http"), "default", "default")
        if args.metric_interval_ms:
            os.environ["OTEL_METRIC_EXPORT_INTERVAL"] = env["OTEL_METRIC_EXPORT_INTERVAL"] = \
                str(args.metric_interval_ms)
        else:
            del os.environ["OTEL_METRIC_EXPORT_INTERVAL"]
            del env["OTEL_METRIC_EXPORT_INTERVAL"]
        b = Bench(otlp)
        placement = Placement(b, otlp)
        b.after_on = placement.apply
        b.on(), b.off()  # the first helper, connections, first exports: before anything is measured
        result = {"environment": env, "machine": machine(), "load_average_before": os.getloadavg()[0],
                  "placements": placements, "rates": rates,
                  "engine": "real Mooncake TransferEngine, TCP on 127.0.0.1, receiver in its own process",
                  "owners": OWNERS}
        for kind in placements:
            placement.place(kind)
            result[kind] = run(b, placement, rates, rounds, seconds)
            result[kind]["where_built"] = b.where
        placement.place("shared")
        result["load_average_after"] = os.getloadavg()[0]
    finally:
        stop_all(b, otlp)
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
