"""Compute on the device's clock: a forward's interval read from timing events on its streams, not from its launch.

A framework that launches its forward on a GPU returns before the work has run (sglang's overlap scheduler returns
once the forward is enqueued), so the host's clock around the launch says when the work was enqueued, not when it
ran. Here the launch is bracketed by timing events recorded on the streams the forward uses: `begin` before the
launch and `end` after it, on the engine's thread (a few event records and one append; never a wait, never a
query). A thread of this module's own, the resolver, turns each bracket into a compute record once its events
have completed, which it learns by non-blocking queries every `poll_s`.

Device time onto the records' clock (clock.py) goes through anchors, timing events whose host time is known to
25 us, taken again as the clocks drift (`device_anchors`): an event's host time stays within 50 us of the truth. A
launch after an idle spell wakes the resolver, which anchors at once.

Nothing is lost silently, and nothing of a request comes after its end (after its end record a compute record
makes no span): `settle(key)`, called when a request ends (integration.end_request), records at once what is
pending for it: on the device's clock where its events completed, else with the launch's host times
(`kv_transfer.compute.clock` = host) and counted in `kv_transfer.instrumentation.dropped` as
`device_compute_unresolved`. The same fallback and count for a bracket whose events have not completed
GIVE_UP_S after its launch (a device that hangs), for one whose events the device fails to read (a query or
elapsed time that raises: recorded at once, never retried), and for device times outside the window the host saw
the work in (a launch's start to when its end was seen complete) by more than IMPLAUSIBLE_NS (a clock that went
backwards or jumped); at most `max_pending` brackets wait, a bracket beyond that is recorded with its host times at
once, counted as `device_compute_full`.

Settling never waits for the device: no lock is held across a device call, so a request that ends never waits for
the resolver's queries, and `settle` itself makes at most SETTLE_QUERIES queries (none while the device answers
slowly: SLOW_IN_A_ROW queries in a row slower than SLOW_QUERY_NS); what it does not read keeps its host times, counted.

Only CUDA devices (torch.cuda: NVIDIA, and AMD through HIP) are read; any other device keeps the host's times.
torch is never imported here: a device is looked up only in a torch the engine already imported.
`use_device_module` is the seam for a torch.cuda-shaped stand-in (tests, where no GPU is).
"""

import logging
import os
import sys
import threading
from collections import deque
from typing import Any, Optional, Sequence, TypeGuard

from otel_kvtransfer import semconv
from otel_kvtransfer.recording import records
from otel_kvtransfer.recording.clock import now_ns
from otel_kvtransfer.recording.device_anchors import Anchors, DeviceModule, TimingEvent
from otel_kvtransfer.recording.recorder import RECORDER

_logger = logging.getLogger(__name__)

DEVICE_TYPES = ("cuda",)  # torch.cuda, also on ROCm (HIP builds of torch answer to "cuda")
POLL_S = 0.005  # how often the resolver queries pending brackets (each pass: one query per bracket, no wait)
IDLE_WAIT_S = 1.0  # how long the resolver sleeps with nothing pending (a bracket wakes it at once)
GIVE_UP_S = 60.0  # a bracket whose events have not completed by then keeps its host times (counted)
MAX_PENDING = 4096  # brackets waiting for their events; beyond it a bracket keeps its host times (counted)
SETTLE_QUERIES = 8  # event queries one request's end may make (a forward's end events: one per stream)
SLOW_QUERY_NS = 5_000_000  # a query slower than this, SLOW_IN_A_ROW times in a row (not one wait for the GIL):
SLOW_IN_A_ROW = 3  # a slow device, which a request's end does not query
CLOSE_BUDGET_NS = 100_000_000  # the queries close() may still make; what it cannot read keeps its host times
IMPLAUSIBLE_NS = 10_000_000  # device times further than this outside the host's window are a misread clock
FULL = "device_compute_full"
UNRESOLVED = "device_compute_unresolved"


class _Bracket:
    """One launch: its start and end events, the host's times around it (the fallback), the keys it served."""

    __slots__ = ("keys", "starts", "ends", "host_start", "host_end", "chunk", "device", "seen")

    def __init__(self, keys: list[records.Key], starts: tuple[TimingEvent, ...], ends: tuple[TimingEvent, ...],
                 host_start: int, host_end: int, chunk: Optional[int], device: Optional[int]) -> None:
        self.keys = keys  # list: keys are removed as their requests settle
        self.starts = starts
        self.ends = ends
        self.host_start = host_start
        self.host_end = host_end
        self.chunk = chunk
        self.device = device
        self.seen: Optional[int] = None  # the records' clock when a query first saw its end events complete


