"""Where the span builder's time goes: cProfile of one drain of N queued records, then the OTLP encoding of the
spans it built, per span.

The records come from the package's Mooncake hot-path function around the zero-cost stand-in method (the exact
tuple a real `transfer_sync_write` makes; labelled 'stand-in'). The spans are kept in memory during the drain
(nothing is sent), then encoded in batches of 512 (the BatchSpanProcessor's default) by the OTLP/HTTP and
OTLP/gRPC span exporters' own `encode_spans` (our fast path while instrumented) and by the exporters' original
encoder, so the three figures sit side by side. The builder code is the same in a helper process, so this is the
floor of both builders. `--pipeline sdk` profiles the previous path (SDK tracer and instruments).

    python bench/profile_builder.py [--records N] [--pipeline direct|sdk] [--top K] [--out FILE] [--quick]

`--out` also writes the figures as JSON (what bench/run_all.py shows as the floor of goal 4).
"""

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import WrappedStandIn, register_transport, wrap_stand_ins

from otel_kvtransfer import KVTransferInstrumentor, config
from otel_kvtransfer.recording.recorder import RECORDER

# Cumulative time of these functions, as shares of the drain (within one pipeline they do not overlap).
PARTS = {
    "direct": {"spans: DirectSpans.child (sampling decision, ids, KVSpan, processors' on_end)":
               ("direct_spans.py", "child"),
               "metrics: RecordMetrics.send (fixed-bucket tables, exemplars)": ("record_metrics.py", "send")},
    "sdk": {"metrics: KVTransferMetricsProcessor.on_end (histogram records, exemplars)": ("processor.py", "on_end"),
            "SDK span start (sampler, attribute validation, processors' on_start)":
            ("sdk/trace/__init__.py", "start_span")},
}
BATCH = 512


def _encoders():
    """(label, encode_spans) of both OTLP span exporter modules, and the original encoder underneath."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as original
    from opentelemetry.exporter.otlp.proto.grpc import trace_exporter as grpc_module
    from opentelemetry.exporter.otlp.proto.http import trace_exporter as http_module

    return [("OTLP/HTTP exporter's encode_spans", http_module),
            ("OTLP/gRPC exporter's encode_spans", grpc_module),
            ("the SDK's own encoder (no fast path)", original)]


def _encode_us(encode, spans, repeats: int = 3) -> float:
    """Best of `repeats` passes (on a shared machine the slower ones measure the neighbours)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for i in range(0, len(spans), BATCH):
            encode(spans[i:i + BATCH]).SerializeToString()
        best = min(best, time.process_time() - start)
    return best / max(len(spans), 1) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--pipeline", choices=("direct", "sdk"), default="direct")
    parser.add_argument("--top", type=int, default=0, help="also print the K functions with the most own time")
    parser.add_argument("--out", help="also write the figures here, as JSON")
    parser.add_argument("--quick", action="store_true", help="2,000 records: a smoke run, not for quoting")
    args = parser.parse_args()
    if args.quick:
        args.records = 2000
    if not 1 <= args.records <= 200_000:
        parser.error("--records: between 1 and 200000")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

    encoders = _encoders()  # imported before instrument(): it speeds up the exporter modules already imported

    class Keep(SpanProcessor):
        def __init__(self):
            self.spans = []

        def on_end(self, span):
            self.spans.append(span)

    kept = Keep()
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(kept)
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()], shutdown_on_exit=False)
    os.environ[config.QUEUE_SIZE] = str(1 << 18)
    os.environ[config.FLUSH_INTERVAL_MS] = "60000"  # the background thread stays asleep: one drain, profiled
    os.environ[config.PIPELINE] = args.pipeline
    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    wrap_stand_ins(lambda wrapped, instance, a, kw: wrapped(*a, **kw))
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
    stats = pstats.Stats(profile)
    total = sum(entry[3] for key, entry in stats.stats.items() if key[2] == "drain")  # cumulative time of drain
    print(f"stand-in records: {args.records:,}, pipeline {args.pipeline}; drain {elapsed:.2f} s under cProfile "
          f"({elapsed / args.records * 1e6:.0f} us per record with the profiler's own overhead)")
    result = {"engine": "stand-in", "records": args.records, "pipeline": args.pipeline, "shares_of_drain": {},
              "encode_us_per_span": {}, "batch": BATCH}
    for label, (path, name) in PARTS[args.pipeline].items():
        spent = sum(entry[3] for key, entry in stats.stats.items() if key[0].endswith(path) and key[2] == name)
        result["shares_of_drain"][label] = spent / total
        print(f"  {spent / total:6.1%}  {label}")
    spans = kept.spans
    print(f"OTLP encoding of the {len(spans):,} spans built, in batches of {BATCH} (no profiler; CPU, best of 3), "
          "us per span:")
    for label, encoder in encoders:
        encode = getattr(encoder, "encode_spans", encoder)
        result["encode_us_per_span"][label] = us = _encode_us(encode, spans)
        print(f"  {us:8.2f}  {label}")
    instrumentor.uninstrument()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
            handle.write("\n")
    if args.top:
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
