"""The engine side of one helper at a time (engine process, under the link's lock): numbered frames out through
the current helper's `channel`, its acknowledgements back into the `ledger`, the helper started, noticed ended
and replaced through `lifecycle`.

Every record is counted exactly once: built by the helper, which acknowledges every frame it has handled; or,
when the helper is alive but not reading (busy, or its collector slow) and the socket is full, dropped before it
is written; or, when the helper died, lost with the frames it never acknowledged (every acknowledgement it sent
is read first) and carried as drops by the next frame (`link_drops`).
"""

import logging
import select
import socket
import time
from typing import Any, Dict, Optional, Tuple, Union, cast

from otel_kvtransfer.offloading import wire
from otel_kvtransfer.offloading.channel import GONE, READ_SIZE, Channel, ready
from otel_kvtransfer.offloading.ledger import Ledger
from otel_kvtransfer.offloading.lifecycle import HelperProcess
from otel_kvtransfer.offloading.link_drops import DROP_REASON, DropTally

_logger = logging.getLogger(__name__)


class HelperConnection:
    def __init__(self, tally: DropTally) -> None:
        self._tally = tally
        self.helper = HelperProcess()
        self.channel: Optional[Channel] = None  # the current helper's socket
        self.ledger = Ledger()  # the frames sent, and what the helper acknowledged
        self.generation = 0  # bumped whenever the helper changes: a flush waits on one helper only
        self.closed = False  # after close(): frames are counted, not sent

    def send(self, payload: Tuple[Any, ...], records: int, drops: Dict[str, int], wait_s: float) -> Optional[int]:
        """One frame; its sequence, or None when no helper took it (its records and drops counted here)."""
        tally = self._tally
        if self.closed:  # a few last calls of an ending process, nobody left to build them
            tally.count_here(records, drops, "the engine is ending")
            return None
        self.pump()
        deadline = time.monotonic() + wait_s
        if self.writing() and not self.push_tail(deadline) and self.helper.proc is not None:
            # Alive but not reading (busy, or its exporter slow): this frame does not go; a dead one is replaced.
            tally.count_here(records, drops, f"the builder process (pid {self.helper.pid()}) is not reading")
            return None
        sequence = self.ledger.next_sequence()
        frame = wire.encode(payload, records, sequence)
        for _ in range(2):  # a helper found dead on the first write: the frame goes to a fresh one
            if not self._ensure_started():
                break
            written = self._write(frame)
            if written is GONE:
                continue
            self.ledger.sent(sequence, records, drops)
            cast(Channel, self.channel).begin(frame, written)  # (started above, and not found gone)
            if self.writing():
                self.push_tail(deadline)
            return sequence
        for reason, count in tally.take().items():  # those a lost helper left: nobody else carries them
            drops = dict(drops)
            drops[reason] = drops.get(reason, 0) + count
        if tally.hushed and not self.ledger.answered:  # helpers still tried: one line says how it ends
            tally.quiet += records + sum(drops.values())
            tally.count_here(records, drops, None)
        else:
            tally.count_here(records, drops, "no builder process is running")
        return None

    def writing(self) -> bool:
        """A frame begun is not all written yet: it goes before anything else."""
        channel = self.channel
        return channel is not None and channel.tail is not None

    def push_tail(self, deadline: float) -> bool:
        """The rest of the frame begun, waiting for room until `deadline`; True once it is all written."""
        return cast(Channel, self.channel).push(deadline, self._write, self._read_acks_while_writing)  # (writing)

    def _read_acks_while_writing(self) -> bool:
        self.read_acks()  # the helper may be waiting for us to read its acknowledgements
        return self.channel is not None

    def _write(self, data: Union[bytes, memoryview]) -> Optional[int]:
        """How much of `data` the socket took (0 while it is full); GONE when the helper has ended (`_lost`)."""
        written = cast(Channel, self.channel).write(data)  # (only ever called with a helper's socket open)
        if written is GONE:
            self._lost()
        return written

    def pump(self) -> None:
        """Without waiting: the acknowledgements that came back (a helper that ended is noticed here), the rest
        of a frame begun, helpers given up that have ended (reaped)."""
        if self.channel is not None:
            self.read_acks()
        if self.writing():
            self.push_tail(0)
        self.helper.reap()

    def read_acks(self, ending: bool = False) -> None:
        while self.channel is not None:
            chunk = self.channel.read()
            if chunk is None:
                return
            if not chunk:  # the helper ended (every acknowledgement it sent came before this)
                if not ending:
                    self._lost()
                else:
                    self._forget_socket()
                return
            self._take_acks(chunk)
            if len(chunk) < READ_SIZE:
                return

    def _take_acks(self, chunk: bytes) -> None:
        tally = self._tally
        if self.ledger.read(chunk, self.helper.said_pid):  # this helper's first: it works
            tally.logged = False
            self.helper.answered()
            if tally.quiet:  # helpers failed to start before this one: what it cost, in one line
                _logger.warning("otel_kvtransfer: the builder process started after failed tries (%s); %d records "
                                "recorded meanwhile are counted as dropped (%s)", self.helper.last_error,
                                tally.quiet, DROP_REASON)
                tally.quiet = 0

    def _lost(self) -> None:
        """The helper ended: read every acknowledgement it sent, then what it never acknowledged is lost (carried
        as drops by the next frame), and the next start is scheduled."""
        self.read_acks(ending=True)
        self._forget_socket()
        records, carried = self.ledger.lost()
        tally = self._tally
        for reason, dropped in carried.items():
            tally.add(reason, dropped)
        if records:
            tally.add(DROP_REASON, records)
        proc, delay = self.helper.lost(worked=self.ledger.answered)
        self._forget_helper()
        if not tally.logged:
            tally.logged = True
            lost_part = (f" without building {records} records; they are counted as dropped ({DROP_REASON})"
                         if records else "")
            _logger.warning("otel_kvtransfer: the builder process (pid %s) ended%s; a fresh one starts %s",
                            getattr(proc, "pid", None) or "?", lost_part,
                            "now" if delay == 0 else f"in {delay:g} s")

    def _forget_socket(self) -> None:
        channel, self.channel = self.channel, None
        self.ledger.discard_partial()
        if channel is not None:
            channel.close()

    def _forget_helper(self) -> None:
        self._forget_socket()
        self.ledger.new_helper()
        self.generation += 1

    def _ensure_started(self) -> bool:
        if self.helper.proc is not None:
            return True
        sock = self.helper.start()
        if sock is None:
            return False
        self.channel = Channel(sock)
        self.ledger.new_helper()
        self.generation += 1
        return True

    # --- the end -----------------------------------------------------------------------------------------------
    def close(self, deadline: float) -> None:
        """End-of-file to the helper (it exports what it holds, then exits), its last acknowledgements read until
        `deadline`; what it never acknowledged, and the drops no frame carried, counted here."""
        self.closed = True
        self.pump()
        tally = self._tally
        if self.helper.proc is None:
            tally.count_here(0, tally.take(), "the engine is ending")
            return
        channel = cast(Channel, self.channel)  # (a helper runs: its socket is open)
        if self.writing():
            self.push_tail(deadline)
        try:
            channel.sock.shutdown(socket.SHUT_WR)  # end-of-file: the helper handles what it has, exports, ends
        except OSError:
            pass
        while self.channel is channel and ready(channel.fileno(), select.POLLIN, deadline - time.monotonic()):
            self.read_acks(ending=True)
        # The helper holds its end until it exits: end-of-file there means it has exported and ended.
        ended = self.channel is not channel
        self.helper.closed(ended)
        if not ended:
            self.ledger.forget()  # still working on them: not lost
        self._forget_helper()
        # What a helper that ended did not acknowledge was lost with it: counted here, no helper is left.
        records, carried = self.ledger.lost()
        drops = tally.take()
        for reason, count in carried.items():
            drops[reason] = drops.get(reason, 0) + count
        tally.count_here(records, drops, "the builder process ended")

    def after_fork_in_child(self) -> None:
        # The parent's socket is the parent's: close this process's copy only (the parent's helper still sees
        # end-of-file when the parent closes), and let this process start its own helper on its first frame.
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()
        self.helper.after_fork_in_child()
        self.generation += 1
        self.ledger.forget()  # the parent's frames: the parent counts them
        self.ledger.new_helper()
