"""The builder's CPU per record (stand-in engine): thread CPU time of one drain of N queued records, R drains.

The records come from the package's own Mooncake wrapper around the zero-cost stand-in method (common.py), so
the figure is the builder's alone: building each send span, its metric points and busy time, handing the span to
the export queue (the export itself runs on the BatchSpanProcessor's thread, not counted). Thread CPU, not wall
time, so the export thread's share of the two cores does not blur it. `--tree` imports the package (and this
folder's helpers) from another checkout, to compare two commits on one machine:

    git worktree add /tmp/before <commit>
    for i in 1 2 3 4; do for tree in /tmp/before .; do python bench/builder_cpu.py --tree $tree; done; done
"""

import argparse
import json
import os
import statistics
import sys
import time

from trees import add_tree_option, use_tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_tree_option(parser)
    parser.add_argument("--records", type=int, default=40_000)
    parser.add_argument("--drains", type=int, default=3)
    args = parser.parse_args()
    use_tree(args.tree)  # the package from `tree`; this folder's stand-in and pipeline helpers
    import pipeline
    from pipeline import RECORDER, SESSION, Pipeline, WrappedStandIn, _instrument, config, register_transport

    import otel_kvtransfer

    pipeline.wrap_stand_ins(lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    per_record = []
    for _ in range(args.drains):
        sink = Pipeline(max_queue_size=1 << 21, max_export_batch_size=512, schedule_delay_millis=50)
        instrumentor = _instrument({config.QUEUE_SIZE: str(1 << 18), config.FLUSH_INTERVAL_MS: "60000"}, sink)
        engine = WrappedStandIn()
        register_transport(engine)
        try:
            RECORDER.drain()
            for _ in range(args.records):
                engine.transfer_sync_write(SESSION, 4096, 8192, 8)
            queued = RECORDER.pending()
            began = time.thread_time()
            RECORDER.drain()
            per_record.append((time.thread_time() - began) / queued * 1e6)
        finally:
            instrumentor.uninstrument()
            sink.shutdown()
    print(json.dumps({"package": os.path.dirname(otel_kvtransfer.__file__), "engine": "stand-in",
                      "us_per_record": {"median": statistics.median(per_record), "min": min(per_record),
                                        "max": max(per_record), "drains": per_record}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
