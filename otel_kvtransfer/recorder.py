"""The hot path: engine wrappers append plain tuples to a bounded queue; a background thread turns them into spans.

Nothing on the calling thread touches the SDK. A record is a tuple whose first item is one of the kinds below;
`spans.SpanBuilder` gives them meaning. The queue is a `collections.deque` (append and popleft are atomic under
the GIL, so no lock on the hot path); when it is full the record is dropped and counted, and the first drop is
logged.

Delivery: the background thread drains every `flush_interval_s`; `drain()` does it at once, and is called by
`FlushFirstSpanProcessor` before the other processors flush or shut down, at interpreter exit, and when a
multiprocessing child exits (which skips atexit).
"""

import atexit
import logging
import os
import threading
from collections import deque
from typing import Callable, List, Optional

from opentelemetry.sdk.trace import SpanProcessor

from otel_kvtransfer import config

_logger = logging.getLogger(__name__)

# Record kinds (first item of every record tuple).
SEND = 1  # one transfer: engine call, or a scope's aggregate of engine calls
BEGIN_REQUEST = 2
END_REQUEST = 3
COMPUTE = 4
BEGIN_RECEIVE = 5
END_RECEIVE = 6

Sink = Callable[[List[tuple]], None]

# How long flushing at shutdown or exit may wait for a drain in progress (a hung synchronous exporter).
EXIT_DRAIN_TIMEOUT_S = 5.0


class Recorder:
    """Bounded, lock-free-on-append hand-off from engine threads to one background span-building thread."""

    def __init__(self, settings: config.Settings):
        self.settings = settings
        self.active = False  # read on the hot path: the wrappers call straight through when False
        self._queue: deque = deque()
        self._capacity = settings.queue_size
        self._sink: Optional[Sink] = None
        self._tick: Optional[Callable[[], None]] = None
        self._drain_lock = threading.Lock()
        self._drop_lock = threading.Lock()
        self._pending_drops = {}  # reason -> count, reported by the background thread
        self._drops_logged = set()
        self._on_drops: Optional[Callable[[str, int], None]] = None
        self._on_fork: Optional[Callable[[], None]] = None
        self._wake = threading.Event()
        self._stalled = False
        self._thread: Optional[threading.Thread] = None
        self.sink_errors = 0
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork_in_child)
        atexit.register(self.final_drain)

    # --- hot path -----------------------------------------------------------------------------------------
    def record(self, rec: tuple) -> None:
        queue = self._queue
        if len(queue) >= self._capacity:
            self.drop("queue_full")
            return
        queue.append(rec)

    def drop(self, reason: str, count: int = 1) -> None:
        with self._drop_lock:
            self._pending_drops[reason] = self._pending_drops.get(reason, 0) + count
        if reason not in self._drops_logged:
            self._drops_logged.add(reason)
            _logger.warning(
                "otel_kvtransfer dropped a record (%s); counted in kv_transfer.instrumentation.dropped, "
                "further drops are counted without logging",
                reason,
            )

    # --- control ------------------------------------------------------------------------------------------
    def start(
        self,
        settings: config.Settings,
        sink: Sink,
        tick: Callable[[], None],
        on_drops: Callable[[str, int], None],
        on_fork: Optional[Callable[[], None]] = None,
    ) -> None:
        self.settings = settings
        self._capacity = settings.queue_size
        self._sink, self._tick, self._on_drops, self._on_fork = sink, tick, on_drops, on_fork
        self.active = True
        # Drain at exit before the providers shut down: their atexit handlers were registered before this one
        # (they exist before instrument()), and atexit runs the latest first.
        atexit.unregister(self.final_drain)
        atexit.register(self.final_drain)
        self._wake.set()  # a waiting thread picks up the new interval now
        self._ensure_thread()

    def stop(self) -> None:
        """Stop recording new transfers; what is queued is still delivered."""
        self.active = False
        self.drain(EXIT_DRAIN_TIMEOUT_S)  # bounded: a hung exporter must not hang uninstrument()

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._run, name="otel-kvtransfer-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:  # a daemon thread: it ends with the process
            self._wake.wait(self.settings.flush_interval_s)
            self._wake.clear()
            self.drain()

    def drain(self, timeout_s: Optional[float] = None) -> bool:
        """Turn everything queued so far into spans, on the calling thread.

        False when another drain (the background thread, held up by a hung synchronous exporter) did not let go
        within `timeout_s`; nothing is lost then, the records stay queued.
        """
        if self._sink is None:
            return True
        if self._stalled:  # a final drain already waited its time out: don't wait again on the way out
            timeout_s = 0
        if not self._drain_lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            return False
        self._stalled = False
        try:
            batch = []
            pop = self._queue.popleft
            try:
                while True:
                    batch.append(pop())
            except IndexError:
                pass
            try:
                if batch:
                    self._sink(batch)
                if self._tick is not None:
                    self._tick()
            except Exception:  # pylint: disable=broad-except
                # A bug of ours must not kill the thread; the records of this batch are reported lost.
                self.sink_errors += 1
                self.drop("builder_error", len(batch))
                _logger.debug("otel_kvtransfer span builder failed", exc_info=True)
            self._report_drops()
        finally:
            self._drain_lock.release()
        return True

    def final_drain(self, timeout_s: float = EXIT_DRAIN_TIMEOUT_S) -> bool:
        """Drain for a process that is about to end: never waits longer than `timeout_s`.

        Records that could not be turned into spans in time are counted as dropped (`flush_timeout`), since
        nothing will deliver them after the process is gone.
        """
        if self.drain(timeout_s):
            return True
        self._stalled = True
        lost = 0
        try:
            while True:
                self._queue.popleft()
                lost += 1
        except IndexError:
            pass
        if lost:
            self.drop("flush_timeout", lost)
        self._report_drops()
        return False

    def _report_drops(self) -> None:
        with self._drop_lock:
            drops, self._pending_drops = self._pending_drops, {}
        if self._on_drops is not None:
            for reason, count in drops.items():
                try:
                    self._on_drops(reason, count)
                except Exception:  # pylint: disable=broad-except
                    _logger.debug("otel_kvtransfer could not count drops", exc_info=True)

    def pending(self) -> int:
        return len(self._queue)

    def _after_fork_in_child(self) -> None:
        # The parent delivers what it queued; the child starts empty with fresh locks and its own thread.
        self._queue = deque()
        self._drain_lock = threading.Lock()
        self._drop_lock = threading.Lock()
        self._pending_drops = {}
        self._wake = threading.Event()
        self._thread = None
        if self._on_fork is not None:
            self._on_fork()
        if self.active:
            self._ensure_thread()


class FlushFirstSpanProcessor(SpanProcessor):
    """Drains the recorder when the TracerProvider flushes or shuts down.

    Registered in front of the other processors, so the spans it builds reach the exporting processors inside
    the same `force_flush()` / `shutdown()` call.
    """

    def __init__(self, recorder: Recorder):
        self._recorder = recorder

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._recorder.drain(timeout_millis / 1000)

    def shutdown(self) -> None:
        self._recorder.final_drain()


# One per process: the wrappers reach it as a module global, the cheapest lookup on the hot path.
RECORDER = Recorder(config.Settings())
