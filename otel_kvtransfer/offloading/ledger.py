"""What one helper has been sent and what it has acknowledged: the bookkeeping that makes every record count
exactly once.

Each frame carries a sequence number, its record count and the drop counts it carries. The helper acknowledges
the frames it has handled, in order (one cumulative number), a flush again when its providers have flushed, and
its pid first of all (`wire`). What a helper that ended never acknowledged is what it lost: its records and the
drops they carried are counted by whoever reads `lost()`. No I/O here: `link` feeds it the bytes it reads.
"""

from collections import deque
from typing import Callable, Deque, Dict, Tuple

from otel_kvtransfer.offloading import wire


class Ledger:
    def __init__(self) -> None:
        self.sequence = 0  # the last sequence given to a frame
        self.flushed = 0  # the latest FLUSH sequence the helper has flushed for
        self.answered = False  # the current helper has acknowledged a frame: it works
        # (sequence, records, drops) of the frames sent and not acknowledged
        self._unacked: Deque[Tuple[int, int, Dict[str, int]]] = deque()
        self._buffer = b""  # a part of an acknowledgement read so far

    def next_sequence(self) -> int:
        self.sequence += 1
        return self.sequence

    def sent(self, sequence: int, records: int, drops: Dict[str, int]) -> None:
        self._unacked.append((sequence, records, drops))

    def read(self, chunk: bytes, on_pid: Callable[[int], None]) -> bool:
        """The acknowledgements in `chunk` (a part of one waits for the rest); True when they hold the current
        helper's first acknowledgement of a frame."""
        buffer = self._buffer + chunk
        whole = len(buffer) - len(buffer) % wire.ACK.size
        acknowledged = 0
        for offset in range(0, whole, wire.ACK.size):
            value = wire.ACK.unpack_from(buffer, offset)[0]
            if value & wire.FLUSHED:
                self.flushed = max(self.flushed, value & ~wire.FLUSHED)
            elif value & wire.HELLO:
                on_pid(value & ~wire.HELLO)
            else:
                acknowledged = value
        self._buffer = buffer[whole:]
        if not acknowledged:
            return False
        unacked = self._unacked
        while unacked and unacked[0][0] <= acknowledged:
            unacked.popleft()
        first, self.answered = not self.answered, True
        return first

    def lost(self) -> Tuple[int, Dict[str, int]]:
        """(records, drops by reason) of every frame not acknowledged, taken off the books."""
        drops: Dict[str, int]
        records, drops = 0, {}
        for _, count, carried in self._unacked:
            records += count
            for reason, dropped in carried.items():
                drops[reason] = drops.get(reason, 0) + dropped
        self._unacked.clear()
        return records, drops

    def forget(self) -> None:
        """The frames sent are not this process's to count (a forked child's copy; a helper still working on
        them when the engine stopped waiting)."""
        self._unacked.clear()

    def discard_partial(self) -> None:
        """The socket is closed: a part of an acknowledgement read from it will never be whole."""
        self._buffer = b""

    def new_helper(self) -> None:
        """Another helper (or none) from now on: nothing of the last one's half-read, nothing acknowledged yet."""
        self._buffer = b""
        self.answered = False
