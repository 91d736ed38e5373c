"""The builder's table of spans that stay open across records: initiator requests and peer waits, per key.

Its one concern is keeping them bounded: by number (the least recently active goes first, across both kinds) and
by time (TTL without activity). Both tables are kept in order of last activity, so eviction costs O(evicted),
not O(open). How an evicted span ends is the builder's business: the table calls the `end_request` /
`end_peer` it was given and counts what it evicted through `on_drop`.
"""

import gc
import math
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from opentelemetry.trace import SpanContext

from otel_kvtransfer.building.aggregate import RequestAggregate

if TYPE_CHECKING:
    from otel_kvtransfer.building.builder_part import BuiltSpan


class OpenRequest:
    __slots__ = ("key", "span", "aggregate", "failure", "touched", "labels", "parent", "statics", "backend")

    def __init__(self, span: "BuiltSpan", now: float, labels: Dict[str, Any], key: Any = None) -> None:
        self.key = key
        self.span = span
        self.aggregate = RequestAggregate()
        self.failure: Optional[str] = None
        self.touched = now
        self.labels = labels  # attributes every send of the request repeats (framework, role, model)
        self.parent: Optional[SpanContext] = None  # the request span's context: its children's parent
        self.statics: Dict[Any, Dict[str, Any]] = {}  # send shape -> its static attributes (send_attributes)
        self.backend: Optional[str] = None


class OpenPeer:
    __slots__ = ("span", "touched", "role", "backend", "expected")

    def __init__(self, span: "BuiltSpan", now: float, role: Optional[str] = None, backend: Optional[str] = None,
                 expected: Any = None) -> None:
        self.span = span
        self.touched = now
        self.role, self.backend, self.expected = role, backend, expected


class OpenSpans:
    """`requests` and `peers`: key -> OpenRequest / OpenPeer, least recently active first. The builder reads
    and pops them directly (a dict lookup per record, no call)."""

    def __init__(self, max_open: int, end_request: Callable[[OpenRequest], None],
                 end_peer: Callable[[OpenPeer], None], on_drop: Callable[[str, int], None]) -> None:
        self.requests: "OrderedDict[object, OpenRequest]" = OrderedDict()
        self.peers: "OrderedDict[object, OpenPeer]" = OrderedDict()
        self._max_open = max_open
        self._end_request, self._end_peer, self._on_drop = end_request, end_peer, on_drop

    def __len__(self) -> int:
        return len(self.requests) + len(self.peers)

    def touch_request(self, key: Any, now: float) -> Optional[OpenRequest]:
        """The open request of `key`, marked active now; None when none is open."""
        state = self.requests.get(key)
        if state is not None:
            state.touched = now
            self.requests.move_to_end(key)
        return state

    def make_room(self, for_requests: bool) -> None:
        """Below max_open before opening one more request (or peer): the least recently active of that kind
        goes; when none of that kind is open, the least recently active of the other kind (max_open bounds
        both kinds together)."""
        table: "OrderedDict[Any, Any]"  # self.requests or self.peers, and `end` the ender of that kind
        end: Callable[[Any], None]
        state: Any
        if for_requests:
            table, reason, end = self.requests, "request_limit", self._end_request
        else:
            table, reason, end = self.peers, "peer_limit", self._end_peer
        while len(self.requests) + len(self.peers) >= self._max_open:
            if not table:
                if table is self.requests:
                    table, reason, end = self.peers, "peer_limit", self._end_peer
                else:
                    table, reason, end = self.requests, "request_limit", self._end_request
                if not table:
                    return
            _, state = table.popitem(last=False)
            end(state)
            self._on_drop(reason, 1)

    def _tables(self) -> Tuple[Tuple["OrderedDict[Any, Any]", Callable[[Any], None], str], ...]:
        return ((self.requests, self._end_request, "request_evicted"),
                (self.peers, self._end_peer, "peer_evicted"))

    def evict_before(self, deadline: float) -> None:
        """End, as evicted, what was last active before `deadline` (oldest first, stops at the first fresh
        one)."""
        for table, end, reason in self._tables():
            evicted = 0
            while table:
                key, state = next(iter(table.items()))
                if state.touched >= deadline:
                    break
                del table[key]
                end(state)
                evicted += 1
            if evicted:
                self._on_drop(reason, evicted)

    def end_all(self, on_drop: Optional[Callable[[str, int], None]] = None) -> None:
        """End every open span as evicted (nothing would ever end it) and count them."""
        on_drop = on_drop or self._on_drop
        for table, end, reason in self._tables():
            count = len(table)
            while table:
                end(table.popitem(last=False)[1])
            if count:
                on_drop(reason, count)

    def end_every(self, end_request: Callable[[OpenRequest], None], end_peer: Callable[[OpenPeer], None],
                  deadline: float = math.inf) -> int:
        """End every open span with the enders given (the process is exiting), oldest first, until `deadline`
        (time.monotonic()), looked at before each one; nothing counted here. Returns how many were left unended
        (then forgotten).

        The cyclic garbage collector waits meanwhile: with a hundred thousand spans open, one full collection
        takes longer than what is left of the bound (tenths of a second), and nothing ended here is cyclic."""
        enders: Tuple[Tuple["OrderedDict[Any, Any]", Callable[[Any], None]], ...] = (
            (self.requests, end_request), (self.peers, end_peer))
        collecting = gc.isenabled()
        gc.disable()
        try:
            for table, end in enders:
                while table:
                    if time.monotonic() >= deadline:
                        left = len(self.requests) + len(self.peers)
                        self.clear()
                        return left
                    end(table.popitem(last=False)[1])
            return 0
        finally:
            if collecting:
                gc.enable()

    def clear(self) -> None:
        """Forget every open span without ending it."""
        self.requests.clear()
        self.peers.clear()
