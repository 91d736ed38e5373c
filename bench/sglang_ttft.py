"""TTFT through sglang-router on a real PD deployment, with and without the instrumentation, over the same requests.

TTFT = time from sending a streaming /generate request to the router until its first streamed token arrives,
measured inside the deployment's network namespace (tests/sglang_serving/client.py). "With": both servers under
`opentelemetry-instrument`, spans to an OTLP-JSON span file. "Without": plain `python -m sglang.launch_server`,
the package's sglang plugin switched off (OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=kv_transfer).

Only one deployment runs at a time (2-core machine), so the two modes alternate by round (round 0: with, then
without; round 1: without, then with; ...), each deployment getting the same warm-up requests and then the same
measured requests. Each deployment start is 1-3 minutes here. Prints the figures and the spread (min, max,
stdev, and the difference of medians next to the spread within each mode), and appends them to
bench/results-sglang.json.

    python bench/sglang_ttft.py [--rounds 1] [--requests 12] [--tokens 300] [--max-new-tokens 8]
"""

import argparse
import os
import statistics
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


def measure(instrument: bool, requests, warmup, workdir):
    deployment = dep.Deployment(workdir, instrument=instrument)
    try:
        deployment.start()
        deployment.generate(warmup)
        return [r["ttft_s"] for r in deployment.generate(requests)]
    finally:
        deployment.stop()


def describe(values):
    return {"n": len(values), "median_ms": 1e3 * statistics.median(values), "mean_ms": 1e3 * statistics.fmean(values),
            "min_ms": 1e3 * min(values), "max_ms": 1e3 * max(values),
            "stdev_ms": 1e3 * statistics.stdev(values) if len(values) > 1 else 0.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--no-save", action="store_true", help=f"do not append to {os.path.basename(RESULTS)}")
    args = parser.parse_args(argv)
    if not (1 <= args.rounds <= 10 and 1 <= args.requests <= 200 and 1 <= args.tokens <= 4000
            and 1 <= args.max_new_tokens <= 256):
        print("sglang_ttft: --rounds 1..10, --requests 1..200, --tokens 1..4000, --max-new-tokens 1..256",
              file=sys.stderr)
        return 2
    # distinct prompts (no prefix-cache hits), the same in every deployment
    requests = dep.prompts(args.requests, args.tokens, args.max_new_tokens, repeat_every=0, seed=21,
                           rid_prefix="bench")
    warmup = dep.prompts(2, args.tokens, args.max_new_tokens, repeat_every=0, seed=22, rid_prefix="warm")
    ttft = {"with": [], "without": []}
    per_round = []
    base = tempfile.mkdtemp(prefix="kvt-sglang-ttft-")
    for round_index in range(args.rounds):
        order = [True, False] if round_index % 2 == 0 else [False, True]
        for instrument in order:
            mode = "with" if instrument else "without"
            print(f"sglang_ttft: round {round_index}, {mode} instrumentation: starting the deployment ...",
                  file=sys.stderr)
            values = measure(instrument, requests, warmup, os.path.join(base, f"r{round_index}-{mode}"))
            ttft[mode] += values
            per_round.append({"round": round_index, "mode": mode, **describe(values)})
    summary = {mode: describe(values) for mode, values in ttft.items()}
    summary["median_difference_ms"] = summary["with"]["median_ms"] - summary["without"]["median_ms"]
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
              "setup": {"rounds": args.rounds, "requests": args.requests, "prompt_tokens": args.tokens,
                        "max_new_tokens": args.max_new_tokens,
                        "model": "tiny config-only Llama (2 layers, hidden 256, 2 KV heads), dummy weights, bf16",
                        "path": "client -> sglang-router (PD) -> prefill -> Mooncake TCP -> decode, one netns"},
              "ttft": summary, "per_deployment": per_round,
              "raw_ttft_s": {mode: [round(v, 5) for v in values] for mode, values in ttft.items()}}
    for mode in ("with", "without"):
        s = summary[mode]
        print(f"TTFT {mode:>7} instrumentation: median {s['median_ms']:.1f} ms  mean {s['mean_ms']:.1f} ms  "
              f"min {s['min_ms']:.1f}  max {s['max_ms']:.1f}  stdev {s['stdev_ms']:.1f} ms  (n={s['n']})")
    print(f"median difference (with - without): {summary['median_difference_ms']:+.1f} ms")
    if not args.no_save:
        append_result(RESULTS, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
