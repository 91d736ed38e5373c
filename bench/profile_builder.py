"""Where the span builder's time goes: cProfile of one drain of N queued records, split by who spends it.

The records come from the package's Mooncake hot-path function around the zero-cost stand-in method (the exact
tuple a real `transfer_sync_write` makes; labelled 'stand-in'), into the production-shaped pipeline of
bench/common.py. The builder code is the same in a helper process (OTEL_KVTRANSFER_BUILDER=process), so this is
the floor of both builders.

    python bench/profile_builder.py [--records N] [--top K]
"""

import argparse
import cProfile
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import Naive, Pipeline, WrappedStandIn, register_transport, wrap_stand_ins  # noqa: E402

from otel_kvtransfer import KVTransferInstrumentor, config  # noqa: E402
from otel_kvtransfer.recorder import RECORDER  # noqa: E402

# Cumulative time of these functions, as shares of the drain (they do not overlap one another).
PARTS = {
    "metrics: KVTransferMetricsProcessor.on_end (histogram records, exemplars)": ("processor.py", "on_end"),
    "SDK span start (sampler, attribute validation, processors' on_start)": ("sdk/trace/__init__.py", "start_span"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--top", type=int, default=0, help="also print the K functions with the most own time")
    args = parser.parse_args()
    if not 1 <= args.records <= 200_000:
        parser.error("--records: between 1 and 200000")
    pipeline = Pipeline(max_queue_size=1 << 21)
    os.environ[config.QUEUE_SIZE] = str(1 << 18)
    os.environ[config.FLUSH_INTERVAL_MS] = "60000"  # the background thread stays asleep: one drain, profiled
    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument(tracer_provider=pipeline.tracer_provider, meter_provider=pipeline.meter_provider)
    wrap_stand_ins(Naive(pipeline).wrapper)
    engine = WrappedStandIn()
    register_transport(engine)
    for _ in range(args.records):
        engine.transfer_sync_write("127.0.0.1:12345", 1, 2, 4096)
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    RECORDER.drain()
    profile.disable()
    elapsed = time.perf_counter() - started
    instrumentor.uninstrument()
    stats = pstats.Stats(profile)
    total = sum(entry[3] for key, entry in stats.stats.items() if key[2] == "drain")  # cumulative time of drain
    print(f"stand-in records: {args.records:,}; drain {elapsed:.2f} s under cProfile "
          f"({elapsed / args.records * 1e6:.0f} us per record with the profiler's own overhead)")
    for label, (path, name) in PARTS.items():
        spent = sum(entry[3] for key, entry in stats.stats.items() if key[0].endswith(path) and key[2] == name)
        print(f"  {spent / total:6.1%}  {label}")
    if args.top:
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
