"""Benchmark 4: truth — do the spans' throughputs match reality?

per_transfer  For 1, 4, 16 and 64 MiB writes through the real Mooncake engine (TCP, 127.0.0.1), the send span's
              `kv_transfer.throughput` against an independent timer (perf_counter around the same engine call,
              taken outside the wrapper). Error = span / timer - 1.
seed          The seed scenario with `demo.run_request`: chunked prefill of 8192 + 1655 tokens with
              a 2048-token cached prefix sent early, fan-out 1 and 4 (one transfer worker sending each chunk to
              every destination in turn), 8 KiB of KV per token. Per request: the request span's throughput (wire
              bytes over the union of its transfer intervals), the legacy figure sglang computes (KV bytes x
              replicas / time from the last chunk's enqueue to success), and the link capacity measured in the
              same run with plain uninstrumented writes to one receiver.
"""

import time

from common import main_wrapper, median
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_kvtransfer import KVTransferInstrumentor, semconv
from otel_kvtransfer.recording.recorder import RECORDER

GIB = float(1 << 30)
MIB = 1 << 20


def _per_transfer(engine, receiver, base, sizes, reps, exporter) -> dict:
    timers = []
    for _ in range(reps):
        for nbytes in sizes:
            wall_before = time.time_ns()
            start = time.perf_counter_ns()
            rc = engine.transfer_sync_write(receiver.session, base, receiver.base_address, nbytes)
            elapsed = time.perf_counter_ns() - start
            wall_after = time.time_ns()
            if rc != 0:
                raise RuntimeError(f"engine returned {rc}")
            timers.append((nbytes, elapsed, wall_before, wall_after))
    RECORDER.drain()
    spans = sorted((s for s in exporter.get_finished_spans() if s.name == semconv.SPAN_SEND),
                   key=lambda s: s.start_time)
    if len(spans) != len(timers):
        raise RuntimeError(f"{len(spans)} spans for {len(timers)} transfers")
    by_size = {}
    for (nbytes, elapsed, wall_before, wall_after), span in zip(timers, spans):
        assert span.attributes[semconv.BYTES] == nbytes
        timer_bps = nbytes * 1e9 / elapsed
        span_bps = span.attributes[semconv.THROUGHPUT]
        by_size.setdefault(nbytes, []).append((span_bps, timer_bps, span_bps / timer_bps - 1.0,
                                               elapsed - (span.end_time - span.start_time),
                                               span.start_time - wall_before, wall_after - span.end_time))
    out = {}
    for nbytes, rows in by_size.items():
        errors = [r[2] for r in rows]
        out[str(nbytes)] = {
            "bytes": nbytes, "transfers": len(rows),
            "median_span_gib_s": median([r[0] for r in rows]) / GIB,
            "median_timer_gib_s": median([r[1] for r in rows]) / GIB,
            "median_error": median(errors), "max_abs_error": max(abs(e) for e in errors),
            "median_timer_minus_span_us": median([r[3] for r in rows]) / 1e3,
            # Where that gap sits (wall clock): before the span's start, after its end.
            "median_before_span_us": median([r[4] for r in rows]) / 1e3,
            "median_after_span_us": median([r[5] for r in rows]) / 1e3,
        }
    exporter.clear()
    return out


