"""Device time onto the records' clock (clock.py), for the device clock's resolver (`device_clock`).

An *anchor* is a timing event recorded on a stream of its own that holds no other work, with the records' clock
read just before the record and again when a query first sees it complete. The anchor's host time is the middle
of that window, and an anchor is kept only when the window is at most ANCHOR_WINDOW_NS, so its host time is right
to half of that (25 us). An event's host time is its anchor's plus the device's elapsed time between the two
(`elapsed_time`). Both ends of one interval go through the same anchor, the one nearest its end, so a duration is
exactly the device's. Device and host clocks drift apart slowly: while brackets are pending the resolver anchors
again every MAX_ANCHOR_INTERVAL_S at the latest (every MIN_ANCHOR_INTERVAL_S until it has measured the drift), and
sooner when the drift rate measured between anchors would make the drift reach DRIFT_BUDGET_NS (25 us) in between;
with the anchor's own 25 us, an event's host time stays within 50 us of the truth.

Only the resolver's thread takes anchors; other threads read them (`times`, for a request that ends) from copies
of the kept ones, so no lock is held across a device call. A device that raises while an anchor is taken gets no
anchor until MAX_ANCHOR_INTERVAL_S later (counted in `stats`): its brackets keep their host times, counted by the
device clock, never a failure retried every pass.
"""

import logging
from collections import deque
from time import monotonic
from typing import Any, Iterable, Optional, Protocol

from otel_kvtransfer.recording.clock import now_ns

_logger = logging.getLogger(__name__)

ANCHOR_WINDOW_NS = 50_000  # an anchor's record-to-seen window: its host time is right to half of this
ANCHOR_TRIES = 8  # records per anchoring before giving up until the next pass
DRIFT_BUDGET_NS = 25_000  # device/host drift allowed between anchors
MAX_ANCHOR_INTERVAL_S = 1.0
MIN_ANCHOR_INTERVAL_S = 0.05
DRIFT_BASELINE_S = 0.5  # the shortest span of anchors a drift rate is measured over (less: too noisy)
KEPT_ANCHORS = 64  # per device: the nearest of them converts a bracket


class TimingEvent(Protocol):
    """A device's timing event (torch.cuda.Event(enable_timing=True), or a stand-in shaped like it)."""

    def record(self, stream: Any, /) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: "TimingEvent", /) -> float: ...


class DeviceModule(Protocol):
    """What the device clock uses of a device module: torch.cuda, or a stand-in shaped like it. Its streams are
    passed through as they are (a stream's `device_index` is read where it has one)."""

    def Event(self, *, enable_timing: bool) -> TimingEvent: ...  # torch.cuda's names, classes there

    def Stream(self, device: Any = ...) -> Any: ...

    def current_stream(self) -> Any: ...

    def is_available(self) -> bool: ...


class _Anchor:
    __slots__ = ("event", "host_ns", "window_ns")

    def __init__(self, event: TimingEvent, host_ns: int, window_ns: int) -> None:
        self.event = event
        self.host_ns = host_ns
        self.window_ns = window_ns


class _DeviceAnchors:
    """One device's anchors: a stream of their own, the last KEPT_ANCHORS, the drift rate measured over them."""

    __slots__ = ("stream", "kept", "rate", "due_s")

    def __init__(self) -> None:
        self.stream: Any = None  # made on the first anchoring (a device call: never under a lock)
        self.kept: deque[_Anchor] = deque(maxlen=KEPT_ANCHORS)
        # (host - device) / device elapsed, over the longest span of kept anchors; None: unknown
        self.rate: Optional[float] = None
        self.due_s = 0.0  # time.monotonic() by which the next anchor is due while brackets are pending

    def nearest(self, host_ns: int) -> Optional[_Anchor]:
        best = None
        for anchor in tuple(self.kept):  # a copy: the resolver may be keeping one meanwhile
            if best is None or abs(anchor.host_ns - host_ns) < abs(best.host_ns - host_ns):
                best = anchor
        return best

    def keep(self, anchor: _Anchor) -> None:
        """A new anchor, the drift measured against the oldest kept, and when the next one is due (raises what
        reading the events raises, before anything is kept)."""
        rate = self.rate
        if self.kept:
            base = self.kept[0]
            host_ns = anchor.host_ns - base.host_ns
            if host_ns >= DRIFT_BASELINE_S * 1e9:
                device_ns = base.event.elapsed_time(anchor.event) * 1e6
                if device_ns > 0:
                    rate = (host_ns - device_ns) / device_ns
        self.rate = rate
        self.kept.append(anchor)
        # Until a drift rate is measured (anchors DRIFT_BASELINE_S apart), anchor as often as allowed.
        interval = MIN_ANCHOR_INTERVAL_S if self.rate is None else MAX_ANCHOR_INTERVAL_S
        if self.rate:
            interval = min(max(DRIFT_BUDGET_NS / 1e9 / abs(self.rate), MIN_ANCHOR_INTERVAL_S), interval)
        self.due_s = monotonic() + interval


