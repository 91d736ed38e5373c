"""`OTEL_KVTRANSFER_BUILDER=process`: spans and metrics are built in a helper process, not in the engine's.

In-process, building a span and its metric points costs the engine process's CPU (about 21 us per record on this
machine's builder, docs/cost.md, where the SDK's own path costs several times that) and holds the GIL the engine's
own threads need. With this mode the engine process keeps only the hot path and, on the recorder's thread, one
pickled frame per drain written to a socket; the helper (`helper_process`) reads the frames and runs the same
builder and metrics processor on an SDK it sets up from the same OTEL_* variables.

The helper starts with the first frame, so a process that records nothing (sglang's tokenizer, say) never starts
one; starting, replacing and reaping helpers is `lifecycle`'s part, the frames this module's. A helper
ends on end-of-file from its engine. Every record is counted exactly once:
- built by the helper, which acknowledges every frame it has handled;
- or, when the helper is alive but not reading (busy, or its collector slow) and the socket is full, dropped
  here before it is written;
- or, when the helper died, lost with the frames it never acknowledged (every acknowledgement it sent is read
  first). The socket (MSG_NOSIGNAL) never raises SIGPIPE in an engine that restored SIGPIPE's default action.
A live helper is never given up for being slow; a dead one is replaced (with a backoff while they keep ending
without acknowledging anything). Drops travel in the next frame to a live helper; what no helper can take is
counted in this process's own MeterProvider (`builder_process`), so drops always reach an exporter. When no
helper ever works (its interpreter gone: `lifecycle`'s bounded tries), the link builds in this process
from then on, with the in-process builder it was given (`fallback`), and says so in one warning line.
Flushing the engine's TracerProvider drains the queue and waits for the helper to flush its providers. At exit
the helper gets end-of-file, exports what it holds and ends by itself; the engine waits at most EXIT_WAIT_S for
it and never kills it. A forked child starts its own helper.
"""

import atexit
import logging
import select
import socket
import threading
import time
from typing import Callable, Optional

from opentelemetry.sdk.trace import SpanProcessor

from otel_kvtransfer.building.attachment import drop_counter
from otel_kvtransfer.offloading import wire
from otel_kvtransfer.offloading.channel import GONE, READ_SIZE, Channel, ready
from otel_kvtransfer.offloading.ledger import Ledger
from otel_kvtransfer.offloading.lifecycle import START_TRIES, HelperProcess
from otel_kvtransfer.recording.sink import Sink, log_own_error

_logger = logging.getLogger(__name__)

WRITE_WAIT_S = 1.0  # how long the recorder's thread waits for room in the socket before it drops a batch
EXIT_WAIT_S = 5.0
DROP_REASON = "builder_process"


