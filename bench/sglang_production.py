"""A production-shaped run on the real sglang PD deployment: highest sustained rate, then instrumented vs not.

The deployment of tests/sglang_serving (prefill + decode servers, sglang-router, one private network namespace)
with a tiny config-only Llama of realistic transfer shape: 32 layers, page size 16, prompts sent through chunked
prefill (several KV chunks per request; 512 tokens by default, as a shared 2-core machine under a load of 10-26
prefills only 20-50 tokens a second at this depth). Hidden size is small so that CPU compute stays bearable; the
KV per token is 32 layers x 2 x 2 KV heads x 64 x 4 B (float32) = 32 KiB, 16 MiB per 512-token request.

1. The load (bench/sglang_load.py). Default: closed loop at --concurrency N (2): N requests always in the
   deployment, so the prefill never waits for work and the completion rate is the highest rate the deployment
   sustains (an open-loop rate above it would grow TTFT without bound); TTFT then holds the queueing an
   arrival meets at that rate. --rate R: open loop, request i leaves at i / R. --ramp (first deployment,
   instrumented): open-loop rates rising by RAMP_FACTOR from half the rate one request alone could reach; a rate
   is sustained when every request succeeds, the completion rate keeps up with the offered rate and TTFT does not
   keep growing (median TTFT of the last third of the requests at most RAMP_GROWTH x that of the first third);
   the highest sustained rate is kept. On a shared 2-core machine a ramp step at a few requests a minute takes
   minutes, hence the closed loop by default.
2. Rounds: instrumented and uninstrumented deployments alternate (round 0: with, without; round 1: without,
   with; ...), each with the same warm-up and the same measured requests under the same load. Per mode: requests/s,
   TTFT p50/p99 with the spread over rounds, and CPU per request of each server's process tree (/proc via psutil,
   between the first and the last measured request), the package's helper processes (OTEL_KVTRANSFER_BUILDER=auto
   starts one per transferring sglang process under opentelemetry-instrument; found by their command line) apart.

Instrumented servers export traces and metrics over OTLP/HTTP to bench/otlp_receiver.py, started in the same
namespace on 127.0.0.1; its span counts are written down. Appends to bench/results-sglang.json.

    python bench/sglang_production.py [--rounds 2] [--requests 10] [--tokens 512]
                                      [--concurrency 2 | --rate R | --ramp]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

from common import append_result, machine
from sglang_serving import deployment as dep

RESULTS = os.path.join(HERE, "results-sglang.json")
LOAD = os.path.join(HERE, "sglang_load.py")
RECEIVER = os.path.join(HERE, "otlp_receiver.py")
HELPER_MARK = "otel_kvtransfer.offloading.helper_process"

MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 2048, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1,
    "eos_token_id": 2,
}
CHUNK_TOKENS = 256
# float32: on a CPU without bf16 units its attention is ~2x faster than bfloat16 (and bytes per page double)
SERVER_FLAGS = ["--page-size", "16", "--max-total-tokens", "32768", "--chunked-prefill-size", str(CHUNK_TOKENS),
                "--dtype", "float32",
                # on CPU sglang sizes the pool from free system memory before and after loading, which the other
                # processes of a shared machine move: a larger fraction (the pool stays capped by max-total-tokens)
                "--mem-fraction-static", "0.5"]
RAMP_FACTOR, RAMP_GROWTH, RAMP_KEEP_UP, RAMP_STEPS, RAMP_REQUESTS = 1.4, 1.5, 0.85, 4, 6
WARMUP = 2
# A CPU-starved server answers /health late: the router's default checks (and its circuit breaker) would take it
# out of service mid-run and fail requests that the server would have served. Failures stay visible: no retries.
ROUTER_FLAGS = ["--health-check-timeout-secs", "120", "--health-failure-threshold", "1000", "--disable-circuit-breaker",
                "--disable-retries", "--queue-timeout-secs", "1800"]


class Receiver:
    """bench/otlp_receiver.py inside the deployment's namespace (it binds 127.0.0.1 there, ports by the kernel)."""

    def __init__(self, nsenter):
        self.proc = dep.start(nsenter + [sys.executable, RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT)
        line = self.proc.stdout.readline()
        try:
            self.http_port = int(json.loads(line)["http_port"])
        except (ValueError, KeyError, TypeError):
            self.stop()
            raise RuntimeError(f"the OTLP receiver did not start: {line[:200]!r}") from None

    def counts(self) -> dict:
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        dep.stop(self.proc)  # its own process group, by its PID


class ProductionDeployment(dep.Deployment):
    """The serving deployment with the production-shaped model; instrumented ones export over OTLP/HTTP."""

    def __init__(self, workdir, instrument, model_dir):
        super().__init__(workdir, instrument=instrument, model_dir=model_dir, server_flags=SERVER_FLAGS,
                         router_flags=ROUTER_FLAGS, exporters=["otlp"] if instrument else None)
        self.receiver = None
        self.exported = None

    def _start_namespace(self):
        super()._start_namespace()
        if self.instrument:  # before the servers: their environment needs the receiver's port
            self.receiver = Receiver(self.nsenter)
            self.extra_env.update({
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.receiver.http_port}",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_METRIC_EXPORT_INTERVAL": "5000"})

    def load(self, mode, value, requests):
        url = f"http://127.0.0.1:{dep.ROUTER_PORT}/generate"
        code, out, err = self.run_in_namespace([sys.executable, LOAD, url, mode, repr(value)], timeout=1800,
                                               input_text=json.dumps(requests))
        if code != 0:
            raise RuntimeError(f"load failed ({code}): {err[-1500:]}")
        return json.loads(out)

    def stop(self):
        super().stop()  # servers first: their exporters flush on SIGTERM
        if self.receiver is not None:
            try:
                self.exported = self.receiver.counts()
            except (OSError, ValueError):
                self.exported = None
            self.receiver.stop()
            self.receiver = None


