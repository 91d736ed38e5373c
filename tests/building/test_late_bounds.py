"""Late completions within bounds: in the log, in time, in memory.

- The log: a storm of late transfers (many requests' sends completing after their requests ended, a peer reading
  an expired key again and again) logs a few lines a scan, then one summary line, as stuck items do; every one
  is still on its span and in the counter.
- Time: an ended request is remembered for `late.LATE_WINDOW_S` whatever the request rate, so a send that
  completes seconds after its request ended is late under it, not a second request span that ends `evicted`;
  past the window it is forgotten, and past the memory bound the oldest is let go early and counted
  (`late_window_full`).
- Memory: what an ended request leaves is what the late check needs (its span context, its end, its labels),
  not its send shapes: bytes per ended request measured with tracemalloc, whatever the number of shapes.

No engine: the SpanBuilder is fed records (tests/building/test_builder.py's harness, both pipelines).
"""

import gc
import tracemalloc

import pytest
from opentelemetry.sdk.trace import SpanProcessor
from support.logs import warnings_logged
from test_builder import PIPELINE, Harness, begin_peer, begin_request, call, end_peer, end_request, info, send

from otel_kvtransfer import semconv
from otel_kvtransfer.building import late
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.recording.clock import now_ns

S = 10**9


@pytest.fixture(autouse=True, params=["direct", "sdk"])
def pipeline(request):
    PIPELINE["now"] = request.param
    yield request.param
    PIPELINE["now"] = "direct"


def _late_events(span):
    return [e for e in span.events if e.name == semconv.EVENT_LATE_COMPLETION]


# --- the log ---------------------------------------------------------------------------------------------------


def test_many_late_requests_log_a_few_lines_then_one_summary_a_scan():
    h = Harness()
    for key in range(1_000):
        h.feed(begin_request(key, 0), end_request(key, 5_000))
    with warnings_logged() as lines:
        for key in range(1_000):  # each request's send completes after its request ended
            h.feed(send(info(key, 0), [call(1_000, 9_000 + key, 100)]))
        h.feed(send(info(0, 1), [call(1_000, 20_000, 100)]))  # a second late send of a request: not a line again
        assert len(lines) == late.MAX_LINES  # the first few, one by one
        h.builder.evict_stale()  # the scan ends: one line for the rest
        assert len(lines) == late.MAX_LINES + 1
        summary = lines[-1]
        assert summary.startswith(f"otel_kvtransfer: {1_000 - late.MAX_LINES} more late KV transfers than the lines")
        assert f"({1_000 - late.MAX_LINES} sends completed after their request had ended, 0 arrivals" in summary
        assert "the latest 0.000 s after its end" in summary and "by backend: test-engine: 995" in summary
        assert "requests 5, 6, 7, ..." in summary
        h.builder.evict_stale()  # nothing new: no line
        assert len(lines) == late.MAX_LINES + 1
        h.feed(begin_request("next", 0), end_request("next", 5_000), send(info("next", 0), [call(1, 6_000, 1)]))
        assert len(lines) == late.MAX_LINES + 2  # a new scan has lines of its own again
    sends = h.spans(semconv.SPAN_SEND)
    assert len(sends) == 1_002 and sum(len(_late_events(s)) for s in sends) == 1_002  # every one on its span


def test_late_arrivals_of_one_expired_key_log_a_few_lines_then_one_summary_a_scan():
    h = Harness(late_watch_s=30.0)
    end = now_ns()
    h.feed(begin_peer("expired", end - S, name=semconv.SPAN_SERVE, role=semconv.ROLE_PREFILL),
           end_peer("expired", end, error="expired"))
    h.builder.release_held()  # exported: every later arrival is said in the log only

    def arrival(at):
        return tuple({r.KIND: r.LATE_ARRIVAL, r.KEY: "expired", r.TIME: at, r.LATE_BACKEND: "nixl"}[i]
                     for i in range(4))

    with warnings_logged() as lines:
        for i in range(5_000):  # a peer reading the expired key again and again
            h.feed(arrival(end + (i + 1) * 1_000_000))
        h.builder.evict_stale()
    assert len(lines) == late.MAX_LINES + 1
    assert all("request expired was still transferred" in line for line in lines[:late.MAX_LINES])
    assert lines[-1].startswith("otel_kvtransfer: 4995 more late KV transfers than the lines above (0 sends")
    assert "4995 arrivals at peer waits that had ended; the latest 5.000 s after its end); by backend: nixl: 4995" \
        in lines[-1]