class HelperLink(Sink):
    """The engine side of the socket, and the recorder's sink: numbered frames out through the current helper's
    `channel`, its acknowledgements back into the `ledger`; what neither can carry is counted here.

    `count_dropped(reason, n)` counts in this process what no helper can carry (default: a counter on the global
    MeterProvider, made when first needed). `fallback()`, when given, makes the in-process builder to build with
    once no helper can start (`in_process.InProcessSink`: take, tick, after_fork_in_child, end_all(on_drop) and
    detach()). All state is under one lock; nothing here waits longer than WRITE_WAIT_S on the
    recorder's thread, a flush's own timeout, or EXIT_WAIT_S at close.
    """

    batched = True  # each drain's records in one frame

    def __init__(self, count_dropped: Optional[Callable[[str, int], None]] = None, fallback: Optional[Callable] = None):
        self._count_dropped = count_dropped
        self._fallback = fallback
        self._local = None  # the in-process builder, once no helper could start: every record is built here
        self._quiet = 0  # records counted without a word while helpers are still being tried
        self._lock = threading.Lock()
        self._helper = HelperProcess()
        self._channel: Optional[Channel] = None  # the current helper's socket
        self._ledger = Ledger()  # the frames sent, and what the helper acknowledged
        self._generation = 0  # bumped whenever the helper changes: a flush waits on one helper only
        self._drops = {}  # drop counts to carry in the next frame
        self._closed = False
        self._logged = False  # one warning per episode (a loss, a stall, no helper), until a helper answers again

    # --- the recorder's sink (the recorder's thread) ---------------------------------------------------------
    def take_batch(self, batch: list) -> None:
        if self._local is None:
            with self._lock:
                if not self._builds_here():
                    drops, self._drops = self._drops, {}
                    self._send((wire.BATCH, batch, drops), len(batch), drops, WRITE_WAIT_S)
                    return
        handle = self._local.take
        for rec in batch:
            try:
                handle(rec)
            except Exception as exc:  # a bug of ours loses only this record, and is counted
                self.count_drops("builder_error", 1)
                log_own_error("building a span", exc)

    def count_drops(self, reason: str, count: int) -> None:
        with self._lock:
            if self._local is not None:
                self._count_here(0, {reason: count}, None)
                return
            self._drops[reason] = self._drops.get(reason, 0) + count

    def tick(self) -> None:
        if self._local is not None:
            self._local.tick()
        elif self._drops:
            self.take_batch([])
        elif self._writing() or self._helper.reap_due():
            with self._lock:
                self._pump()

    # --- flush, end, close ----------------------------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Ask the helper to flush its providers; True once it says it has, within `timeout_s`. Other callers
        (the recorder's thread) are never held up for longer than one slice of the wait. A helper that ends
        before it has flushed is replaced, and the fresh one asked (with the drops the loss left)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._builds_here():  # the spans went to this process's processors, flushed by its provider
                return True
        while True:
            asked = self._ask_flush(deadline)
            if asked is None:
                return False
            flushed = self._await_flushed(*asked, deadline)
            if flushed is not None:
                return flushed

    def _ask_flush(self, deadline: float):
        """(sequence, generation) of a FLUSH frame sent after every frame begun before it and the drops not yet
        carried, or None when none could go before `deadline`."""
        while True:
            with self._lock:
                self._pump()
                if not self._writing():
                    if self._drops:
                        drops, self._drops = self._drops, {}
                        self._send((wire.BATCH, [], drops), 0, drops, 0)
                    if not self._writing():
                        sequence = self._send((wire.FLUSH,), 0, {}, 0)
                        return None if sequence is None else (sequence, self._generation)
                fd = self._channel.fileno()
            if not self._wait(fd, select.POLLOUT, deadline):
                return None

    def _await_flushed(self, sequence: int, generation: int, deadline: float) -> Optional[bool]:
        """True once that helper has flushed, False at `deadline`, None when it ended first."""
        while True:
            with self._lock:
                if self._generation == generation:
                    self._pump()
                if self._generation != generation:
                    return None
                if self._ledger.flushed >= sequence:
                    return True
                fd = self._channel.fileno()
            if not self._wait(fd, select.POLLIN | (select.POLLOUT if self._writing() else 0), deadline):
                return False

    @staticmethod
    def _wait(fd: int, events: int, deadline: float) -> bool:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready(fd, events, min(left, 0.05))  # a slice: the descriptor may change under another thread
        return True

    def release_held(self) -> None:
        """A flush's last step: the in-process builder's (the helper's own is the FLUSH frame's first step)."""
        if self._local is not None:
            self._local.release_held()

    def end_at_exit(self, deadline: float = float("inf")) -> int:
        """The exit drain's last step: the in-process builder's, once it builds (a helper ends what it holds open
        itself, when its engine's end reaches it)."""
        return self._local.end_at_exit(deadline) if self._local is not None else 0

    def export_wait_s(self) -> float:
        return self._local.export_wait_s() if self._local is not None else 0.0

    def end_open(self) -> None:
        """uninstrument(): the helper ends what it holds open as evicted, as the in-process builder does."""
        if self._local is not None:
            self._local.end_all(self.count_drops)
            return
        with self._lock:
            if self._helper.proc is not None:
                self._send((wire.END_OPEN,), 0, {}, WRITE_WAIT_S)

    def close(self, wait_s: float = EXIT_WAIT_S, detach: bool = True) -> None:
        """End-of-file to the helper (it exports what it holds, then exits); wait for it at most `wait_s`. Building
        in this process instead: nothing to wait for; `detach` takes the in-process builder off the SDK."""
        if self._local is not None:
            if detach:
                self._local.detach()
            return
        deadline = time.monotonic() + wait_s
        self.tick()  # the drops not yet carried
        with self._lock:
            self._closed = True
            self._pump()
            if self._helper.proc is None:
                self._count_here(0, self._take_drops(), "the engine is ending")
                return
            channel = self._channel
            if self._writing():
                self._push_tail(deadline)
            try:
                channel.sock.shutdown(socket.SHUT_WR)  # end-of-file: the helper handles what it has, exports, ends
            except OSError:
                pass
            while self._channel is channel and ready(channel.fileno(), select.POLLIN, deadline - time.monotonic()):
                self._read_acks(ending=True)
            # The helper holds its end until it exits: end-of-file there means it has exported and ended.
            self._closed_helper(ended=self._channel is not channel)

    def _closed_helper(self, ended: bool) -> None:
        self._helper.closed(ended)
        if not ended:
            self._ledger.forget()  # still working on them: not lost
        self._forget_helper()
        # What a helper that ended did not acknowledge was lost with it: counted here, no helper is left.
        records, carried = self._ledger.lost()
        drops = self._take_drops()
        for reason, count in carried.items():
            drops[reason] = drops.get(reason, 0) + count
        self._count_here(records, drops, "the builder process ended")

    def close_at_exit(self) -> None:
        """close() at interpreter exit: an in-process builder stays on the SDK, whose own shutdown (after this)
        still drains the last records into it and exports them."""
        self.close(detach=False)

    def after_fork_in_child(self) -> None:
        # The parent's socket is the parent's: close this process's copy only (the parent's helper still sees
        # end-of-file when the parent closes), and let this process start its own helper on its first frame.
        self._lock = threading.Lock()
        if self._local is not None:  # no helper could start in the parent: none would here either
            self._local.after_fork_in_child()
            return
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        self._helper.after_fork_in_child()
        self._generation += 1
        self._ledger.forget()  # the parent's frames: the parent counts them
        self._ledger.new_helper()
        self._drops = {}
        self._logged = False

    def pid(self) -> Optional[int]:
        return self._helper.pid()

    # --- the socket (callers hold self._lock) ----------------------------------------------------------------
    def _send(self, payload: tuple, records: int, drops: dict, wait_s: float) -> Optional[int]:
        """One frame; its sequence, or None when no helper took it (its records and drops counted here)."""
        if self._closed:  # after close(): a few last calls of an ending process, nobody left to build them
            self._count_here(records, drops, "the engine is ending")
            return None
        self._pump()
        deadline = time.monotonic() + wait_s
        if self._writing() and not self._push_tail(deadline) and self._helper.proc is not None:
            # Alive but not reading (busy, or its exporter slow): this frame does not go; a dead one is replaced.
            self._count_here(records, drops, f"the builder process (pid {self._helper.pid()}) is not reading")
            return None
        sequence = self._ledger.next_sequence()
        frame = wire.encode(payload, records, sequence)
        for _ in range(2):  # a helper found dead on the first write: the frame goes to a fresh one
            if not self._ensure_started():
                break
            written = self._write(frame)
            if written is GONE:
                continue
            self._ledger.sent(sequence, records, drops)
            self._channel.begin(frame, written)
            if self._writing():
                self._push_tail(deadline)
            return sequence
        for reason, count in self._take_drops().items():  # those a lost helper left: nobody else carries them
            drops = dict(drops)
            drops[reason] = drops.get(reason, 0) + count
        if self._fallback is not None and not self._ledger.answered:  # helpers still tried: one line says how it ends
            self._quiet += records + sum(drops.values())
            self._count_here(records, drops, None)
        else:
            self._count_here(records, drops, "no builder process is running")
        return None

    def _builds_here(self) -> bool:
        """True once this process builds its own records: no helper could start in START_TRIES tries, and the
        link has an in-process builder to fall back to (made now, on first need)."""
        if self._local is not None:
            return True
        if self._fallback is None or self._helper.proc is not None or not self._helper.given_up():
            return False
        fallback, self._fallback = self._fallback, None
        try:
            self._local = fallback()
        except Exception as exc:
            _logger.warning("otel_kvtransfer: the builder process could not start (%s), and building in this process "
                            "failed too (%s: %s); records are counted as dropped (%s)", self._helper.last_error,
                            type(exc).__name__, str(exc)[:200], DROP_REASON)
            self._logged = True
            return False
        drops = self._take_drops()
        self._quiet += sum(drops.values())
        self._count_here(0, drops, None)
        _logger.warning("otel_kvtransfer: the builder process could not start in %d tries (%s); spans and metrics "
                        "are built in this process from now on (%d records recorded meanwhile are counted as "
                        "dropped, %s)", START_TRIES, self._helper.last_error, self._quiet, DROP_REASON)
        self._quiet = 0
        return True

    def _writing(self) -> bool:
        """A frame begun is not all written yet: it goes before anything else."""
        channel = self._channel
        return channel is not None and channel.tail is not None

    def _push_tail(self, deadline: float) -> bool:
        """The rest of the frame begun, waiting for room until `deadline`; True once it is all written."""
        return self._channel.push(deadline, self._write, self._read_acks_while_writing)

    def _read_acks_while_writing(self) -> bool:
        self._read_acks()  # the helper may be waiting for us to read its acknowledgements
        return self._channel is not None

    def _write(self, data) -> Optional[int]:
        """How much of `data` the socket took (0 while it is full); GONE when the helper has ended (`_lost`)."""
        written = self._channel.write(data)
        if written is GONE:
            self._lost()
        return written

    def _pump(self) -> None:
        """Without waiting: the acknowledgements that came back (a helper that ended is noticed here), the rest
        of a frame begun, helpers given up that have ended (reaped)."""
        if self._channel is not None:
            self._read_acks()
        if self._writing():
            self._push_tail(0)
        self._helper.reap()

    def _read_acks(self, ending: bool = False) -> None:
        while self._channel is not None:
            chunk = self._channel.read()
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
        if self._ledger.read(chunk, self._helper.said_pid):  # this helper's first: it works
            self._logged = False
            self._helper.answered()
            if self._quiet:  # helpers failed to start before this one: what it cost, in one line
                _logger.warning("otel_kvtransfer: the builder process started after failed tries (%s); %d records "
                                "recorded meanwhile are counted as dropped (%s)", self._helper.last_error,
                                self._quiet, DROP_REASON)
                self._quiet = 0

    def _lost(self) -> None:
        """The helper ended: read every acknowledgement it sent, then what it never acknowledged is lost (carried
        as drops by the next frame), and the next start is scheduled."""
        self._read_acks(ending=True)
        self._forget_socket()
        records, carried = self._ledger.lost()
        for reason, dropped in carried.items():
            self._drops[reason] = self._drops.get(reason, 0) + dropped
        if records:
            self._drops[DROP_REASON] = self._drops.get(DROP_REASON, 0) + records
        proc, delay = self._helper.lost(worked=self._ledger.answered)
        self._forget_helper()
        if not self._logged:
            self._logged = True
            lost_part = (f" without building {records} records; they are counted as dropped ({DROP_REASON})"
                         if records else "")
            _logger.warning("otel_kvtransfer: the builder process (pid %s) ended%s; a fresh one starts %s",
                            getattr(proc, "pid", None) or "?", lost_part,
                            "now" if delay == 0 else f"in {delay:g} s")

    def _forget_socket(self) -> None:
        channel, self._channel = self._channel, None
        self._ledger.discard_partial()
        if channel is not None:
            channel.close()

    def _forget_helper(self) -> None:
        self._forget_socket()
        self._ledger.new_helper()
        self._generation += 1

    def _ensure_started(self) -> bool:
        if self._helper.proc is not None:
            return True
        sock = self._helper.start()
        if sock is None:
            return False
        self._channel = Channel(sock)
        self._ledger.new_helper()
        self._generation += 1
        return True

    # --- what no helper can carry ----------------------------------------------------------------------------
    def _take_drops(self) -> dict:
        drops, self._drops = self._drops, {}
        return drops

    def _count_here(self, records: int, drops: dict, why: Optional[str]) -> None:
        """Counted in this process's own metrics: no helper can carry them now (`why`: for the episode's one
        warning line; None: counted without a word)."""
        if records:
            drops = dict(drops)
            drops[DROP_REASON] = drops.get(DROP_REASON, 0) + records
        if not drops:
            return
        if self._count_dropped is None:
            self._count_dropped = drop_counter(None)  # the global MeterProvider
        for reason, count in drops.items():
            try:
                self._count_dropped(reason, count)
            except Exception:
                _logger.debug("otel_kvtransfer could not count drops", exc_info=True)
        if why is not None and not self._logged:
            self._logged = True
            _logger.warning("otel_kvtransfer: %s; %d records are counted as dropped (%s) in this process's own "
                            "metrics, and what follows until a helper takes records again",
                            why, sum(drops.values()), ", ".join(sorted(drops)))


class HelperFlushProcessor(SpanProcessor):
    """On the engine's TracerProvider: its flush and shutdown also deliver to, and flush, the helper."""

    def __init__(self, recorder, link: HelperLink):
        self._recorder = recorder
        self._link = link

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        deadline = time.monotonic() + timeout_millis / 1000
        if not self._recorder.drain(timeout_millis / 1000, flushing=True):
            return False
        return self._link.flush(max(deadline - time.monotonic(), 0.001))

    def shutdown(self) -> None:
        self._recorder.final_drain()
        self._link.close()


def register_exit(link: HelperLink) -> None:
    """Close the link at exit after the recorder's final drain (registered before it: atexit runs last first)."""
    atexit.register(link.close_at_exit)


def unregister_exit(link: HelperLink) -> None:
    atexit.unregister(link.close_at_exit)