# --- CPU of the server process trees ------------------------------------------------------------------------------
def cpu_snapshot(deployment) -> dict:
    """pid -> (category, CPU seconds so far): each server's tree, the package's helpers apart."""
    import psutil

    found = {}
    for name in ("prefill", "decode"):
        for pid in deployment.server_pids(name):
            try:
                process = psutil.Process(pid)
                times = process.cpu_times()
                helper = any(HELPER_MARK in part for part in process.cmdline())
                found[pid] = (f"{name}_helper" if helper else name, times.user + times.system)
            except psutil.Error:
                continue
    return found


def cpu_used(before: dict, after: dict) -> dict:
    """CPU seconds per category between two snapshots (a process born in between counted whole)."""
    used = {}
    for pid, (category, seconds) in after.items():
        used[category] = used.get(category, 0.0) + seconds - before.get(pid, (category, 0.0))[1]
    return used


# --- figures ------------------------------------------------------------------------------------------------------
def quantile(values, q):
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def load_figures(answer, offered_rate=None) -> dict:
    ok = [r for r in answer["results"] if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok]
    ends = [r["offset_s"] + r["total_s"] for r in ok]
    span = (max(ends) - min(r["offset_s"] for r in ok)) if ok else 0.0
    third = max(1, len(ok) // 3)
    ordered = [r["ttft_s"] for r in sorted(ok, key=lambda r: r["offset_s"])]
    return {"offered_rate": offered_rate, "requests": len(answer["results"]),
            "errors": len(answer["results"]) - len(ok),
            "requests_per_s": len(ok) / span if span > 0 else 0.0,
            "ttft_p50_ms": 1e3 * quantile(ttft, 0.5) if ttft else None,
            "ttft_p99_ms": 1e3 * quantile(ttft, 0.99) if ttft else None,
            "ttft_first_third_ms": 1e3 * statistics.median(ordered[:third]) if ok else None,
            "ttft_last_third_ms": 1e3 * statistics.median(ordered[-third:]) if ok else None,
            "first_error": next((r["error"] for r in answer["results"] if r["error"]), None)}


def sustained(figures) -> bool:
    return (figures["errors"] == 0 and figures["requests_per_s"] >= RAMP_KEEP_UP * figures["offered_rate"]
            and figures["ttft_last_third_ms"] <= RAMP_GROWTH * figures["ttft_first_third_ms"])


def ramp(deployment, alone_s, tokens, max_new_tokens):
    """Rates from half of 1/alone_s up by RAMP_FACTOR; the highest sustained one, and every step's figures."""
    rate, kept, steps = round(0.5 / alone_s, 3), None, []
    for step in range(RAMP_STEPS):
        requests = dep.prompts(RAMP_REQUESTS, tokens, max_new_tokens, repeat_every=0, seed=100 + step,
                               rid_prefix=f"ramp{step}")
        figures = load_figures(deployment.load("open", rate, requests), rate)
        figures["sustained"] = sustained(figures)
        steps.append(figures)
        print(f"sglang_production: ramp {rate:.3f}/s -> {figures['requests_per_s']:.3f}/s, TTFT p50 "
              f"{figures['ttft_p50_ms']:.0f} ms (first third {figures['ttft_first_third_ms']:.0f}, last third "
              f"{figures['ttft_last_third_ms']:.0f}), errors {figures['errors']}: "
              f"{'sustained' if figures['sustained'] else 'NOT sustained'}", file=sys.stderr)
        if not figures["sustained"]:
            break
        kept = rate
        rate = round(rate * RAMP_FACTOR, 3)
    return kept if kept is not None else round(steps[0]["offered_rate"] / RAMP_FACTOR, 3), steps


def describe(values) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}


