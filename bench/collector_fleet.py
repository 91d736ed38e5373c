"""Cost at fleet shape: the spans/s a Collector agent + gateway tier carries on this machine with N engines feeding
it, and the CPU of our instrumentation beside the Collectors'.

    python bench/collector_fleet.py [--engines 1,2,4] [--repeats 3] [--seconds 10] [--rooms-per-s 25]
                                    [--chunk-kib 256] [--out bench/results-collector-fleet.json]

Everything runs in one private network namespace (`unshare -rn`, loopback up): Jaeger, the gateway and the agent
from the shipped configs (bench/fleet_stack.py says what it merges over them), and N engines (bench/fleet_engine.py:
each a prefill process pushing real bytes over TCP on 127.0.0.1 to the decode process it spawns, both real
Mooncake engines instrumented by the package as a deployment is, exporting OTLP/gRPC to the agent). All N start,
warm up, then run --seconds of rooms together, then flush. Per run:

- spans made by the engines; accepted by the agent and by the gateway's routing tier, routed by its
  `loadbalancing` exporter; refused, failed and dropped, from the Collectors' own metrics (otelcol_*);
- CPU seconds of every process (its threads' /proc schedstat; /proc/<pid>/stat where a thread ended): the
  engines (prefill, decode), their builder helpers, the agent, the gateway and Jaeger (these three also less
  their idle rate, read for 5 s before the first run); inside each engine process, per thread (the engine's
  calling thread, its compute thread, Mooncake's and gRPC's native threads, our recorder thread, the SDK's);
- the machine's busy CPU over the run (/proc/stat) and what of it was outside this benchmark's processes.

Each N runs --repeats times (runs of different N alternate); the summary gives each figure's median beside its
spread (min-max over the repeats). After the last run the benchmark waits out the gateway's tail-sampling
decision and reads what reached Jaeger. Metric text read back is untrusted (bench/collector_metrics.py); any bad
input or failed part ends the run with one line, every started process stopped by its PID.
"""

import argparse
import datetime
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import cpu  # noqa: E402
from collector_metrics import BadExposition, fetch, label_values, total  # noqa: E402
from fleet_stack import (  # noqa: E402
    AGENT,
    DECISION_WAIT_S,
    GATEWAY,
    JAEGER,
    Stack,
    StackError,
    config_digests,
    find_binaries,
    version_of,
)
from support.observability.parts import start, stop_all  # noqa: E402  (fleet_stack put tests/ on the path)

DEFAULT_OUT = os.path.join(HERE, "results-collector-fleet.json")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
MAX_LINE = 64 << 10  # one line from an engine process
LIMITS = {"engines": (1, 8), "repeats": (1, 10), "seconds": (2.0, 60.0), "rooms_per_s": (0.0, 500.0),
          "chunk_kib": (4, 16384)}
START_TIMEOUT_S = 180  # N engines importing numpy, the SDK and Mooncake on a loaded 2-core machine
SETTLE_TIMEOUT_S = 20
IDLE_S = 5.0
ENGINE_PIDS = ("pid", "decode_pid", "helper_pid", "decode_helper_pid")


class FleetError(RuntimeError):
    """The benchmark cannot go on; the message is one line."""


# --- CPU from /proc ------------------------------------------------------------------------------------------

def cpu_reading(pid):
    """(ns on the CPU per live thread, the process's tick count in ns) of a process; None for no pid or one
    that is gone. Threads' schedstat counts nanoseconds: a Collector's run of a few hundred spans costs it a
    few clock ticks, too coarse for /proc/<pid>/stat alone."""
    if not pid:
        return None
    try:
        return cpu.threads_ns(int(pid)), cpu.ticks_ns(int(pid))
    except (OSError, ValueError, IndexError):
        return None


