"""Run every benchmark, each in a fresh process, and write bench/results.json and bench/RESULTS.md.

    python bench/run_all.py            # the full run (~30 minutes on 2 cores)
    python bench/run_all.py --quick    # a smoke run with fewer rounds: its figures are not for quoting
    python bench/run_all.py --only engine_threads_1s   # those again, into the results.json already there

Nothing here passes or fails: the figures are written down with the machine they were measured on (and its load
average), beside the goals, and each goal is marked met, NOT met, or within the noise of the same run. The cost
to the engine is measured as a deployment pays it (real OTLP exporters set up from OTEL_*, to a receiver process
on 127.0.0.1), in the default configuration over OTLP/HTTP and OTLP/gRPC, and with the previous pipeline
(OTEL_KVTRANSFER_PIPELINE=sdk, OTEL_KVTRANSFER_BUILDER=thread) as the "before" beside them. Runs inside a network
namespace of its own (Mooncake's handshake listener binds all interfaces).
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import in_private_network, machine, write_json

# name -> (script, arguments); the cost runs first, each in a process of its own
SCRIPTS = {
    "engine_cost_http": ("engine_cost", ["--protocol", "http/protobuf"]),
    "engine_cost_grpc": ("engine_cost", ["--protocol", "grpc", "--parts", "process,builder"]),
    "engine_cost_before": ("engine_cost", ["--protocol", "http/protobuf", "--pipeline", "sdk", "--builder", "thread",
                                           "--parts", "process,builder"]),
    "engine_threads_1s": ("engine_threads", []),
    "engine_threads_default": ("engine_threads", ["--metric-interval-ms", "0", "--placements", "shared"]),
    # vLLM's own per-transfer telemetry beside ours: in the vLLM virtualenv (it needs vLLM), skipped without one
    "vllm_anchor": ("engine_cost", ["--parts", "anchor"], "vllm"),
    "pipeline": ("pipeline", []), "memory": ("memory", []), "truth": ("truth", []), "eviction": ("eviction", []),
    # the builder against 59be0ed's (before busy time, set-up, late completion, string repair, span limits)
    "builder_before": ("builder_before", []),
    # where goals 3 and 4 stop: the wrapper's steps and the builder's parts (stand-in engine, labelled so)
    "wrapper_floor": ("wrapper_floor", []), "profile_builder": ("profile_builder", []),
}
BENCHES = list(SCRIPTS)
COST_RUNS = {"engine_cost_http": "OTLP/HTTP protobuf, default configuration",
             "engine_cost_grpc": "OTLP/gRPC, default configuration",
             "engine_cost_before": "before: OTEL_KVTRANSFER_PIPELINE=sdk, OTEL_KVTRANSFER_BUILDER=thread, OTLP/HTTP"}
GOALS = {"total_cpu_us": 20.0, "engine_cpu_us": 5.0, "builder_per_s": 100_000, "thread_added_us": 2.0,
         "neighbour_slowdown": 0.01, "capacity_per_s": 20_000, "truth_error": 0.02, "eviction_ratio": 2.0,
         "ours_marginal_us": 2.0, "ours_idle_us_per_s": 1000.0, "calling_zero_length_us": 1.0,
         "helper_marginal_us": 15.0}
THREAD_RUNS = {"engine_threads_1s": "metrics every 1 s", "engine_threads_default": "the SDK's default metric interval"}
OWNER_LABELS = {"calling": "the calling thread", "recorder": "our recorder thread", "sdk": "the SDK's export threads",
                "mooncake": "Mooncake's own threads", "python_other": "the bench's main thread (its flushes)",
                "ended": "threads that ended in the round", "engine_process": "**the engine process**",
                "helper": "the helper process (beside the engine)",
                "helper_builder": "of it, its builder (the main thread)",
                "helper_export": "of it, its export threads (the SDK's)",
                "calling_wall_in_calls": "wall time inside the engine calls (not CPU)"}
OWNERS_IN_ENGINE = ("calling", "recorder", "sdk", "mooncake", "python_other", "ended")
PLACEMENT_LABELS = {"shared": "as scheduled", "apart": "engine on a core of its own",
                    "receiver_alone": "receiver on a core of its own"}


def _vllm_python() -> str:
    """The vLLM virtualenv's interpreter (scripts/setup-vllm.sh builds it), where vLLM is importable."""
    venv = os.environ.get("KVT_VLLM_VENV") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "otel-kvtransfer", "vllm-venv")
    return os.path.join(venv, "bin", "python")


def _run_one(name: str, quick: bool) -> dict:
    script, extra, *where = SCRIPTS[name]
    python = _vllm_python() if where == ["vllm"] else sys.executable
    if not os.access(python, os.X_OK):
        print(f"bench: {name} skipped: no vLLM virtualenv ({python}; bash scripts/setup-vllm.sh)", file=sys.stderr)
        return {"skipped": "no vLLM virtualenv (bash scripts/setup-vllm.sh builds it)",
                "load_average_1min_before_after": [round(os.getloadavg()[0], 2)] * 2}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{name}.json")
        cmd = [python, os.path.join(HERE, f"{script}.py"), "--out", out] + extra
        cmd += ["--quick"] if quick else []
        env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"))
        if where == ["vllm"]:  # that virtualenv measures this checkout's package, whatever copy it holds itself
            env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(HERE), env.get("PYTHONPATH")) if p)
        load_before = os.getloadavg()[0]
        start = time.monotonic()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
        elapsed = time.monotonic() - start
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"bench/{script}.py ({name}) failed with exit code {proc.returncode}")
        with open(out, encoding="utf-8") as handle:
            result = json.load(handle)
    result["wall_s"] = round(elapsed, 1)
    result["stderr_lines"] = _distinct_lines(proc.stderr)
    # Other processes on the machine (another developer's tests, say) add noise: say how busy it was.
    result["load_average_1min_before_after"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(f"bench: {name} done in {elapsed:.0f} s", file=sys.stderr)
    return result


def _distinct_lines(text: str, keep: int = 40) -> list:
    """What a benchmark said on stderr (a helper's warnings land there too): distinct lines without their
    timestamps, most frequent first, bounded; [count, line]."""
    counts = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("{", "}", '"')):
            continue
        # glog lines start "E1130 20:56:52.384230 10616 file.cpp:1098]": drop the time and thread id
        head, _, rest = line.partition("]")
        key = (head.split()[0][:1] + " " + head.split()[-1] + "]" + rest) if rest and head[:1] in "IWEF" \
            and len(head.split()) >= 3 else line
        key = key[:300]
        counts[key] = counts.get(key, 0) + 1
    return [[n, line] for line, n in sorted(counts.items(), key=lambda kv: -kv[1])[:keep]]


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _against_noise(pairs, goal) -> str:
    """(figure, A/A) pairs against an upper bound: met only when the figure is within it AND the noise is small
    enough to tell; NOT met when the figure exceeds it by more than the noise; otherwise within noise."""
    verdicts = []
    for figure, noise in pairs:
        if figure <= goal and abs(noise) <= goal:
            verdicts.append("met")
        elif figure > goal + abs(noise):
            verdicts.append("NOT met")
        else:
            verdicts.append("within noise")
    if "NOT met" in verdicts:
        return "NOT met"
    return "met" if all(v == "met" for v in verdicts) else "within noise"


