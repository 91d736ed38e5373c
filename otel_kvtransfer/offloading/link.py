"""`OTEL_KVTRANSFER_BUILDER=process`: spans and metrics are built in a helper process, not in the engine's.

In-process, building a span and its metric points costs the engine process's CPU (about 21 us per record on this
machine's builder, docs/cost.md, where the SDK's own path costs several times that) and holds the GIL the engine's
own threads need. With this mode the engine process keeps only the hot path and, on the recorder's thread, one
pickled frame per drain written to a socket; the helper (`helper_process`) reads the frames and runs the same
builder and metrics processor on an SDK it sets up from the same OTEL_* variables.

The helper starts with the first frame, so a process that records nothing (sglang's tokenizer, say) never starts
one; starting, replacing and reaping helpers is `lifecycle`'s part, the frames and acknowledgements
`helper_connection`'s (every record counted exactly once), the drops `link_drops`'. A helper ends on
end-of-file from its engine. The socket (MSG_NOSIGNAL) never raises SIGPIPE in an engine that restored SIGPIPE's
default action. A live helper is never given up for being slow; a dead one is replaced (with a backoff while they
keep ending without acknowledging anything). Drops travel in the next frame to a live helper; what no helper can
take is counted in this process's own MeterProvider (`builder_process`), so drops always reach an exporter. When no
helper ever works (its interpreter gone: `lifecycle`'s bounded tries), the link builds in this process
from then on, with the in-process builder it was given (`fallback`), and says so in one warning line.
Flushing the engine's TracerProvider drains the queue and waits for the helper to flush its providers. At exit
the helper gets end-of-file, exports what it holds and ends by itself; the engine waits at most EXIT_WAIT_S for
it and never kills it. A forked child starts its own helper.
"""

import atexit
import logging
import select
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple, cast

from opentelemetry.sdk.trace import SpanProcessor

from otel_kvtransfer.offloading import wire
from otel_kvtransfer.offloading.channel import Channel, ready
from otel_kvtransfer.offloading.helper_connection import HelperConnection
from otel_kvtransfer.offloading.lifecycle import START_TRIES
from otel_kvtransfer.offloading.link_drops import DROP_REASON, DropTally
from otel_kvtransfer.recording.sink import Sink, log_own_error

if TYPE_CHECKING:
    from otel_kvtransfer.building.in_process import InProcessSink
    from otel_kvtransfer.recording.recorder import Recorder

_logger = logging.getLogger(__name__)

WRITE_WAIT_S = 1.0  # how long the recorder's thread waits for room in the socket before it drops a batch
EXIT_WAIT_S = 5.0


