"""The hot path's hand-off: engine threads append plain tuples (`records`) to a bounded queue; one background
thread hands them to the span builder.

Nothing on an engine thread touches the SDK. The queue is a `collections.deque` (append and popleft are atomic
under the GIL, so no lock on the hot path); when it is full the record is dropped and counted, and the first drop
of each reason is logged.

Delivery: the background thread drains every `flush_interval_s` (once a second while nothing is recorded, woken by
the next record); `drain()` does it at once and is called by `FlushFirstSpanProcessor` before the other processors
flush or shut down, at interpreter exit, and when a multiprocessing child exits (which skips atexit), also a child
that inherited the instrumentation by fork without running `instrument()` itself. A drain given a timeout carries
one deadline through all of its work, including the direct pipeline's wait for room in the export queues
(`deadline` is what that wait reads): a slow but live exporter cannot stretch it. What a flush could not deliver by
its deadline stays queued, in order, for the next drain; what an exit drain could not (a slow or hung exporter),
including records already taken from the queue, is counted as dropped (`flush_timeout`): nothing vanishes
uncounted. After its last records, within the same bound, the exit drain has the builder end what is still open
(the sink's `end_at_exit`: ended by the process's exit); what the bound leaves unended is counted too.
"""

import atexit
import logging
import math
import multiprocessing.util
import os
import threading
import time
from collections import deque
from typing import Callable, Optional

from opentelemetry.sdk.trace import SpanProcessor

from otel_kvtransfer import config
from otel_kvtransfer.recording import inflight

_logger = logging.getLogger(__name__)

# How long flushing at shutdown or exit may wait for a drain in progress (a hung synchronous exporter).
EXIT_DRAIN_TIMEOUT_S = 5.0
# How long stop() waits for the background thread to end.
JOIN_TIMEOUT_S = 5.0
NO_DEADLINE = math.inf


_OWN_ERRORS_LOGGED = set()


def log_own_error(what: str, exc: BaseException) -> None:
    """The first failure of each kind, with what failed, at WARNING (the drop counter says how many); the rest
    at debug, with the traceback."""
    kind = (what, type(exc).__name__)
    if kind not in _OWN_ERRORS_LOGGED and len(_OWN_ERRORS_LOGGED) < 64:
        _OWN_ERRORS_LOGGED.add(kind)
        _logger.warning("otel_kvtransfer: %s failed (%s: %s); counted as builder_error", what, type(exc).__name__,
                        str(exc)[:200], exc_info=True)
    else:
        _logger.debug("otel_kvtransfer: %s failed", what, exc_info=True)


class Sink:
    """Where the recorder's thread delivers records: the builder in this process (`building.in_process`) or the
    link to the builder process (`offloading.link`). With `batched`, each drain's records come in one list to
    `take_batch` (the link: its writes are bounded); otherwise one at a time to `take`, so that a drain's deadline
    is read between records. All of it runs on the recorder's thread, but `after_fork_in_child` (the child's
    only thread, at fork)."""

    batched = False

    def take(self, rec: tuple) -> None:
        raise NotImplementedError

    def take_batch(self, batch: list) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        """After each drain: the builder's periodic work (eviction, stuck reports)."""

    def count_drops(self, reason: str, count: int) -> None:
        """The records the recorder dropped since the last drain, by reason."""

    def after_fork_in_child(self) -> None:
        """A forked child starts with nothing of its parent's."""

    def end_at_exit(self, deadline: float = math.inf) -> int:
        """The exit drain's last step, within its bound: end what is still open (ended by the process's exit)
        until `deadline` (time.monotonic()); how many it could not end by then (counted as flush_timeout)."""
        return 0

    def export_wait_s(self) -> float:
        """Seconds the builder here has waited for room in the export queues so far (what a slow exporter costs
        it): the exit drain's line says whether that is what took its time."""
        return 0.0

    def release_held(self) -> None:
        """A flush's last step: what has ended but is held back (peer waits watched for late KV) goes out now."""


