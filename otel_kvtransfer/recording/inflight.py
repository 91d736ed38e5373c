"""What the engine process is transferring right now, seen from the recorder's thread: sync engine calls still
inside the engine, and async submissions whose completion nobody has observed yet; and, as kind `connect`, the
set-up calls towards a peer still in progress.

A hung sync call is visible only while it hangs, so it must be found without any work on the hot path: once a
second the recorder's thread reads `sys._current_frames()` and finds the threads whose Python frame is an engine
wrapper registered here (`register_wrapper`), reading its locals (when the call started, its peer, its bytes, the
transfer scope it belongs to). Async submissions are the entries of every `pending.PendingTransfers`.

The result travels as one INFLIGHT record (records.py) to whichever builder builds the spans (this process's
thread or the helper), which keeps the `kv_transfer.inflight` gauges and reports each item that stays open longer
than OTEL_KVTRANSFER_STUCK_S once, while it is still open (`stuck.py`).
"""

import sys
import threading
import time
import weakref
from types import CodeType, FrameType
from typing import Any, Callable, Dict, Hashable, Iterator, Optional, Protocol, Sequence

from otel_kvtransfer.recording import clock as records_clock  # `clock` is the watcher's own scan clock
from otel_kvtransfer.recording import records as r
from otel_kvtransfer.semconv import INFLIGHT_SEND

SCAN_INTERVAL_S = 1.0

# What is in flight: (start_ns, key, peer, nbytes, backend[, kind]) (kind: semconv.INFLIGHT_SEND when left out, or
# INFLIGHT_CONNECT for a set-up call)
Item = tuple[Any, ...]
# What a wrapper's frame says of its call: describe(frame locals) -> an item, or None
Describe = Callable[[Dict[str, Any]], Optional[Item]]


class Pending(Protocol):
    """A table of what was submitted and has not ended (`pending.PendingTransfers`, an engine's own)."""

    def in_flight(self) -> Iterator[tuple[Hashable, Item]]: ...


_WRAPPERS: Dict[CodeType, Describe] = {}  # code object of a wrapper -> what its frame says
_PENDING: "weakref.WeakSet[Pending]" = weakref.WeakSet()  # every PendingTransfers


def register_wrapper(code: CodeType, describe: Describe) -> None:
    _WRAPPERS[code] = describe


def register_pending(pending: Pending) -> None:
    _PENDING.add(pending)


def _scope_key(scope: object) -> Optional[r.Key]:
    info = getattr(scope, "info", None)
    return info[r.INFO_KEY] if info else None


def describe_call(start: int, scope: object, args: Sequence[Any], backend: str) -> Item:
    """(start_ns, key, peer, nbytes, backend) of an engine call in progress, from its wrapper's locals."""
    peer = args[0] if args else None
    nbytes = None
    if len(args) > 3:
        lengths = args[3]
        if isinstance(lengths, int):
            nbytes = lengths
        elif isinstance(lengths, list) and len(lengths) <= 4096:
            nbytes = sum(x for x in lengths if isinstance(x, int))
    return (start, _scope_key(scope), peer if isinstance(peer, str) else None, nbytes, backend)


class Watcher:
    """Scans at most once per SCAN_INTERVAL_S; each scan is one INFLIGHT record for the builder."""

    def __init__(self, stuck_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._stuck_ns = int(stuck_s * 1e9)
        self._clock = clock
        self._next = 0.0
        self._reported: set[Hashable] = set()
        self._last_count = 0
        self.scans = 0  # scans made: what "a few scans have passed" waits on

    def due(self) -> bool:
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + SCAN_INTERVAL_S
        return True

    def until_due(self) -> float:
        """Seconds until the next scan is due (0 when it is)."""
        return max(self._next - self._clock(), 0.0)

    def scan(self, now_ns: Optional[int] = None) -> Optional[r.Record]:
        """(INFLIGHT, now_ns, open count, oldest start_ns or None, [stuck item, ...]) where an item is
        (start_ns, key, peer, nbytes, backend), each reported once while it stays open; None when nothing is in
        flight and nothing was at the last scan (a process that never transfers sends no record at all, and so
        never starts a builder process)."""
        self.scans += 1
        records_clock.refresh()  # once a second, off the hot path: the wall clock's step since start (clock.py)
        now_ns = records_clock.now_ns() if now_ns is None else now_ns
        items = _calls_in_progress() if _WRAPPERS else {}
        for pending in list(_PENDING):
            for handle, item in pending.in_flight():
                items[("async", id(pending), handle, item[0])] = item
        oldest: Optional[int]
        oldest_connect: Optional[int]
        stuck: list[Item]
        oldest, stuck, sends, connects, oldest_connect = None, [], 0, 0, None
        for ident, item in items.items():
            start = item[0]
            kind = item[5] if len(item) > 5 else INFLIGHT_SEND
            if kind == INFLIGHT_SEND:
                sends += 1
                if oldest is None or start < oldest:
                    oldest = start
            else:
                connects += 1
                if oldest_connect is None or start < oldest_connect:
                    oldest_connect = start
            if now_ns - start >= self._stuck_ns and ident not in self._reported:
                stuck.append(item[:5] + (kind,))
                self._reported.add(ident)
        # Forget what has ended: the ids kept are a subset of what is open now (bounded by the pending tables and
        # the threads), so each item is reported once for as long as it stays open, however many there are.
        self._reported &= items.keys()
        if not items and not self._last_count:
            return None
        self._last_count = len(items)
        return r.inflight(now_ns, sends, oldest, stuck, (connects, oldest_connect))


def _calls_in_progress() -> Dict[tuple[Any, ...], Item]:
    """("call", thread, start) -> item of every sync call some other thread is inside now, read from its wrapper's
    frame (the top frame, or one just below it)."""
    items: Dict[tuple[Any, ...], Item] = {}
    me = threading.get_ident()
    frame: Optional[FrameType]
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        depth = 0
        while frame is not None and depth < 4:  # the wrapper is the top frame, or just below
            describe = _WRAPPERS.get(frame.f_code)
            if describe is not None:
                item = describe(frame.f_locals)
                if item is not None:
                    items[("call", ident, item[0])] = item
                break
            frame, depth = frame.f_back, depth + 1
    return items
