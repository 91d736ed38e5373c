"""Set-up hidden inside a transfer: Mooncake opens a peer's segment in its first call to it, so that call's time
is mostly set-up. The first send to each peer of such an engine says so (`kv_transfer.first_to_peer`)."""

from typing import Any, Dict, Hashable, Iterable, Set, Tuple

from otel_kvtransfer import semconv
from otel_kvtransfer.recording import records as r

Call = Tuple[Any, ...]  # records.call


class FirstToPeer:
    """The first send to each peer of an engine that connects inside its first call gets `first_to_peer`: seen
    here, on the builder's side, so the engine thread pays nothing. The first this process's instrumentation saw
    (a send made before it was on is not known); at most MAX_PEERS_SEEN peers, later ones are not marked."""

    MAX_PEERS_SEEN = 65536
    _FIRST = {semconv.FIRST_TO_PEER: True}

    def __init__(self, backends: Iterable[str]) -> None:
        self.backends = frozenset(backends)
        # per backend, the peers it has sent to
        self._seen: Dict[str, Set[Hashable]] = {backend: set() for backend in self.backends}
        self._count = 0

    def mark(self, call: Call) -> Call:
        """`call`, with first_to_peer among its extra attributes when it is the first to its peer. A first call
        that failed set nothing up: it is marked, and the next call to that peer is a first one again."""
        seen = self._seen[call[r.CALL_BACKEND]]
        peer = call[r.CALL_PEER]
        try:
            if peer in seen or self._count >= self.MAX_PEERS_SEEN:
                return call
            if call[r.CALL_ERROR] is None:
                seen.add(peer)
                self._count += 1
        except TypeError:  # a peer that cannot be hashed: not marked
            return call
        extra = call[r.CALL_EXTRA]
        return call[:r.CALL_EXTRA] + ({**extra, **self._FIRST} if extra else self._FIRST,) + call[r.CALL_EXTRA + 1:]
