"""What a receiver learns about its KV after its wait ended (sglang verifies its KV checksum when the request enters
a batch) and how long it waited for KV memory before it asked for its KV: through the integration API, into the
receive span and the metrics derived from it, on both pipelines (our tables, and the SDK's instruments from spans).

The framework side (sglang's own classes) is tested on a real deployment: tests/deployments/test_sglang_integrity.py.
"""

import pytest
from support.telemetry import Telemetry

from otel_kvtransfer import config, semconv
from otel_kvtransfer import integration as kvt

BACKEND, FRAMEWORK = "mooncake", "fw"
S = 1_000_000_000


@pytest.fixture(params=["direct", "sdk"])
def telemetry(request, monkeypatch):
    if request.param == "sdk":
        monkeypatch.setenv(config.PIPELINE, "sdk")
    t = Telemetry().instrument()
    yield t
    t.uninstrument()


def _receive(key, start_s, wait_s=None):
    attributes = {} if wait_s is None else {semconv.ALLOCATION_WAIT_S: wait_s}
    kvt.begin_receive(key, backend=BACKEND, framework=FRAMEWORK, attributes=attributes, start_ns=start_s * S)


def _receives(telemetry) -> dict:
    return {s.attributes[semconv.REQUEST_KEY]: s for s in telemetry.spans(semconv.SPAN_RECEIVE)}


def test_a_receive_awaiting_its_verdict_is_exported_with_it(telemetry):
    _receive(1, 10)
    kvt.end_receive(1, end_ns=11 * S, outcome_pending=True)
    _receive(2, 10)
    kvt.end_receive(2, end_ns=12 * S, outcome_pending=True)
    # both wait for what sglang will say of their KV (had they left at their end, nothing could be added now)
    kvt.receive_outcome(1, attributes={semconv.INTEGRITY: semconv.INTEGRITY_VERIFIED}, at_ns=20 * S)
    digests = {semconv.INTEGRITY_EXPECTED_DIGEST: "0x5a1c02f1", semconv.INTEGRITY_COMPUTED_DIGEST: "0x5a1c02f0"}
    kvt.receive_outcome(2, attributes={semconv.INTEGRITY: semconv.INTEGRITY_MISMATCH},
                        events=((semconv.EVENT_INTEGRITY_MISMATCH, digests),), at_ns=21 * S)
    receives = _receives(telemetry)
    assert receives["1"].attributes[semconv.INTEGRITY] == "verified" and not receives["1"].events
    assert (receives["1"].start_time, receives["1"].end_time) == (10 * S, 11 * S)  # the wait, not the verdict
    mismatch = receives["2"]
    assert mismatch.attributes[semconv.INTEGRITY] == "mismatch" and mismatch.end_time == 12 * S
    (event,) = mismatch.events
    assert event.name == semconv.EVENT_INTEGRITY_MISMATCH and dict(event.attributes) == digests
    assert event.timestamp == 21 * S
    metrics = telemetry.metrics()
    (counted,) = metrics[semconv.METRIC_INTEGRITY_MISMATCHES]
    assert counted.value == 1
    assert dict(counted.attributes) == {semconv.BACKEND: BACKEND, semconv.FRAMEWORK: FRAMEWORK}
    assert sum(p.count for p in metrics[semconv.METRIC_RECEIVE_DURATION]) == 2
    assert telemetry.dropped() == {}


def test_a_verdict_that_comes_while_the_wait_is_open_lands_on_it(telemetry):
    _receive(3, 10)
    kvt.receive_outcome(3, attributes={semconv.INTEGRITY: semconv.INTEGRITY_MISMATCH})
    kvt.end_receive(3, end_ns=11 * S)
    assert _receives(telemetry)["3"].attributes[semconv.INTEGRITY] == "mismatch"
    assert telemetry.metrics()[semconv.METRIC_INTEGRITY_MISMATCHES][0].value == 1


def test_a_receive_whose_verdict_never_comes_leaves_as_it_is(telemetry):
    """No verdict will come (sglang admits a prefill of another layout unverified): an empty outcome lets it go;
    a flush lets go what still waits; a verdict for a wait no longer held is counted, not lost silently."""
    _receive(4, 10)
    kvt.end_receive(4, end_ns=11 * S, outcome_pending=True)
    kvt.receive_outcome(4)
    assert semconv.INTEGRITY not in _receives(telemetry)["4"].attributes
    _receive(5, 10)
    kvt.end_receive(5, end_ns=11 * S, outcome_pending=True)
    assert "5" in _receives(telemetry)  # spans() flushes: out as it ended
    kvt.receive_outcome(5, attributes={semconv.INTEGRITY: semconv.INTEGRITY_MISMATCH})
    assert telemetry.dropped() == {"outcome_unmatched": 1}
    assert semconv.METRIC_INTEGRITY_MISMATCHES not in telemetry.metrics()


def test_the_allocation_wait_is_a_histogram_of_the_receives_that_carry_it(telemetry):
    _receive(6, 10, wait_s=2.5)
    kvt.end_receive(6, end_ns=11 * S)
    _receive(7, 10, wait_s=0.004)
    kvt.end_receive(7, end_ns=11 * S, error_type="transfer_failed")
    _receive(8, 10)  # a receive its framework knows no admission of
    kvt.end_receive(8, end_ns=11 * S)
    (wait,) = telemetry.metrics()[semconv.METRIC_RECEIVE_ALLOCATION_WAIT]
    assert (wait.count, wait.sum) == (2, pytest.approx(2.504))
    assert dict(wait.attributes) == {semconv.BACKEND: BACKEND, semconv.FRAMEWORK: FRAMEWORK}
    assert _receives(telemetry)["6"].attributes[semconv.ALLOCATION_WAIT_S] == 2.5


def test_bad_outcomes_are_counted_never_raised(telemetry):
    kvt.receive_outcome(object())
    kvt.receive_outcome(9, events=[("x",)])
    assert telemetry.dropped() == {"api_error": 2}


def test_mismatch_lines_are_one_escaped_bounded_line_each_and_a_storm_is_summed(caplog):
    """The decode's WARNING per mismatch (frameworks/sglang/integrity.py): a rid comes from a client, so it is
    printed escaped, on one line, cut; past 20 lines a minute the rest are counted into the next line."""
    import logging

    from otel_kvtransfer.frameworks.sglang.integrity import MismatchLines

    now = [0.0]
    lines = MismatchLines(limit=2, window_s=60.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="otel_kvtransfer")
    hostile = "r\nid\x1b[31m\u2028" + "x" * 500
    lines.mismatch(7, hostile, "127.0.0.1:8998", "0x10", "0x11")
    lines.mismatch(8, "b", "127.0.0.1:8998", "0x20", None)
    for room in (9, 10, 11):
        lines.mismatch(room, "c", "127.0.0.1:8998", "0x30", "0x31")  # over the limit: counted, not logged
    now[0] = 61.0
    lines.mismatch(12, "d", "127.0.0.1:8998", "0x40", "0x41")
    said = [r.getMessage() for r in caplog.records if "KV checksum rejected" in r.getMessage()]
    assert len(said) == 3
    first = said[0]
    assert "\n" not in first and "\x1b" not in first and "\u2028" not in first
    assert "r\\x0aid\\x1b[31m\\u2028" in first and f"({len(hostile)} characters)" in first
    assert "request 7 " in first and "from prefill 127.0.0.1:8998" in first and "expected 0x10, computed 0x11" in first
    assert "computed as expected on this rank (a peer rank's differed)" in said[1]
    assert "request 12 " in said[2] and "3 more mismatches not logged before this one" in said[2]