def _thread_noise(shape: dict) -> float:
    """A calling-thread figure's noise: the larger of its median A/A and the median size of one round's A/A
    difference (a shape whose rounds swing by hundreds of us, Mooncake polling inside, can have a median A/A
    near 0: that is luck, not precision). Results written before the rounds were kept: the median A/A."""
    rounds = shape.get("aa_thread_cpu_us_rounds")
    typical = statistics.median(abs(x) for x in rounds) if rounds else 0.0
    return max(abs(shape["aa_thread_cpu_us"]), typical)


def _cost_summary(cost: dict) -> dict:
    """One cost run's goals: figures, their A/A noise, verdicts."""
    out = {"where_built": None}
    p = cost.get("process")
    if p:
        out.update({
            "where_built": p["where_built"],
            "total_cpu_us": p["added_total_cpu_us"], "total_aa_us": p["aa_total_cpu_us"],
            "engine_cpu_us": p["added_engine_cpu_us"], "engine_aa_us": p["aa_engine_cpu_us"],
            "total_verdict": _against_noise([(p["added_total_cpu_us"], p["aa_total_cpu_us"])], GOALS["total_cpu_us"])
            if p["send_spans_received"] == p["transfers_made_on"] == p["size_count_received"] else "NOT met",
            "process_spans_received": p["send_spans_received"], "process_transfers_on": p["transfers_made_on"],
            "process_size_count": p["size_count_received"],
            "engine_verdict": _against_noise([(p["added_engine_cpu_us"], p["aa_engine_cpu_us"])],
                                             GOALS["engine_cpu_us"])})
    builder = cost.get("builder_alone")
    if builder:
        default = builder["default_queue"]
        out.update({"builder_per_s": default["records_per_cpu_s"], "builder_dropped": default["dropped"],
                    "builder_records": default["records"],
                    "builder_verdict": _verdict(default["records_per_cpu_s"] >= GOALS["builder_per_s"]
                                                and default["dropped"] == 0)})
        big = builder.get("queue_holds_backlog")
        if big:
            out.update({"builder_big_queue_per_s": big["records_per_cpu_s"], "builder_big_queue_dropped":
                        big["dropped"], "builder_big_queue_size": big["bsp_max_queue_size"]})
    thread = cost.get("thread")
    if thread and all("aa_thread_cpu_us_rounds" in v for v in thread.values()):
        out["thread_noise_us"] = {shape: _thread_noise(v) for shape, v in thread.items()}
    if thread:
        out.update({
            "thread_added_us": {shape: v["added_thread_cpu_us"] for shape, v in thread.items()},
            "thread_aa_us": {shape: v["aa_thread_cpu_us"] for shape, v in thread.items()},
            "thread_verdict": _against_noise([(v["added_thread_cpu_us"], _thread_noise(v))
                                              for v in thread.values()], GOALS["thread_added_us"])})
    neighbour = cost.get("neighbour")
    if neighbour:
        out.update({"neighbour_slowdown": neighbour["slowdown"]["median"],
                    "neighbour_aa": neighbour["slowdown_aa"]["median"],
                    "neighbour_verdict": _against_noise([(neighbour["slowdown"]["median"],
                                                          neighbour["slowdown_aa"]["median"])],
                                                        GOALS["neighbour_slowdown"])})
    a = cost["agreement"]
    out.update({"spans_complete": a["spans_complete"], "metrics_agree": a["metrics_agree"],
                "transfers_made": a["transfers_made_instrumented"], "sends_received": a["send_spans_received"],
                "size_count": a["size_histogram_count"]})
    return out


def _threads_summary(run: dict) -> dict:
    """Goals 2, 3 and 4 (the helper's part) of the attribution run, per placement: figure, A/A, verdict."""
    out = {}
    for kind in run["placements"]:
        x = run[kind]
        marginal, idle, zero = x["marginal_us_per_transfer"]["ours_in_engine"], x["idle"]["recorder"], \
            x["zero_length_call"]
        helper = x["marginal_us_per_transfer"]["helper"]
        out[kind] = {
            "ours_marginal_us": marginal["median"], "ours_marginal_aa": marginal["aa"],
            "ours_marginal_verdict": _against_noise([(marginal["median"], marginal["aa"])], GOALS["ours_marginal_us"])
            if marginal["median"] is not None else "not measured (the higher rate was not reached)",
            "ours_idle_us_per_s": idle["added"], "ours_idle_aa": idle["aa"],
            "ours_idle_verdict": _against_noise([(idle["added"], idle["aa"])], GOALS["ours_idle_us_per_s"]),
            "calling_zero_length_us": zero["added_thread_cpu_us"], "calling_zero_length_aa": zero["aa_thread_cpu_us"],
            "calling_zero_length_verdict": _against_noise([(zero["added_thread_cpu_us"], _thread_noise(zero))],
                                                          GOALS["calling_zero_length_us"]),
            **({"calling_zero_length_noise": _thread_noise(zero)} if "aa_thread_cpu_us_rounds" in zero else {}),
            "calling_waits_per_block": zero.get("waits_per_block"), "calling_block": zero.get("calls_per_block"),
            "helper_marginal_us": helper["median"], "helper_marginal_aa": helper["aa"],
            "helper_marginal_rounds": [helper["min"], helper["max"]],
            "helper_builder_us": x["marginal_us_per_transfer"].get("helper_builder", {}).get("median"),
            "helper_export_us": x["marginal_us_per_transfer"].get("helper_export", {}).get("median"),
            "helper_marginal_verdict": _against_noise([(helper["median"], helper["aa"])], GOALS["helper_marginal_us"])
            if helper["median"] is not None else "not measured (the higher rate was not reached)"}
    return out


def summary(results: dict) -> dict:
    pipe, mem, truth, evict = (results[k] for k in ("pipeline", "memory", "truth", "eviction"))
    growth = mem["rss_after_warmup_mib"]["growth"]
    return {
        "cost": {name: _cost_summary(results[name]) for name in COST_RUNS},
        "threads": {name: _threads_summary(results[name]) for name in THREAD_RUNS},
        "capacity_per_s": pipe["sustained_capacity_per_s"],
        "capacity_goal_met": pipe["sustained_capacity_per_s"] >= GOALS["capacity_per_s"],
        "overload_accounted": pipe["overload"]["accounted"] and pipe["overload"]["wrong_return_values"] == 0,
        "rss_growth_mib_after_warmup": growth,
        "rss_flat": abs(growth) < 5.0,
        "truth_worst_median_error": truth["per_transfer_worst_median_abs_error"],
        "truth_worst_error": truth["per_transfer_worst_abs_error"],
        "truth_goal_met": truth["per_transfer_worst_median_abs_error"] <= GOALS["truth_error"],
        "truth_median_error_by_bytes": {size: v["median_error"] for size, v in truth["per_transfer"].items()},
        "eviction_tick_ratio": evict["tick_ratio_100k_over_1k"],
        "eviction_open_ratio": evict["open_when_full_ratio_100k_over_1k"],
        "eviction_goal_met": max(evict["tick_ratio_100k_over_1k"],
                                 evict["open_when_full_ratio_100k_over_1k"]) <= GOALS["eviction_ratio"],
    }


def _labels(text: str) -> str:
    """A receiver's attribute-set label ('{"k": "v"}') as `v` values, for a table."""
    try:
        return "/".join(str(v) for v in json.loads(text).values()) or "-"
    except (ValueError, AttributeError):
        return text[:80]


