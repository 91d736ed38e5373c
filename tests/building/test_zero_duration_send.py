"""A successful send of no measurable duration (its end read the same as its start) has no speed: no throughput
attribute, no point in the throughput histograms, and a request whose sends all took no measurable time none in
the request throughput histogram. Both pipelines make the same points.

No engine: a real call always takes measurable time on this machine's clock, so the calls are handed over the
way an engine module hands over the calls it timed (`integration.deliver`), with start == end as a clock too
coarse to tell them apart would read them.
"""

import pytest
from support.telemetry import Telemetry

from otel_kvtransfer import config, semconv
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.engines.mooncake import BACKEND
from otel_kvtransfer.recording import integration, records

S = 1_000_000_000


def _deliver(start: int, end: int, nbytes: int) -> None:
    integration.deliver(records.call(start, end, nbytes, 1, semconv.OP_WRITE, "127.0.0.1:7001", "tcp", 0, None,
                                     BACKEND))


def _workload() -> None:
    kvt.begin_request(5, backend=BACKEND, framework="test", start_ns=1 * S)
    with kvt.transfer_scope(5, chunk_index=0):
        _deliver(2 * S, 2 * S, 4 << 20)  # no measurable duration, 4 MiB: a peer-throughput size too
    with kvt.transfer_scope(5, chunk_index=1):
        _deliver(3 * S, 3 * S + 1_000_000, 4 << 20)  # 1 ms
    kvt.end_request(5, end_ns=4 * S)
    kvt.begin_request(6, backend=BACKEND, framework="test", start_ns=5 * S)
    with kvt.transfer_scope(6, chunk_index=0):
        _deliver(6 * S, 6 * S, 8192)
    kvt.end_request(6, end_ns=7 * S)
    _deliver(8 * S, 8 * S, 8192)  # a raw engine call


def _run(monkeypatch, pipeline):
    monkeypatch.setenv(config.PIPELINE, pipeline)
    telemetry = Telemetry().instrument()
    try:
        _workload()
        sends = telemetry.spans(semconv.SPAN_SEND)
        metrics = telemetry.metrics()
    finally:
        telemetry.uninstrument()
    points = {name: sorted((sorted(dict(p.attributes).items()), getattr(p, "count", None),
                            p.sum if hasattr(p, "sum") else p.value)
                           for p in found)
              for name, found in metrics.items() if name.startswith("kv_transfer.") and "instrumentation" not in name}
    return sends, points


@pytest.mark.parametrize("pipeline", ["direct", "sdk"])
def test_a_send_of_no_measurable_duration_has_no_speed(monkeypatch, pipeline):
    sends, points = _run(monkeypatch, pipeline)
    speeds = {(s.attributes.get(semconv.REQUEST_KEY), s.attributes[semconv.BYTES], s.end_time - s.start_time):
              s.attributes.get(semconv.THROUGHPUT) for s in sends}
    assert speeds == {("5", 4 << 20, 0): None, ("5", 4 << 20, 1_000_000): (4 << 20) * 1e3, ("6", 8192, 0): None,
                      (None, 8192, 0): None}
    assert [(count, total) for _, count, total in points[semconv.METRIC_THROUGHPUT]] == [(1, (4 << 20) * 1e3)]
    assert [(count, total) for _, count, total in points[semconv.METRIC_PEER_THROUGHPUT]] == [(1, (4 << 20) * 1e3)]
    assert sum(count for _, count, _ in points[semconv.METRIC_DURATION]) == 4
    # request 5 moved for 1 ms: 8 MiB / 1 ms; request 6 never took measurable time: no speed
    assert [(count, total) for _, count, total in points[semconv.METRIC_REQUEST_THROUGHPUT]] == [
        (1, (8 << 20) * 1e3)]
    assert sum(count for _, count, _ in points[semconv.METRIC_REQUEST_SIZE]) == 2


def test_both_pipelines_make_the_same_points(monkeypatch):
    _, direct = _run(monkeypatch, "direct")
    _, sdk = _run(monkeypatch, "sdk")
    assert direct == sdk
