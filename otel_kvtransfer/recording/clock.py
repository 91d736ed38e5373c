"""The one clock of every record: monotonic, read on a wall-clock basis.

A record's time is `monotonic_ns() + BASE`, where BASE is the wall clock minus the monotonic clock when this module
was imported. So every duration (end - start of one send, busy time, a request's length) is a monotonic measure,
never negative however the wall clock steps (NTP, an operator, a resumed VM), and the values are still Unix-epoch
nanoseconds that spans carry as they are: taking one costs the engine thread what `time.time_ns()` did.

After a step, spans keep the basis they started with: they stay consistent with each other and their durations
exact, and differ from the wall clock by the step. Times a framework hands over (the integration API's start_ns /
end_ns, compute intervals) may come from `time.time_ns()` or from `now_ns()`: `from_wall` brings them onto this
clock. Until the wall clock steps both read the same and nothing changes; after a step, a time nearer the wall
clock than this one was read on the wall clock after the step, and the step is taken off it (so a compute interval
read before and after a step stays in order). That costs two clock reads on that framework call, never on an
engine call; the recorder's thread measures the step too, once per scan.

The builder process uses its engine process's BASE (given in its environment), so times it takes itself (an
evicted span's end, a stuck item's age) are on the same clock as the records it reads.
"""

import os
from time import monotonic_ns, time_ns
from typing import SupportsInt

BASE_ENV = "OTEL_KVTRANSFER_CLOCK_BASE_NS"  # set in the builder process's environment by its engine process
STEP_NS = 1_000_000  # a change of (wall - this clock) below this is the jitter of reading two clocks, not a step
_MAX_INHERITED_SKEW_NS = 86_400 * 10**9  # an inherited BASE further than this from our own is not believed


def _base() -> int:
    own = time_ns() - monotonic_ns()
    raw = os.environ.get(BASE_ENV, "")
    if raw.strip().lstrip("-").isdigit() and len(raw) < 24:
        inherited = int(raw)
        if abs(inherited - own) <= _MAX_INHERITED_SKEW_NS:
            return inherited
    return own


BASE = _base()
_step = [0]  # wall clock - this clock, as of the last refresh that saw it move by STEP_NS or more


def now_ns() -> int:
    """Now, on the records' clock. The hot paths inline it: `monotonic_ns() + BASE`."""
    return monotonic_ns() + BASE


def refresh() -> int:
    """Measure how far the wall clock has stepped from this clock since import (off the hot path); the value is
    kept while it moves by less than STEP_NS, so a wall time converted twice converts the same."""
    return _measure(monotonic_ns() + BASE)


def _measure(now: int) -> int:
    measured = time_ns() - now
    if abs(measured - _step[0]) >= STEP_NS:
        _step[0] = measured
    return _step[0]


def from_wall(ns: SupportsInt) -> int:
    """A framework's time (from `time.time_ns()` or `now_ns()`, taken recently) on the records' clock."""
    ns = int(ns)
    now = monotonic_ns() + BASE
    step = _measure(now)
    if step and abs(ns - (now + step)) < abs(ns - now):  # nearer the wall clock: read on it, after the step
        return ns - step
    return ns


def environment() -> dict[str, str]:
    """What a builder process needs in its environment to read this process's clock."""
    return {BASE_ENV: str(BASE)}