# What begin() hands to end(): (host time before the launch, its start events or None, the device's index)
_Token = tuple[int, Optional[tuple[TimingEvent, ...]], Optional[int]]
_WAIT = "wait"  # a bracket's events not complete yet (or no anchor yet): neither device nor host times now


def _good_key(key: object) -> TypeGuard[records.Key]:
    return (isinstance(key, int) and not isinstance(key, bool)) or isinstance(key, str)


def _device_of(stream: Any) -> Optional[int]:
    return getattr(stream, "device_index", None)


class DeviceClock:
    """Compute brackets on one device module's timing events (torch.cuda, or a stand-in shaped like it)."""

    def __init__(self, device: DeviceModule, *, poll_s: float = POLL_S, give_up_s: float = GIVE_UP_S,
                 max_pending: int = MAX_PENDING) -> None:
        self.device = device
        self._poll_s = poll_s
        self._give_up_ns = int(give_up_s * 1e9)
        self._max_pending = max_pending
        self._incoming: deque[_Bracket] = deque()  # brackets from engine threads (append is atomic: no lock there)
        self._pending: dict[int, _Bracket] = {}  # id -> _Bracket, oldest first
        self._by_key: dict[records.Key, set[int]] = {}  # key -> {id of a pending bracket serving it}
        self._lock = threading.Lock()  # the pending table, and every record made from it; never held across a
        # device call
        self._anchors = Anchors(device)
        self._slow_run = 0  # queries in a row slower than SLOW_QUERY_NS
        self._wake = threading.Event()
        self._idle = False
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._counts = {"device": 0, "host": 0}

    # --- engine thread ---------------------------------------------------------------------------------------
    def current_stream(self) -> Any:
        return self.device.current_stream()

    def begin(self, streams: Sequence[Any]) -> _Token:
        """Before a launch: a timing event on each stream the launch uses. The token goes to `end`."""
        host = now_ns()
        try:
            capturing = getattr(self.device, "is_current_stream_capturing", None)
            if capturing is not None and capturing():
                return (host, None, None)  # a CUDA graph being captured: no timing events in it, the host's times
            events = []
            for stream in streams:
                event = self.device.Event(enable_timing=True)
                event.record(stream)
                events.append(event)
            return (host, tuple(events), _device_of(streams[0]))
        except Exception:
            RECORDER.drop("wrapper_error")
            _logger.debug("otel_kvtransfer could not record a timing event", exc_info=True)
            return (host, None, None)

    def end(self, token: _Token, streams: Sequence[Any], keys: Sequence[Any],
            chunk_index: Optional[int] = None) -> None:
        """After the launch: a timing event on each stream; the bracket waits for them off this thread."""
        host_start, starts, device = token
        valid = [k for k in keys if _good_key(k)]
        if len(valid) != len(keys):
            RECORDER.drop("api_error", len(keys) - len(valid))  # as integration.record_compute counts them
        keys = list(dict.fromkeys(valid))  # each request once
        ends = None
        if starts is not None:
            try:
                events = []
                for stream in streams:
                    event = self.device.Event(enable_timing=True)
                    event.record(stream)
                    events.append(event)
                ends = tuple(events)
            except Exception:
                RECORDER.drop("wrapper_error")
                _logger.debug("otel_kvtransfer could not record a timing event", exc_info=True)
        host_end = now_ns()
        if not keys:
            return
        if ends is None or starts is None:  # no events: the launch's own times, as where there is no device
            self._record(keys, host_start, host_end, chunk_index, semconv.CLOCK_HOST)
            return
        if len(self._incoming) + len(self._pending) >= self._max_pending:
            RECORDER.drop(FULL, len(keys))
            self._record(keys, host_start, host_end, chunk_index, semconv.CLOCK_HOST)
            return
        self._incoming.append(_Bracket(keys, starts, ends, host_start, host_end, chunk_index, device))
        if self._thread is None:
            self._start()
        elif self._idle:  # after an idle spell: anchor now, near this launch
            self._idle = False
            self._wake.set()

    # --- a request ends (any thread) ---------------------------------------------------------------------------
    def settle(self, key: records.Key) -> None:
        """Record now what is pending for `key` (its request ends): never waits for the device (a bounded number of
        queries, none while the device is slow; no lock held across one)."""
        if not self._pending and not self._incoming:
            return
        brackets = []
        with self._lock:  # the key's brackets taken out of the table: the resolver records them for other keys only
            self._absorb()
            for bracket_id in self._by_key.pop(key, ()):
                bracket = self._pending.get(bracket_id)
                if bracket is None:
                    continue
                bracket.keys.remove(key)
                if not bracket.keys:
                    del self._pending[bracket_id]
                brackets.append(bracket)
        if not brackets:
            return
        queries = SETTLE_QUERIES
        found = []
        for bracket in brackets:
            times: Any = _WAIT
            if bracket.seen is not None:
                times = _bracket_times(self._anchors, bracket)
            elif self._slow_run < SLOW_IN_A_ROW and queries >= len(bracket.ends):
                queries -= len(bracket.ends)
                times = self._read(bracket)
            found.append((bracket, times))
        with self._lock:
            for bracket, times in found:
                if isinstance(times, tuple):
                    self._record([key], times[0], times[1], bracket.chunk, semconv.CLOCK_DEVICE)
                else:
                    RECORDER.drop(UNRESOLVED)
                    self._record([key], bracket.host_start, bracket.host_end, bracket.chunk, semconv.CLOCK_HOST)

    # --- the resolver ------------------------------------------------------------------------------------------
    def _start(self) -> None:
        with self._lock:
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._run, name="otel-kvtransfer-device-clock", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._pass()
            except Exception:
                RECORDER.drop("wrapper_error")
                _logger.debug("otel_kvtransfer: the device clock's pass failed", exc_info=True)
            # The flag first, then the look: an end() racing this either is seen here or sees the flag and wakes us.
            self._idle = True
            if self._pending or self._incoming:
                self._idle = False
                self._wake.wait(self._poll_s)
            else:
                self._wake.wait(IDLE_WAIT_S)
            self._wake.clear()
            self._idle = False

    def _pass(self) -> None:
        with self._lock:
            self._absorb()
            devices = {b.device for b in self._pending.values()}
        for device in devices:
            self._anchors.anchor_if_due(device)
        self._resolve(now_ns())

    def _absorb(self) -> None:
        """Brackets from the engine threads into the table (under the lock)."""
        incoming = self._incoming
        while incoming:
            bracket = incoming.popleft()
            bracket_id = id(bracket)
            self._pending[bracket_id] = bracket
            for key in bracket.keys:
                self._by_key.setdefault(key, set()).add(bracket_id)

    def _resolve(self, now: int, deadline: Optional[int] = None) -> None:
        """Each pending bracket read (outside the lock: a request that ends meanwhile does not wait for the device;
        past `deadline`, or while the device is slow, no more queries), then recorded under it for the keys it still
        serves: device times, or host times once it failed or gave up."""
        with self._lock:
            self._absorb()
            pending = list(self._pending.items())
        found = []
        for bracket_id, bracket in pending:
            if bracket.seen is None and deadline is not None and (
                    self._slow_run >= SLOW_IN_A_ROW or now_ns() >= deadline):
                times: Any = _WAIT
            else:
                times = self._read(bracket)
            found.append((bracket_id, bracket, times))
        with self._lock:
            for bracket_id, bracket, times in found:
                if self._pending.get(bracket_id) is not bracket:
                    continue  # settled meanwhile by the end of the last request it served
                if isinstance(times, tuple):
                    self._record(bracket.keys, times[0], times[1], bracket.chunk, semconv.CLOCK_DEVICE)
                elif times is None or now - bracket.host_end > self._give_up_ns:
                    RECORDER.drop(UNRESOLVED, len(bracket.keys))
                    self._record(bracket.keys, bracket.host_start, bracket.host_end, bracket.chunk,
                                 semconv.CLOCK_HOST)
                else:
                    continue
                del self._pending[bracket_id]
                for key in bracket.keys:
                    ids = self._by_key.get(key)
                    if ids is not None:
                        ids.discard(bracket_id)
                        if not ids:
                            del self._by_key[key]

    def _read(self, bracket: _Bracket) -> Any:
        """Query a bracket's end events (a stream runs in order: its end event done means its start event is too):
        its device times; _WAIT while not complete; None where the device fails to answer (host times)."""
        if bracket.seen is None:
            seen = now_ns()
            try:
                for event in bracket.ends:
                    asked = now_ns()
                    done = event.query()
                    seen = now_ns()
                    self._slow_run = self._slow_run + 1 if seen - asked > SLOW_QUERY_NS else 0
                    if not done:
                        return _WAIT
            except Exception:
                _logger.debug("otel_kvtransfer could not query a timing event", exc_info=True)
                return None
            bracket.seen = seen
        return _bracket_times(self._anchors, bracket)

    def _record(self, keys: Sequence[records.Key], start: int, end: int, chunk: Optional[int], clock: str) -> None:
        self._counts["device" if clock == semconv.CLOCK_DEVICE else "host"] += len(keys)
        if RECORDER.active:
            RECORDER.record(records.compute(tuple(keys), start, end, chunk, clock))

    # --- life --------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """What the clock did: records on each clock, anchors taken and refused, their windows, the drift rate."""
        return {"compute_records_device": self._counts["device"], "compute_records_host": self._counts["host"],
                **self._anchors.stats(), "pending": len(self._pending) + len(self._incoming)}

    def close(self) -> None:
        """Stop the resolver; what is pending is recorded now (device times where complete, else host, counted)."""
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        self._resolve(now_ns() + self._give_up_ns + 1, now_ns() + CLOSE_BUDGET_NS)