def _cost_section(cost: dict, title: str) -> list:
    lines = [title, "", f"Exporters: {cost['exporters']}. Environment: "
             + ", ".join(f"`{k}={v}`" for k, v in cost["environment"].items()
                         if k != "OTEL_EXPORTER_OTLP_ENDPOINT") + ".", ""]
    p = cost.get("process")
    if p:
        h = p["helper_cpu_us_on"]
        lines += [f"- CPU per transfer, one thread making paced 64 KiB real writes at {p['paced_rate_per_s']}/s "
                  f"({p['rounds']} rounds of {p['round_s']:g} s per mode; spans built "
                  f"{'in a helper process' if p['where_built'] == 'process' else 'in the engine process'}): "
                  f"engine process off {p['engine_cpu_us_off']['median']:.1f} us, on "
                  f"{p['engine_cpu_us_on']['median']:.1f} us: **added {p['added_engine_cpu_us']:+.1f} us** "
                  f"(A/A {p['aa_engine_cpu_us']:+.1f}); helper processes {h['median']:.1f} us "
                  f"(rounds {h['min']:.1f} .. {h['max']:.1f}); **added in total {p['added_total_cpu_us']:+.1f} us** "
                  f"(A/A {p['aa_total_cpu_us']:+.1f}; rounds "
                  + ", ".join(f"{x:+.0f}" for x in p["added_total_cpu_us_rounds"]) + ")."]
        lines.append(f"- In these rounds the receiver got {p['send_spans_received']:,} kv_transfer.send spans of "
                     f"{p['transfers_made_on']:,} transfers made while instrumented; kv_transfer.size counted "
                     f"{p['size_count_received']:,}.")
        if p["rounds_counted_in_ticks"] or p["processes_ended_mid_round"]:
            lines.append(f"- {p['rounds_counted_in_ticks']} process-rounds counted in clock ticks (a thread "
                         f"ended), {p['processes_ended_mid_round']} processes ended mid-round (not counted).")
    thread = cost.get("thread")
    if thread:
        lines += ["", "| engine call | uninstrumented us per call | added on the calling thread: CPU us (A/A) "
                  "| added wall us (A/A) |", "|---|---:|---:|---:|"]
        for shape, v in thread.items():
            lines.append(f"| {shape} | {v['off_us_per_call']:.1f} | {v['added_thread_cpu_us']:+.2f} "
                         f"({v['aa_thread_cpu_us']:+.2f}) | {v['added_wall_us']:+.1f} ({v['aa_wall_us']:+.1f}) |")
        lines.append("")
    builder = cost.get("builder_alone")
    if builder:
        for label, b in (("as deployed", builder["default_queue"]),
                         ("span queue holding the backlog", builder.get("queue_holds_backlog"))):
            if not b:
                continue
            where = ("the helper process's CPU" if b["where_built"] == "process"
                     else "the engine process's Python threads' CPU")
            lines.append(
                f"- Builder alone, {label} (OTEL_BSP_MAX_QUEUE_SIZE {b['bsp_max_queue_size']:,}): {b['records']:,} "
                f"queued records built and exported over OTLP: **{b['records_per_cpu_s']:,.0f} records/s** of "
                f"{where} ({b['cpu_us_per_record']:.1f} us each; {b['records_per_wall_s']:,.0f}/s of wall time); "
                f"spans received {b['spans_received']:,}, **dropped {b['dropped']:,}**"
                + (f"; handing them over cost the engine process {b['handoff_cpu_us_per_record']:.2f} us each"
                   if b["handoff_cpu_us_per_record"] is not None else "")
                + (f"; the helper's main thread {b['helper_main_us_per_record']:.1f} us a record (unpickling "
                   f"{b['unpickle_us_per_record']:.2f} of it), its other threads {b['helper_other_us_per_record']:.1f}"
                   if b.get("helper_main_us_per_record") is not None else "") + ".")
    n = cost.get("neighbour")
    if n:
        lines.append(f"- A CPU-bound Python thread beside real 8 B transfers at 1,000/s slows by "
                     f"**{n['slowdown']['median']:+.1%}** (rounds {n['slowdown']['min']:+.1%} .. "
                     f"{n['slowdown']['max']:+.1%}; A/A {n['slowdown_aa']['median']:+.1%})"
                     + (f"; the transfers reached {n['transfers_per_s_achieved']['median']:,.0f}/s beside it."
                        if n.get("transfers_per_s_achieved") else "."))
    noted = [f"{n} x `{line[:160]}`" for n, line in cost.get("stderr_lines", [])
             if "otel" in line.lower() or "queue full" in line.lower()]
    if noted:
        lines.append("- Said on stderr (this process and its helpers): " + "; ".join(noted[:6]) + ".")
    a = cost["agreement"]
    sends, made, size = a["send_spans_received"], a["transfers_made_instrumented"], a["size_histogram_count"]
    dropped = ", ".join(f"{_labels(label)} {count:,}" for label, count in a["dropped_by_reason"].items())
    lines += [f"- Whole run: the receiver got {sends:,} kv_transfer.send spans of {made:,} transfers made while "
              f"instrumented ({'all' if sends == made else 'NOT all'}); kv_transfer.size counts {size:,} "
              f"({'==' if size == sends else '!='} spans received, {'==' if size == made else '!='} transfers "
              f"made); builder processes started: {a['builder_processes']}; "
              f"kv_transfer.instrumentation.dropped: {dropped or 'none'}.", ""]
    return lines


# NIXL's own per-transfer telemetry, as its authors measured it (ai-dynamo/nixl pull request 1890, C++): three
# steady_clock reads per transfer (~23 ns each through the vDSO; ~9 ns with the CPU counter it moved to), ~90% of
# a fixed per-transfer cost that took ~10-11% of small-message throughput at 4 KiB on its POSIX backend, ~0 by
# 512 KiB. Cited, not measured here.
NIXL_CITED = {"source": "ai-dynamo/nixl#1890", "us_per_transfer": 3 * 0.023 / 0.9,
              "us_per_transfer_tsc": 3 * 0.009 / 0.9, "share_4k": "10-11% of throughput (POSIX backend)",
              "share_64k": "a few % (decaying to ~0 by 512 KiB)"}


def _vllm_ruler(shape: dict) -> tuple:
    """(vLLM's per-send cost goal 1 is judged by, its A/A or None): its code in position where the run measured
    it, else (an older engine_cost.py) its code alone."""
    if "vllm_in_position_us" in shape:
        return shape["vllm_in_position_us"], shape["vllm_in_position_aa_us"]
    return shape["vllm_us_per_send"], None


COMPILED_BAR = 0.30  # goal 4: a compiled path only where it is at least this much cheaper than the Python one


def _compiled_line(anchor: dict) -> list:
    """Goal 4 on goal 1's ruler: the async pair's calling-thread cost, compiled against the Python wrappers alone
    (same run, each with its A/A)."""
    x = next((x for x in anchor["shapes"].values() if "ours_python_added_outside_engine_us" in x), None)
    if x is None:
        return [f"Goal 4 (compiled path): not measured (the async wrappers ran {anchor.get('hot_path', 'in Python')})."]
    compiled, python = x["ours_added_outside_engine_us"], x["ours_python_added_outside_engine_us"]
    noise = max(abs(x["ours_aa_outside_engine_us"]), abs(x["ours_python_aa_outside_engine_us"]))
    cheaper = 1 - compiled / python if python > 0 else 0.0
    verdict = ("met" if compiled + noise <= python * (1 - COMPILED_BAR) else
               "NOT met" if compiled - noise > python * (1 - COMPILED_BAR) else "within noise")
    return [f"Goal 4, the compiled path on the same ruler: the async pair's calling thread, compiled "
            f"{compiled:+.2f} us (A/A {x['ours_aa_outside_engine_us']:+.2f}) against the Python wrappers alone "
            f"{python:+.2f} us (A/A {x['ours_python_aa_outside_engine_us']:+.2f}): {cheaper:.0%} cheaper, the bar "
            f"{COMPILED_BAR:.0%}: {verdict}."]


