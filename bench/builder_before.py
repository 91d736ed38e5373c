"""The builder's CPU per record against an earlier commit's, in one session: engine_cost.py's builder part (real
Mooncake records, built and exported through the real OTLP/HTTP exporter to a receiver) with the package imported
from a checkout of that commit and from this one, runs alternating (compare_trees.py).

    python bench/builder_before.py [--commit 59be0ed] [--runs 3] [--quick] [--out FILE]

The earlier checkout is a detached `git worktree` in a temporary folder, removed at the end. 59be0ed is the last
commit before busy time, set-up, late completion, string repair and span limits were added to the builder. Each
tree's spread over its runs is printed beside its median: a difference inside it is not a difference.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import compare_trees
from common import emit_json, machine

ROOT = os.path.dirname(HERE)
BEFORE_COMMIT = "59be0ed"
CASES = ("default_queue", "queue_holds_backlog")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=120, check=False)


def _figures(path: str) -> dict:
    """{case: (us per record, records per second, dropped)} of one engine_cost.py run's builder part."""
    import json

    with open(path, encoding="utf-8") as handle:
        alone = json.load(handle).get("builder_alone") or {}
    return {case: (x["cpu_us_per_record"], x.get("records_per_cpu_s"), x.get("dropped")) for case, x in alone.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default=BEFORE_COMMIT, help=f"the earlier commit (default {BEFORE_COMMIT})")
    parser.add_argument("--runs", type=int, default=3, help="pairs of runs (default 3; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="one pair: a smoke run, not for quoting")
    parser.add_argument("--out", help="write the JSON here as well as to stdout")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    if not 1 <= runs <= 10:
        parser.error("--runs: 1 to 10")
    if not all(c in "0123456789abcdef" for c in args.commit.lower()) or not 4 <= len(args.commit) <= 40:
        parser.error("--commit: a commit's hexadecimal name")
    if _git("cat-file", "-e", f"{args.commit}^{{commit}}").returncode != 0:
        emit_json({"skipped": f"commit {args.commit} is not in this checkout's history (a shallow clone?)"}, args.out)
        return 0
    result = {"commit_before": args.commit, "commit_after": _git("rev-parse", "--short", "HEAD").stdout.strip(),
              "runs": runs, "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="kvt-before-") as tmp:
        tree, out_dir = os.path.join(tmp, "tree"), os.path.join(tmp, "runs")
        added = _git("worktree", "add", "--detach", tree, args.commit)
        if added.returncode != 0:
            raise SystemExit(f"builder_before: git worktree add failed: {added.stderr.strip()[:300]}")
        try:
            compare_trees.run({"before": tree, "after": ROOT}, runs, "builder", out_dir)
            for label in compare_trees.LABELS:
                per_run = [_figures(os.path.join(out_dir, f"{label}_{i}.json")) for i in range(1, runs + 1)]
                result[label] = {case: {"us_per_record_runs": [run[case][0] for run in per_run],
                                        "us_per_record": statistics.median(run[case][0] for run in per_run),
                                        "records_per_s_runs": [run[case][1] for run in per_run],
                                        "dropped_runs": [run[case][2] for run in per_run]}
                                 for case in CASES if all(case in run for run in per_run)}
        finally:
            _git("worktree", "remove", "--force", tree)
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
