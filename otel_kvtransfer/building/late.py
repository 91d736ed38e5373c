"""Sends that complete after their request concluded: the signal for "the next request silently holds the
previous request's KV".

A request that ends (normally, failed, evicted or at exit) leaves a small entry here for LATE_WINDOW_S: its span's
context, when it ended, its labels (shared with every request that has the same), nothing of its sends. A send of
that key that arrives in that time is built under the ended request span instead of opening a second one; if it
ended after the request did, it carries the span event `kv_transfer.late_completion` with
`kv_transfer.after_request_end_s` and counts in `kv_transfer.late_completions`, and the first such send of a
request is one line of the log (`LateLines`). The window is a time, whatever the request rate, up to MAX_ENDED
entries: past that many requests ended in one window (more than ~1,000 a second), the oldest entry is let go
before its window is over and counted as dropped (`late_window_full`), so what can no longer be recognised late is
said; a send of a request let go, or ended longer ago than the window, opens a request span of its own, as a send
of an unknown key does.

On the peer's side, a wait (receive or serve) that ended with an error (its lease expired, its KV was freed) is
held open for `late_watch_s` before it is exported: KV of it that still arrives, or is still read, in that time
(`records.LATE_ARRIVAL`) puts the same event on it, counts, and is one line of the log. A wait ended in time is
exported at once; so is every held one when the process ends.

The lines: request keys and peer names come from clients and peers, so each is printed as one bounded line with
control and format characters escaped (`printable.one_line`). A storm of late transfers (a frozen decode under
load, a peer re-reading an expired key) logs its first MAX_LINES one by one per scan and the rest in one summary
line at the end of the scan, as stuck items do; every one is still counted and gets its event.
"""

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from opentelemetry.trace import SpanContext

from otel_kvtransfer.building.printable import one_line

if TYPE_CHECKING:
    from otel_kvtransfer.building.builder_part import BuiltSpan

_logger = logging.getLogger(__name__)

LATE_WINDOW_S = 60.0  # how long after its request's end a send is still recognised as late (at least)
MAX_ENDED = 65536  # ended requests remembered at once: LATE_WINDOW_S at up to ~1,090 requests ending a second
MAX_RELEASED = 4096  # peer waits remembered after their export, to say an arrival after it in the log
MAX_HELD = 4096  # peer waits held for a late arrival; beyond it the oldest is exported at once
MAX_LATE_SHAPES = 64  # requests whose late sends' shapes are kept (send_attributes' cache), the latest first
MAX_LABEL_SETS = 1024  # distinct label sets shared by the ended requests
MAX_LINES = 5  # late lines logged one by one per scan; the rest go into one summary line
MAX_KEYS_NAMED = 3  # request keys a summary line names


class EndedRequest:
    __slots__ = ("parent", "end_ns", "labels", "warned")

    def __init__(self, parent: Optional[SpanContext], end_ns: int, labels: Dict[str, Any]) -> None:
        self.parent = parent  # the ended request span's context: the late send's parent
        self.end_ns = end_ns
        self.labels = labels  # shared with the other ended requests of the same labels: never changed
        self.warned = False