# --- time --------------------------------------------------------------------------------------------------------


def test_a_send_seconds_late_is_late_under_its_request_whatever_the_request_rate():
    """10,000 requests end (1,000 a second for 10 s, or any faster rate), then the first one's send completes 5 s
    after its request's end: late under that request, not a second request span that would end evicted."""
    h = Harness()
    start = now_ns() - 20 * S
    for key in range(10_000):
        at = start + key * S // 1_000
        h.feed(begin_request(key, at), send(info(key, 0), [call(at, at + 1_000, 64)]), end_request(key, at + 2_000))
    end0 = start + 2_000
    h.feed(send(info(0, 1), [call(end0 - 1_000, end0 + 5 * S, 64)]))
    assert h.builder.open_count() == 0  # no request span opened for it
    h.builder.end_all()
    assert h.drops == {}  # nothing evicted, nothing let go early
    request = next(s for s in h.spans(semconv.SPAN_REQUEST) if s.attributes[semconv.REQUEST_KEY] == "0")
    (late_send,) = [s for s in h.spans(semconv.SPAN_SEND) if _late_events(s)]
    assert late_send.parent.span_id == request.context.span_id
    assert _late_events(late_send)[0].attributes[semconv.AFTER_REQUEST_END_S] == pytest.approx(5.0)
    assert len(h.spans(semconv.SPAN_REQUEST)) == 10_000


def test_the_window_is_a_time_past_which_an_ended_request_is_forgotten():
    h = Harness()
    now = now_ns()
    window = int(late.LATE_WINDOW_S * S)
    h.feed(begin_request("old", now - window - 2 * S), end_request("old", now - window - S),
           begin_request("recent", now - window + 2 * S), end_request("recent", now - window + 3 * S))
    h.builder.evict_stale()  # the scan forgets what ended longer ago than the window
    h.feed(send(info("recent", 0), [call(now - S, now, 8)]), send(info("old", 0), [call(now - S, now, 8)]))
    assert h.builder.open_count() == 1  # "old": a request span of its own, as any send of an unknown key opens
    sends = {s.attributes[semconv.REQUEST_KEY]: s for s in h.spans(semconv.SPAN_SEND)}
    assert [len(_late_events(sends[key])) for key in ("recent", "old")] == [1, 0]


def test_past_the_memory_bound_the_oldest_is_let_go_early_and_counted():
    h = Harness()
    for key in range(late.MAX_ENDED + 1):  # the real bound, through the builder: one let go, counted
        h.feed(begin_request(key, key), end_request(key, key + 1))
    assert len(h.builder._ended) == late.MAX_ENDED and h.drops == {"late_window_full": 1}
    dropped = []
    ended = late.EndedRequests(limit=3, on_drop=lambda reason, n: dropped.append((reason, n)))
    for key in range(3):
        ended.ended(key, None, key * S, {})
    ended.ended(3, None, 3 * S, {})  # key 0 let go inside its window: counted
    assert dropped == [("late_window_full", 1)] and ended.get(0) is None and ended.get(1) is not None
    ended.ended(4, None, 200 * S, {})  # key 1 let go after its window was over anyway: not counted
    assert dropped == [("late_window_full", 1)]


# --- memory ------------------------------------------------------------------------------------------------------


class _Nothing(SpanProcessor):
    def on_end(self, span):
        pass


@pytest.mark.parametrize("shapes", [1, 64])
def test_an_ended_request_keeps_only_what_the_late_check_needs(shapes):
    """What the ended-request table keeps alive, per request: measured as the memory that clearing it frees (so
    the span pipeline's own caches, bounded on their own, do not count), the same for 1 or 64 send shapes."""
    h = Harness(processor=_Nothing())
    requests = 500
    tracemalloc.start()
    try:
        for key in range(requests):
            h.feed(begin_request(key, 0, attributes={semconv.TP_RANK: 0}))
            for destination in range(shapes):
                h.feed(send(info(key, 0, destination=destination),
                            [call(1_000, 2_000, 100, peer=f"127.0.0.1:{4000 + destination}")]))
            h.feed(end_request(key, 5_000))
        assert len(h.builder._ended) == requests
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        h.builder._ended.clear()
        gc.collect()
        per_request = (held - tracemalloc.get_traced_memory()[0]) / requests
    finally:
        tracemalloc.stop()
    # Its span context, its end time, its entry in the table; the labels are shared by every request that has the
    # same. (Before, each kept its 64 shapes of send attributes, about 1 KiB each.)
    assert 0 < per_request <= 600, per_request