def cpu_used_s(before, after, main_thread_of=None) -> float:
    """CPU seconds between two readings: the threads' nanoseconds when every thread of the first reading is still
    there, else the tick counts (an ended thread took its schedstat with it). `main_thread_of`: that thread only."""
    if before is None or after is None:
        return 0.0
    (threads0, ticks0), (threads1, ticks1) = before, after
    if main_thread_of is not None:
        return max(threads1.get(main_thread_of, 0) - threads0.get(main_thread_of, 0), 0) / 1e9
    if set(threads0) <= set(threads1):
        return sum(ns - threads0.get(tid, 0) for tid, ns in threads1.items()) / 1e9
    return max(ticks1 - ticks0, 0) / 1e9


def machine_cpu_s() -> tuple:
    """(busy, stolen) CPU seconds of the whole machine so far, every core (/proc/stat's first line): busy is user,
    nice, system, irq and softirq; stolen is what the hypervisor gave to others while this machine wanted it."""
    with open("/proc/stat", encoding="ascii") as handle:
        fields = handle.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq) * TICK_S, steal * TICK_S


# --- the Collectors' own metrics ------------------------------------------------------------------------------

def collector_counts() -> dict:
    """The span counters of the agent, the gateway and Jaeger, now."""
    agent, gateway, jaeger = fetch(AGENT["telemetry"]), fetch(GATEWAY["telemetry"]), fetch(JAEGER["telemetry"])
    counts = {
        "agent_accepted": total(agent, "otelcol_receiver_accepted_spans", receiver="otlp"),
        "agent_refused": total(agent, "otelcol_receiver_refused_spans"),
        "agent_failed_receive": total(agent, "otelcol_receiver_failed_spans"),
        "agent_sent": total(agent, "otelcol_exporter_sent_spans"),
        "agent_send_failed": total(agent, "otelcol_exporter_send_failed_spans"),
        "agent_enqueue_failed": total(agent, "otelcol_exporter_enqueue_failed_spans"),
        "agent_metric_points": total(agent, "otelcol_receiver_accepted_metric_points"),
        "gateway_accepted": total(gateway, "otelcol_receiver_accepted_spans", receiver="otlp"),
        "gateway_refused": total(gateway, "otelcol_receiver_refused_spans"),
        "gateway_failed_receive": total(gateway, "otelcol_receiver_failed_spans"),
        "gateway_routed": total(gateway, "otelcol_exporter_sent_spans", exporter="loadbalancing"),
        "gateway_sampling_accepted": total(gateway, "otelcol_receiver_accepted_spans", receiver="otlp/sampling"),
        "gateway_to_jaeger": total(gateway, "otelcol_exporter_sent_spans", exporter="otlp_grpc/jaeger"),
        "gateway_send_failed": total(gateway, "otelcol_exporter_send_failed_spans"),
        "gateway_enqueue_failed": total(gateway, "otelcol_exporter_enqueue_failed_spans"),
        "jaeger_accepted": total(jaeger, "otelcol_receiver_accepted_spans"),
    }
    # the names this Collector version uses, so a renamed counter shows up as a missing one, not a silent zero
    counts["_receivers_seen"] = {"agent": label_values(agent, "otelcol_receiver_accepted_spans", "receiver"),
                                 "gateway": label_values(gateway, "otelcol_receiver_accepted_spans", "receiver")}
    return counts


def _delta(after: dict, before: dict) -> dict:
    return {k: round(after[k] - before[k]) for k in after if not k.startswith("_")}


# --- engine processes ---------------------------------------------------------------------------------------