class EndedRequests:
    """Key -> EndedRequest of the requests that ended in the last `window_s` (at most `limit`, the newest)."""

    def __init__(self, window_s: float = LATE_WINDOW_S, limit: int = MAX_ENDED,
                 on_drop: Optional[Callable[[str, int], None]] = None) -> None:
        self._ended: "OrderedDict[Any, EndedRequest]" = OrderedDict()  # in the order they ended
        self._window_ns = int(window_s * 1e9)
        self._limit = limit
        self._on_drop = on_drop or (lambda reason, n: None)
        self._label_sets: Dict[Tuple[Any, ...], Dict[str, Any]] = {}  # label items -> the one dict of them
        # key -> its late sends' static attributes
        self._shapes: "OrderedDict[Any, Dict[Any, Dict[str, Any]]]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._ended)

    def ended(self, key: Any, parent: Optional[SpanContext], end_ns: int, labels: Dict[str, Any]) -> None:
        if key in self._ended:
            del self._ended[key]
        elif len(self._ended) >= self._limit:
            _, oldest = self._ended.popitem(last=False)
            if oldest.end_ns > end_ns - self._window_ns:  # let go inside its window: said, not silent
                self._on_drop("late_window_full", 1)
        self._ended[key] = EndedRequest(parent, end_ns, self._shared(labels))

    def _shared(self, labels: Dict[str, Any]) -> Dict[str, Any]:
        try:
            items = tuple(labels.items())
            found = self._label_sets.get(items)
        except TypeError:  # an unhashable label value: kept as it is
            return labels
        if found is None:
            if len(self._label_sets) >= MAX_LABEL_SETS:
                self._label_sets.clear()
            found = self._label_sets[items] = dict(labels)
        return found

    def expire(self, now_ns: int) -> None:
        """Forget the requests that ended more than the window before `now_ns` (oldest first)."""
        deadline = now_ns - self._window_ns
        while self._ended:
            key, oldest = next(iter(self._ended.items()))
            if oldest.end_ns > deadline:
                return
            del self._ended[key]
            self._shapes.pop(key, None)

    def reopened(self, key: Any) -> None:
        """A new request of the same key began: its sends are its own."""
        self._ended.pop(key, None)
        self._shapes.pop(key, None)

    def get(self, key: Any) -> Optional[EndedRequest]:
        return self._ended.get(key)

    def shapes(self, key: Any) -> Dict[Any, Dict[str, Any]]:
        """The cache of static send attributes (send_attributes.attributes) for late sends of `key`: kept for the
        last MAX_LATE_SHAPES requests that had one, not for every ended request."""
        found = self._shapes.get(key)
        if found is None:
            if len(self._shapes) >= MAX_LATE_SHAPES:
                self._shapes.popitem(last=False)
            found = self._shapes[key] = {}
        else:
            self._shapes.move_to_end(key)
        return found

    def clear(self) -> None:
        self._ended.clear()
        self._shapes.clear()


class HeldPeer:
    __slots__ = ("span", "end_ns", "release_ns")

    def __init__(self, span: "BuiltSpan", end_ns: int, release_ns: int) -> None:
        self.span = span  # open: its end (end_ns) is known, only its export waits
        self.end_ns = end_ns
        self.release_ns = release_ns


class HeldPeers:
    """Key -> HeldPeer, oldest first; `release(span, end_ns)` ends and exports one. The keys released last are
    remembered (bounded) so that an arrival after its span left still says so in the log, once per arrival until
    one was put on the span."""

    def __init__(self, watch_s: float, release: Callable[["BuiltSpan", int], None], limit: int = MAX_HELD) -> None:
        self._held: "OrderedDict[Any, HeldPeer]" = OrderedDict()
        self._released: "OrderedDict[Any, Optional[int]]" = OrderedDict()  # key -> its end (None: reported)
        self._watch_ns = int(watch_s * 1e9)
        self._release = release
        self._limit = limit

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, key: Any, span: "BuiltSpan", end_ns: int) -> None:
        if self._watch_ns <= 0:
            return self._release(span, end_ns)
        earlier = self.take(key)
        if earlier is not None:  # a wait of the same key held before: exported first, not lost
            self._let_go(key, earlier)
        if len(self._held) >= self._limit:
            self._let_go(*self._held.popitem(last=False))
        self._held[key] = HeldPeer(span, end_ns, end_ns + self._watch_ns)

    def take(self, key: Any) -> Optional[HeldPeer]:
        """The held wait of `key`, no longer held (the caller ends it), or None."""
        return self._held.pop(key, None)

    def reported(self, key: Any) -> None:
        """A late arrival was put on the wait of `key`: later ones of it are not reported again."""
        self._remember(key, None)

    def released_end(self, key: Any) -> Optional[int]:
        """When the wait of `key` had ended, if it was held, exported since and not reported late; else None."""
        return self._released.get(key)

    def release_due(self, now_ns: int) -> None:
        """Export the waits whose watch is over (they were held in order of their end)."""
        while self._held:
            key, held = next(iter(self._held.items()))
            if held.release_ns > now_ns:
                return
            del self._held[key]
            self._let_go(key, held)

    def release_all(self) -> None:
        while self._held:
            self._let_go(*self._held.popitem(last=False))

    def clear(self) -> None:
        self._held.clear()
        self._released.clear()

    def _let_go(self, key: Any, held: HeldPeer) -> None:
        self._remember(key, held.end_ns)
        self._release(held.span, held.end_ns)

    def _remember(self, key: Any, end_ns: Optional[int]) -> None:
        if len(self._released) >= MAX_RELEASED:
            self._released.popitem(last=False)
        self._released[key] = end_ns