def run_deployment(instrument, model_dir, workdir, args, state):
    deployment = ProductionDeployment(workdir, instrument, model_dir)
    entry = {"mode": "with" if instrument else "without"}
    started = time.monotonic()
    try:
        deployment.start()
        entry["start_s"] = round(time.monotonic() - started, 1)
        warm = deployment.generate(dep.prompts(WARMUP, args.tokens, args.max_new_tokens, repeat_every=0, seed=22,
                                               rid_prefix="warm"))
        entry["warmup_ttft_ms"] = [round(1e3 * r["ttft_s"], 1) for r in warm]
        if args.ramp and state.get("rate") is None:
            alone = statistics.median(r["total_s"] for r in warm[1:])
            state["rate"], state["ramp"] = ramp(deployment, alone, args.tokens, args.max_new_tokens)
            print(f"sglang_production: kept rate {state['rate']}/s", file=sys.stderr)
        mode, value = ("open", state["rate"]) if state.get("rate") else ("closed", args.concurrency)
        requests = dep.prompts(args.requests, args.tokens, args.max_new_tokens, repeat_every=0, seed=21,
                               rid_prefix="bench")
        load_before = os.getloadavg()
        before = cpu_snapshot(deployment)
        answer = deployment.load(mode, value, requests)
        after = cpu_snapshot(deployment)
        entry.update(load_figures(answer, state.get("rate")))
        entry["phase_s"] = round(answer["wall_s"], 2)  # CPU per second too: helpers cost time, not only work
        entry["loadavg_before"], entry["loadavg_after"] = list(load_before), list(os.getloadavg())
        ok = max(1, len(answer["results"]) - entry["errors"])
        used = cpu_used(before, after)
        entry["cpu_s"] = {k: round(v, 3) for k, v in sorted(used.items())}
        entry["cpu_ms_per_request"] = {k: round(1e3 * v / ok, 2) for k, v in sorted(used.items())}
        entry["helper_pids"] = sorted(pid for pid, (category, _) in after.items() if category.endswith("_helper"))
        entry["raw_ttft_s"] = [round(r["ttft_s"], 4) for r in answer["results"] if r["error"] is None]
    finally:
        deployment.stop()
    if deployment.exported is not None:
        spans = deployment.exported.get("spans", {})
        size = deployment.exported.get("metrics", {}).get("kv_transfer.size", {})
        entry["exported"] = {"spans": spans, "kv_transfer.size": {"count": size.get("count"), "sum": size.get("sum")},
                             "receiver_requests": deployment.exported.get("requests")}
    entry["left_running"] = [pid for pid in entry.get("helper_pids", []) if os.path.exists(f"/proc/{pid}")]
    return entry