def _bracket_times(anchors: Anchors, bracket: _Bracket) -> Any:
    """(start, end) of a complete bracket on the records' clock (`device_anchors`), kept inside the host's
    window (its launch's start to when its end was seen): _WAIT without an anchor yet; None where reading the
    events fails or their times lie far outside that window."""
    seen = bracket.seen
    if seen is None:
        return _WAIT
    try:
        times = anchors.times(bracket.device, bracket.host_start, bracket.starts, bracket.ends)
    except Exception:
        _logger.debug("otel_kvtransfer could not read a timing event", exc_info=True)
        return None
    if times is None:
        return _WAIT
    start, end = times
    if start < bracket.host_start - IMPLAUSIBLE_NS or end > seen + IMPLAUSIBLE_NS:
        _logger.debug("otel_kvtransfer: device times %d..%d outside the host's window %d..%d", start, end,
                      bracket.host_start, seen)
        return None
    # The work began after its launch did and had ended when the query saw it: within the anchor's error,
    # clamping moves the times towards the truth.
    start = min(max(start, bracket.host_start), seen)
    return start, min(max(end, start), seen)


# --- the process's clocks ----------------------------------------------------------------------------------------

_clocks: dict[str, Optional[DeviceClock]] = {}  # device type -> its clock, or None: no such device in this process
_stand_ins: dict[str, tuple[DeviceModule, dict[str, Any]]] = {}  # device type -> (module, options) given by
# use_device_module
_live: list[DeviceClock] = []  # the clocks made, for settle()