def _anchors_headline(results: dict) -> list:
    """Goals 1-3 of this round: ours on the engine's threads beside vLLM's own per-send statistics (same run), the
    builder against 59be0ed, and the table beside vLLM's and NIXL's own telemetry."""
    lines = ["## Headline: beside the engines' own telemetry", ""]
    anchor = results.get("vllm_anchor", {})
    anchor = anchor.get("anchor") or anchor
    if "skipped" in anchor or "shapes" not in anchor:
        lines += [f"Goals 1 and 3: skipped ({anchor.get('skipped', 'run by an older engine_cost.py')}).", ""]
    else:
        lines += [f"bench/engine_cost.py --parts anchor (vLLM {anchor['vllm']}'s virtualenv): real Mooncake calls "
                  "over TCP on 127.0.0.1, the SDK's OTLP/HTTP exporters to a receiver. Ours: added on the calling "
                  "thread outside the engine's own calls (on and off alternating, A/A beside; the thread's CPU in "
                  "all, with the engine's polling, is in section 1.6) + our recorder thread per record (one drain of "
                  "queued records, rounds min .. max). vLLM's: its `MooncakeKVConnectorStats` code where its "
                  "connector runs it, around each real call of the shape on the calling thread, measured as ours is "
                  "(outside the engine's own calls, with and without it alternating, A/A beside): the ruler of the "
                  "verdict; beside it the same code alone on the figures of finished sends, in a loop that leaves "
                  "it a warm cache (rounds min .. max). GC: the cyclic GC's time per call on the calling thread "
                  "(gc.callbacks), off -> on.", "",
                  "| goal 1: ours on the engine's threads <= vLLM's own per send | ours: calling (A/A) + recorder "
                  "| ours, engine's threads | vLLM's code in position (A/A) | vLLM's code alone "
                  "| GC per call, off -> on | verdict |",
                  "|---|---|---:|---:|---:|---|---|"]
        for shape, x in anchor["shapes"].items():
            rec = x["ours_recorder_us_per_record_rounds"]
            ours, noise = x["ours_engine_threads_us"], abs(x["ours_aa_outside_engine_us"])
            vllm, vllm_aa = _vllm_ruler(x)
            noise = max(noise, abs(vllm_aa or 0.0))
            verdict = "met" if ours + noise <= vllm else "NOT met" if ours - noise > vllm else "within noise"
            gc_share = x["ours_gc_us_per_call"]
            in_position = f"{vllm:.2f} us ({vllm_aa:+.2f})" if vllm_aa is not None else "not run"
            lines.append(f"| {shape} | {x['ours_added_outside_engine_us']:+.2f} "
                         f"({x['ours_aa_outside_engine_us']:+.2f}) + "
                         f"{x['ours_recorder_us_per_record']:.2f} ({min(rec):.2f} .. {max(rec):.2f}) "
                         f"| **{ours:.2f} us** | {in_position} | {x['vllm_us_per_send']:.2f} us "
                         f"({x['vllm_us_per_send_min']:.2f} .. {x['vllm_us_per_send_max']:.2f}) "
                         f"| {gc_share['off']:.3f} -> {gc_share['on']:.3f} us | {verdict} |")
        lines += [""] + _compiled_line(anchor)
        own = anchor["transfer_cpu_us"]
        c4, c64 = own["4096"]["median"], own["65536"]["median"]
        zero = anchor["shapes"].get("0 B sync write")
        lines += ["", f"Goal 3, per transfer and as a share of a real transfer's own CPU (this process, every "
                  f"thread, uninstrumented sync writes over TCP: 4 KiB {c4:.1f} us ({own['4096']['min']:.1f} .. "
                  f"{own['4096']['max']:.1f}), 64 KiB {c64:.1f} us ({own['65536']['min']:.1f} .. "
                  f"{own['65536']['max']:.1f})):", "",
                  "| telemetry | per transfer | share of a 4 KiB transfer's CPU | of a 64 KiB one |",
                  "|---|---:|---:|---:|"]
        if zero:
            ours = zero["ours_engine_threads_us"]
            lines.append(f"| ours, a span per transfer (engine's threads; its helper process aside) | {ours:.2f} us "
                         f"| {ours / c4:.1%} | {ours / c64:.1%} |")
            vllm, _ = _vllm_ruler(zero)
            lines.append(f"| vLLM's MooncakeKVConnectorStats, a list per step (same run, in position) | {vllm:.2f} us "
                         f"| {vllm / c4:.1%} | {vllm / c64:.1%} |")
            alone = zero["vllm_us_per_send"]
            lines.append(f"| the same code alone, warm cache (same run) | {alone:.2f} us "
                         f"| {alone / c4:.1%} | {alone / c64:.1%} |")
        n = NIXL_CITED
        lines += [f"| NIXL's telemetry, C++ ({n['source']}, cited: its POSIX backend, not this machine) "
                  f"| ~{n['us_per_transfer']:.2f} us (~{n['us_per_transfer_tsc']:.2f} with the CPU counter) "
                  f"| {n['share_4k']} | {n['share_64k']} |", ""]
    before = results.get("builder_before", {})
    if "skipped" in before or "before" not in before:
        lines += [f"Goal 2: skipped ({before.get('skipped', 'not run')}).", ""]
    else:
        lines += [f"Goal 2, the builder's CPU per record (helper process + its export threads, real Mooncake "
                  f"records over OTLP/HTTP; bench/builder_before.py, {before['runs']} run(s) of each tree "
                  f"alternating, each run beside):", "",
                  f"| case | {before['commit_before']} (before the new features) | {before['commit_after']} (now) "
                  "| verdict |", "|---|---|---|---|"]
        for case, label in (("default_queue", "as deployed (span queue 2,048)"),
                            ("queue_holds_backlog", "span queue holding the backlog")):
            if case not in before["before"] or case not in before["after"]:
                continue
            old, new = before["before"][case], before["after"][case]
            spread = max(old["us_per_record_runs"]) - min(old["us_per_record_runs"])
            verdict = ("met" if new["us_per_record"] <= old["us_per_record"] else
                       "NOT met" if new["us_per_record"] > max(old["us_per_record_runs"]) else "within noise")
            lines.append(f"| {label} | {old['us_per_record']:.2f} us ("
                         + ", ".join(f"{v:.2f}" for v in old["us_per_record_runs"]) + f") "
                         f"| {new['us_per_record']:.2f} us (" + ", ".join(f"{v:.2f}" for v in new["us_per_record_runs"])
                         + f") | {verdict} (spread before {spread:.2f}) |")
        lines.append("")
    return lines


