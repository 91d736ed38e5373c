"""Many items stuck at once: each is counted once however many there are and however many scans see it, and the
log says the first few one by one and the rest in one summary line per scan (how many, the oldest, by kind and
peer), not one line per item.

Real records, not a real hang: 70,000 transfers hung on one frozen peer cannot be made on this machine (a real
Mooncake write hung on a frozen receiver is test_stuck.py's one item). The sends are async submissions entered in
a pending table (`pending.PendingTransfers.submit`, what the engine modules call when a submission returns) that
never complete; the requests are opened through the integration API. Both carry start times a minute old
(OTEL_KVTRANSFER_STUCK_S=1), and both watchers' scans are held until every item is in place, so that one scan finds
them all stuck at once, as when a peer freezes under load; the scans run as they would once let go.
"""

import logging
import time

from support.telemetry import Telemetry
from support.waiting import wait_until

from otel_kvtransfer import config, semconv
from otel_kvtransfer import integration as kvt
from otel_kvtransfer.building import stuck
from otel_kvtransfer.recording import inflight
from otel_kvtransfer.recording.pending import PendingTransfers
from otel_kvtransfer.recording.recorder import RECORDER

SENDS = 70_000  # above the 65,536 ids the scan once kept before forgetting them all
REQUESTS = 20_000
PEER = "127.0.0.1:7001"
MINUTE_NS = 60 * 10**9


def _stuck_counts(telemetry) -> dict:
    points = telemetry.metrics().get(semconv.METRIC_STUCK, [])
    counts = {}
    for point in points:
        kind = dict(point.attributes)[semconv.INFLIGHT_KIND]
        counts[kind] = counts.get(kind, 0) + point.value
    return counts


class _Held:
    """The scans of both watchers (the recorder's `inflight.Watcher.scan` for sends, the builder's
    `stuck.OpenWatch.tick` for requests) held until every item is in place, then counted: so the first scan after
    the release finds them all, as when a peer freezes under load. `opened` counts the requests the builder has
    opened."""

    def __init__(self, monkeypatch):
        self.held, self.scans, self.ticks, self.opened = True, 0, 0, 0
        opened = stuck.OpenWatch.opened

        def counted_opened(watch, *args, **kwargs):
            self.opened += 1
            return opened(watch, *args, **kwargs)

        monkeypatch.setattr(inflight.Watcher, "scan", self._held(inflight.Watcher.scan, "scans"))
        monkeypatch.setattr(stuck.OpenWatch, "tick", self._held(stuck.OpenWatch.tick, "ticks"))
        monkeypatch.setattr(stuck.OpenWatch, "opened", counted_opened)

    def _held(self, method, counter: str):
        """`method`, doing nothing while held; once let go, each call that ran is counted in `counter`."""

        def held(owner, *args, **kwargs):
            if self.held:
                return None
            try:
                return method(owner, *args, **kwargs)
            finally:
                setattr(self, counter, getattr(self, counter) + 1)

        return held


def test_seventy_thousand_stuck_items_are_counted_once_and_summarised(monkeypatch, caplog):
    monkeypatch.setenv(config.STUCK_S, "1")
    monkeypatch.setenv(config.MAX_PENDING_ASYNC, str(SENDS + 1))
    caplog.set_level(logging.WARNING, logger="otel_kvtransfer")
    held = _Held(monkeypatch)
    telemetry = Telemetry().instrument()
    pending = PendingTransfers("mooncake")
    try:
        old = time.time_ns() - MINUTE_NS
        for n in range(SENDS):
            pending.submit(("stuck", n), old + n, 4096, 1, semconv.OP_WRITE, PEER, "tcp")
        for key in range(REQUESTS):
            kvt.begin_request(key, backend="mooncake", framework="test", start_ns=old + key)
        wait_until(lambda: held.opened == REQUESTS, 300, "every request opened by the builder")
        held.held = False
        expected = {semconv.INFLIGHT_SEND: SENDS, semconv.INFLIGHT_REQUEST: REQUESTS}
        wait_until(lambda: all(_stuck_counts(telemetry).get(kind, 0) >= count for kind, count in expected.items()),
                   300, "every item reported stuck")
        # Several more scans and ticks see the same items still open: none is reported again.
        scans, ticks = held.scans, held.ticks
        wait_until(lambda: held.scans >= scans + 3 and held.ticks >= ticks + 3, 120, "three more scans and ticks")
        wait_until(lambda: RECORDER.pending() == 0, 120, "the scans' records built")
        assert _stuck_counts(telemetry) == expected
    finally:
        pending.abandon()
        telemetry.uninstrument()
    lines = [r.getMessage() for r in caplog.records if r.name == stuck.__name__]
    singles = [line for line in lines if "is stuck:" in line]
    summaries = [line for line in lines if "became stuck in this scan" in line]
    assert len(lines) == len(singles) + len(summaries)
    # the sends became stuck in one scan, the requests in one tick: each said its first few, then one line
    assert len(singles) == 2 * stuck.MAX_LINES
    assert len(summaries) == 2
    (sends,) = [line for line in summaries if f"{SENDS} items" in line]
    assert f"send to {PEER}: {SENDS - stuck.MAX_LINES}" in sends
    (requests,) = [line for line in summaries if f"{REQUESTS} items" in line]
    assert f"request: {REQUESTS - stuck.MAX_LINES}" in requests