def _seed(engine, src, receivers, fanout, requests, cfg_factory, exporter) -> dict:
    from otel_kvtransfer import demo
    from otel_kvtransfer import integration as kvt
    from otel_kvtransfer.demo.loopback import digest

    cfg = cfg_factory(fanout)
    destinations = [demo._Destination(r, i) for i, r in enumerate(receivers[:fanout])]
    before = demo.measure_link_capacity(engine, receivers[0], src.ctypes.data, cfg.kv_bytes)
    rows, legacy = [], []
    try:
        for n in range(requests):
            legacy.append(demo.run_request(20_000 + 100 * fanout + n, engine, src, destinations, cfg, kvt,
                                           "mooncake"))
    finally:
        RECORDER.drain()
    after = demo.measure_link_capacity(engine, receivers[0], src.ctypes.data, cfg.kv_bytes)
    capacity = max(before, after)
    size = cfg.kv_bytes + cfg.aux_bytes
    verified = all(r.digest(0, size) == digest(src[:size]) for r in receivers[:fanout])
    spans = {int(s.attributes[semconv.REQUEST_KEY]): s for s in exporter.get_finished_spans()
             if s.name == semconv.SPAN_REQUEST}
    for item in legacy:
        attrs = spans[item["room"]].attributes
        true_bps = attrs[semconv.THROUGHPUT]
        rows.append({
            "room": item["room"], "chunks": attrs[semconv.CHUNK_COUNT], "transfers": attrs[semconv.TRANSFER_COUNT],
            "wire_mib": attrs[semconv.BYTES] / MIB, "logical_mib": attrs[semconv.LOGICAL_BYTES] / MIB,
            "busy_ms": attrs[semconv.BUSY_S] * 1e3, "true_gib_s": true_bps / GIB,
            "legacy_gib_s": item["legacy_gib_s"], "legacy_over_true": item["legacy_gib_s"] * GIB / true_bps,
            "enqueue_to_done_gib_s": item["enqueue_to_done_gib_s"],
            "compute_overlap_ratio": attrs.get(semconv.COMPUTE_OVERLAP_RATIO, 0.0),
            "true_over_capacity": true_bps / capacity, "error": item["error"],
        })
    exporter.clear()
    return {"fanout": fanout, "requests": requests, "link_capacity_gib_s": capacity / GIB,
            "link_capacity_before_after_gib_s": [before / GIB, after / GIB], "bytes_verified": verified,
            "kv_mib_per_destination": cfg.kv_bytes / MIB, "rows": rows,
            "median_true_gib_s": median([r["true_gib_s"] for r in rows]),
            "median_legacy_gib_s": median([r["legacy_gib_s"] for r in rows]),
            "median_legacy_over_true": median([r["legacy_over_true"] for r in rows])}


def run(quick: bool = False) -> dict:
    import numpy as np

    from otel_kvtransfer import demo
    from otel_kvtransfer.demo.loopback import Receiver, open_engine

    def cfg_factory(fanout):
        return demo.DemoConfig(requests=3, fanout=fanout, prefix_tokens=2048, chunk_tokens=[8192, 1655])

    probe = cfg_factory(1)
    size = max(probe.kv_bytes + probe.aux_bytes, 64 * MIB)
    fanouts = [1, 4]
    receivers = []
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = KVTransferInstrumentor()
    try:
        env = {"MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "ERROR"}
        receivers.append(Receiver(size, env=env))
        engine = open_engine()
        src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        assert engine.register_memory(src.ctypes.data, src.nbytes) == 0
        # Per transfer first, with one receiver process only (fewer processes sharing the two cores).
        demo.measure_link_capacity(engine, receivers[0], src.ctypes.data, size, rounds=1)
        instrumentor.instrument(tracer_provider=provider)
        per_transfer = _per_transfer(engine, receivers[0], src.ctypes.data, [MIB, 4 * MIB, 16 * MIB, 64 * MIB],
                                     3 if quick else 20, exporter)
        instrumentor.uninstrument()
        while len(receivers) < max(fanouts):
            receivers.append(Receiver(size, env=env))
        for receiver in receivers:  # open every connection and touch every receiver page before timing anything
            demo.measure_link_capacity(engine, receiver, src.ctypes.data, size, rounds=1)
        instrumentor.instrument(tracer_provider=provider)
        seed = [_seed(engine, src, receivers, k, 1 if quick else 3, cfg_factory, exporter) for k in fanouts]
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
        for receiver in receivers:
            receiver.stop()
    worst = max(v["max_abs_error"] for v in per_transfer.values())
    return {
        "engine": "Mooncake TransferEngine over TCP, 127.0.0.1, receiver processes",
        "per_transfer": per_transfer, "per_transfer_worst_abs_error": worst,
        "per_transfer_worst_median_abs_error": max(abs(v["median_error"]) for v in per_transfer.values()),
        "seed": seed,
    }


if __name__ == "__main__":
    main_wrapper(run)