def _threads_headline(results: dict) -> list:
    """The engine process's cost owner by owner: goals 1-5 of the attribution, each run and placement a row."""
    lines = ["## Headline: the engine process's CPU, owner by owner", "",
             "bench/engine_threads.py: the engine process's CPU read thread by thread (schedstat), on vs off, A/A "
             "beside, under each placement of the run's processes; marginal: the slope of the added CPU between "
             "700 and 2,800 paced 64 KiB transfers/s. The builder's rate is bench/engine_cost.py's builder part "
             "(1.1, 1.2), vLLM's own telemetry its anchor part. 'measured' marks a figure with no bound to meet.",
             "", "| goal | run, placement | figure (A/A) | verdict |", "|---|---|---|---|"]
    threads = results["summary"]["threads"]

    def each_placement():
        for name, label in THREAD_RUNS.items():
            for kind, x in threads[name].items():
                yield f"{label}, {PLACEMENT_LABELS[kind]}", x, results[name][kind]

    for where, _, run in each_placement():
        rate = min(run["by_rate"], key=int)
        at = run["by_rate"][rate]
        parts = ", ".join(f"{OWNER_LABELS[o]} {at[o]['added']:+.1f}" for o in OWNERS_IN_ENGINE)
        lines.append(f"| 1. the engine process's added CPU per transfer, each microsecond with its owner | {where} "
                     f"| at {int(rate):,}/s: {at['engine_process']['added']:+.1f} us "
                     f"({at['engine_process']['aa']:+.1f}) = {parts} | measured |")
    goals = (("ours_marginal", f"2. our threads in the engine process <= {GOALS['ours_marginal_us']:g} us per "
              "transfer, marginal", "us"),
             ("ours_idle", f"2. our threads in the engine process <= {GOALS['ours_idle_us_per_s'] / 1000:g} ms of "
              "CPU per second, nothing transferred", "us/s"),
             ("calling_zero_length", f"3. <= {GOALS['calling_zero_length_us']:g} us added on the calling thread per "
              "engine call (0 B real writes)", "us"),
             ("helper_marginal", f"4. the helper process <= {GOALS['helper_marginal_us']:g} us per transfer, "
              "marginal", "us"))
    for key, goal, unit in goals:
        for where, x, _ in each_placement():
            figure = x["ours_idle_us_per_s"] if key == "ours_idle" else x.get(key + "_us")
            noise = x.get(key + "_noise")  # a round's typical A/A, where the run kept its rounds
            spread = "" if noise is None else f", ±{noise:.2f}"
            shown = "-" if figure is None else f"{figure:+.2f} {unit} ({x[key + '_aa']:+.2f}{spread})"
            if key == "helper_marginal" and figure is not None:  # no helper runs uninstrumented: its A/A is 0
                shown += f"; rounds {x['helper_marginal_rounds'][0]:+.2f} .. {x['helper_marginal_rounds'][1]:+.2f}"
                if x.get("helper_builder_us") is not None:
                    shown += (f"; of it the builder {x['helper_builder_us']:+.2f}, the export threads "
                              f"{x['helper_export_us']:+.2f}")
            if key == "calling_zero_length" and x.get("calling_waits_per_block"):
                waits = x["calling_waits_per_block"]
                shown += (f"; the calling thread's waits per block of {x['calling_block']} calls: "
                          f"{waits['on']:g} on, {waits['off']:g} off")
            lines.append(f"| {goal} | {where} | {shown} | {x.get(key + '_verdict', 'not measured')} |")
    for name in ("engine_cost_http", "engine_cost_grpc"):
        x = results["summary"]["cost"][name]
        if x.get("builder_per_s") is None:
            continue
        shown = f"{x['builder_per_s']:,.0f}/s, dropped {x['builder_dropped']:,} of {x['builder_records']:,}"
        if "builder_big_queue_per_s" in x:
            shown += (f" (span queue {x['builder_big_queue_size']:,}: {x['builder_big_queue_per_s']:,.0f}/s, "
                      f"dropped {x['builder_big_queue_dropped']:,})")
        lines.append(f"| 4. one builder >= {GOALS['builder_per_s']:,} records/s, nothing dropped (its CPU) "
                     f"| {COST_RUNS[name]} | {shown} | {x['builder_verdict']} |")
    anchor = results["vllm_anchor"].get("anchor") or results["vllm_anchor"]
    zero = (anchor.get("shapes") or {}).get("0 B sync write")
    if zero is None:
        lines.append(f"| 5. beside vLLM's own per-transfer telemetry | - | skipped: "
                     f"{anchor.get('skipped', 'run by an older engine_cost.py')} | - |")
    else:
        lines.append(f"| 5. beside vLLM's own per-transfer telemetry | vLLM {anchor['vllm']}, 0 B real writes "
                     f"| vLLM's code {_vllm_ruler(zero)[0]:.2f} us per send in position "
                     f"({zero['vllm_us_per_send']:.2f} alone); ours on the calling thread "
                     f"{zero['ours_added_outside_engine_us']:+.2f} us ({zero['ours_aa_outside_engine_us']:+.2f}) "
                     "outside the engine's calls, on our "
                     f"recorder thread {zero['ours_recorder_us_per_record']:.2f} us per record (the first headline "
                     "has every shape) | measured |")
    return lines


def _floors(results: dict) -> list:
    """Where goals 3 and 4 stop, from the same run: the wrapper's cost step by step, and the helper's CPU per
    record split into its threads and the builder's parts."""
    wrapper, profile = results["wrapper_floor"], results["profile_builder"]
    steps = wrapper["steps"]
    lines = ["", "### Where goals 3 and 4 stop", "",
             "- Goal 3, the wrapper step by step around a zero-cost stand-in method (`bench/wrapper_floor.py`; "
             "stand-in, not the engine; medians of "
             f"{wrapper['rounds']} blocks of {wrapper['calls_per_block']:,} calls, spread beside): the bare call "
             f"{steps['direct']['median']:.2f} us ({steps['direct']['spread']:.2f}); "
             + ", ".join(f"{name} {added:+.2f}" for name, added in wrapper["added_by_step"].items())
             + f" -> the package's wrapper {steps['package']['median']:.2f} us ({steps['package']['spread']:.2f}), "
             f"{steps['package']['median'] - steps['direct']['median']:+.2f} us over the bare call. A Python "
             f"function that only passes the arguments on costs {wrapper['added_by_step']['forward']:+.2f} of it."]
    b = results["engine_cost_http"].get("builder_alone", {}).get("default_queue", {})
    if b.get("helper_main_us_per_record") is not None:
        lines.append(
            f"- Goal 4, the helper's {b['cpu_us_per_record']:.1f} us per record (1.1's builder alone, real "
            f"Mooncake records, OTLP/HTTP): its main thread {b['helper_main_us_per_record']:.1f} us (reading and "
            f"unpickling the frame {b['unpickle_us_per_record']:.2f} us of it, the rest building), its other "
            f"threads (the SDK's: encoding, the HTTP requests, metrics) {b['helper_other_us_per_record']:.1f} us.")
    encode = profile["encode_us_per_span"]
    lines.append(
        f"- Goal 4, building's parts (`bench/profile_builder.py`, {profile['records']:,} stand-in records, "
        "cProfile shares of one drain): "
        + "; ".join(f"{share:.0%} {label}" for label, share in profile["shares_of_drain"].items())
        + f"; {1 - sum(profile['shares_of_drain'].values()):.0%} the rest of the drain (reading each record, "
        "the checks before building, the loop). Encoding per span, batches of "
        f"{profile['batch']}: " + "; ".join(f"{label} {us:.2f} us" for label, us in encode.items()) + ".")
    return lines


