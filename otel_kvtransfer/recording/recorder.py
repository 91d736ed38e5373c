"""The hot path's hand-off: engine threads append plain tuples (`records`) to a bounded queue; one background
thread hands them to the span builder.

Nothing on an engine thread touches the SDK. The queue is a `collections.deque` (append and popleft are atomic
under the GIL, so no lock on the hot path); when it is full the record is dropped and counted (`drops`), and the
first drop of each reason is logged.

The background thread drains every `flush_interval_s` (once a second while nothing is recorded, woken by the next
record); `drain()` does it at once and is called by `FlushFirstSpanProcessor` before the other processors flush or
shut down, at interpreter exit, and when a multiprocessing child exits (which skips atexit), also a child that
inherited the instrumentation by fork without running `instrument()` itself. How a drain keeps its deadline and
counts what it could not deliver: `delivery`.
"""

import atexit
import logging
import multiprocessing.util
import os
import threading
from collections import deque
from typing import Callable, Optional

from opentelemetry.sdk.trace import SpanProcessor

from otel_kvtransfer import config
from otel_kvtransfer.recording import inflight, records
from otel_kvtransfer.recording.delivery import EXIT_DRAIN_TIMEOUT_S, Delivery, DrainOutcome
from otel_kvtransfer.recording.drops import DropCounts
from otel_kvtransfer.recording.records import Record
from otel_kvtransfer.recording.sink import Sink

_logger = logging.getLogger(__name__)

# How long stop() waits for the background thread to end.
JOIN_TIMEOUT_S = 5.0


