"""Sends that complete after their request concluded: the signal for "the next request silently holds the
previous request's KV".

A request that ends (normally, failed, evicted or at exit) leaves a small entry here: its span's context, when it
ended, its labels. A send of that key that arrives afterwards is built under the ended request span instead of
opening a second one; if it ended after the request did, it carries the span event `kv_transfer.late_completion`
with `kv_transfer.after_request_end_s`, counts in `kv_transfer.late_completions`, and the first such send of a
request logs one WARNING. The table keeps the most recently ended requests only, so it stays bounded.

On the peer's side, a wait (receive or serve) that ended with an error (its lease expired, its KV was freed) is
held open for `late_watch_s` before it is exported: KV of it that still arrives, or is still read, in that time
(`records.LATE_ARRIVAL`) puts the same event on it, counts, and logs one WARNING. A wait ended in time is exported
at once; so is every held one when the process ends.
"""

import logging
from collections import OrderedDict
from typing import Optional

from otel_kvtransfer import semconv

_logger = logging.getLogger(__name__)

MAX_ENDED = 4096  # requests remembered after their end (the newest); a send later than that opens a request
MAX_HELD = 4096  # peer waits held for a late arrival; beyond it the oldest is exported at once


class EndedRequest:
    __slots__ = ("parent", "end_ns", "labels", "statics", "warned")

    def __init__(self, parent, end_ns: int, labels: dict, statics: dict):
        self.parent = parent  # the ended request span's context: the late send's parent
        self.end_ns = end_ns
        self.labels = labels
        self.statics = statics  # the request's send shapes, as send_attributes caches them
        self.warned = False


class EndedRequests:
    """Key -> EndedRequest of the requests that ended last (at most `limit`)."""

    def __init__(self, limit: int = MAX_ENDED):
        self._ended: "OrderedDict[object, EndedRequest]" = OrderedDict()
        self._limit = limit

    def __len__(self) -> int:
        return len(self._ended)

    def ended(self, key, parent, end_ns: int, labels: dict, statics: dict) -> None:
        if key in self._ended:
            del self._ended[key]
        elif len(self._ended) >= self._limit:
            self._ended.popitem(last=False)
        self._ended[key] = EndedRequest(parent, end_ns, labels, statics)

    def reopened(self, key) -> None:
        """A new request of the same key began: its sends are its own."""
        self._ended.pop(key, None)

    def get(self, key) -> Optional[EndedRequest]:
        return self._ended.get(key)

    def clear(self) -> None:
        self._ended.clear()


class HeldPeer:
    __slots__ = ("span", "end_ns", "release_ns")

    def __init__(self, span, end_ns: int, release_ns: int):
        self.span = span  # open: its end (end_ns) is known, only its export waits
        self.end_ns = end_ns
        self.release_ns = release_ns


class HeldPeers:
    """Key -> HeldPeer, oldest first; `release(span, end_ns)` ends and exports one. The keys released last are
    remembered (bounded) so that an arrival after its span left still says so in the log, once per arrival until
    one was put on the span."""

    def __init__(self, watch_s: float, release, limit: int = MAX_HELD):
        self._held: "OrderedDict[object, HeldPeer]" = OrderedDict()
        self._released: "OrderedDict[object, Optional[int]]" = OrderedDict()  # key -> its end (None: reported)
        self._watch_ns = int(watch_s * 1e9)
        self._release = release
        self._limit = limit

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, key, span, end_ns: int) -> None:
        if self._watch_ns <= 0:
            return self._release(span, end_ns)
        earlier = self.take(key)
        if earlier is not None:  # a wait of the same key held before: exported first, not lost
            self._let_go(key, earlier)
        if len(self._held) >= self._limit:
            self._let_go(*self._held.popitem(last=False))
        self._held[key] = HeldPeer(span, end_ns, end_ns + self._watch_ns)

    def take(self, key) -> Optional[HeldPeer]:
        """The held wait of `key`, no longer held (the caller ends it), or None."""
        return self._held.pop(key, None)

    def reported(self, key) -> None:
        """A late arrival was put on the wait of `key`: later ones of it are not reported again."""
        self._remember(key, None)

    def released_end(self, key) -> Optional[int]:
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

    def _let_go(self, key, held: HeldPeer) -> None:
        self._remember(key, held.end_ns)
        self._release(held.span, held.end_ns)

    def _remember(self, key, end_ns: Optional[int]) -> None:
        if len(self._released) >= MAX_ENDED:
            self._released.popitem(last=False)
        self._released[key] = end_ns


def late_by_s(ended: EndedRequest, send_end_ns: int) -> Optional[float]:
    """How long after its request's end the send completed; None when it did not (it only arrived later)."""
    late = send_end_ns - ended.end_ns
    return late / 1e9 if late > 0 else None


def warn_once(ended: EndedRequest, key, attrs, late_s: float) -> None:
    """One WARNING per request, at its first late send."""
    if ended.warned:
        return
    ended.warned = True
    _logger.warning("otel_kvtransfer: a %s send of request %s completed %.3f s after the request had ended: its "
                    "bytes may land in memory a later request already holds (kv_transfer.late_completion)",
                    str(attrs.get(semconv.BACKEND, "KV"))[:32], str(key)[:128], late_s)


def warn_peer(key, backend, late_s: float, exported: bool) -> None:
    """One WARNING per peer wait: at its first late arrival (held), or at each one after its span left."""
    where = "its span had been exported already (OTEL_KVTRANSFER_LATE_WATCH_S)" if exported else \
        "kv_transfer.late_completion"
    _logger.warning("otel_kvtransfer: %s KV of request %s was still transferred %.3f s after its peer wait had "
                    "ended and its memory was given back: a later request may hold those blocks (%s)",
                    str(backend)[:32], str(key)[:128], late_s, where)