def _device_type(device: object) -> Optional[str]:
    if device is None:
        return None
    name = str(getattr(device, "type", device))
    return name.split(":", 1)[0].strip().lower() or None


def _module_for(kind: str) -> Optional[DeviceModule]:
    """torch's module for this device type, when the engine imported torch and the device is there."""
    if kind in _stand_ins:
        return _stand_ins[kind][0]
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    module = getattr(torch, kind, None)
    try:
        return module if module is not None and module.is_available() else None
    except Exception:
        return None


def for_device(device: object) -> Optional[DeviceClock]:
    """This process's clock for a framework's device ("cuda", "cuda:1", a torch.device); None where the forward's
    times stay the host's: a CPU forward, another device type, no torch imported by the engine, no device."""
    kind = _device_type(device)
    if kind not in DEVICE_TYPES:
        return None
    try:
        return _clocks[kind]
    except KeyError:
        pass
    if kind not in _stand_ins and "torch" not in sys.modules:
        return None  # asked again once the engine has imported torch
    module = _module_for(kind)
    clock = None
    if module is not None:
        clock = DeviceClock(module, **(_stand_ins.get(kind, (None, {}))[1]))
        _live.append(clock)
    _clocks[kind] = clock
    return clock


def use_device_module(module: Optional[DeviceModule], kind: str = "cuda", **options: Any) -> Optional[DeviceClock]:
    """Time this process's `kind` forwards on `module` (torch.cuda-shaped: Event(enable_timing=True) with
    record(stream) / query() / elapsed_time(), Stream(device=...), current_stream(), is_available()) instead of
    torch's; `options` go to DeviceClock (poll_s, give_up_s, max_pending). None puts torch's back. The clock made
    before for `kind` is closed. Returns the new clock (None for module None)."""
    old = _clocks.pop(kind, None)
    if old is not None:
        old.close()
        _live.remove(old)
    if module is None:
        _stand_ins.pop(kind, None)
        return None
    _stand_ins[kind] = (module, dict(options))
    return for_device(kind)


def settle(key: records.Key) -> None:
    """A request ends: what its device brackets still hold is recorded now, before its end record. Never raises:
    the end record comes after it whatever the device does."""
    for clock in tuple(_live):
        try:
            clock.settle(key)
        except Exception:
            RECORDER.drop("wrapper_error")
            _logger.debug("otel_kvtransfer could not settle a request's device compute", exc_info=True)


def _forget_after_fork() -> None:
    # The resolver thread does not survive a fork, and a forked child cannot use its parent's CUDA context.
    _clocks.clear()
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
