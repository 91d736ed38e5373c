"""Two checkouts' cost on one machine in one session: engine_cost.py's calling-thread and per-transfer figures
with the package imported from each tree in turn, runs alternating (before, after, before, after, ...), so a
change's cost is read beside the spread of its own runs and not against a figure from another day.

This checkout's engine_cost.py measures both trees (the bench is the same ruler; only the package differs). Each
run starts from a folder outside both trees, so that nothing puts the current folder's package ahead of the one
asked for (a `python -m` helper process puts its working folder first on its path).

    git worktree add /tmp/before <commit>
    python bench/compare_trees.py --before /tmp/before --after . --runs 2 --out /tmp/compare
    python bench/compare_trees.py --summarize /tmp/compare      # the table again, from the runs' JSON files
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE_COST = os.path.join(HERE, "engine_cost.py")
LABELS = ("before", "after")
RUN_TIMEOUT_S = 900
# (figure, where it is in engine_cost's JSON): the per-call shapes of its `thread` part, its `process` part.
THREAD_SHAPES = ("0 B sync write", "8 B sync write", "8 B write in a transfer_scope")


def _tree(path: str) -> str:
    tree = os.path.abspath(path)
    if not os.path.isfile(os.path.join(tree, "otel_kvtransfer", "__init__.py")):
        raise SystemExit(f"compare_trees: {path[:200]!r} holds no otel_kvtransfer package")
    return tree


def run(trees: dict, runs: int, parts: str, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    outside = tempfile.mkdtemp(prefix="kvt-compare-")
    total = runs * len(trees)
    done = 0
    for index in range(1, runs + 1):
        for label, tree in trees.items():
            out = os.path.join(out_dir, f"{label}_{index}.json")
            env = dict(os.environ, PYTHONPATH=tree)
            started = time.monotonic()
            with open(os.path.join(out_dir, f"{label}_{index}.log"), "wb") as log:
                try:
                    code = subprocess.run([sys.executable, ENGINE_COST, "--parts", parts, "--out", out], cwd=outside,
                                          env=env, stdout=log, stderr=subprocess.STDOUT,
                                          timeout=RUN_TIMEOUT_S).returncode
                except subprocess.TimeoutExpired:
                    code = "timeout"
            done += 1
            print(f"compare_trees: run {done}/{total} ({label}, {tree}) rc={code} in "
                  f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    os.rmdir(outside)


def _figures(result: dict) -> dict:
    figures = {}
    for shape in THREAD_SHAPES:
        entry = (result.get("thread") or {}).get(shape)
        if entry:
            figures[f"calling thread, {shape} (us/call)"] = (entry["added_thread_cpu_us"], entry["aa_thread_cpu_us"])
    process = result.get("process")
    if process:
        figures["engine process CPU per transfer (us)"] = (process["added_engine_cpu_us"],
                                                           process["aa_engine_cpu_us"])
    # the builder alone: a cost of its own, not a difference, so no A/A beside it
    for case, label in (("default_queue", "as deployed"), ("queue_holds_backlog", "export queue holding the backlog")):
        entry = (result.get("builder_alone") or {}).get(case)
        if entry:
            figures[f"builder CPU per record, {label} (us; {entry['where_built']})"] = (entry["cpu_us_per_record"],
                                                                                       None)
    return figures


def _cell(value: float, aa) -> str:
    return f"{value:.2f}" if aa is None else f"{value:+.2f} ({aa:+.2f})"


def summarize(out_dir: str) -> int:
    by_label = {label: [] for label in LABELS}
    for path in sorted(glob.glob(os.path.join(out_dir, "*_*.json"))):
        label = os.path.basename(path).split("_", 1)[0]
        if label in by_label:
            try:
                with open(path, encoding="utf-8") as handle:
                    by_label[label].append(_figures(json.load(handle)))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                print(f"compare_trees: skipping {os.path.basename(path)[:100]}: {type(exc).__name__}",
                      file=sys.stderr)
    if not all(by_label.values()):
        print(f"compare_trees: no runs of both trees in {out_dir[:200]}", file=sys.stderr)
        return 1
    names = [name for name in by_label["before"][0] if all(name in run for runs in by_label.values()
                                                           for run in runs)]
    print("| figure | before: added (A/A), or cost, per run | after: the same | median before -> after |")
    print("|---|---|---|---|")
    for name in names:
        cells = []
        for label in LABELS:
            cells.append(", ".join(_cell(*run[name]) for run in by_label[label]))
        medians = [statistics.median(run[name][0] for run in by_label[label]) for label in LABELS]
        sign = "+" if by_label["before"][0][name][1] is not None else ""
        print(f"| {name} | {cells[0]} | {cells[1]} | {medians[0]:{sign}.2f} -> {medians[1]:{sign}.2f} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="the checkout measured first in each pair")
    parser.add_argument("--after", help="the checkout measured second")
    parser.add_argument("--runs", type=int, default=2, help="pairs of runs (default 2)")
    parser.add_argument("--parts", default="thread,process", help="engine_cost.py --parts (default thread,process)")
    parser.add_argument("--out", help="folder for each run's JSON and log")
    parser.add_argument("--summarize", metavar="DIR", help="only print the table from the runs in DIR")
    args = parser.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    if not (args.before and args.after and args.out):
        parser.error("--before, --after and --out (or --summarize DIR)")
    if not 1 <= args.runs <= 10:
        parser.error("--runs: 1 to 10")
    run({"before": _tree(args.before), "after": _tree(args.after)}, args.runs, args.parts, args.out)
    return summarize(args.out)


if __name__ == "__main__":
    sys.exit(main())