def _threads_section(run: dict, title: str) -> list:
    lines = [title, "", "Environment: " + ", ".join(f"`{k}={v}`" for k, v in run["environment"].items()
                                                      if k != "OTEL_EXPORTER_OTLP_ENDPOINT") + ".", ""]
    for kind in run["placements"]:
        x = run[kind]
        rates = list(x["by_rate"])
        built = "in a helper process" if x["where_built"] == "process" else "in the engine process"
        lines += [f"### {PLACEMENT_LABELS[kind]} (spans built {built})", "",
                  "| owner | " + " | ".join(f"{int(r):,}/s: off us per transfer | added (A/A)" for r in rates)
                  + " | nothing transferred: added us per second (A/A) |",
                  "|---|" + "---:|---:|" * len(rates) + "---:|"]
        for owner, label in OWNER_LABELS.items():
            if owner not in x["idle"]:  # written before this owner was read
                continue
            cells = [f"{x['by_rate'][r][owner]['off']:.1f} | {x['by_rate'][r][owner]['added']:+.1f} "
                     f"({x['by_rate'][r][owner]['aa']:+.1f})" for r in rates]
            idle = x["idle"][owner]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {idle['added']:+.0f} ({idle['aa']:+.0f}) |")
        m = x["marginal_us_per_transfer"]
        z = x["zero_length_call"]
        marginal = {"ours_in_engine": "our threads in the engine process", "calling": "the calling thread",
                    "engine_process": "the engine process", "helper": "the helper process",
                    "helper_builder": "its builder", "helper_export": "its export threads"}
        lines += ["", "- Marginal us per transfer (slope between the rates; rounds min .. max; A/A): "
                  + "; ".join(f"{label} {m[o]['median']:+.2f} ({m[o]['min']:+.2f} .. {m[o]['max']:+.2f}; "
                              f"A/A {m[o]['aa']:+.2f})" for o, label in marginal.items()
                              if o in m and m[o]["median"] is not None) + ".",
                  f"- 0 B real writes (the engine's smallest work, {z['off_us_per_call']:.2f} us each uninstrumented): "
                  f"added on the calling thread **{z['added_thread_cpu_us']:+.2f} us** of CPU "
                  f"(A/A {z['aa_thread_cpu_us']:+.2f}), {z['added_wall_us']:+.2f} us of wall "
                  f"(A/A {z['aa_wall_us']:+.2f}).", ""]
    return lines