class Recorder:
    """Bounded hand-off from engine threads to one background span-building thread."""

    def __init__(self, settings: config.Settings):
        self.settings = settings
        self.active = False  # read on the hot path: the wrappers call straight through when False
        self.watcher = None  # inflight.Watcher while instrumented
        self._queue: deque = deque()
        self._capacity = settings.queue_size
        self._sink: Optional[Sink] = None
        self._fresh_locks()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._batch: list = []  # records taken from the queue by the drain in progress
        self._done = 0  # how many of them it has handled
        self._abandoned = False  # an exit drain gave up (on its deadline, or on a drain in progress)
        self._drains = 0  # drains begun: the number of the one in progress
        self._given_up_on = 0  # the drain in progress an exit drain gave up on and counted the rest of
        self._not_ended = 0  # spans still open that the last exit drain's deadline left unended
        # time.monotonic() by which the drain in progress must end (NO_DEADLINE: a background drain, unbounded).
        self.deadline = NO_DEADLINE
        # What a multiprocessing child runs on its way out; None: drain, then flush the global providers.
        self.child_exit: Optional[Callable[[], None]] = None
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork_in_child)
        # multiprocessing starts each child by clearing the exit finalizers it inherited, then runs these hooks.
        multiprocessing.util.register_after_fork(self, Recorder._in_multiprocessing_child)

    def _fresh_locks(self) -> None:
        self._drain_lock = threading.Lock()
        # Reentrant: a NIXL handle freed by the garbage collector may count a drop on a thread already counting one.
        self._drop_lock = threading.RLock()
        self._pending_drops = {}  # reason -> count, reported by the background thread
        self._drops_logged = set()
        self._wake = threading.Event()
        self._idle = False  # the thread sleeps past the flush interval: the next record wakes it

    # --- hot path -----------------------------------------------------------------------------------------
    def record(self, rec: tuple) -> None:
        # The Mooncake sync wrapper inlines the common case (room in the queue, the thread awake: one append) and
        # calls this for the rest; a frame less per transfer is ~5% of the wrapper's own cost.
        queue = self._queue
        if len(queue) >= self._capacity:
            self.drop("queue_full")
            return
        queue.append(rec)
        if self._idle:  # the first record after a quiet spell is delivered at once, not after the long sleep
            self._idle = False
            self._wake.set()

    def drop(self, reason: str, count: int = 1) -> None:
        with self._drop_lock:
            self._pending_drops[reason] = self._pending_drops.get(reason, 0) + count
        if reason not in self._drops_logged:
            self._drops_logged.add(reason)
            _logger.warning(
                "otel_kvtransfer dropped a record (%s); counted in kv_transfer.instrumentation.dropped, "
                "further drops are counted without logging", reason)

    # --- lifecycle ----------------------------------------------------------------------------------------
    def start(self, settings: config.Settings, sink: Sink) -> None:
        """Record from now on, delivering to `sink`."""
        self.settings = settings
        self._capacity = settings.queue_size
        self._sink = sink
        self._stopping = False
        self._abandoned = False
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
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT_S)
            if thread.is_alive():
                _logger.warning("otel_kvtransfer: the recorder thread did not end in %ss (a hung exporter?)",
                                JOIN_TIMEOUT_S)
        atexit.unregister(self.final_drain)
        self._report_drops()
        self._sink = None

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="otel-kvtransfer-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = wait_s = self.settings.flush_interval_s
        while not self._stopping:
            self._idle = wait_s > interval
            if self._idle and self._queue:  # recorded after the drain, before the flag: do not sleep long
                self._idle, wait_s = False, interval
            self._wake.wait(wait_s)
            self._wake.clear()
            self._idle = False
            if not self._stopping:
                recorded = bool(self._queue)
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
                    self.record(rec)
            except Exception:
                self.drop("wrapper_error")
                _logger.debug("otel_kvtransfer could not scan what is in flight", exc_info=True)

    # --- delivery -----------------------------------------------------------------------------------------
    def drain(self, timeout_s: Optional[float] = None, flushing: bool = False) -> bool:
        """Hand everything queued so far to the builder, on the calling thread, within `timeout_s` (None: no bound);
        `flushing` (a provider's force_flush): then export what the builder holds back though it has ended.

        False when it could not within `timeout_s`: another drain (a hung synchronous exporter holding the builder)
        did not let go, or the exporters took longer than that; nothing is lost then, what was not delivered stays
        queued, in order, ahead of what is recorded meanwhile.
        """
        return self._drain(timeout_s, self._requeue, flushing=flushing) is True

    def current_deadline(self) -> float:
        """The deadline of the drain in progress (what the direct pipeline's wait for room reads)."""
        return self.deadline

    def _drain(self, timeout_s: Optional[float], on_rest: Callable[[list], None], at_end: bool = False,
               flushing: bool = False):
        """True when everything was delivered; None when the drain lock was not had in time; False when the
        deadline came first, after `on_rest` got the records not delivered (under the lock: order is kept).
        With `at_end`, the sink's `end_at_exit` runs last, under the lock and the same deadline, whether or not
        everything was delivered; with `flushing`, its `release_held`."""
        sink = self._sink  # as it is now: stop() may clear it
        if sink is None:
            return True
        last_step = sink.release_held if flushing else None
        wait_s = -1 if timeout_s is None else max(timeout_s, 0)
        deadline = NO_DEADLINE if timeout_s is None else time.monotonic() + wait_s
        if not self._drain_lock.acquire(timeout=wait_s):
            return None
        try:
            self._drains += 1
            batch = self._take()
            self.deadline = deadline
            if not self._deliver(batch, sink, deadline):
                if self._given_up_on == self._drains:
                    return False  # an exit drain counted this batch's rest already
                rest = batch[self._done:]
                self._batch, self._done = [], 0
                on_rest(rest)
                self._run_at_end(last_step)
                if at_end:
                    self._end_open(sink, deadline)
                self._report_drops()  # what the wait for room counted: the flush's caller reads the metrics next
                return False
            self._batch = []
            self._run_at_end(last_step)
            if at_end and not self._end_open(sink, deadline):
                return False
            self._after_delivery(sink)
        finally:
            self.deadline = NO_DEADLINE
            self._drain_lock.release()
        return True

    @staticmethod
    def _run_at_end(at_end: Optional[Callable[[], None]]) -> None:
        if at_end is not None:
            try:
                at_end()
            except Exception as exc:
                log_own_error("ending the spans still open at exit", exc)

    def _end_open(self, sink: Sink, deadline: float) -> bool:
        """The exit drain's last step: the builder ends what is still open, within the drain's deadline; what it
        could not end by then is counted (flush_timeout) and kept for the line that says so. False then."""
        try:
            left = sink.end_at_exit(deadline)
        except Exception as exc:
            log_own_error("ending the spans still open at exit", exc)
            return True
        if not isinstance(left, int) or left <= 0:
            return True
        self._not_ended += left
        self.drop("flush_timeout", left)
        return False

    def _requeue(self, rest: list) -> None:
        self._queue.extendleft(reversed(rest))  # one C call: no engine thread's append lands in between

    def _take(self) -> list:
        """Everything queued now, in order, as the batch in progress (what an exit drain counts if it hangs)."""
        queue, pop = self._queue, self._queue.popleft
        batch = self._batch = []
        self._done = 0
        try:
            for _ in range(len(queue)):
                batch.append(pop())
        except IndexError:
            pass
        return batch

    def _deliver(self, batch: list, sink: Sink, deadline: float = NO_DEADLINE) -> bool:
        """Hand the batch to the builder: in one list (the builder process's link, whose writes are bounded), or
        record by record (the builder in this process), each failure counted. False when an exit drain gave up on
        it meanwhile, or when `deadline` came first (`self._done` records were handled)."""
        if sink.batched:
            if batch:
                try:
                    sink.take_batch(batch)
                except Exception as exc:
                    self.drop("builder_error", len(batch))
                    log_own_error("handing records to the builder", exc)
                self._done = len(batch)
            return True
        bounded = deadline != NO_DEADLINE
        clock, number, handle = time.monotonic, self._drains, sink.take
        for rec in batch:
            if self._given_up_on == number:
                return False  # an exit drain counted the rest of this batch; stop delivering it
            if bounded and clock() >= deadline:
                return False
            try:
                handle(rec)
            except Exception as exc:
                # A bug of ours loses only this record, and is counted.
                self.drop("builder_error")
                log_own_error("building a span", exc)
            self._done += 1
        return True

    def _after_delivery(self, sink: Sink) -> None:
        """The builder's periodic work (eviction, stuck reports), then the drops counted since the last drain."""
        try:
            sink.tick()
        except Exception:
            _logger.debug("otel_kvtransfer builder tick failed", exc_info=True)
        self._report_drops()

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
        if self._abandoned:
            timeout_s = 0  # already gave up once on the way out: don't wait again
        waited = self._export_wait_s()
        lost = []
        self._not_ended = 0
        outcome = self._drain(timeout_s, lost.append, at_end=at_exit)
        if outcome is True:
            return True
        if outcome is None:  # the drain in progress did not let go: its batch's rest is counted here, once
            # (the providers' shutdown calls this again after the atexit drain)
            left = 0 if self._given_up_on == self._drains else max(len(self._batch) - self._done, 0)
            self._given_up_on = self._drains
        else:
            left = sum(len(rest) for rest in lost)
        self._abandoned = True
        try:
            while True:
                self._queue.popleft()
                left += 1
        except IndexError:
            pass
        if left:
            self.drop("flush_timeout", left)
        if left or self._not_ended or outcome is None:
            _logger.warning("otel_kvtransfer: the exit drain stopped at its %g s bound, %s; %d records not delivered "
                            "and %d requests and peer waits still open not ended are counted as dropped "
                            "(flush_timeout)", timeout_s, self._exit_cause(outcome, timeout_s,
                                                                           self._export_wait_s() - waited),
                            left, self._not_ended)
        self._report_drops()
        return False

    @staticmethod
    def _exit_cause(outcome, timeout_s: float, waited_s: float) -> str:
        """What took the exit drain's time, as the line says it."""
        if outcome is None:
            return "a drain in progress holding the builder (an exporter that hangs)"
        if waited_s > 0 and waited_s >= timeout_s / 2:
            return f"{waited_s:.1f} s of it waiting for room in the export queue (a slow or hung exporter)"
        return f"building and ending spans (of it {waited_s:.1f} s waiting for the exporters)"

    def _export_wait_s(self) -> float:
        sink = self._sink
        try:
            return float(sink.export_wait_s()) if sink is not None else 0.0
        except Exception:
            return 0.0

    def _report_drops(self) -> None:
        with self._drop_lock:
            drops, self._pending_drops = self._pending_drops, {}
        sink = self._sink
        if sink is None:
            with self._drop_lock:  # nobody to report to yet: keep them for later
                for reason, count in drops.items():
                    self._pending_drops[reason] = self._pending_drops.get(reason, 0) + count
            return
        for reason, count in drops.items():
            try:
                sink.count_drops(reason, count)
            except Exception:
                _logger.debug("otel_kvtransfer could not count drops", exc_info=True)

    def pending(self) -> int:
        return len(self._queue)

    def _after_fork_in_child(self) -> None:
        # The parent delivers what it queued; the child starts empty with fresh locks and its own thread.
        self._queue = deque()
        self._fresh_locks()
        self._batch, self._done = [], 0
        self._thread = None
        if self._sink is not None:
            self._sink.after_fork_in_child()
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

    def __init__(self, recorder: Recorder):
        self._recorder = recorder

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._recorder.drain(timeout_millis / 1000, flushing=True)

    def shutdown(self) -> None:
        self._recorder.final_drain()


# One per process: the wrappers reach it as a module global, the cheapest lookup on the hot path.
RECORDER = Recorder(config.Settings())
