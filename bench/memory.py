"""Benchmark 3: RSS over 1,000,000 recorded transfers, sampled every 100,000.

The transfers come in requests as an engine makes them: begin_request(room), 4 scoped transfers (chunks 0-3 of
the room, one engine call each, the last one `is_last_chunk`), end_request(room); rooms are reused (1,000 of
them, round-robin), so the builder's per-room state is exercised. The engine calls are the package's Mooncake
wrapper around the zero-cost stand-in method (1,000,000 real loopback transfers would take minutes and measure
the engine); the records, the spans, the metrics and the export path (BatchSpanProcessor + no-op exporter) are
the real ones. The producer hands the builder a drain every 10,000 transfers, so nothing is dropped and every
transfer becomes a span and metric points.
"""

import gc

from common import Pipeline, WrappedStandIn, main_wrapper, register_transport, rss_bytes, wrap_stand_ins

from otel_kvtransfer import KVTransferInstrumentor
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.recording.recorder import RECORDER

SESSION = "127.0.0.1:12345"
CHUNKS = 4


def run(quick: bool = False) -> dict:
    total = 200_000 if quick else 1_000_000
    sample_every = 20_000 if quick else 100_000
    wrap_stand_ins(lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    pipeline = Pipeline(max_queue_size=1 << 16, max_export_batch_size=512, schedule_delay_millis=50)
    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument(tracer_provider=pipeline.tracer_provider, meter_provider=pipeline.meter_provider)
    engine = WrappedStandIn()
    register_transport(engine)
    call = engine.transfer_sync_write
    samples = [{"transfers": 0, "rss_mib": rss_bytes() / 2**20}]
    transfers, room_index = 0, 0
    try:
        while transfers < total:
            room = 10_000 + room_index % 1000
            room_index += 1
            kvt.begin_request(room, backend="mooncake")
            for chunk in range(CHUNKS):
                with kvt.transfer_scope(room, chunk_index=chunk, payload="kv", is_last_chunk=chunk == CHUNKS - 1):
                    call(SESSION, 4096, 8192, 65536)
            kvt.end_request(room)
            transfers += CHUNKS
            if transfers % 10_000 == 0:
                RECORDER.drain()
            if transfers % sample_every == 0:
                RECORDER.drain()
                pipeline.tracer_provider.force_flush()
                gc.collect()
                samples.append({"transfers": transfers, "rss_mib": rss_bytes() / 2**20,
                                "queued": RECORDER.pending()})
        RECORDER.drain()
        pipeline.tracer_provider.force_flush()
        in_metrics = pipeline.transfers_in_metrics()
        dropped = pipeline.dropped()
        exported = pipeline.exporter.count
    finally:
        instrumentor.uninstrument()
        pipeline.shutdown()
    warm = [s["rss_mib"] for s in samples if s["transfers"] >= 2 * sample_every]
    return {
        "engine": "the package's Mooncake wrapper around the zero-cost stand-in method (not the real engine)",
        "transfers": transfers, "requests": room_index, "rooms_reused": 1000,
        "transfers_in_metrics": in_metrics, "spans_exported": exported, "dropped": dropped,
        "samples": samples,
        "rss_after_warmup_mib": {"first": warm[0], "last": warm[-1], "min": min(warm), "max": max(warm),
                                 "growth": warm[-1] - warm[0]},
    }


if __name__ == "__main__":
    main_wrapper(run)