class Anchors:
    """The anchors of one device module (torch.cuda, or a stand-in shaped like it), per device. Anchors are taken
    on one thread only (the device clock's resolver); `times` may be called from any."""

    def __init__(self, device_module: DeviceModule) -> None:
        self._module = device_module
        self._by_device: dict[Optional[int], _DeviceAnchors] = {}  # device index -> its anchors
        self._counts = {"anchors": 0, "refused": 0, "failed": 0}
        self._windows: deque[int] = deque(maxlen=1024)

    def anchor_if_due(self, device: Optional[int]) -> None:
        """A new anchor for `device` when one is due. Never raises: a device that fails here is left alone until
        MAX_ANCHOR_INTERVAL_S later."""
        anchors = self._by_device.get(device)
        if anchors is None:
            anchors = self._by_device[device] = _DeviceAnchors()
        if monotonic() < anchors.due_s:
            return
        try:
            if anchors.stream is None:
                module = self._module
                anchors.stream = module.Stream() if device is None else module.Stream(device=device)
            anchor = self._take(anchors.stream)
            if anchor is None:  # again soon; brackets wait (or keep their host times past their give-up time)
                anchors.due_s = monotonic() + MIN_ANCHOR_INTERVAL_S
            else:
                anchors.keep(anchor)
                self._counts["anchors"] += 1
                self._windows.append(anchor.window_ns)
        except Exception:
            self._counts["failed"] += 1
            anchors.due_s = monotonic() + MAX_ANCHOR_INTERVAL_S
            _logger.debug("otel_kvtransfer could not take a device clock anchor", exc_info=True)

    def _take(self, stream: Any) -> Optional[_Anchor]:
        best = None
        for _ in range(ANCHOR_TRIES):
            event = self._module.Event(enable_timing=True)
            before = now_ns()
            event.record(stream)
            seen = None
            while True:  # a record on an idle stream completes within microseconds: spin, bounded
                if event.query():
                    seen = now_ns()
                    break
                if now_ns() - before > ANCHOR_WINDOW_NS:
                    break
            if seen is not None and seen - before <= ANCHOR_WINDOW_NS:
                if best is None or seen - before < best.window_ns:
                    best = _Anchor(event, (before + seen) // 2, seen - before)
                if best.window_ns <= ANCHOR_WINDOW_NS // 4:
                    break
        if best is None:
            self._counts["refused"] += 1
        return best

    def times(self, device: Optional[int], host_start: int, starts: Iterable[TimingEvent],
              ends: Iterable[TimingEvent]) -> Optional[tuple[int, int]]:
        """(start, end) of a bracket's events on the records' clock through the anchor nearest its end (found
        through the one nearest its launch at `host_start`); both ends through one anchor, so the duration is the
        device's. None without an anchor. Raises what reading the events raises."""
        anchors = self._by_device.get(device)
        anchor = anchors.nearest(host_start) if anchors is not None else None
        if anchors is None or anchor is None:
            return None
        end = _through(anchor, ends)
        nearer = anchors.nearest(end)  # never None: `anchor` is kept
        if nearer is not None and nearer is not anchor:
            anchor, end = nearer, _through(nearer, ends)
        # The forward can start once every stream it uses got there; it has ended once every one has.
        start = _through(anchor, starts)
        return start, max(end, start)

    def stats(self) -> dict[str, Any]:
        windows = sorted(self._windows)
        rates = [a.rate for a in list(self._by_device.values()) if a.rate is not None]
        return {
            "anchors": self._counts["anchors"], "anchorings_refused": self._counts["refused"],
            "anchorings_failed": self._counts["failed"],
            "anchor_window_median_ns": windows[len(windows) // 2] if windows else None,
            "anchor_window_max_ns": windows[-1] if windows else None,
            "drift_ppm": [-rate * 1e6 for rate in rates],  # how much faster the device's clock runs than the host's
        }


def _through(anchor: _Anchor, events: Iterable[TimingEvent]) -> int:
    """The latest of `events` on the records' clock: the anchor's host time + the device's elapsed time."""
    base, event = anchor.host_ns, anchor.event
    return max(base + round(event.elapsed_time(e) * 1e6) for e in events)
