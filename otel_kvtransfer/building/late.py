"""Sends that complete after their request concluded: the signal for "the next request silently holds the
previous request's KV".

A request that ends (normally, failed, evicted or at exit) leaves a small entry here: its span's context, when it
ended, its labels. A send of that key that arrives afterwards is built under the ended request span instead of
opening a second one; if it ended after the request did, it carries the span event `kv_transfer.late_completion`
with `kv_transfer.after_request_end_s`, counts in `kv_transfer.late_completions`, and the first such send of a
request logs one WARNING. The table keeps the most recently ended requests only, so it stays bounded.
"""

import logging
from collections import OrderedDict
from typing import Optional

from otel_kvtransfer import semconv

_logger = logging.getLogger(__name__)

MAX_ENDED = 4096  # requests remembered after their end (the newest); a send later than that opens a request


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
