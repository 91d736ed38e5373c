"""Benchmark 2: pipeline capacity — transfers per second turned into spans and metrics, and what happens beyond.

Real engine calls over loopback top out at a few tens of thousands per second on two cores and would measure the
engine, not the pipeline; so the records are made by the package's own Mooncake wrapper around the zero-cost
stand-in method (bench/common.py): the exact tuples a real `transfer_sync_write` produces, through the exact hot
path (wrapper -> recorder queue -> background span builder -> metrics processor -> BatchSpanProcessor -> no-op
exporter). Labelled 'stand-in' in the results.

  builder_only     N records queued with the builder idle, then one drain timed: the builder's own rate
  sustained        a producer thread offers R transfers/s for a few seconds while the background thread runs
                   with the default settings; the highest R with nothing dropped and a queue depth that settles
                   (its peak in the last third of the run no higher than in the middle third) is the sustained
                   capacity
  overload         a small queue (4096) and a producer calling as fast as it can: drops are counted, every call
                   returns the engine's value, the accounting closes (spans + dropped == calls)
"""

import os
import time

from common import Pipeline, WrappedStandIn, main_wrapper, median, register_transport, wrap_stand_ins

from otel_kvtransfer import KVTransferInstrumentor, config
from otel_kvtransfer.recording.recorder import RECORDER

SESSION = "127.0.0.1:12345"


def _instrument(env: dict, pipeline: Pipeline):
    for key in (config.QUEUE_SIZE, config.FLUSH_INTERVAL_MS):
        os.environ.pop(key, None)
    os.environ.update(env)
    instrumentor = KVTransferInstrumentor()
    instrumentor.instrument(tracer_provider=pipeline.tracer_provider, meter_provider=pipeline.meter_provider)
    return instrumentor


def _sdk_span_floor(n: int) -> float:
    """Microseconds per span of the bare SDK: start + end one span with a send span's attributes, same export."""
    from opentelemetry.trace import SpanKind

    from otel_kvtransfer import semconv

    pipeline = Pipeline(max_queue_size=1 << 21)
    tracer = pipeline.tracer_provider.get_tracer("sdk-floor")
    attrs = {semconv.BYTES: 8, semconv.DESCRIPTOR_COUNT: 1, semconv.ENGINE_CALLS: 1, semconv.THROUGHPUT: 1e9,
             semconv.NETWORK_IO_DIRECTION: semconv.DIRECTION_TRANSMIT, semconv.OP: semconv.OP_WRITE,
             semconv.SERVER_ADDRESS: "127.0.0.1", semconv.SERVER_PORT: 12345, semconv.NETWORK_TRANSPORT: "tcp",
             semconv.BACKEND: "mooncake"}
    start = time.perf_counter()
    for i in range(n):
        span = tracer.start_span(semconv.SPAN_SEND, kind=SpanKind.CLIENT, attributes=attrs, start_time=i)
        span.end(end_time=i + 1)
    elapsed = time.perf_counter() - start
    pipeline.shutdown()
    return elapsed / n * 1e6


def _builder_only(n: int, metrics: str = "on") -> dict:
    pipeline = Pipeline(max_queue_size=1 << 21, max_export_batch_size=512, schedule_delay_millis=50, metrics=metrics)
    instrumentor = _instrument({config.QUEUE_SIZE: str(1 << 18), config.FLUSH_INTERVAL_MS: "60000"}, pipeline)
    engine = WrappedStandIn()
    register_transport(engine)
    call = engine.transfer_sync_write
    try:
        RECORDER.drain()
        for _ in range(n):
            call(SESSION, 4096, 8192, 8)
        queued = RECORDER.pending()
        start = time.perf_counter()
        RECORDER.drain()
        elapsed = time.perf_counter() - start
        pipeline.tracer_provider.force_flush()
        result = {
            "records": n, "queued": queued, "drain_s": elapsed, "spans_per_s": queued / elapsed,
            "us_per_transfer": elapsed / queued * 1e6,
            "spans_exported": pipeline.exporter.count, "transfers_in_metrics": pipeline.transfers_in_metrics(),
            "dropped": pipeline.dropped() if metrics != "no_reader" else None,
        }
    finally:
        instrumentor.uninstrument()
        pipeline.shutdown()
    return result