class EngineProcess:
    """One bench/fleet_engine.py (prefill + its decode), its lines read on a thread of our own."""

    def __init__(self, index: int, args, env: dict, log_path: str):
        self.index = index
        self.log_path = log_path
        with open(log_path, "w", encoding="utf-8") as log:
            self.proc = start([sys.executable, os.path.join(HERE, "fleet_engine.py"), "--index", str(index),
                               "--seconds", str(args.seconds), "--rooms-per-s", str(args.rooms_per_s),
                               "--chunk-kib", str(args.chunk_kib)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                              cwd=ROOT)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name=f"engine-{index}-lines").start()

    def _read(self) -> None:
        while True:
            line = self.proc.stdout.readline(MAX_LINE)
            if not line:
                self.lines.put(None)
                return
            self.lines.put(line)

    def expect(self, kind: str, timeout_s: float) -> dict:
        """The JSON of the next `kind` line (other lines skipped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise FleetError(f"engine {self.index}: no {kind} within {timeout_s:.0f} s "
                                 f"({self.last_error()})") from None
            if line is None:
                raise FleetError(f"engine {self.index} ended before {kind} ({self.last_error()})")
            if line.startswith(kind + " "):
                try:
                    data = json.loads(line[len(kind) + 1:])
                except ValueError:
                    data = None
                if not isinstance(data, dict):
                    raise FleetError(f"engine {self.index}: its {kind} line is not a JSON object")
                return data

    def send(self, word: str) -> None:
        try:
            self.proc.stdin.write(word + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass

    def last_error(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as handle:
                lines = [line.strip() for line in handle.read()[-20_000:].splitlines() if line.strip()]
        except OSError:
            return "no log"
        ours = [line for line in lines if line.startswith("fleet_engine:")]
        return ((ours or lines or ["empty log"])[-1])[:300]


def _number(data: dict, key: str, what: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e15:
        raise FleetError(f"{what}: {key} is not a number in range")
    return float(value)


def _pid(data: dict, key: str, what: str):
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 22:
        raise FleetError(f"{what}: {key} is not a process id")
    return value


def _threads(data, what: str) -> dict:
    if not isinstance(data, dict):
        raise FleetError(f"{what}: no thread figures")
    return {k: _number(data, k, what) for k in ("engine_calling", "engine_compute", "recorder", "sdk", "native",
                                                "other_python", "ended", "process")}


def engine_environment(index: int) -> dict:
    """OTEL_* as a deployment sets them (the SDK's OTLP/gRPC exporters to the agent); nothing else of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp", "OTEL_LOGS_EXPORTER": "none",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{AGENT['otlp_grpc']}",
                "OTEL_METRIC_EXPORT_INTERVAL": "5000", "MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "ERROR",
                # the forward pass's numpy on one thread: BLAS threads spinning on 2 cores would be the run
                "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)})
    return env


# --- one run ----------------------------------------------------------------------------------------------------

def _settled(counts: dict, made: int = 0, before=None) -> bool:
    """The agent has the spans the engines made (when `before` is given: since then), it has sent all it
    accepted, and the gateway has routed all the agent sent."""
    d = _delta(counts, before) if before is not None else counts
    return (d["agent_accepted"] >= made and d["agent_sent"] >= d["agent_accepted"]
            and d["gateway_routed"] >= d["agent_sent"])


def _wait_settled(made: int = 0, before=None) -> dict:
    """The counters once settled, or at the bound (what is missing then is reported as such)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        now = collector_counts()
        if _settled(now, made, before) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def idle_rates(stack: Stack, seconds: float = IDLE_S) -> dict:
    """CPU seconds per second of each Collector part with nothing sent to it (its timers, health, self-metrics)."""
    pids = stack.pids()
    before = {part: cpu_reading(pid) for part, pid in pids.items()}
    time.sleep(seconds)
    return {part: round(cpu_used_s(before[part], cpu_reading(pid)) / seconds, 5) for part, pid in pids.items()}


def run_once(stack: Stack, n: int, args, workdir: str, number: int, idle: dict) -> dict:
    engines = []
    launched = time.monotonic()
    try:
        for index in range(n):
            engines.append(EngineProcess(index, args, engine_environment(index),
                                         os.path.join(workdir, f"run{number}-engine{index}.log")))
        ready = [e.expect("READY", START_TIMEOUT_S) for e in engines]
        start_s = time.monotonic() - launched
        pids = [{k: _pid(r, k, f"engine {i} READY") for k in ENGINE_PIDS} for i, r in enumerate(ready)]
        stack_pids = stack.pids()
        load_before = os.getloadavg()
        counts_before = _wait_settled()  # the warm-up's spans through the tier before the clock starts
        machine_before, own_before = machine_cpu_s(), time.process_time()
        stack_before = {part: cpu_reading(pid) for part, pid in stack_pids.items()}
        engine_before = [{k: cpu_reading(p) for k, p in e.items()} for e in pids]
        started = time.monotonic()
        for e in engines:
            e.send("go")
        ran = [e.expect("RAN", args.seconds + 120) for e in engines]
        ran_s = time.monotonic() - started
        engine_after = [{k: cpu_reading(p) for k, p in e.items()} for e in pids]
        made = 0
        for i, r in enumerate(ran):
            made += int(_number(r, "spans_made", f"engine {i} RAN"))
            for key in ("helper_pid", "decode_helper_pid"):
                if _pid(r, key, f"engine {i} RAN") != pids[i][key]:
                    raise FleetError(f"engine {i}: its builder helper changed during the run (one died)")
        counts_after = _wait_settled(made, counts_before)
        settled_s = time.monotonic() - started
        stack_after = {part: cpu_reading(pid) for part, pid in stack_pids.items()}
        machine_after, own_after = machine_cpu_s(), time.process_time()
        load_after = os.getloadavg()
        for e in engines:
            e.send("exit")
        for e in engines:
            try:
                e.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
    finally:
        stop_all([e.proc for e in engines])
    engine_cpu = [{k: round(cpu_used_s(engine_before[i][k], engine_after[i][k]), 4) for k in ENGINE_PIDS}
                  for i in range(n)]
    helper_build = [sum(cpu_used_s(engine_before[i][k], engine_after[i][k], pids[i][k])
                        for k in ("helper_pid", "decode_helper_pid") if pids[i][k]) for i in range(n)]
    stack_cpu = {part: round(cpu_used_s(stack_before[part], stack_after[part]), 4) for part in stack_pids}
    machine_used = [b - a for a, b in zip(machine_before, machine_after)]
    figures = _figures(n, ran, made, ran_s, settled_s, _delta(counts_after, counts_before), counts_after, stack_cpu,
                       idle, engine_cpu, helper_build, machine_used, own_after - own_before, load_before, load_after)
    figures["engines_ready_s"] = round(start_s, 1)  # N engines started and warmed up
    return figures


def _figures(n, ran, made, ran_s, settled_s, counts, counts_after, stack_cpu, idle, engine_cpu, helper_build,
             machine_s, own_s, load_before, load_after) -> dict:
    per_engine = []
    for i, r in enumerate(ran):
        cpu = engine_cpu[i]
        per_engine.append({
            "rooms": int(_number(r, "rooms", f"engine {i} RAN")), "seconds": _number(r, "seconds", "RAN"),
            "spans_made": int(_number(r, "spans_made", "RAN")), "bytes": int(_number(r, "bytes", "RAN")),
            "failed_transfers": int(_number(r, "failed_transfers", "RAN")),
            "cpu_s": {"prefill": cpu["pid"], "decode": cpu["decode_pid"], "prefill_helper": cpu["helper_pid"],
                      "decode_helper": cpu["decode_helper_pid"]},
            "helper_build_s": round(helper_build[i], 4),
            "prefill_threads": _threads(r.get("threads"), f"engine {i} RAN"),
            "decode_threads": _threads(r.get("decode_threads"), f"engine {i} RAN"),
            "native_by_name": r.get("threads", {}).get("native_by_name", {})})
    ours = sum(e["prefill_threads"]["recorder"] + e["decode_threads"]["recorder"] + e["cpu_s"]["prefill_helper"]
               + e["cpu_s"]["decode_helper"] for e in per_engine)
    helpers = sum(e["cpu_s"]["prefill_helper"] + e["cpu_s"]["decode_helper"] for e in per_engine)
    engines_own = sum(e["prefill_threads"][k] + e["decode_threads"][k] for e in per_engine
                      for k in ("engine_calling", "engine_compute", "native"))
    calling = sum(e["prefill_threads"]["engine_calling"] + e["decode_threads"]["engine_calling"]
                  for e in per_engine)
    sdk_in_engine = sum(e["prefill_threads"]["sdk"] + e["decode_threads"]["sdk"] for e in per_engine)
    bench_processes = (sum(sum(e["cpu_s"].values()) for e in per_engine) + sum(stack_cpu.values()) + own_s)
    seconds = statistics.mean(e["seconds"] for e in per_engine)
    accepted = counts["agent_accepted"]
    per_k = (lambda cpu_s: round(cpu_s * 1e6 / accepted, 1)) if accepted else (lambda cpu_s: None)
    above_idle = {part: max(stack_cpu.get(part, 0.0) - idle.get(part, 0.0) * settled_s, 0.0)
                  for part in ("agent", "gateway", "jaeger")}
    return {
        "engines": n, "rooms": sum(e["rooms"] for e in per_engine), "spans_made": made,
        "bytes_moved": sum(e["bytes"] for e in per_engine),
        "failed_transfers": sum(e["failed_transfers"] for e in per_engine),
        "run_s": round(seconds, 3), "go_to_flushed_s": round(ran_s, 3), "go_to_settled_s": round(settled_s, 3),
        "spans_made_per_s": round(made / seconds, 1),
        "agent_accepted_per_s": round(accepted / ran_s, 1),
        "gateway_routed_per_s": round(counts["gateway_routed"] / ran_s, 1),
        "spans_lost_before_agent": made - accepted,
        "refused_or_failed": {k: v for k, v in counts.items() if k.endswith(("refused", "failed", "failed_receive"))},
        "counts": counts, "receivers_seen": counts_after["_receivers_seen"],
        "cpu_s": {"agent": stack_cpu.get("agent"), "gateway": stack_cpu.get("gateway"),
                  "jaeger": stack_cpu.get("jaeger"), "ours": round(ours, 3), "ours_helpers": round(helpers, 3),
                  "ours_recorder_threads": round(ours - helpers, 3), "engines_own": round(engines_own, 3),
                  "engines_calling_threads": round(calling, 3),
                  "sdk_threads_in_engines": round(sdk_in_engine, 3), "benchmark_itself": round(own_s, 3)},
        "cpu_us_per_span": {"agent": per_k(stack_cpu.get("agent", 0.0)),
                            "gateway": per_k(stack_cpu.get("gateway", 0.0)), "ours": per_k(ours),
                            "ours_helpers": per_k(helpers), "ours_recorder_threads": per_k(ours - helpers),
                            "engines_calling_threads": per_k(calling), "engines_own": per_k(engines_own)},
        # the Collectors' CPU less what they use idle over the same time (timers, health, their own metrics)
        "cpu_us_per_span_above_idle": {part: per_k(v) for part, v in above_idle.items()},
        "machine": {"busy_cpu_s": round(machine_s[0], 2), "stolen_cpu_s": round(machine_s[1], 2),
                    "outside_benchmark_cpu_s": round(machine_s[0] - bench_processes, 2),
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in load_after]},
        "per_engine": per_engine,
    }


# --- summary ---------------------------------------------------------------------------------------------------

SUMMARY = {  # figure -> how to read it from a run
    "spans_made_per_s": lambda r: r["spans_made_per_s"],
    "agent_accepted_per_s": lambda r: r["agent_accepted_per_s"],
    "gateway_routed_per_s": lambda r: r["gateway_routed_per_s"],
    "spans_lost_before_agent": lambda r: r["spans_lost_before_agent"],
    "refused_or_failed": lambda r: sum(r["refused_or_failed"].values()),
    "agent_cpu_s": lambda r: r["cpu_s"]["agent"],
    "gateway_cpu_s": lambda r: r["cpu_s"]["gateway"],
    "jaeger_cpu_s": lambda r: r["cpu_s"]["jaeger"],
    "ours_cpu_s": lambda r: r["cpu_s"]["ours"],
    "engines_own_cpu_s": lambda r: r["cpu_s"]["engines_own"],
    "agent_us_per_span": lambda r: r["cpu_us_per_span"]["agent"],
    "gateway_us_per_span": lambda r: r["cpu_us_per_span"]["gateway"],
    "agent_us_per_span_above_idle": lambda r: r["cpu_us_per_span_above_idle"]["agent"],
    "gateway_us_per_span_above_idle": lambda r: r["cpu_us_per_span_above_idle"]["gateway"],
    "jaeger_us_per_span_above_idle": lambda r: r["cpu_us_per_span_above_idle"]["jaeger"],
    "ours_us_per_span": lambda r: r["cpu_us_per_span"]["ours"],
    "ours_helpers_us_per_span": lambda r: r["cpu_us_per_span"]["ours_helpers"],
    "ours_recorder_threads_us_per_span": lambda r: r["cpu_us_per_span"]["ours_recorder_threads"],
    "engines_calling_threads_us_per_span": lambda r: r["cpu_us_per_span"]["engines_calling_threads"],
    "engines_own_us_per_span": lambda r: r["cpu_us_per_span"]["engines_own"],
    "ours_cpu_s_per_s": lambda r: round(r["cpu_s"]["ours"] / r["go_to_flushed_s"], 4),
    "collectors_cpu_s_per_s": lambda r: round((r["cpu_s"]["agent"] + r["cpu_s"]["gateway"]) / r["go_to_settled_s"], 4),
    "engines_ready_s": lambda r: r["engines_ready_s"],
    "outside_benchmark_cpu_s": lambda r: r["machine"]["outside_benchmark_cpu_s"],
    "stolen_cpu_s": lambda r: r["machine"].get("stolen_cpu_s"),
}


def summarize(runs: list) -> dict:
    """Per N: each figure's median, min and max over the repeats."""
    out = {}
    for n in sorted({r["engines"] for r in runs}):
        mine = [r for r in runs if r["engines"] == n]
        figures = {}
        for name, read in SUMMARY.items():
            values = [v for v in (read(r) for r in mine) if v is not None]
            if values:
                figures[name] = {"median": round(statistics.median(values), 2), "min": min(values),
                                 "max": max(values)}
        out[str(n)] = {"repeats": len(mine), **figures}
    return out


def _cell(figure: dict, digits: int = 0) -> str:
    if not figure:
        return "-"
    return (f"{figure['median']:,.{digits}f} ({figure['min']:,.{digits}f}-{figure['max']:,.{digits}f})")


def table(summary: dict) -> str:
    lines = ["| engines | spans/s made | agent accepted/s | gateway routed/s | lost, refused, failed | "
             "agent CPU us/span (above idle) | gateway CPU us/span (above idle) | ours CPU us/span | "
             "engines' own CPU us/span |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, s in summary.items():
        lost = s.get("spans_lost_before_agent", {}).get("max", 0) + s.get("refused_or_failed", {}).get("max", 0)
        lines.append(f"| {n} | {_cell(s.get('spans_made_per_s'))} | {_cell(s.get('agent_accepted_per_s'))} "
                     f"| {_cell(s.get('gateway_routed_per_s'))} | {lost:,.0f} "
                     f"| {_cell(s.get('agent_us_per_span_above_idle'), 1)} "
                     f"| {_cell(s.get('gateway_us_per_span_above_idle'), 1)} "
                     f"| {_cell(s.get('ours_us_per_span'), 1)} | {_cell(s.get('engines_own_us_per_span'), 1)} |")
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------------------------

def _arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="1,2,4", help="comma-separated engine counts (each 1-8)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine count (1-10)")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of rooms per run (2-60)")
    parser.add_argument("--rooms-per-s", type=float, default=25.0,
                        help="rooms each engine starts per second (0: as fast as they go; at most 500)")
    parser.add_argument("--chunk-kib", type=int, default=256, help="KiB of KV per chunk and destination (4-16384)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="the results file (JSON)")
    args = parser.parse_args()
    try:
        args.engine_counts = [int(x) for x in args.engines.split(",") if x.strip()]
    except ValueError:
        parser.error("--engines: comma-separated whole numbers")
    low, high = LIMITS["engines"]
    if not args.engine_counts or len(args.engine_counts) > 6 or any(not low <= n <= high for n in
                                                                    args.engine_counts):
        parser.error(f"--engines: 1 to 6 counts, each {low}-{high}")
    for name in ("repeats", "seconds", "rooms_per_s", "chunk_kib"):
        low, high = LIMITS[name]
        if not low <= getattr(args, name) <= high:
            parser.error(f"--{name.replace('_', '-')}: {low}-{high}")
    return args


def _git_head() -> str:
    """The checkout's commit, and whether its tree differs from it (the configs and the package included)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=ROOT, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=30, cwd=ROOT, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (head[:40] or "unknown") + (" with uncommitted changes" if dirty else "")


def _on_sigterm(signum, frame):
    raise SystemExit(f"collector_fleet: stopped by signal {signum}")


def main() -> int:
    args = _arguments()
    from common import in_private_network, machine, write_json

    in_private_network()
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        binaries = find_binaries()
    except StackError as exc:
        print(f"collector_fleet: {exc}", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="kvt-collector-fleet-")
    stack = Stack(binaries, workdir)
    order = [n for _ in range(args.repeats) for n in args.engine_counts]  # runs of each N alternate
    results = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "command": " ".join(["python bench/collector_fleet.py", *sys.argv[1:]]),
               "machine": machine(), "binaries": {part: version_of(path) for part, path in binaries.items()},
               "configs_sha256": config_digests(), "git_head": _git_head(),
               "settings": {"engines": args.engine_counts, "repeats": args.repeats, "seconds": args.seconds,
                            "rooms_per_s_per_engine": args.rooms_per_s, "chunk_kib": args.chunk_kib,
                            "protocol": "grpc", "builder": "the package's default (a helper process per engine "
                                                           "process)",
                            "shape": "N x (prefill -> decode, real Mooncake over TCP on 127.0.0.1) -> agent "
                                     "(collector/agent.yaml) -> gateway (collector/gateway.yaml: loadbalancing, "
                                     "tail_sampling) -> Jaeger (collector/jaeger.yaml); Tempo not run"},
               "load_average_start": [round(x, 2) for x in os.getloadavg()], "runs": []}
    began = time.monotonic()
    try:
        stack.start()
        idle = results["collector_idle_cpu_s_per_s"] = idle_rates(stack)
        for number, n in enumerate(order, 1):
            run = run_once(stack, n, args, workdir, number, idle)
            results["runs"].append(run)
            print(f"collector_fleet: run {number}/{len(order)}: {n} engine(s), {run['spans_made_per_s']:,.0f} "
                  f"spans/s made, agent {run['agent_accepted_per_s']:,.0f}/s, gateway "
                  f"{run['gateway_routed_per_s']:,.0f}/s, lost {run['spans_lost_before_agent']}, CPU s: "
                  f"agent {run['cpu_s']['agent']}, gateway {run['cpu_s']['gateway']}, ours {run['cpu_s']['ours']}",
                  file=sys.stderr, flush=True)
        time.sleep(DECISION_WAIT_S + 3)  # the gateway's last tail-sampling decisions, exported to Jaeger
        final = collector_counts()
        results["session"] = {k: round(final[k]) for k in ("gateway_routed", "gateway_sampling_accepted",
                                                           "gateway_to_jaeger", "jaeger_accepted",
                                                           "gateway_send_failed", "gateway_enqueue_failed")}
        for part in ("agent", "gateway", "jaeger"):
            stack.alive(part)
    except (FleetError, StackError, BadExposition) as exc:
        print(f"collector_fleet: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("collector_fleet: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    finally:
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    results["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    results["wall_s"] = round(time.monotonic() - began, 1)
    results["summary"] = summarize(results["runs"])
    write_json(args.out, results)
    print(table(results["summary"]))
    print(f"collector_fleet: wrote {os.path.relpath(args.out, ROOT)} in {results['wall_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
