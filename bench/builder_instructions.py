"""The builder's machine instructions per record (stand-in engine), counted by valgrind's callgrind: a figure that
two commits can be compared by on a shared machine, where thread CPU time spreads by a quarter from run to run.

Each run starts the same process twice under callgrind, with the same hash seed: both queue N records from the
package's own Mooncake wrapper around the zero-cost stand-in method (common.py), one of them also drains them
through the builder (span, metric rows, hand-off to the BatchSpanProcessor). The difference of the two main
threads' instruction counts, over N, is the builder's per record; the export thread is counted apart and left
out. Instructions are not time (a cache miss costs many), so the figure ranks changes, it does not replace
`builder_cpu.py`'s microseconds. Needs valgrind (`apt-get install valgrind`); a run takes about a minute.

    python bench/builder_instructions.py [--records N] [--runs R] [--tree T] [--without metric-rows|send-metrics]
"""

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from trees import add_tree_option

HERE = os.path.abspath(__file__)


# --without: a part of the builder's work switched off, to see its share (the figures are then not a builder's)
WITHOUT = {
    "none": None,
    "metric-rows": ("otel_kvtransfer.building.kvmetrics", "KVMetrics", "_apply",
                    lambda self, pending: [rows.rows.clear() for rows in pending]),
    "send-metrics": ("otel_kvtransfer.building.record_metrics", "RecordMetrics", "send", lambda self, *a: None),
}


def _child(tree: str, records: int, drain: bool, without: str) -> None:
    """Queue `records` records, drain them when `drain`, and end at once (no exit work in the count)."""
    import importlib

    from trees import use_tree

    use_tree(tree)
    if WITHOUT[without] is not None:
        module, cls, name, replacement = WITHOUT[without]
        setattr(getattr(importlib.import_module(module), cls), name, replacement)
    import pipeline
    from pipeline import RECORDER, SESSION, Pipeline, WrappedStandIn, _instrument, config, register_transport

    pipeline.wrap_stand_ins(lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    sink = Pipeline(max_queue_size=1 << 21, max_export_batch_size=512, schedule_delay_millis=50)
    _instrument({config.QUEUE_SIZE: str(1 << 18), config.FLUSH_INTERVAL_MS: "60000"}, sink)
    engine = WrappedStandIn()
    register_transport(engine)
    RECORDER.drain()
    for _ in range(records):
        engine.transfer_sync_write(SESSION, 4096, 8192, 8)
    if drain:
        RECORDER.drain()
    sys.stdout.flush()
    os._exit(0)


def _main_thread_instructions(tree: str, records: int, drain: bool, without: str, folder: str) -> int:
    out = os.path.join(folder, f"cg-{int(drain)}")
    command = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}.%p",
               sys.executable, HERE, "--child", "drain" if drain else "queue", "--records", str(records),
               "--tree", tree, "--without", without]
    done = subprocess.run(command, env=dict(os.environ, PYTHONHASHSEED="0"), capture_output=True, text=True,
                          timeout=900)
    files = glob.glob(out + ".*-01")  # thread 1: the main thread, which drains
    try:
        if done.returncode != 0 or len(files) != 1:
            raise SystemExit(f"builder_instructions: callgrind run failed ({done.returncode}): "
                             f"{done.stderr.strip().splitlines()[-1:] or 'no output'}")
        with open(files[0]) as handle:
            for line in handle:
                if line.startswith("summary:"):
                    return int(line.split()[1])
        raise SystemExit("builder_instructions: callgrind wrote no summary line")
    finally:
        for path in glob.glob(out + ".*"):
            os.remove(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_tree_option(parser)
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--without", choices=sorted(WITHOUT), default="none",
                        help="switch a part off to see its share: the rows' application, or a send's metrics")
    parser.add_argument("--child", choices=("queue", "drain"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.tree, args.records, args.child == "drain", args.without)
    if not 100 <= args.records <= 50_000:
        parser.error("--records: between 100 and 50000")
    if not 1 <= args.runs <= 10:
        parser.error("--runs: between 1 and 10")
    if shutil.which("valgrind") is None:
        print("builder_instructions: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    per_record = []
    with tempfile.TemporaryDirectory(prefix="kvt-callgrind-") as folder:
        for run in range(args.runs):
            print(f"run {run + 1}/{args.runs}: {args.records:,} records, queued then drained, under callgrind",
                  file=sys.stderr, flush=True)
            queued = _main_thread_instructions(args.tree, args.records, False, args.without, folder)
            drained = _main_thread_instructions(args.tree, args.records, True, args.without, folder)
            per_record.append((drained - queued) / args.records)
    print(json.dumps({"tree": os.path.abspath(args.tree), "engine": "stand-in", "records": args.records,
                      "without": args.without,
                      "instructions_per_record": {"median": statistics.median(per_record), "min": min(per_record),
                                                  "max": max(per_record), "runs": per_record}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