def _offer(rate: float, seconds: float) -> dict:
    """Offer `rate` transfers/s for `seconds` with the default settings; account for every one."""
    pipeline = Pipeline(max_queue_size=1 << 18, max_export_batch_size=512, schedule_delay_millis=50)
    instrumentor = _instrument({}, pipeline)
    engine = WrappedStandIn()
    register_transport(engine)
    call = engine.transfer_sync_write
    group = 50
    try:
        total = int(rate * seconds)
        start = time.perf_counter()
        bad = 0
        depths = []  # (seconds since start, queue depth)
        for sent in range(0, total, group):
            for _ in range(group):
                if call(SESSION, 4096, 8192, 8) != 0:
                    bad += 1
            depths.append((time.perf_counter() - start, RECORDER.pending()))
            due = start + (sent + group) / rate
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        offered_s = time.perf_counter() - start
        sent_total = ((total + group - 1) // group) * group
        # How long until the background thread (not us) has turned the backlog into spans.
        stop = time.perf_counter()
        while RECORDER.pending() and time.perf_counter() - stop < 30:
            time.sleep(0.005)
        backlog_s = time.perf_counter() - stop
        RECORDER.drain()
        pipeline.tracer_provider.force_flush()
        dropped = pipeline.dropped()
        in_metrics = pipeline.transfers_in_metrics()
        # Keeping up = the queue depth settles: its peak in the last third is not above the middle third's.
        third = seconds / 3
        middle = max((d for t, d in depths if third <= t < 2 * third), default=0)
        last = max((d for t, d in depths if t >= 2 * third), default=0)
        return {
            "offered_per_s": rate, "achieved_offer_per_s": sent_total / offered_s, "calls": sent_total,
            "wrong_return_values": bad, "max_queue_depth": max(d for _, d in depths),
            "peak_depth_middle_third": middle, "peak_depth_last_third": last,
            "keeps_up": last <= 1.2 * middle + 2 * group,
            "record_to_span_latency_s_max": max(d for _, d in depths) / rate,
            "backlog_cleared_s": backlog_s,
            "transfers_in_metrics": in_metrics, "spans_exported": pipeline.exporter.count, "dropped": dropped,
            "accounted": in_metrics + sum(dropped.values()) == sent_total,
        }
    finally:
        instrumentor.uninstrument()
        pipeline.shutdown()


def _overload(seconds: float, queue_size: int = 4096) -> dict:
    pipeline = Pipeline(max_queue_size=1 << 18, max_export_batch_size=512, schedule_delay_millis=50)
    instrumentor = _instrument({config.QUEUE_SIZE: str(queue_size)}, pipeline)
    engine = WrappedStandIn()
    register_transport(engine)
    call = engine.transfer_sync_write
    block = 1000
    try:
        calls, bad, per_call = 0, 0, []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter_ns()
            for _ in range(block):
                if call(SESSION, 4096, 8192, 8) != 0:
                    bad += 1
            per_call.append((time.perf_counter_ns() - t0) / block)
            calls += block
        RECORDER.drain()
        pipeline.tracer_provider.force_flush()
        dropped = pipeline.dropped()
        in_metrics = pipeline.transfers_in_metrics()
        return {
            "queue_size": queue_size, "seconds": seconds, "calls": calls, "calls_per_s": calls / seconds,
            "wrong_return_values": bad, "median_ns_per_call_engine_thread": median(per_call),
            "transfers_in_metrics": in_metrics, "dropped": dropped, "spans_exported": pipeline.exporter.count,
            "accounted": in_metrics + sum(dropped.values()) == calls,
        }
    finally:
        instrumentor.uninstrument()
        pipeline.shutdown()


def run(quick: bool = False) -> dict:
    saved = {k: os.environ.get(k) for k in (config.QUEUE_SIZE, config.FLUSH_INTERVAL_MS)}
    wrap_stand_ins(lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    try:
        builder = _builder_only(50_000 if quick else 200_000)
        # Where the builder's time goes: the same drain with exemplars off, with no metric reader, and the bare
        # SDK span with the same attributes.
        breakdown_n = 20_000 if quick else 60_000
        breakdown = {
            "us_per_transfer_default": _builder_only(breakdown_n)["us_per_transfer"],
            "us_per_transfer_exemplars_off": _builder_only(breakdown_n, "no_exemplars")["us_per_transfer"],
            "us_per_transfer_no_metric_reader": _builder_only(breakdown_n, "no_reader")["us_per_transfer"],
            "us_per_span_bare_sdk": _sdk_span_floor(breakdown_n),
        }
        seconds = 1.5 if quick else 6.0
        steps = []
        capacity = 0
        for rate in (5_000, 10_000, 15_000, 17_500, 20_000, 22_500, 25_000, 30_000, 40_000):
            step = _offer(rate, seconds)
            steps.append(step)
            ok = (not step["dropped"] and step["accounted"] and step["keeps_up"] and not step["wrong_return_values"]
                  and step["achieved_offer_per_s"] >= 0.97 * rate)
            if not ok:
                break
            capacity = rate
        overload = _overload(1.0 if quick else 3.0)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {
        "records_from": "the package's Mooncake wrapper around a zero-cost stand-in method (not the real engine)",
        "builder_only": builder,
        "builder_breakdown": breakdown,
        "sustained_steps": steps,
        "sustained_capacity_per_s": capacity,
        "overload": overload,
    }


if __name__ == "__main__":
    main_wrapper(run)
