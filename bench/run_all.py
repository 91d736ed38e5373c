"""Run every benchmark, each in a fresh process, and write bench/results.json and bench/RESULTS.md.

    python bench/run_all.py            # the full run (a few minutes on 2 cores)
    python bench/run_all.py --quick    # a smoke run with fewer rounds: its figures are not for quoting

Nothing here passes or fails: the figures are written down with the machine they were measured on, beside the
goals (issue 12's for the cost, issue 6's for capacity, memory and truth), and each goal is marked met or not met.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import machine, write_json  # noqa: E402

BENCHES = ["engine_cost", "engine_cost_process", "pipeline", "memory", "truth", "eviction"]
# name -> (script, arguments) where they differ from bench/<name>.py
SCRIPTS = {"engine_cost_process": ("engine_cost", ["--builder", "process"])}
GOALS = {"eviction_ratio": 2.0, "thread_added_us": 2.0, "process_added_cpu_us": 15.0, "builder_per_s": 60_000, "neighbour_slowdown": 0.01,
         "capacity_per_s": 20_000, "truth_error": 0.02}


def _run_one(name: str, quick: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{name}.json")
        script, extra = SCRIPTS.get(name, (name, []))
        cmd = [sys.executable, os.path.join(HERE, f"{script}.py"), "--out", out] + extra + (["--quick"] if quick else [])
        env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"))
        load_before = os.getloadavg()[0]
        start = time.monotonic()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
        elapsed = time.monotonic() - start
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"bench/{name}.py failed with exit code {proc.returncode}")
        with open(out, encoding="utf-8") as handle:
            result = json.load(handle)
    result["wall_s"] = round(elapsed, 1)
    # Other processes on the machine (another developer's tests, say) add noise: say how busy it was.
    result["load_average_1min_before_after"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(f"bench: {name} done in {elapsed:.0f} s", file=sys.stderr)
    return result


def _fmt(value, digits=1):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


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


def _cost_summary(cost: dict) -> dict:
    thread = cost["thread"]
    process, neighbour = cost["process"], cost["neighbour"]
    return {
        "thread_verdict": _against_noise([(v["added_thread_cpu_us"], v["aa_thread_cpu_us"]) for v in thread.values()],
                                         GOALS["thread_added_us"]),
        "process_verdict": _against_noise([(process["added_cpu_us_per_transfer"],
                                            process["aa_cpu_us_per_transfer"])], GOALS["process_added_cpu_us"]),
        "neighbour_verdict": _against_noise([(neighbour["slowdown"]["median"], neighbour["slowdown_aa"]["median"])],
                                            GOALS["neighbour_slowdown"]),
        "thread_added_us": {shape: v["added_thread_cpu_us"] for shape, v in thread.items()},
        "thread_aa_us": {shape: v["aa_thread_cpu_us"] for shape, v in thread.items()},
        "process_aa_cpu_us": process["aa_cpu_us_per_transfer"],
        "neighbour_aa": neighbour["slowdown_aa"]["median"],
        "neighbour_aa_range": [neighbour["slowdown_aa"]["min"], neighbour["slowdown_aa"]["max"]],
        "thread_goal_met": all(v["added_thread_cpu_us"] <= GOALS["thread_added_us"] for v in thread.values()),
        "process_added_cpu_us": cost["process"]["added_cpu_us_per_transfer"],
        "process_goal_met": cost["process"]["added_cpu_us_per_transfer"] <= GOALS["process_added_cpu_us"],
        "rate_change": cost["process"]["rate_change"],
        "rate_change_aa": cost["process"]["rate_change_aa"],
        "builder_per_s": cost["builder_alone"]["records_per_cpu_s"],
        "builder_goal_met": cost["builder_alone"]["records_per_cpu_s"] >= GOALS["builder_per_s"],
        "neighbour_slowdown": cost["neighbour"]["slowdown"]["median"],
        "neighbour_goal_met": cost["neighbour"]["slowdown"]["median"] <= GOALS["neighbour_slowdown"],
        "metrics_complete": cost["metrics_complete"]["transfers_in_metrics"]
        == cost["metrics_complete"]["transfers_made_instrumented"],
    }


def summary(results: dict) -> dict:
    pipe, mem, truth, evict = (results[k] for k in BENCHES[2:])
    growth = mem["rss_after_warmup_mib"]["growth"]
    return {
        "builder": {"thread": _cost_summary(results["engine_cost"]),
                    "process": _cost_summary(results["engine_cost_process"])},
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


def _cost_section(cost: dict, title: str) -> list:
    p, b, n, mc = cost["process"], cost["builder_alone"], cost["neighbour"], cost["metrics_complete"]
    helper = cost["builder"] == "process"
    lines = [title, "",
             "instrument() and uninstrument() alternate round by round in one process; each figure is the median of "
             "per-round differences, beside the A/A noise of the same run (two uninstrumented rounds).", "",
             "| engine call | uninstrumented us per call | added on the calling thread: CPU us (A/A) "
             "| added wall us (A/A) |", "|---|---:|---:|---:|"]
    for shape, v in cost["thread"].items():
        lines.append(f"| {shape} | {v['off_us_per_call']:.1f} | {v['added_thread_cpu_us']:+.2f} "
                     f"({v['aa_thread_cpu_us']:+.2f}) | {v['added_wall_us']:+.1f} ({v['aa_wall_us']:+.1f}) |")
    lines += ["", f"- CPU per transfer, every thread of the engine process, one thread making paced 64 KiB writes at "
              f"{p['paced_rate_per_s']}/s: off {p['cpu_us_per_transfer_off']['median']:.1f} us, on "
              f"{p['cpu_us_per_transfer_on']['median']:.1f} us: **added {p['added_cpu_us_per_transfer']:+.1f} us** "
              f"(A/A {p['aa_cpu_us_per_transfer']:+.1f} us)."]
    if helper:
        h = p["helper_cpu_us_per_transfer"]
        lines.append(f"- The builder process's own CPU per transfer in the same rounds (another process, on the "
                     f"other core here): {h['median']:.1f} us (rounds {h['min']:.1f} .. {h['max']:.1f}).")
    lines += [f"- Unpaced transfers per second: off {p['unpaced_rate_off']['median']:,.0f}, on "
              f"{p['unpaced_rate_on']['median']:,.0f}: change {p['rate_change']:+.1%} (A/A {p['rate_change_aa']:+.1%}).",
              (f"- Builder alone ({b['records']:,} queued records, one drain): the builder process builds "
               f"**{b['records_per_cpu_s']:,.0f} records/s** on its CPU ({b['cpu_us_per_record']:.1f} us each); "
               f"handing them over costs the engine process {b['handoff_cpu_us_per_record']:.2f} us each."
               if helper else
               f"- Builder alone ({b['records']:,} queued records, one drain, one core): "
               f"**{b['records_per_cpu_s']:,.0f} records/s** ({b['cpu_us_per_record']:.1f} us each)."),
              f"- A CPU-bound Python thread beside real transfers at 1,000/s slows by **{n['slowdown']['median']:+.1%}** "
              f"(rounds {n['slowdown']['min']:+.1%} .. {n['slowdown']['max']:+.1%}; A/A "
              f"{n['slowdown_aa']['median']:+.1%}, {n['slowdown_aa']['min']:+.1%} .. {n['slowdown_aa']['max']:+.1%}).",
              f"- Metrics complete: {mc['transfers_in_metrics']:,} transfers in the metrics of "
              f"{mc['transfers_made_instrumented']:,} made while instrumented; {mc['exemplars']} exemplars on the "
              f"size histogram at the last collection"
              + (f" (summed over the {mc['helpers']} builder processes of the run: one per instrument())."
                 if helper else "."), ""]
    return lines


def render(results: dict) -> str:
    m = results["machine"]
    pipe, mem, truth = results["pipeline"], results["memory"], results["truth"]
    s = results["summary"]
    lines = ["# Benchmark results", "",
             f"Written by `python bench/run_all.py{' --quick' if results['quick'] else ''}` on {results['date']} "
             f"({results['total_wall_s']:.0f} s). What each figure means: [README.md](README.md).", ""]
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
    t, h = s["builder"]["thread"], s["builder"]["process"]

    def both(figure, met):
        def verdict(x):
            return x[met] if isinstance(x[met], str) else _verdict(x[met])
        return f"{figure(t)} | {verdict(t)} | {figure(h)} | {verdict(h)} |"

    lines += ["", "## Headline: cost to the engine (issue 12)", "",
              "Both builders measured in the same run, each in its own process: the default builds spans on a "
              "thread of the engine process; OTEL_KVTRANSFER_BUILDER=process builds them in a helper process. "
              "A verdict is 'met' only when the figure is within the goal and the A/A noise of the same run is "
              "small enough to tell; 'NOT met' when the figure exceeds the goal by more than that noise; "
              "otherwise 'within noise'.", "",
              "| goal | in-process builder (default) | | builder process | |", "|---|---|---|---|---|",
              "| <= 2 us added on the calling thread per real engine call (A/A beside each) | "
              + both(lambda x: "; ".join(f"{shape}: {v:+.2f} us ({x['thread_aa_us'][shape]:+.2f})"
                                         for shape, v in x["thread_added_us"].items()), "thread_verdict"),
              "| <= 15 us CPU per transfer, all threads of the engine process | "
              + both(lambda x: f"{x['process_added_cpu_us']:+.1f} us (A/A {x['process_aa_cpu_us']:+.1f})",
                     "process_verdict"),
              "| engine's unpaced transfer rate unchanged (A/A beside it) | "
              + f"{t['rate_change']:+.1%} (A/A {t['rate_change_aa']:+.1%}) | - | "
              + f"{h['rate_change']:+.1%} (A/A {h['rate_change_aa']:+.1%}) | - |",
              "| builder alone >= 60,000 transfers/s on one core | "
              + both(lambda x: f"{x['builder_per_s']:,.0f}/s", "builder_goal_met"),
              "| a CPU-bound Python thread slows <= 1% at 1,000 transfers/s | "
              + both(lambda x: f"{x['neighbour_slowdown']:+.1%} (A/A {x['neighbour_aa']:+.1%}, rounds "
                               f"{x['neighbour_aa_range'][0]:+.0%} .. {x['neighbour_aa_range'][1]:+.0%})",
                     "neighbour_verdict"),
              "| metrics count every transfer, exemplars kept | "
              + both(lambda x: str(x["metrics_complete"]), "metrics_complete"),
              "", "## Headline: capacity, memory, truth", "", "| goal | figure | verdict |", "|---|---|---|",
              f"| >= 20,000 transfers/s into spans + metrics, nothing dropped | sustained: "
              f"{s['capacity_per_s']:,}/s | {_verdict(s['capacity_goal_met'])} |",
              f"| beyond capacity: drops counted, engine unaffected | spans + dropped == calls: "
              f"{pipe['overload']['accounted']}, wrong return values: {pipe['overload']['wrong_return_values']} "
              f"| {_verdict(s['overload_accounted'])} |",
              f"| RSS flat over 1,000,000 transfers after warm-up | growth {s['rss_growth_mib_after_warmup']:+.2f} MiB "
              f"| {_verdict(s['rss_flat'])} |",
              f"| per-transfer throughput within 2% of an independent timer | median error by size: "
              + ", ".join(f"{int(size) >> 20} MiB {err:+.2%}" for size, err in s["truth_median_error_by_bytes"].items())
              + f" (worst single {s['truth_worst_error']:.2%}) "
              f"| {_verdict(s['truth_goal_met'])} |",
              f"| eviction cost independent of the number of open requests (100,000 vs 1,000 open) | TTL tick "
              f"x{s['eviction_tick_ratio']:.2f}, opening one when full x{s['eviction_open_ratio']:.2f} "
              f"| {_verdict(s['eviction_goal_met'])} |", ""]
    lines += _cost_section(results["engine_cost"], "## 1. Cost to the engine (issue 12): in-process builder "
                                                    "(default), real Mooncake engine")
    lines += _cost_section(results["engine_cost_process"], "## 1b. Cost to the engine (issue 12): builder process "
                                                           "(OTEL_KVTRANSFER_BUILDER=process), real Mooncake engine")

    # 2. pipeline
    b = pipe["builder_only"]
    lines += ["## 2. Pipeline capacity", "",
              f"Records made by the package's Mooncake hot-path function around a stand-in method (not the engine) (the exact tuples and hot "
              f"path of a real call), turned into spans (BatchSpanProcessor + no-op exporter) and metrics.", "",
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
    lines += ["", f"Beyond capacity (queue {o['queue_size']:,}, producer calling as fast as it can for {o['seconds']} s): "
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
    lines += ["", f"After warm-up: {r['first']:.1f} -> {r['last']:.1f} MiB (min {r['min']:.1f}, max {r['max']:.1f}).", ""]

    # 4. truth
    lines += ["## 4. Truth", "", "### Per transfer: span throughput vs an independent timer", "",
              "Real Mooncake writes, TCP 127.0.0.1; the timer is perf_counter around the same engine call, outside "
              "the wrapper (so it also holds the wrapper's own microseconds).", "",
              "| bytes | transfers | span GiB/s (median) | timer GiB/s (median) | median error | worst error "
              "| timer - span (median us) | of which before the span's start / after its end (us) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size, v in truth["per_transfer"].items():
        lines.append(f"| {int(size):,} | {v['transfers']} | {v['median_span_gib_s']:.3f} | {v['median_timer_gib_s']:.3f} "
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


def rerender(out_dir: str) -> None:
    """RESULTS.md again from results.json (after a change to the rendering; no benchmark runs)."""
    with open(os.path.join(out_dir, "results.json"), encoding="utf-8") as handle:
        results = json.load(handle)
    results["summary"] = summary(results)
    write_json(os.path.join(out_dir, "results.json"), results)
    with open(os.path.join(out_dir, "RESULTS.md"), "w", encoding="utf-8") as handle:
        handle.write(render(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds: a smoke run, not for quoting")
    parser.add_argument("--out-dir", default=HERE, help="where results.json and RESULTS.md go (default: bench/)")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite RESULTS.md from the results.json in --out-dir, running nothing")
    args = parser.parse_args()
    if args.render_only:
        rerender(args.out_dir)
        return
    start = time.monotonic()
    results = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "quick": args.quick, "machine": machine()}
    for name in BENCHES:
        results[name] = _run_one(name, args.quick)
    results["total_wall_s"] = round(time.monotonic() - start, 1)
    results["summary"] = summary(results)
    results["goals"] = GOALS
    os.makedirs(args.out_dir, exist_ok=True)
    write_json(os.path.join(args.out_dir, "results.json"), results)
    text = render(results)
    with open(os.path.join(args.out_dir, "RESULTS.md"), "w", encoding="utf-8") as handle:
        handle.write(text)
    # The headline (issue 12's goals 1-3 for both builders, then capacity, memory, truth) on stdout as well.
    start = text.index("## Headline")
    print(text[start:text.index("## 1.", start)])
    print(f"bench: wrote {args.out_dir}/results.json and RESULTS.md in {results['total_wall_s']:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
