"""Where the Mooncake sync wrapper's cost on the calling thread goes: the same stand-in call wrapped in steps.

Each step is the one before it plus one part of what the package's wrapper (`mooncake._sync`) does per call,
written here as the wrapper writes it; the last step is the package's wrapper itself. All wrap the same zero-cost
stand-in method (common.py), so the figures are Python's own, not an engine's (labelled stand-in):

  direct      the stand-in method called with no wrapper
  forward     a Python function that takes the four arguments as the wrapper does (positional-only) and passes
              them on: the floor of any Python wrapper
  clocks      + the two clock readings around the call
  context     + the checks before the call (recorder on, the current context, suppress_instrumentation(), the
              thread's transfer scope)
  record      + the record built and appended to a deque (the package's own record layout)
  package     the package's wrapper, recording for real (its records drained between blocks)

Beside them, not a step: `star_forward`, a wrapper that forwards `*args, **kwargs` (what the package's wrapper did
before it took its arguments as positional-only parameters).

Blocks of each step alternate, round after round, so drift hits all alike; per step the median of its blocks,
and beside it the spread (max - min) of those blocks. The GC is on (the engine's default) unless `--gc off`.

    python bench/wrapper_floor.py [--tree OTHER_CHECKOUT] [--calls 2000] [--rounds 30] [--gc off] [--out FILE] [--quick]
"""

import argparse
import collections
import gc
import json
import os
import statistics
import sys
import time
from time import monotonic_ns

from trees import add_tree_option, use_tree

STEPS = ("direct", "forward", "clocks", "context", "record", "package")
MEASURED = STEPS + ("star_forward",)


def _steps(original, package_wrapper):
    """step -> a class whose transfer_sync_write is that step's wrapper around `original`."""
    # Each step is written out whole: calling the step before it would add a frame, and measure that instead.
    from otel_kvtransfer.recording import clock, integration
    from otel_kvtransfer.recording.patching import SUPPRESS_KEY, SUPPRESS_KEY_PLAIN, current_context
    from otel_kvtransfer.recording.recorder import RECORDER
    from otel_kvtransfer.recording.records import RAW_CALL

    recorder, context, thread, base = RECORDER, current_context, integration.THREAD, clock.BASE
    suppress, suppress_plain = SUPPRESS_KEY, SUPPRESS_KEY_PLAIN
    queue = collections.deque()
    unset = object()

    def star_forward(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    def forward(self, a=unset, b=unset, c=unset, d=unset, /, *rest, **kwargs):
        if rest or kwargs or d is unset:
            return original(self, *(x for x in (a, b, c, d) if x is not unset), *rest, **kwargs)
        return original(self, a, b, c, d)

    def clocks(self, a=unset, b=unset, c=unset, d=unset, /, *rest, **kwargs):
        if rest or kwargs or d is unset:
            return original(self, *(x for x in (a, b, c, d) if x is not unset), *rest, **kwargs)
        start = monotonic_ns() + base  # noqa: F841 - read as the wrapper reads it
        rc = original(self, a, b, c, d)
        end = monotonic_ns() + base  # noqa: F841
        return rc

    def checks(self, a=unset, b=unset, c=unset, d=unset, /, *rest, **kwargs):
        if rest or kwargs or d is unset:
            return original(self, *(x for x in (a, b, c, d) if x is not unset), *rest, **kwargs)
        if not recorder.active:
            return original(self, a, b, c, d)
        ctx = context()
        if ctx and (ctx.get(suppress) or ctx.get(suppress_plain)):
            return original(self, a, b, c, d)
        scope = thread.scope  # noqa: F841
        start = monotonic_ns() + base  # noqa: F841
        rc = original(self, a, b, c, d)
        end = monotonic_ns() + base  # noqa: F841
        return rc

    def record(self, a=unset, b=unset, c=unset, d=unset, /, *rest, **kwargs):
        if rest or kwargs or d is unset:
            return original(self, *(x for x in (a, b, c, d) if x is not unset), *rest, **kwargs)
        if not recorder.active:
            return original(self, a, b, c, d)
        ctx = context()
        if ctx and (ctx.get(suppress) or ctx.get(suppress_plain)):
            return original(self, a, b, c, d)
        scope = thread.scope  # noqa: F841
        start = monotonic_ns() + base
        rc = original(self, a, b, c, d)
        end = monotonic_ns() + base
        if len(queue) < 1 << 18:
            queue.append((RAW_CALL, start, end, int(d), 1, "write", a, "tcp", rc, None, "mooncake", None,
                          ctx or None))
        return rc

    made = {"direct": original, "forward": forward, "clocks": clocks, "context": checks, "record": record,
            "package": package_wrapper, "star_forward": star_forward}
    return {name: type(f"StandIn_{name}", (), {"transfer_sync_write": made[name]}) for name in MEASURED}, queue


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_tree_option(parser)
    parser.add_argument("--calls", type=int, default=2_000, help="calls per block")
    parser.add_argument("--rounds", type=int, default=30, help="blocks of each step")
    parser.add_argument("--gc", choices=("on", "off"), default="on")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--quick", action="store_true", help="6 rounds: a smoke run, not for quoting")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 6
    if not (500 <= args.calls <= 100_000 and 5 <= args.rounds <= 200):
        parser.error("--calls: 500..100000, --rounds: 5..200")
    tree = use_tree(args.tree)
    os.environ.update({"OTEL_KVTRANSFER_FLUSH_INTERVAL_MS": "60000", "OTEL_KVTRANSFER_QUEUE_SIZE": str(1 << 18),
                       "OTEL_KVTRANSFER_BUILDER": "thread"})
    from common import WrappedStandIn, _no_op_write, instrument_stand_ins, register_transport

    from otel_kvtransfer.recording.recorder import RECORDER

    instrumentor = instrument_stand_ins()
    classes, queue = _steps(_no_op_write, WrappedStandIn.__dict__["transfer_sync_write"])
    calls = {}
    for name, cls in classes.items():
        engine = cls()
        register_transport(engine)
        calls[name] = engine.transfer_sync_write
    per_call = {name: [] for name in MEASURED}
    try:
        for _ in range(args.rounds):
            for name in MEASURED:
                call = calls[name]
                gc.collect()
                if args.gc == "off":
                    gc.disable()
                started = time.thread_time_ns()
                for _ in range(args.calls):
                    call("127.0.0.1:12345", 1, 2, 0)
                per_call[name].append((time.thread_time_ns() - started) / args.calls / 1e3)
                gc.enable()
                queue.clear()
                RECORDER.drain()  # the package's records built between blocks, outside the figure
    finally:
        instrumentor.uninstrument()
    medians = {name: statistics.median(values) for name, values in per_call.items()}
    result = {"package": os.path.join(tree, "otel_kvtransfer"), "engine": "stand-in", "gc": args.gc,
              "calls_per_block": args.calls, "rounds": args.rounds, "unit": "us of thread CPU per call",
              "steps": {name: {"median": round(medians[name], 3),
                               "spread": round(max(per_call[name]) - min(per_call[name]), 3)} for name in MEASURED},
              "added_by_step": {name: round(medians[name] - medians[STEPS[i - 1]], 3)
                                for i, name in enumerate(STEPS) if i}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