def late_by_s(ended: EndedRequest, send_end_ns: int) -> Optional[float]:
    """How long after its request's end the send completed; None when it did not (it only arrived later)."""
    late = send_end_ns - ended.end_ns
    return late / 1e9 if late > 0 else None


class LateLines:
    """The log lines of late transfers: the first MAX_LINES of a scan one by one, the rest in one summary line when
    the scan ends (`flush`)."""

    def __init__(self) -> None:
        self._logged = 0
        self._reset()

    def _reset(self) -> None:
        self._sends = self._arrivals = 0
        self._latest_s = 0.0
        self._backends: Dict[str, int] = {}
        self._keys: List[str] = []

    def send(self, ended: EndedRequest, key: Any, backend: Optional[str], peer: Any, late_s: float) -> None:
        """A request's send completed late: its first late send is a line (or part of the scan's summary)."""
        if ended.warned:
            return
        ended.warned = True
        if self._logged < MAX_LINES:
            self._logged += 1
            to = "" if peer is None else f" to {one_line(peer)}"
            _logger.warning("otel_kvtransfer: a %s send of request %s%s completed %.3f s after the request had "
                            "ended: its bytes may land in memory a later request already holds "
                            "(kv_transfer.late_completion)", one_line(backend or "KV", 32), one_line(key, 128), to,
                            late_s)
            return
        self._sends += 1
        self._note(key, backend, late_s)

    def arrival(self, key: Any, backend: Optional[str], late_s: float, exported: bool) -> None:
        """KV of a peer wait arrived after it had ended: at its first arrival (held), or at each one after its span
        left."""
        if self._logged < MAX_LINES:
            self._logged += 1
            where = "its span had been exported already (OTEL_KVTRANSFER_LATE_WATCH_S)" if exported else \
                "kv_transfer.late_completion"
            _logger.warning("otel_kvtransfer: %s KV of request %s was still transferred %.3f s after its peer wait "
                            "had ended and its memory was given back: a later request may hold those blocks (%s)",
                            one_line(backend, 32), one_line(key, 128), late_s, where)
            return
        self._arrivals += 1
        self._note(key, backend, late_s)

    def _note(self, key: Any, backend: Optional[str], late_s: float) -> None:
        self._latest_s = max(self._latest_s, late_s)
        name = one_line(backend, 32)
        if name in self._backends or len(self._backends) < 8:
            self._backends[name] = self._backends.get(name, 0) + 1
        if len(self._keys) < MAX_KEYS_NAMED:
            shown = one_line(key, 64)
            if shown not in self._keys:
                self._keys.append(shown)

    def flush(self) -> None:
        """The scan is over: one line for the late transfers not logged one by one; the next scan has lines of
        its own again."""
        more = self._sends + self._arrivals
        if more:
            by_backend = ", ".join(f"{name}: {count}" for name, count in
                                   sorted(self._backends.items(), key=lambda item: -item[1]))
            _logger.warning("otel_kvtransfer: %d more late KV transfers than the lines above (%d sends completed "
                            "after their request had ended, %d arrivals at peer waits that had ended; the latest %.3f "
                            "s after its end); by backend: %s; requests %s%s (kv_transfer.late_completion)",
                            more, self._sends, self._arrivals, self._latest_s, by_backend, ", ".join(self._keys),
                            ", ..." if more > len(self._keys) else "")
        self._logged = 0
        self._reset()
