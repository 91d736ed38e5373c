"""The client's request id (sglang's `rid`) of each room this prefill process is sending, for the spans that see
only the room.

A router that retries a failed request (sglang-router: a decode that answered 5xx, e.g. a KV checksum mismatch)
sends the client's same JSON body again with a new bootstrap room: the room changes per attempt, the `rid` the
client gave does not, and both the prefill and the decode of every attempt get it. The request span and the decode's
receive span read it from their sglang `Req`; the transfer worker's sends see only the chunk's room, so the sender
remembers the room's rid here when it is made, and the room's conclusion forgets it.

Bounded: at most MAX_ROOMS rooms at once (rooms that never conclude would otherwise pile up); past that the oldest
is let go, counted as `rid_evicted`, and its later sends carry no rid.
"""

from typing import Dict, Optional

from otel_kvtransfer.recording.patching import count_drop

MAX_ROOMS = 65536
EVICTED = "rid_evicted"  # reason of kv_transfer.instrumentation.dropped
_MAX_RID_CHARS = 256  # as on the request span (common.room_attributes)

_rids: Dict[int, str] = {}


def remember(room, rid) -> None:
    """The rid of a room this process begins sending (None or a room that is no int: nothing to remember)."""
    if rid is None or not isinstance(room, int) or isinstance(room, bool):
        return
    if room not in _rids and len(_rids) >= MAX_ROOMS:
        try:
            _rids.pop(next(iter(_rids)))  # the oldest (dicts keep insertion order)
        except (StopIteration, RuntimeError, KeyError):  # another thread concluded rooms meanwhile
            pass
        count_drop(EVICTED)
    _rids[room] = str(rid)[:_MAX_RID_CHARS]


def rid_of(room) -> Optional[str]:
    return _rids.get(room)


def forget(room) -> None:
    _rids.pop(room, None)


def forget_all() -> None:
    _rids.clear()


__all__ = ["MAX_ROOMS", "EVICTED", "remember", "rid_of", "forget", "forget_all"]
