"""The recorder's drains: what is queued, in order, handed to the sink within one deadline.

A drain runs on the recorder's thread every flush interval, and on the caller's thread when a provider flushes
(`FlushFirstSpanProcessor`), at interpreter exit and when a multiprocessing child exits. A drain given a timeout
carries one deadline through all of its work, including the direct pipeline's wait for room in the export queues
(`deadline` is what that wait reads): a slow but live exporter cannot stretch it. What a flush could not deliver by
its deadline stays queued, in order, for the next drain; what an exit drain could not (a slow or hung exporter),
including records already taken from the queue, is counted as dropped (`flush_timeout`): nothing vanishes
uncounted. After its last records, within the same bound, the exit drain has the builder end what is still open
(the sink's `end_at_exit`: ended by the process's exit); what the bound leaves unended is counted too.
"""

import enum
import logging
import math
import operator
import threading
import time
from collections import deque
from itertools import repeat
from typing import Callable, Optional, Protocol

from otel_kvtransfer.recording.records import INFLIGHT, KIND, Record
from otel_kvtransfer.recording.sink import Sink, log_own_error

_logger = logging.getLogger(__name__)

# operator.call(f) calls f() in C (Python 3.11+); None before it, where the drain pops in a Python loop.
_call: Optional[Callable[[Callable[[], Record]], Record]] = getattr(operator, "call", None)

# How long flushing at shutdown or exit may wait for a drain in progress (a hung synchronous exporter).
EXIT_DRAIN_TIMEOUT_S = 5.0
NO_DEADLINE = math.inf


class DrainOutcome(enum.Enum):
    DELIVERED = "delivered"  # everything taken was handed over (and, at exit, everything open was ended)
    DEADLINE = "deadline"  # the deadline came first: the rest went to the drain's `on_rest`, or stayed open
    GIVEN_UP = "given up"  # an exit drain gave up on this drain meanwhile, and counted its rest itself
    BUSY = "busy"  # another drain held the builder past the wait (a hung exporter): nothing was taken


class Drained(Protocol):
    """What the drains use of their recorder (`recorder.Recorder`)."""

    queue: deque[Record]
    sink: Optional[Sink]

    def drop(self, reason: str, count: int = 1) -> None: ...

    def keep_scan(self, rec: Record) -> None: ...  # the latest in-flight scan, delivered after what is queued

    def take_scan(self) -> Optional[Record]: ...

    def report_drops(self) -> None: ...


class DrainProgress:
    """The drains' accounting: what an exit drain reads to count exactly what a drain in progress left."""

    __slots__ = ("batch", "done", "number", "given_up_on", "abandoned", "not_ended")

    def __init__(self) -> None:
        self.batch: list[Record] = []  # records taken from the queue by the drain in progress
        self.done = 0  # how many of them it has handled
        self.number = 0  # drains begun: the number of the one in progress
        self.given_up_on = 0  # the drain in progress an exit drain gave up on and counted the rest of
        self.abandoned = False  # an exit drain gave up (on its deadline, or on a drain in progress)
        self.not_ended = 0  # spans still open that the last exit drain's deadline left unended