def _anchor_section(run: dict, title: str) -> list:
    """bench/engine_cost.py --parts anchor, run with the vLLM virtualenv's python."""
    x = run.get("anchor") or run
    if "skipped" in x or "shapes" not in x:
        return [title, "", f"Skipped: {x.get('skipped', 'run by an older engine_cost.py')}.", ""]
    lines = [title, "",
             f"bench/engine_cost.py --parts anchor (the vLLM virtualenv's python, vLLM {x['vllm']}). vLLM's Mooncake "
             "connector keeps `MooncakeKVConnectorStats` on its send path: two perf_counter readings, "
             "`sum(lengths)` and `record_transfer` per send, and per engine step (here "
             f"{x['step_sends']} sends) `clone_and_reset`, pickled to the scheduler process. That code's own CPU "
             f"is run where the connector runs it, around each real call of the shape, measured as ours is "
             f"(outside the engine's calls, with and without it alternating, A/A beside), and alone on the figures "
             f"of real sends of each shape (a warm cache), {x['rounds']} rounds. Ours in the same run: "
             "added on the calling thread (on and off alternating, A/A beside), outside the engine's own calls "
             "(a timing shim under our wrapper takes the engine's calls out, and with them its polling) and in "
             "all, our recorder thread's CPU per "
             "record (a drain of queued records), the builder process's in 1.1. vLLM aggregates and logs its "
             "stats in other processes: not counted here.", "",
             "| shape | real send (median us) | vLLM's code in position (A/A) | vLLM's code alone "
             "| ours, calling thread, outside the engine's "
             "calls (A/A) | ours, calling thread in all (A/A) | ours, recorder per record "
             "| GC per call on the calling thread, off -> on |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for shape, y in x["shapes"].items():
        vllm, vllm_aa = _vllm_ruler(y)
        lines.append(f"| {shape} | {y['send_us_median']:.1f} ({y['sends_failed']} failed) "
                     + (f"| {vllm:.2f} ({vllm_aa:+.2f}) " if vllm_aa is not None else "| not run ")
                     + f"| {y['vllm_us_per_send']:.2f} ({y['vllm_us_per_send_min']:.2f} .. "
                     f"{y['vllm_us_per_send_max']:.2f}) | {y['ours_added_outside_engine_us']:+.2f} "
                     f"({y['ours_aa_outside_engine_us']:+.2f}) | {y['ours_added_thread_cpu_us']:+.2f} "
                     f"({y['ours_aa_thread_cpu_us']:+.2f}) | {y['ours_recorder_us_per_record']:.2f} "
                     f"| {y['ours_gc_us_per_call']['off']:.3f} -> {y['ours_gc_us_per_call']['on']:.3f} us |")
    return lines + [""]


def render(results: dict) -> str:
    m = results["machine"]
    pipe, mem, truth = results["pipeline"], results["memory"], results["truth"]
    s = results["summary"]
    lines = ["# Benchmark results", "",
             f"Written by `python bench/run_all.py{' --quick' if results['quick'] else ''}` on {results['date']} "
             f"({results['total_wall_s']:.0f} s). What each figure means: [README.md](README.md).", ""]
    if results.get("rerun"):
        lines += ["Run again since, each alone (`--only`): " + ", ".join(
            f"{name} on {when}" for name, when in results["rerun"].items()) + ".", ""]
    if results["quick"]:
        lines += ["**Quick (smoke) run: fewer rounds; do not quote these figures.**", ""]
    lines += ["## Machine", "", "| | |", "|---|---|",
              f"| CPU | {m['cpu_model']}, {m['nproc']} cores (nproc) |",
              f"| memory | {m['memory_gib']} GiB |", f"| kernel | {m['kernel']} |",
              f"| Python | {m['python']} ({m['python_implementation']}) |"]
    for name, version in m["packages"].items():
        lines.append(f"| {name} | {version or 'not installed'} |")
    loads = ", ".join(f"{name} {results[name]['load_average_1min_before_after'][0]:.2f} -> "
                      f"{results[name]['load_average_1min_before_after'][1]:.2f}" for name in BENCHES)
    lines.append(f"| load average (1 min) before -> after each benchmark | {loads} |")
    lines += ["", "A load average well above the benchmark's own (about 1) means other processes shared the two "
              "cores during the run; their noise is in the figures. Rerun on a quiet machine before quoting."]
    c = s["cost"]
    runs = list(COST_RUNS)

    def row(goal, figure, verdict_key):
        cells = []
        for name in runs:
            x = c[name]
            if x.get(verdict_key) is None:
                cells.append("- | -")
            else:
                cells.append(f"{figure(x)} | {x[verdict_key]}")
        return f"| {goal} | " + " | ".join(cells) + " |"

    lines += [""] + _anchors_headline(results)
    lines += ["## Headline: what a transfer costs a deployment", "",
              "Each column is one process set up from OTEL_* as a deployment is (the distro's configurator, OTLP "
              "exporters for spans and metrics, metrics every 1 s) exporting to a receiver process on 127.0.0.1; "
              "real Mooncake writes; instrumentation on and off alternating round by round in that process. "
              "Figures are medians of per-round differences, the A/A noise (two uninstrumented rounds) beside "
              "them. A verdict is 'met' only when the figure is within the goal and the A/A noise is small enough "
              "to tell; 'NOT met' when it exceeds the goal by more than that noise; otherwise 'within noise'."
              + (" Beside a calling-thread figure, ± is the median size of one round's A/A difference: its verdict "
                 "reads the larger of the two as the noise (a shape whose rounds swing by hundreds of us can have a "
                 "median A/A near 0)." if any("thread_noise_us" in c[name] for name in runs) else ""), "",
              "| goal | " + " | | ".join(COST_RUNS[name] for name in runs) + " | |",
              "|---|" + "---|---|" * len(runs),
              row("<= 20 us CPU per transfer in total (engine process + every helper it starts), 64 KiB writes "
                  "at 700/s; the receiver gets every span, kv_transfer.size counts each",
                  lambda x: f"{x['total_cpu_us']:+.1f} us (A/A {x['total_aa_us']:+.1f}); spans received "
                            f"{x['process_spans_received']:,} of {x['process_transfers_on']:,}, size count "
                            f"{x['process_size_count']:,}",
                  "total_verdict"),
              row("<= 5 us CPU per transfer in the engine process",
                  lambda x: f"{x['engine_cpu_us']:+.1f} us (A/A {x['engine_aa_us']:+.1f})", "engine_verdict"),
              row(f">= {GOALS['builder_per_s']:,} transfers/s by one builder alone, nothing dropped (its CPU; queued "
                  "records built and exported over OTLP)",
                  lambda x: f"{x['builder_per_s']:,.0f}/s, dropped {x['builder_dropped']:,} of "
                            f"{x['builder_records']:,}"
                  + (f" (span queue {x['builder_big_queue_size']:,}: {x['builder_big_queue_per_s']:,.0f}/s, "
                     f"dropped {x['builder_big_queue_dropped']:,})" if "builder_big_queue_per_s" in x else ""),
                  "builder_verdict"),
              row("<= 2 us added on the calling thread per real engine call (A/A beside each)",
                  lambda x: "; ".join(f"{shape}: {v:+.2f} us ({x['thread_aa_us'][shape]:+.2f}"
                                      + (f", ±{x['thread_noise_us'][shape]:.2f}" if "thread_noise_us" in x else "")
                                      + ")" for shape, v in x["thread_added_us"].items()), "thread_verdict"),
              row("a CPU-bound Python thread slows <= 1% beside 1,000 transfers/s",
                  lambda x: f"{x['neighbour_slowdown']:+.1%} (A/A {x['neighbour_aa']:+.1%})", "neighbour_verdict"),
              "| the receiver got every span; kv_transfer.size counts the sends received | "
              + " | ".join(f"{x['sends_received']:,} of {x['transfers_made']:,} spans; size count {x['size_count']:,}"
                           f" | {_verdict(x['spans_complete'] and x['metrics_agree'])}"
                           for x in (c[name] for name in runs)) + " |",
              ""] + _threads_headline(results) + _floors(results) + [
              "", "## Headline: capacity, memory, truth", "", "| goal | figure | verdict |", "|---|---|---|",
              f"| >= 20,000 transfers/s into spans + metrics, nothing dropped (counting exporter) | sustained: "
              f"{s['capacity_per_s']:,}/s | {_verdict(s['capacity_goal_met'])} |",
              f"| beyond capacity: drops counted, engine unaffected | spans + dropped == calls: "
              f"{pipe['overload']['accounted']}, wrong return values: {pipe['overload']['wrong_return_values']} "
              f"| {_verdict(s['overload_accounted'])} |",
              f"| RSS flat over {mem['transfers']:,} transfers after warm-up | growth "
              f"{s['rss_growth_mib_after_warmup']:+.2f} MiB "
              f"| {_verdict(s['rss_flat'])} |",
              "| per-transfer throughput within 2% of an independent timer | median error by size: "
              + ", ".join(f"{int(size) >> 20} MiB {err:+.2%}" for size, err in s["truth_median_error_by_bytes"].items())
              + f" (worst single {s['truth_worst_error']:.2%}) "
              f"| {_verdict(s['truth_goal_met'])} |",
              f"| eviction cost independent of the number of open requests (100,000 vs 1,000 open) | TTL tick "
              f"x{s['eviction_tick_ratio']:.2f}, opening one when full x{s['eviction_open_ratio']:.2f} "
              f"| {_verdict(s['eviction_goal_met'])} |", ""]
    for number, name in enumerate(runs, 1):
        lines += _cost_section(results[name], f"## 1.{number} Cost to the engine: {COST_RUNS[name]}")
    for number, name in enumerate(THREAD_RUNS, len(runs) + 1):
        lines += _threads_section(results[name], f"## 1.{number} Who owns the engine process's CPU: "
                                                 f"{THREAD_RUNS[name]}")
    lines += _anchor_section(results["vllm_anchor"], f"## 1.{len(runs) + len(THREAD_RUNS) + 1} vLLM's own "
                                                     "per-transfer telemetry beside ours")

    # 2. pipeline
    b = pipe["builder_only"]
    lines += ["## 2. Pipeline capacity (counting exporter)", "",
              "Records made by the package's Mooncake hot-path function around a stand-in method (not the engine) "
              "(the exact tuples and hot "
              "path of a real call), turned into spans (BatchSpanProcessor + no-op exporter) and metrics.", "",
              f"- Builder alone ({b['records']:,} queued records, one drain): **{b['spans_per_s']:,.0f} transfers/s** "
              f"({b['us_per_transfer']:.1f} us of builder time per transfer); spans exported {b['spans_exported']:,}, "
              f"transfers in metrics {b['transfers_in_metrics']:,}, dropped {b['dropped'] or 0}.",
              "- Where the builder's time goes (us per transfer, same drain): default "
              f"{pipe['builder_breakdown']['us_per_transfer_default']:.1f}; exemplars off "
              f"{pipe['builder_breakdown']['us_per_transfer_exemplars_off']:.1f}; no metric reader "
              f"{pipe['builder_breakdown']['us_per_transfer_no_metric_reader']:.1f}; the bare SDK span with the "
              f"same attributes and export, no builder: {pipe['builder_breakdown']['us_per_span_bare_sdk']:.1f}.",
              f"- Sustained, default settings (queue 65,536, flush 200 ms), producer thread offering R/s: "
              f"**{pipe['sustained_capacity_per_s']:,}/s** is the highest R with nothing dropped and a settled queue.",
              "", "| offered /s | achieved /s | peak queue depth | middle / last third peak | keeps up | "
              "record->span latency (max) | dropped | spans + dropped == calls |",
              "|---:|---:|---:|---:|---|---:|---|---|"]
    for st in pipe["sustained_steps"]:
        lines.append(
            f"| {st['offered_per_s']:,} | {st['achieved_offer_per_s']:,.0f} | {st['max_queue_depth']:,} "
            f"| {st['peak_depth_middle_third']:,} / {st['peak_depth_last_third']:,} | {st['keeps_up']} "
            f"| {st['record_to_span_latency_s_max']:.2f} s | {st['dropped'] or 0} | {st['accounted']} |")
    o = pipe["overload"]
    lines += ["", f"Beyond capacity (queue {o['queue_size']:,}, producer calling as fast as it can for "
              f"{o['seconds']} s): "
              f"{o['calls']:,} calls ({o['calls_per_s']:,.0f}/s), {o['wrong_return_values']} wrong return values, "
              f"engine-thread cost {o['median_ns_per_call_engine_thread'] / 1e3:.2f} us per call "
              f"(stand-in, not the engine); {o['transfers_in_metrics']:,} "
              f"transfers became spans and metrics, dropped {o['dropped']}; spans + dropped == calls: "
              f"{o['accounted']}.", ""]

    # 3. memory
    lines += ["## 3. Memory", "",
              f"{mem['transfers']:,} transfers in {mem['requests']:,} requests (begin, 4 scoped transfers, end) over "
              f"{mem['rooms_reused']:,} reused rooms, through the wrapper around the stand-in method; "
              f"{mem['transfers_in_metrics']:,} in metrics, {mem['spans_exported']:,} spans exported "
              f"(sends + requests), dropped {mem['dropped'] or 0}.", "",
              "| transfers | RSS MiB | queued |", "|---:|---:|---:|"]
    for smp in mem["samples"]:
        lines.append(f"| {smp['transfers']:,} | {smp['rss_mib']:.1f} | {smp.get('queued', '-')} |")
    r = mem["rss_after_warmup_mib"]
    lines += ["", f"After warm-up: {r['first']:.1f} -> {r['last']:.1f} MiB (min {r['min']:.1f}, "
              f"max {r['max']:.1f}).", ""]

    # 4. truth
    lines += ["## 4. Truth", "", "### Per transfer: span throughput vs an independent timer", "",
              "Real Mooncake writes, TCP 127.0.0.1; the timer is perf_counter around the same engine call, outside "
              "the wrapper (so it also holds the wrapper's own microseconds).", "",
              "| bytes | transfers | span GiB/s (median) | timer GiB/s (median) | median error | worst error "
              "| timer - span (median us) | of which before the span's start / after its end (us) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size, v in truth["per_transfer"].items():
        lines.append(f"| {int(size):,} | {v['transfers']} | {v['median_span_gib_s']:.3f} "
                     f"| {v['median_timer_gib_s']:.3f} "
                     f"| {v['median_error']:+.2%} | {v['max_abs_error']:.2%} | {v['median_timer_minus_span_us']:.1f} "
                     f"| {v['median_before_span_us']:.1f} / {v['median_after_span_us']:.1f} |")
    lines += ["", "### Seed scenario (chunked prefill 8192 + 1655 tokens, 2048-token cached prefix sent early)", "",
              "| fan-out | room | transfers | wire MiB | logical MiB | busy ms | true GiB/s (spans) | legacy GiB/s "
              "| legacy / true | enqueue->done GiB/s | compute overlap | link capacity GiB/s | true / capacity |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for seed in truth["seed"]:
        for row in seed["rows"]:
            lines.append(
                f"| {seed['fanout']} | {row['room']} | {row['transfers']} | {row['wire_mib']:.1f} "
                f"| {row['logical_mib']:.1f} | {row['busy_ms']:.1f} | {row['true_gib_s']:.2f} "
                f"| {row['legacy_gib_s']:.2f} | {row['legacy_over_true']:.1f}x | {row['enqueue_to_done_gib_s']:.2f} "
                f"| {row['compute_overlap_ratio']:.0%} | {seed['link_capacity_gib_s']:.2f} "
                f"| {row['true_over_capacity']:.0%} |")
    lines += ["", "Link capacity: best of plain uninstrumented writes of one request's KV to one receiver, measured "
              "before and after the requests of the same run. Bytes verified on every receiver: "
              + ", ".join(f"fan-out {x['fanout']}: {x['bytes_verified']}" for x in truth["seed"]) + ".", ""]
    return "\n".join(lines)


def _bad_input(message: str) -> None:
    print(message[:300], file=sys.stderr)
    sys.exit(2)


def _load(out_dir: str) -> dict:
    try:
        with open(os.path.join(out_dir, "results.json"), encoding="utf-8") as handle:
            results = json.load(handle)
    except (OSError, ValueError) as exc:
        _bad_input(f"bench: cannot read {out_dir}/results.json ({type(exc).__name__}); run bench/run_all.py")
    if not isinstance(results, dict):
        _bad_input(f"bench: {out_dir}/results.json is not what run_all.py writes; run bench/run_all.py")
    return results


def _missing(results: dict) -> list:
    return [name for name in BENCHES if name not in results]


def rerender(out_dir: str) -> None:
    """RESULTS.md again from results.json (after a change to the rendering; no benchmark runs)."""
    results = _load(out_dir)
    if _missing(results):
        _bad_input(f"bench: {out_dir}/results.json has no {', '.join(_missing(results))} (written by an older "
                   "run_all.py); run bench/run_all.py, or those with --only")
    _write(out_dir, results)


def _write(out_dir: str, results: dict) -> str:
    results["summary"] = summary(results)
    results["goals"] = GOALS
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, "results.json"), results)
    text = render(results)
    with open(os.path.join(out_dir, "RESULTS.md"), "w", encoding="utf-8") as handle:
        handle.write(text)
    return text


def run_only(out_dir: str, names: list, quick: bool) -> None:
    """Run `names` again and put their results into the results.json already in `out_dir` (the rest kept)."""
    results = _load(out_dir)
    if bool(results.get("quick")) != quick:
        _bad_input("bench: --only must match the run in results.json (both --quick, or neither)")
    missing = [name for name in _missing(results) if name not in names]
    if missing:
        _bad_input(f"bench: {out_dir}/results.json has no {', '.join(missing)}; add them to --only")
    for name in names:
        results[name] = _run_one(name, quick)
    results.setdefault("rerun", {}).update(dict.fromkeys(names, datetime.datetime.now(
        datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")))
    _write(out_dir, results)
    print(f"bench: {', '.join(names)} written into {out_dir}/results.json and RESULTS.md", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds: a smoke run, not for quoting")
    parser.add_argument("--out-dir", default=HERE, help="where results.json and RESULTS.md go (default: bench/)")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite RESULTS.md from the results.json in --out-dir, running nothing")
    parser.add_argument("--only", help="comma-separated benchmarks to run again, into the results.json already "
                                       f"in --out-dir (of {', '.join(BENCHES)})")
    args = parser.parse_args()
    if args.render_only:
        rerender(args.out_dir)
        return
    only = [name.strip() for name in (args.only or "").split(",") if name.strip()]
    if args.only is not None and (not only or any(name not in SCRIPTS for name in only)):
        parser.error(f"--only: comma-separated, of {', '.join(BENCHES)}")
    in_private_network()
    if only:
        run_only(args.out_dir, only, args.quick)
        return
    start = time.monotonic()
    results = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "quick": args.quick, "machine": machine()}
    partial = os.path.join(args.out_dir, "results.partial.json")
    for number, name in enumerate(BENCHES, 1):
        try:
            results[name] = _run_one(name, args.quick)
        except (SystemExit, subprocess.TimeoutExpired) as exc:
            # What ran before is kept, for a look at its figures.
            raise SystemExit(f"{exc}\nbench: the {number - 1} benchmarks done before it are in {partial}") from None
        write_json(partial, results)
        print(f"bench: {number}/{len(BENCHES)} done", file=sys.stderr)
    results["total_wall_s"] = round(time.monotonic() - start, 1)
    text = _write(args.out_dir, results)
    os.remove(partial)
    # The headlines (the cost goals for each configuration, then capacity, memory, truth) on stdout as well.
    start = text.index("## Headline")
    print(text[start:text.index("## 1.1", start)])
    print(f"bench: wrote {args.out_dir}/results.json and RESULTS.md in {results['total_wall_s']:.0f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
