"""The calling thread's cost of the package's Mooncake sync wrapper alone (stand-in engine): thread CPU per call.

The wrapper is the package's own (`mooncake._sync`) around the zero-cost stand-in method (common.py), so nothing
of an engine's work or its polling is in the figure; the recorder is on but its thread asleep (nothing drains
during the blocks; their records are built between them, on this thread, outside the figure). What is measured is
the code that runs on an engine's calling thread, which two commits can be compared on without the neighbours'
noise. `--tree` imports the package from another checkout:

    git worktree add /tmp/before <commit>
    for i in 1 2 3; do for tree in /tmp/before .; do python bench/hot_path.py --tree $tree; done; done
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
    parser.add_argument("--calls", type=int, default=20_000, help="calls per block")
    parser.add_argument("--blocks", type=int, default=15)
    args = parser.parse_args()
    if not (1_000 <= args.calls <= 200_000 and 3 <= args.blocks <= 100):
        parser.error("--calls: 1000..200000, --blocks: 3..100")
    tree = use_tree(args.tree)
    os.environ.update({"OTEL_KVTRANSFER_FLUSH_INTERVAL_MS": "60000", "OTEL_KVTRANSFER_QUEUE_SIZE": str(1 << 18),
                       "OTEL_KVTRANSFER_BUILDER": "thread"})
    from common import WrappedStandIn, register_transport, wrap_stand_ins
    from opentelemetry.sdk.trace import TracerProvider

    from otel_kvtransfer import KVTransferInstrumentor
    from otel_kvtransfer.recording.recorder import RECORDER

    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument(tracer_provider=TracerProvider(shutdown_on_exit=False))
    wrap_stand_ins(lambda wrapped, instance, a, kw: wrapped(*a, **kw))
    engine = WrappedStandIn()
    register_transport(engine)
    call = engine.transfer_sync_write
    per_call = []
    try:
        for _ in range(args.blocks):
            started = time.thread_time_ns()
            for _ in range(args.calls):
                call("127.0.0.1:12345", 1, 2, 0)
            per_call.append((time.thread_time_ns() - started) / args.calls / 1e3)
            RECORDER.drain()  # the block's records built between blocks, outside the figure
    finally:
        instrumentor.uninstrument()
    print(json.dumps({"package": os.path.join(tree, "otel_kvtransfer"), "engine": "stand-in",
                      "us_per_call": {"median": statistics.median(per_call), "min": min(per_call),
                                      "max": max(per_call)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
