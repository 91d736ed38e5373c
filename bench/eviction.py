"""Benchmark: the cost of the builder's eviction does not grow with the number of open requests.

For 1,000 and 100,000 open fresh requests (none stale): the cost of one TTL tick (`SpanBuilder.evict_stale`,
which the recorder's thread runs after every drain), and beside it what a tick that walks every open request
(the rule before the fix) costs on the same number. Then, with the table full at `max_open`, the cost of opening
one more request, which evicts the least recently active. Each figure is the median of many rounds with its
spread (p10, p90, min, max), in microseconds. The builder is the real one on a real SDK TracerProvider with no
exporter (the figure is the builder's own work); its clock is controlled, so nothing turns stale by itself.

    python bench/eviction.py [--quick] [--out FILE]
"""

import time

from common import machine, main_wrapper, quantile
from opentelemetry.sdk.trace import TracerProvider

from otel_kvtransfer import semconv
from otel_kvtransfer.building.builder import SpanBuilder
from otel_kvtransfer.building.sampler import RecordUnsampledSampler
from otel_kvtransfer.recording import records as r


def _begin(key):
    return r.begin_request(key, 0, semconv.ROLE_PREFILL, "bench", None, None, None)


def _spread(samples_ns):
    us = [s / 1000 for s in samples_ns]
    return {"median_us": quantile(us, 0.5), "p10_us": quantile(us, 0.1), "p90_us": quantile(us, 0.9),
            "min_us": min(us), "max_us": max(us), "rounds": len(us)}


def _builder(max_open):
    provider = TracerProvider(shutdown_on_exit=False)
    tracer = provider.get_tracer(semconv.INSTRUMENTATION_NAME)
    tracer.sampler = RecordUnsampledSampler(tracer.sampler)  # as the instrumentor does
    now = [0.0]
    drops = {}
    builder = SpanBuilder(tracer, 600.0, max_open, on_drop=lambda reason, n: drops.__setitem__(
        reason, drops.get(reason, 0) + n), clock=lambda: now[0])
    return builder, now, drops


class _Touched:
    __slots__ = ("touched",)

    def __init__(self):
        self.touched = 0.0


def _full_scan(table, deadline):
    """What a tick did before: walk every open request to find the stale ones."""
    return [key for key, state in table.items() if state.touched < deadline]


def measure(open_requests: int, rounds: int) -> dict:
    builder, now, drops = _builder(max_open=open_requests)
    for key in range(open_requests):
        builder.handle(_begin(key))
    assert builder.open_count() == open_requests and not drops
    now[0] = 1.0  # all still fresh (TTL 600 s)
    ticks = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        builder.evict_stale()
        ticks.append(time.perf_counter_ns() - start)
    assert builder.open_count() == open_requests and not drops  # a tick that found nothing stale

    table = {key: _Touched() for key in range(open_requests)}
    scans = []
    for _ in range(max(rounds // 20, 5)):
        start = time.perf_counter_ns()
        _full_scan(table, 1.0 - 600.0)
        scans.append(time.perf_counter_ns() - start)

    opens = []  # the table is full: each new request evicts the least recently active one
    for key in range(open_requests, open_requests + rounds):
        start = time.perf_counter_ns()
        builder.handle(_begin(key))
        opens.append(time.perf_counter_ns() - start)
    assert builder.open_count() == open_requests and drops == {"request_limit": rounds}
    return {"open_requests": open_requests, "tick": _spread(ticks), "tick_walking_every_request": _spread(scans),
            "open_one_when_full": _spread(opens)}


def run(quick: bool = False) -> dict:
    rounds = 200 if quick else 2_000
    results = [measure(n, rounds) for n in (1_000, 100_000)]
    small, large = results
    return {
        "machine": machine(),
        "results": results,
        "tick_ratio_100k_over_1k": large["tick"]["median_us"] / small["tick"]["median_us"],
        "open_when_full_ratio_100k_over_1k": (large["open_one_when_full"]["median_us"]
                                              / small["open_one_when_full"]["median_us"]),
        "walk_ratio_100k_over_1k": (large["tick_walking_every_request"]["median_us"]
                                    / small["tick_walking_every_request"]["median_us"]),
    }


if __name__ == "__main__":
    main_wrapper(run)