class HelperLink(Sink):
    """The recorder's sink in the engine process: each drain's records as one frame to the current helper
    (`connection`), what no helper can carry counted here (`link_drops.DropTally`).

    `count_dropped(reason, n)` counts in this process what no helper can carry (default: a counter on the global
    MeterProvider, made when first needed). `fallback()`, when given, makes the in-process builder to build with
    once no helper can start (`in_process.InProcessSink`: take, tick, after_fork_in_child, end_all(on_drop) and
    detach()). All state is under one lock; nothing here waits longer than WRITE_WAIT_S on the
    recorder's thread, a flush's own timeout, or EXIT_WAIT_S at close.
    """

    batched = True  # each drain's records in one frame

    def __init__(self, count_dropped: Optional[Callable[[str, int], None]] = None,
                 fallback: Optional[Callable[[], "InProcessSink"]] = None) -> None:
        self._fallback = fallback
        # the in-process builder, once no helper could start: every record is built here
        self._local: Optional["InProcessSink"] = None
        self._lock = threading.Lock()
        self._tally = DropTally(count_dropped, hushed=fallback is not None)
        self.connection = HelperConnection(self._tally)

    # --- the recorder's sink (the recorder's thread) ---------------------------------------------------------
    def take_batch(self, batch: List[Tuple[Any, ...]]) -> None:
        if self._local is None:
            with self._lock:
                if not self._builds_here():
                    drops = self._tally.take()
                    self.connection.send((wire.BATCH, batch, drops), len(batch), drops, WRITE_WAIT_S)
                    return
        handle = cast("InProcessSink", self._local).take  # (set: else a helper took the batch above)
        for rec in batch:
            try:
                handle(rec)
            except Exception as exc:  # a bug of ours loses only this record, and is counted
                self.count_drops("builder_error", 1)
                log_own_error("building a span", exc)

    def count_drops(self, reason: str, count: int) -> None:
        with self._lock:
            if self._local is not None:
                self._tally.count_here(0, {reason: count}, None)
                return
            self._tally.add(reason, count)

    def tick(self) -> None:
        if self._local is not None:
            self._local.tick()
        elif self._tally.pending:
            self.take_batch([])
        elif self.connection.writing() or self.connection.helper.reap_due():
            with self._lock:
                self.connection.pump()

    def _builds_here(self) -> bool:
        """True once this process builds its own records: no helper could start in START_TRIES tries, and the
        link has an in-process builder to fall back to (made now, on first need)."""
        if self._local is not None:
            return True
        helper = self.connection.helper
        if self._fallback is None or helper.proc is not None or not helper.given_up():
            return False
        fallback, self._fallback = self._fallback, None
        tally = self._tally
        tally.hushed = False
        try:
            self._local = fallback()
        except Exception as exc:
            _logger.warning("otel_kvtransfer: the builder process could not start (%s), and building in this process "
                            "failed too (%s: %s); records are counted as dropped (%s)", helper.last_error,
                            type(exc).__name__, str(exc)[:200], DROP_REASON)
            tally.logged = True
            return False
        drops = tally.take()
        tally.quiet += sum(drops.values())
        tally.count_here(0, drops, None)
        _logger.warning("otel_kvtransfer: the builder process could not start in %d tries (%s); spans and metrics "
                        "are built in this process from now on (%d records recorded meanwhile are counted as "
                        "dropped, %s)", START_TRIES, helper.last_error, tally.quiet, DROP_REASON)
        tally.quiet = 0
        return True

    # --- flush --------------------------------------------------------------------------------------------------
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

    def _ask_flush(self, deadline: float) -> Optional[Tuple[int, int]]:
        """(sequence, generation) of a FLUSH frame sent after every frame begun before it and the drops not yet
        carried, or None when none could go before `deadline`."""
        connection = self.connection
        while True:
            with self._lock:
                connection.pump()
                if not connection.writing():
                    if self._tally.pending:
                        drops = self._tally.take()
                        connection.send((wire.BATCH, [], drops), 0, drops, 0)
                    if not connection.writing():
                        sequence = connection.send((wire.FLUSH,), 0, {}, 0)
                        return None if sequence is None else (sequence, connection.generation)
                fd = cast(Channel, connection.channel).fileno()  # (still writing: its socket is open)
            if not self._wait(fd, select.POLLOUT, deadline):
                return None

    def _await_flushed(self, sequence: int, generation: int, deadline: float) -> Optional[bool]:
        """True once that helper has flushed, False at `deadline`, None when it ended first."""
        connection = self.connection
        while True:
            with self._lock:
                if connection.generation == generation:
                    connection.pump()
                if connection.generation != generation:
                    return None
                if connection.ledger.flushed >= sequence:
                    return True
                fd = cast(Channel, connection.channel).fileno()  # (the same helper: its socket is open)
            if not self._wait(fd, select.POLLIN | (select.POLLOUT if connection.writing() else 0), deadline):
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

    # --- the end ------------------------------------------------------------------------------------------------
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
            if self.connection.helper.proc is not None:
                self.connection.send((wire.END_OPEN,), 0, {}, WRITE_WAIT_S)

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
            self.connection.close(deadline)

    def close_at_exit(self) -> None:
        """close() at interpreter exit: an in-process builder stays on the SDK, whose own shutdown (after this)
        still drains the last records into it and exports them."""
        self.close(detach=False)

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        if self._local is not None:  # no helper could start in the parent: none would here either
            self._local.after_fork_in_child()
            return
        self.connection.after_fork_in_child()
        self._tally.pending = {}
        self._tally.logged = False

    def pid(self) -> Optional[int]:
        return self.connection.helper.pid()


class HelperFlushProcessor(SpanProcessor):
    """On the engine's TracerProvider: its flush and shutdown also deliver to, and flush, the helper."""

    def __init__(self, recorder: "Recorder", link: HelperLink) -> None:
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
