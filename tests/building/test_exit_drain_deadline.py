"""The exit's ending of open spans (building/open_spans.py `end_every`) looks at its deadline before each span it
ends, and the cyclic garbage collector does not run meanwhile: with 130,000 requests open, a full collection in the
middle of it took tenths of a second, which a look every few dozen spans could not keep inside the 5 s bound.

A fake clock (the module's `time`, replaced for the test) that each ending moves by one second: no timing is
asserted, only how many were ended before the deadline and what is left.
"""

import gc
import types

import pytest

from otel_kvtransfer.building import open_spans

OPEN = 100  # requests, and as many peer waits


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(open_spans, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


def _table(ended, clock):
    def end(state):
        ended.append((state, gc.isenabled()))
        clock[0] += 1.0  # each ending takes a second of the fake clock

    table = open_spans.OpenSpans(10 * OPEN, end, end, on_drop=lambda reason, n: None)
    for key in range(OPEN):
        table.requests[key] = f"request-{key}"
        table.peers[key] = f"peer-{key}"
    return table, end


def test_the_deadline_is_looked_at_before_each_span_ended(clock):
    ended = []
    table, end = _table(ended, clock)
    left = table.end_every(end, end, deadline=10.5)
    assert [state for state, _ in ended] == [f"request-{key}" for key in range(11)]  # at 0, 1, ..., 10 s
    assert left == 2 * OPEN - 11
    assert len(table) == 0  # what was left is forgotten: a later drain does not count it again
    assert table.end_every(end, end, deadline=0.0) == 0


def test_everything_ends_when_the_deadline_allows_and_no_collection_runs_meanwhile(clock):
    ended = []
    table, end = _table(ended, clock)
    assert gc.isenabled()
    assert table.end_every(end, end, deadline=float(10 * OPEN)) == 0
    assert len(ended) == 2 * OPEN
    assert not any(collecting for _, collecting in ended)
    assert gc.isenabled()  # as it was before


def test_a_collector_the_process_turned_off_stays_off(clock):
    ended = []
    table, end = _table(ended, clock)
    gc.disable()
    try:
        table.end_every(end, end, deadline=5.0)
        assert not gc.isenabled()
    finally:
        gc.enable()