def summarize(per_deployment) -> dict:
    summary = {}
    for mode in ("with", "without"):
        runs = [d for d in per_deployment if d["mode"] == mode and "ttft_p50_ms" in d]
        ttft = [1e3 * v for d in runs for v in d["raw_ttft_s"]]
        categories = sorted({k for d in runs for k in d["cpu_ms_per_request"]})
        summary[mode] = {
            "deployments": len(runs),
            "requests_per_s": describe([d["requests_per_s"] for d in runs]),
            "ttft_p50_ms": describe([d["ttft_p50_ms"] for d in runs]),
            "ttft_p99_ms": describe([d["ttft_p99_ms"] for d in runs]),
            "pooled_ttft_ms": {"n": len(ttft), "p50": quantile(ttft, 0.5) if ttft else None,
                               "p99": quantile(ttft, 0.99) if ttft else None},
            "cpu_ms_per_request": {k: describe([d["cpu_ms_per_request"].get(k, 0.0) for d in runs])
                                   for k in categories},
        }
    with_cpu = summary["with"]["cpu_ms_per_request"]
    helper = sum(v.get("median", 0.0) for k, v in with_cpu.items() if k.endswith("_helper"))
    servers = sum(v.get("median", 0.0) for v in with_cpu.values())
    without = sum(v.get("median", 0.0) for v in summary["without"]["cpu_ms_per_request"].values())
    summary["package_cpu"] = {
        "helper_ms_per_request": helper,
        "helper_share_of_instrumented_server_cpu": helper / servers if servers else None,
        "server_trees_ms_per_request": {"with": servers, "without": without},
        "added_ms_per_request": servers - without if servers and without else None,
        "added_share": (servers - without) / without if servers and without else None,
    }
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2, help="closed loop: requests always in flight")
    parser.add_argument("--rate", type=float, default=None, help="open loop at this many requests/s")
    parser.add_argument("--ramp", action="store_true", help="open loop at the highest rate a ramp sustains")
    parser.add_argument("--modes", choices=("both", "with", "without"), default="both")
    parser.add_argument("--no-save", action="store_true", help=f"do not append to {os.path.basename(RESULTS)}")
    args = parser.parse_args(argv)
    if not (1 <= args.rounds <= 10 and 3 <= args.requests <= 300 and 16 <= args.tokens <= 6000
            and 1 <= args.max_new_tokens <= 256 and (args.rate is None or 0 < args.rate <= 50)
            and 1 <= args.concurrency <= 32 and not (args.ramp and args.rate)):
        print("sglang_production: --rounds 1..10, --requests 3..300, --tokens 16..6000, --max-new-tokens 1..256, "
              "--concurrency 1..32, --rate 0..50 (not with --ramp)", file=sys.stderr)
        return 2
    base = tempfile.mkdtemp(prefix="kvt-sglang-prod-")
    model_dir = os.path.join(base, "model")
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(MODEL, handle)
    state = {"rate": args.rate, "ramp": []}
    per_deployment, began = [], time.monotonic()
    for round_index in range(args.rounds):
        order = [True, False] if round_index % 2 == 0 else [False, True]
        if args.modes != "both":
            order = [args.modes == "with"]
        for instrument in order:
            mode = "with" if instrument else "without"
            print(f"sglang_production: round {round_index}, {mode}: starting the deployment ...", file=sys.stderr)
            entry = run_deployment(instrument, model_dir, os.path.join(base, f"r{round_index}-{mode}"), args, state)
            entry["round"] = round_index
            per_deployment.append(entry)
            print(f"sglang_production: round {round_index}, {mode}: {entry.get('requests_per_s', 0):.3f} req/s, "
                  f"TTFT p50 {entry.get('ttft_p50_ms') or 0:.0f} ms p99 {entry.get('ttft_p99_ms') or 0:.0f} ms, "
                  f"CPU ms/request {entry.get('cpu_ms_per_request')}, errors {entry.get('errors')} "
                  f"{entry.get('first_error') or ''}", file=sys.stderr)
            if entry.get("errors") and entry.get("errors") == entry.get("requests"):
                print("sglang_production: every request failed; stopping (logs in " + base + ")", file=sys.stderr)
                return 1
    config = dep.model_config(model_dir)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "kind": "production", "machine": machine(),
        "setup": {"rounds": args.rounds, "requests": args.requests, "prompt_tokens": args.tokens,
                  "max_new_tokens": args.max_new_tokens,
                  "load": (f"open loop at {state['rate']}/s ({'ramp' if args.ramp else '--rate'})" if state["rate"]
                           else f"closed loop, {args.concurrency} requests always in flight"), "model": MODEL,
                  "server_flags": SERVER_FLAGS, "router_flags": ROUTER_FLAGS,
                  "kv_bytes_per_request": dep.expected_kv_bytes(args.tokens, config),
                  "exporter": "OTLP/HTTP (traces and metrics) to bench/otlp_receiver.py on 127.0.0.1, same netns",
                  "path": "client threads -> sglang-router (PD) -> prefill -> Mooncake TCP -> decode, one netns",
                  "wall_s": round(time.monotonic() - began, 1)},
        "ramp": state["ramp"], "summary": summarize(per_deployment), "per_deployment": per_deployment}
    print(json.dumps(result["summary"], indent=1))
    if not args.no_save:
        append_result(RESULTS, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