class Delivery:
    """The drains of one recorder (its `queue`, `sink`, `drop()` and `report_drops()`), one at a time."""

    def __init__(self, recorder: Drained) -> None:
        self._recorder = recorder
        self._lock = threading.Lock()
        self.progress = DrainProgress()
        # time.monotonic() by which the drain in progress must end (NO_DEADLINE: a background drain, unbounded).
        self.deadline = NO_DEADLINE

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self.progress.batch, self.progress.done = [], 0

    def drain(self, timeout_s: Optional[float], flushing: bool = False) -> DrainOutcome:
        """Everything queued so far to the sink, within `timeout_s` (None: no bound); what the deadline left stays
        queued, in order, ahead of what is recorded meanwhile. `flushing`: then the sink's `release_held`."""
        return self._run(timeout_s, self._requeue, flushing=flushing)

    def _run(self, timeout_s: Optional[float], on_rest: Callable[[list[Record]], None], at_end: bool = False,
             flushing: bool = False) -> DrainOutcome:
        """With DEADLINE, `on_rest` got the records not delivered (under the lock: order is kept). With `at_end`,
        the sink's `end_at_exit` runs last, under the lock and the same deadline, whether or not everything was
        delivered; with `flushing`, its `release_held`."""
        sink = self._recorder.sink  # as it is now: stop() may clear it
        if sink is None:
            return DrainOutcome.DELIVERED
        wait_s = -1 if timeout_s is None else max(timeout_s, 0)
        deadline = NO_DEADLINE if timeout_s is None else time.monotonic() + wait_s
        if not self._lock.acquire(timeout=wait_s):
            return DrainOutcome.BUSY
        try:
            self.deadline = deadline
            return self._hand_over(sink, deadline, on_rest, at_end, sink.release_held if flushing else None)
        finally:
            self.deadline = NO_DEADLINE
            self._lock.release()

    def _hand_over(self, sink: Sink, deadline: float, on_rest: Callable[[list[Record]], None], at_end: bool,
                   last_step: Optional[Callable[[], None]]) -> DrainOutcome:
        progress = self.progress
        progress.number += 1
        batch = self._take()
        if not self._deliver(batch, sink, deadline):
            if progress.given_up_on == progress.number:
                return DrainOutcome.GIVEN_UP  # an exit drain counted this batch's rest already
            rest = batch[progress.done:]
            progress.batch, progress.done = [], 0
            on_rest(rest)
            _run_last_step(last_step)
            if at_end:
                self._end_open(sink, deadline)
            self._recorder.report_drops()  # what the wait for room counted: the flush's caller reads the metrics next
            return DrainOutcome.DEADLINE
        progress.batch = []
        _run_last_step(last_step)
        if at_end and not self._end_open(sink, deadline):
            return DrainOutcome.DEADLINE
        try:  # the builder's periodic work (eviction, stuck reports), then the drops counted since the last drain
            sink.tick()
        except Exception:
            _logger.debug("otel_kvtransfer builder tick failed", exc_info=True)
        self._recorder.report_drops()
        return DrainOutcome.DELIVERED

    def _take(self) -> list[Record]:
        """Everything queued now, in order, as the batch in progress (what an exit drain counts if it hangs)."""
        queue = self._recorder.queue
        pop = queue.popleft
        batch = self.progress.batch = []
        self.progress.done = 0
        try:
            if _call is not None:  # popped and appended in C, not a Python loop (a tenth of the recorder per record)
                batch.extend(map(_call, repeat(pop, len(queue))))  # what was appended before an IndexError stays
            else:
                for _ in range(len(queue)):
                    batch.append(pop())
        except IndexError:  # another drain's exit emptied it meanwhile
            pass
        scan = self._recorder.take_scan()
        if scan is not None:  # the scan made right before this drain: after what was queued, as it used to be
            batch.append(scan)
        return batch

    def _requeue(self, rest: list[Record]) -> None:
        recorder = self._recorder
        if rest and rest[-1][KIND] == INFLIGHT:  # an undelivered scan goes back to its slot
            scan = rest.pop()
            newer = recorder.take_scan()  # made meanwhile: it supersedes this one, which keeps its stuck reports
            recorder.keep_scan(scan)
            if newer is not None:
                recorder.keep_scan(newer)
        recorder.queue.extendleft(reversed(rest))  # one C call: no engine thread's append lands in between

    def _deliver(self, batch: list[Record], sink: Sink, deadline: float) -> bool:
        """Hand the batch to the builder: in one list (the builder process's link, whose writes are bounded), or
        record by record (the builder in this process), each failure counted. False when an exit drain gave up on
        it meanwhile, or when `deadline` came first (`progress.done` records were handled)."""
        progress, drop = self.progress, self._recorder.drop
        if sink.batched:
            if batch:
                try:
                    sink.take_batch(batch)
                except Exception as exc:
                    drop("builder_error", len(batch))
                    log_own_error("handing records to the builder", exc)
                progress.done = len(batch)
            return True
        bounded = deadline != NO_DEADLINE
        clock, number, handle = time.monotonic, progress.number, sink.take
        for rec in batch:
            if progress.given_up_on == number:
                return False  # an exit drain counted the rest of this batch; stop delivering it
            if bounded and clock() >= deadline:
                return False
            try:
                handle(rec)
            except Exception as exc:
                # A bug of ours loses only this record, and is counted.
                drop("builder_error")
                log_own_error("building a span", exc)
            progress.done += 1
        return True

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
        self.progress.not_ended += left
        self._recorder.drop("flush_timeout", left)
        return False

    # --- the exit drain ----------------------------------------------------------------------------------------
    def exit_drain(self, timeout_s: float, at_exit: bool) -> bool:
        """A drain for a process about to end (`Recorder.final_drain`): never longer than `timeout_s`. What it
        could not deliver in time is counted as dropped (`flush_timeout`), with one WARNING line."""
        progress = self.progress
        if progress.abandoned:
            timeout_s = 0  # already gave up once on the way out: don't wait again
        waited = self._export_wait_s()
        lost: list[list[Record]] = []
        progress.not_ended = 0
        outcome = self._run(timeout_s, lost.append, at_end=at_exit)
        if outcome is DrainOutcome.DELIVERED:
            return True
        if outcome is DrainOutcome.BUSY:  # the drain in progress did not let go: its batch's rest is counted here,
            # once (the providers' shutdown calls this again after the atexit drain)
            left = 0 if progress.given_up_on == progress.number else max(len(progress.batch) - progress.done, 0)
            progress.given_up_on = progress.number
        else:
            left = sum(len(rest) for rest in lost)
        progress.abandoned = True
        left += self._discard_queue()
        if left:
            self._recorder.drop("flush_timeout", left)
        if left or progress.not_ended or outcome is DrainOutcome.BUSY:
            _logger.warning("otel_kvtransfer: the exit drain stopped at its %g s bound, %s; %d records not delivered "
                            "and %d requests and peer waits still open not ended are counted as dropped "
                            "(flush_timeout)", timeout_s, _exit_cause(outcome, timeout_s,
                                                                      self._export_wait_s() - waited),
                            left, progress.not_ended)
        self._recorder.report_drops()
        return False

    def _discard_queue(self) -> int:
        queue, discarded = self._recorder.queue, 0
        try:
            while True:
                queue.popleft()
                discarded += 1
        except IndexError:
            pass
        return discarded

    def _export_wait_s(self) -> float:
        sink = self._recorder.sink
        try:
            return float(sink.export_wait_s()) if sink is not None else 0.0
        except Exception:
            return 0.0


def _run_last_step(step: Optional[Callable[[], None]]) -> None:
    if step is not None:
        try:
            step()
        except Exception as exc:
            log_own_error("ending the spans still open at exit", exc)


def _exit_cause(outcome: DrainOutcome, timeout_s: float, waited_s: float) -> str:
    """What took the exit drain's time, as the line says it."""
    if outcome is DrainOutcome.BUSY:
        return "a drain in progress holding the builder (an exporter that hangs)"
    if waited_s > 0 and waited_s >= timeout_s / 2:
        return f"{waited_s:.1f} s of it waiting for room in the export queue (a slow or hung exporter)"
    return f"building and ending spans (of it {waited_s:.1f} s waiting for the exporters)"