class Recorder:
    """Bounded hand-off from engine threads to one background span-building thread.

    The hot path's contract: an engine wrapper may hand a record over inline instead of calling `record` (a
    Python frame less per transfer), through these attributes and only as `record` does:
    - `queue`: the deque records are appended to; a forked child gets a new one, so read it per call;
    - `capacity`: append only while `len(queue) < capacity` (else call `record`, which counts the drop);
    - `idle`: True while the thread sleeps past the flush interval; whoever appends while it is True sets it
      False and sets `wake`, the Event that ends that sleep (the first record after a quiet spell is delivered
      at once, not after the long sleep).
    """

    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings
        self.active = False  # read on the hot path: the wrappers call straight through when False
        self.watcher: Optional[inflight.Watcher] = None  # while instrumented
        self.queue: deque[Record] = deque()
        # The latest in-flight scan not yet delivered (an INFLIGHT record): one slot beside the queue that the next
        # drain empties (`keep_scan`, `take_scan`). A newer scan takes the place of an older one (what is in flight
        # now supersedes what was; the older one's stuck reports, each made once, are carried over), so a full
        # queue never drops a scan, and a drop of `queue_full` is always a record the engine or a framework made.
        self.snapshot: Optional[Record] = None
        self._scan_lock = threading.Lock()  # the recorder's thread keeps a scan while another thread drains
        self.capacity = settings.queue_size
        self.idle = False
        self.wake = threading.Event()
        self.sink: Optional[Sink] = None  # where drains deliver; None while not recording
        self._drops = DropCounts()
        self._delivery = Delivery(self)
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        # What a multiprocessing child runs on its way out; None: drain, then flush the global providers.
        self.child_exit: Optional[Callable[[], None]] = None
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork_in_child)
        # multiprocessing starts each child by clearing the exit finalizers it inherited, then runs these hooks.
        multiprocessing.util.register_after_fork(self, Recorder._in_multiprocessing_child)

    # --- hot path -----------------------------------------------------------------------------------------
    def record(self, rec: Record) -> None:
        queue = self.queue
        if len(queue) >= self.capacity:
            self.drop("queue_full")
            return
        queue.append(rec)
        if self.idle:
            self.idle = False
            self.wake.set()

    def drop(self, reason: str, count: int = 1) -> None:
        self._drops.add(reason, count)

    def report_drops(self) -> None:
        """The drops counted since the last report, to the sink (kept while there is none)."""
        self._drops.report(self.sink)

    def pending(self) -> int:
        return len(self.queue)

    # --- lifecycle ----------------------------------------------------------------------------------------
    def start(self, settings: config.Settings, sink: Sink) -> None:
        """Record from now on, delivering to `sink`."""
        self.settings = settings
        self.capacity = settings.queue_size
        self.sink = sink
        self._stopping = False
        self._delivery.progress.abandoned = False
        # Drain at exit before the providers shut down: their atexit handlers were registered before this one
        # (they exist before instrument()), and atexit runs the latest first.
        atexit.register(self.final_drain)
        self._start_thread()
        self.active = True

    def stop(self) -> None:
        """Stop recording; deliver what is queued (bounded wait), then end and join the background thread."""
        self.active = False
        self.final_drain(at_exit=False)  # the instrumentor ends what is still open, as evicted
        self._stopping = True
        self.wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT_S)
            if thread.is_alive():
                _logger.warning("otel_kvtransfer: the recorder thread did not end in %ss (a hung exporter?)",
                                JOIN_TIMEOUT_S)
        atexit.unregister(self.final_drain)
        self.report_drops()
        self.sink = None

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="otel-kvtransfer-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = wait_s = self.settings.flush_interval_s
        while not self._stopping:
            self.idle = wait_s > interval
            if self.idle and self.queue:  # recorded after the drain, before the flag: do not sleep long
                self.idle, wait_s = False, interval
            self.wake.wait(wait_s)
            self.wake.clear()
            self.idle = False
            if not self._stopping:
                recorded = bool(self.queue)
                self._watch_inflight()
                self.drain()
                wait_s = self.next_wait_s(recorded)

    def next_wait_s(self, recorded: bool) -> float:
        """The flush interval while records come in; with none since the last wake, until the next in-flight
        scan is due (each wake of an idle thread costs ~0.2 ms of CPU): the next record, or a flush, ends that sleep
        at once."""
        interval = self.settings.flush_interval_s
        if recorded:
            return interval
        watcher = self.watcher
        return max(interval, watcher.until_due() if watcher is not None else inflight.SCAN_INTERVAL_S)

    def _watch_inflight(self) -> None:
        """Once a second, what the engine is transferring now, as one INFLIGHT record (inflight.py)."""
        watcher = self.watcher
        if watcher is not None and watcher.due():
            try:
                rec = watcher.scan()
                if rec is not None:
                    self.keep_scan(rec)
            except Exception:
                self.drop("wrapper_error")
                _logger.debug("otel_kvtransfer could not scan what is in flight", exc_info=True)

    def keep_scan(self, rec: Record) -> None:
        """`rec`, an in-flight scan, waits for the next drain in place of any older one not delivered yet."""
        with self._scan_lock:
            older = self.snapshot
            if older is not None and older[records.INFLIGHT_STUCK]:
                rec = records.inflight(rec[records.INFLIGHT_AT], rec[records.INFLIGHT_COUNT],
                                       rec[records.INFLIGHT_OLDEST],
                                       older[records.INFLIGHT_STUCK] + rec[records.INFLIGHT_STUCK],
                                       rec[records.INFLIGHT_CONNECTS])
            self.snapshot = rec

    def take_scan(self) -> Optional[Record]:
        """The scan waiting for a drain, taken from its slot (None: none waits)."""
        with self._scan_lock:
            rec, self.snapshot = self.snapshot, None
        return rec

    # --- delivery (delivery.py) ---------------------------------------------------------------------------
    def drain(self, timeout_s: Optional[float] = None, flushing: bool = False) -> bool:
        """Hand everything queued so far to the builder, on the calling thread, within `timeout_s` (None: no bound);
        `flushing` (a provider's force_flush): then export what the builder holds back though it has ended.

        False when it could not within `timeout_s`: another drain (a hung synchronous exporter holding the builder)
        did not let go, or the exporters took longer than that; nothing is lost then, what was not delivered stays
        queued, in order, ahead of what is recorded meanwhile.
        """
        return self._delivery.drain(timeout_s, flushing) is DrainOutcome.DELIVERED

    def current_deadline(self) -> float:
        """The deadline of the drain in progress (what the direct pipeline's wait for room reads)."""
        return self._delivery.deadline

    def final_drain(self, timeout_s: float = EXIT_DRAIN_TIMEOUT_S, at_exit: bool = True) -> bool:
        """Drain for a process that is about to end (or, `at_exit` False, an uninstrument): never longer than
        `timeout_s`, whatever the exporters do. At exit, the builder then ends what is still open (the sink's
        `end_at_exit`), within the same bound.

        What could not be delivered in time is counted as dropped (`flush_timeout`): the queue, and the part of
        the batch not handled by then, this drain's own or the stuck drain's it gave up on (it will not be
        handled: nothing runs after exit); and the requests and peer waits still open that the bound left
        unended. One WARNING line says how many of each, and what took the time: waiting for room in the export
        queue (a slow or hung exporter), a drain that did not let go (a hung one), or building and ending spans.
        """
        return self._delivery.exit_drain(timeout_s, at_exit)

    # --- fork ---------------------------------------------------------------------------------------------
    def _after_fork_in_child(self) -> None:
        # The parent delivers what it queued; the child starts empty with fresh locks and its own thread.
        self.queue = deque()
        self.snapshot = None
        self._scan_lock = threading.Lock()
        self._drops = DropCounts()
        self.wake = threading.Event()
        self.idle = False
        self._delivery.after_fork_in_child()
        self._thread = None
        if self.sink is not None:
            self.sink.after_fork_in_child()
        if self.active:
            self._start_thread()

    def _in_multiprocessing_child(self) -> None:
        # Such a child ends with os._exit and skips atexit: without this, what it recorded last never leaves it.
        # (instrument() registers the same when it runs in the child; a forked child inherits it instead.)
        if self.active:
            multiprocessing.util.Finalize(self, self._exit_child, exitpriority=100)

    def _exit_child(self) -> None:
        if self.child_exit is not None:
            self.child_exit()
            return
        self.final_drain()
        from opentelemetry import metrics, trace

        for provider in (trace.get_tracer_provider(), metrics.get_meter_provider()):
            flush = getattr(provider, "force_flush", None)
            if flush is not None:
                try:
                    flush(timeout_millis=int(EXIT_DRAIN_TIMEOUT_S * 1000))
                except Exception:
                    _logger.debug("otel_kvtransfer: flush at a child's exit failed", exc_info=True)


class FlushFirstSpanProcessor(SpanProcessor):
    """Drains the recorder when the TracerProvider flushes or shuts down.

    Registered in front of the other processors, so the spans it builds reach the exporting processors inside
    the same `force_flush()` / `shutdown()` call.
    """

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._recorder.drain(timeout_millis / 1000, flushing=True)

    def shutdown(self) -> None:
        self._recorder.final_drain()


# One per process: the wrappers reach it as a module global, the cheapest lookup on the hot path.
RECORDER = Recorder(config.Settings())
