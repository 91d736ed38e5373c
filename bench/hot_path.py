"""The calling thread's cost of the package's Mooncake sync wrapper alone (stand-in engine): thread CPU per call.

The wrapper is the package's own (`mooncake._sync`) around the zero-cost stand-in method (common.py), so nothing
of an engine's work or its polling is in the figure; the recorder is on but its thread asleep (nothing drains
during the blocks; their records are built between them, on this thread, outside the figure). What is measured is
the code that runs on an engine's calling thread, which two commits can be compared on without the neighbours'
noise. `--tree` imports the package from another checkout:

    git worktree add /tmp/before <commit>
    for i in 1 2 3; do for tree in /tmp/before .; do python bench/hot_path.py --tree $tree; done; done

Python's cyclic GC runs on the thread whose allocation sets it off, so its collections are in the figure; the
run also prints how many there were of each generation and the time they took (`gc.callbacks`), and `--gc off`
measures the same blocks with the GC disabled. `--calls` is how many records wait in the queue at a block's end
(the recorder drains between blocks): 20,000 by default, ~1,000 nearer what waits between two drains in a
deployment. `--shape async` times an async send instead: the package's submission and wait wrappers around
stand-ins, one submission of 8 descriptors and the wait for its id a call: compiled where the package was built
with its C part, or with OTEL_KVTRANSFER_HOT_PATH=python the Python wrappers alone (the output says which).
"""

import argparse
import gc
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
    parser.add_argument("--gc", choices=("on", "off"), default="on", help="the cyclic GC during the blocks")
    parser.add_argument("--shape", choices=("sync", "async"), default="sync",
                        help="sync: transfer_sync_write of 0 B; async: batch_transfer_async_write of 8 descriptors, "
                             "then get_batch_transfer_status of its id (one send a call)")
    args = parser.parse_args()
    if not (1_000 <= args.calls <= 200_000 and 3 <= args.blocks <= 100):
        parser.error("--calls: 1000..200000, --blocks: 3..100")
    tree = use_tree(args.tree)
    os.environ.update({"OTEL_KVTRANSFER_FLUSH_INTERVAL_MS": "60000", "OTEL_KVTRANSFER_QUEUE_SIZE": str(1 << 18),
                       "OTEL_KVTRANSFER_BUILDER": "thread"})
    from common import WrappedStandIn, instrument_stand_ins, register_transport

    from otel_kvtransfer.recording.recorder import RECORDER

    instrumentor = instrument_stand_ins()
    async_wrappers = "python"
    if args.shape == "async":
        call = _async_pair()
        compiled = (sys.modules.get("otel_kvtransfer.engines.mooncake.compiled")  # the chooser's place in the wing,
                    or sys.modules.get("otel_kvtransfer.recording.compiled"))  # in trees before it; absent earlier
        if compiled is not None and compiled.chosen() is not None:
            async_wrappers = "compiled"
    else:
        engine = WrappedStandIn()
        register_transport(engine)
        call = engine.transfer_sync_write
    per_call = []
    collections = GCCount()
    try:
        for _ in range(args.blocks):
            gc.collect()  # each block starts from the same heap, whatever the last drain left
            if args.gc == "off":
                gc.disable()
            collections.counting = True
            started = time.thread_time_ns()
            for _ in range(args.calls):
                call("127.0.0.1:12345", 1, 2, 0)
            per_call.append((time.thread_time_ns() - started) / args.calls / 1e3)
            collections.counting = False
            gc.enable()
            RECORDER.drain()  # the block's records built between blocks, outside the figure
    finally:
        collections.close()
        instrumentor.uninstrument()
    calls = args.calls * args.blocks
    print(json.dumps({"package": os.path.join(tree, "otel_kvtransfer"), "engine": "stand-in", "shape": args.shape,
                      "gc": args.gc, "async_wrappers": async_wrappers,
                      "calls_per_block": args.calls,
                      "us_per_call": {"median": statistics.median(per_call), "min": min(per_call),
                                      "max": max(per_call)},
                      "gc_collections": collections.count, "gc_ms": {g: round(ns / 1e6, 2) for g, ns in
                                                                     collections.ns.items()},
                      "gc_us_per_call": round(sum(collections.ns.values()) / calls / 1e3, 3)}))
    return 0


def _async_pair():
    """A function of the sync call's four arguments that makes one async send: a submission of 8 descriptors,
    then the wait for its id, each the package's own wrapper (`mooncake._async`, `mooncake._batch_status`) around a
    stand-in that does nothing (its ids counting up)."""
    import itertools

    from common import register_transport

    from otel_kvtransfer.engines import mooncake

    ids = itertools.count(1)

    def submit(self, *args):
        return next(ids)

    def status(self, *args):
        return 0

    stand_in = type("AsyncStandIn", (), {"batch_transfer_async_write": mooncake._async(submit, mooncake.WRITE, True),
                                         "get_batch_transfer_status": mooncake._batch_status(status)})
    engine = stand_in()
    register_transport(engine)
    srcs, dsts, lengths = list(range(8)), list(range(8)), [0] * 8
    submit_batch, wait = engine.batch_transfer_async_write, engine.get_batch_transfer_status

    def pair(session, *_):
        return wait([submit_batch(session, srcs, dsts, lengths)])

    return pair


class GCCount:
    """The collections of each generation during the blocks and their wall time (on this thread, the only one
    allocating while they run)."""

    def __init__(self):
        self.counting = False
        self.count = {0: 0, 1: 0, 2: 0}
        self.ns = {0: 0, 1: 0, 2: 0}
        self._started = 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase, info):
        if not self.counting:
            return
        if phase == "start":
            self._started = time.perf_counter_ns()
        else:
            generation = info["generation"]
            self.count[generation] += 1
            self.ns[generation] += time.perf_counter_ns() - self._started

    def close(self):
        gc.callbacks.remove(self._on_gc)


if __name__ == "__main__":
    sys.exit(main())
