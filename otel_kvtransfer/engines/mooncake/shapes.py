"""0.3.14's other shapes of the same transfers (integer arrays, a pages table), and the CUDA stream's calls.

Their bytes and descriptors are exact, read without a copy. Arrays and pages tables are counted on the calling
thread once the call returned: a caller may well refill the same arrays for its next call (not having to build
them per call is what they are for), so a reference kept for the builder could read the next call's lengths.
numpy sums an array of thousands in a few microseconds; a pages table's lengths are one column of F rows (F
fields, a few to a few hundred). Scatter lists (scatter.py) are summed the same way: a scatter's caller may refill
its lists before it drains the ticket, so the send's bytes are read as the call returns, never later.
"""

from time import monotonic_ns
from typing import Any, Dict, Tuple

from otel_kvtransfer import semconv
from otel_kvtransfer.engines.mooncake.calls import (
    Count,
    Method,
    call_of,
    deliver,
    emit,
    in_progress,
    in_progress_at_peer,
)
from otel_kvtransfer.engines.mooncake.methods import NIC_HINT_AT
from otel_kvtransfer.recording import clock, inflight, integration
from otel_kvtransfer.recording.patching import own_error, recording_context, safely
from otel_kvtransfer.recording.records import CALL_EXTRA


def array_total(array: Any) -> Tuple[int, int]:
    """(sum, count) of a contiguous 8-byte integer array, where it lies: numpy's own sum for a numpy array, else
    the values of its buffer through a memoryview (array.array, a memoryview: rare, and a Python loop)."""
    size = getattr(array, "size", None)
    if type(size) is int:  # numpy (its size is a Python int; a torch tensor's is a method, and has no buffer)
        total = int(array.sum())
        # numpy's integer sum wraps (an unsigned -1 and 4,096 sum to 4,095); its float sum does not: where they
        # part, the exact sum, for the builder to count and clamp
        if abs(float(array.sum(dtype=float)) - total) > 1e-6 * abs(total) + 1.0:
            total = sum(array.tolist())
        return total, size
    view = memoryview(array)
    values = view.cast("B").cast("Q" if view.format in ("Q", "L", "<Q", "=Q") and view.itemsize == 8 else "q")
    return sum(values), len(values)


def arrays_count(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[int, int]:
    """(bytes, descriptors) of an *_arrays call: its lengths array, summed."""
    return array_total(args[3] if len(args) > 3 else kwargs["lengths"])


_EIGHT_BYTE_INTEGERS = frozenset("qQlL")


def pages_count(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[int, int]:
    """(bytes, descriptors) of a *_pages call. `fields` is a C-contiguous [F, 5] table of (src_base, src_stride,
    dst_base, dst_stride, length) rows and the engine makes descriptor (f, i) of `length` bytes for every field f
    and page i: pages x the fields' lengths summed, in pages x F descriptors (checked at the receiver by
    tests/engines/test_mooncake_cuda13.py)."""
    pages = memoryview(args[1] if len(args) > 1 else kwargs["src_pages"]).nbytes >> 3
    fields = memoryview(args[3] if len(args) > 3 else kwargs["fields"])
    table = fields.cast("B").cast("q")
    if fields.format.lstrip("@=<") not in _EIGHT_BYTE_INTEGERS or fields.itemsize != 8:  # a float table's bits
        return -1, pages * (len(table) // 5)  # are no lengths: counted by the builder as invalid_length
    return pages * sum(table[4::5]), pages * (len(table) // 5)


def counted(original: Method, op: str, count: Count, nic_at: int) -> Method:
    """A sync call whose lengths come as arrays or a pages table: timed as `sync.general`'s calls, its bytes and
    descriptors from `count(args, kwargs)` once it returned (see above). A family of its own, so the common sync
    call stays as it is."""
    thread, base, now = integration.THREAD, clock.BASE, recording_context

    def transfer(self: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = now()
        if ctx is None:
            return original(self, *args, **kwargs)
        scope = thread.scope
        start = monotonic_ns() + base
        try:
            rc = original(self, *args, **kwargs)
        except BaseException as exc:
            safely("record a failed Mooncake call", deliver, self, args, kwargs, op, True, start, None,
                   type(exc).__qualname__, ctx, nic_at, count)
            raise
        end = monotonic_ns() + base
        try:
            emit(scope, ctx, call_of(self, args, kwargs, op, True, start, end, rc,
                                     None if rc == 0 else "transfer_failed", nic_at, count))
        except Exception:
            own_error("record a Mooncake call")
        return rc

    inflight.register_wrapper(transfer.__code__, in_progress_at_peer)
    return transfer


def on_stream(original: Method, op: str, batch: bool) -> Method:
    """A `*_on_cuda` call: it queues the transfer on the caller's CUDA stream and returns None (it raises when it
    cannot); Mooncake moves the bytes when the stream gets there, in a driver callback where no Python runs (and
    ends the process if that transfer fails). Its send is the moment it was queued, a send of no duration (so it
    claims no throughput and no busy time) with exact bytes and descriptors, `kv_transfer.post_s` the time inside
    the call."""
    thread, now = integration.THREAD, recording_context
    nic_at = NIC_HINT_AT["transfer_write_on_cuda"]

    def transfer(self: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = now()
        if ctx is None:
            return original(self, *args, **kwargs)
        scope = thread.scope
        start = clock.now_ns()
        try:
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            safely("record a failed Mooncake call", deliver, self, args, kwargs, op, batch, start, None,
                   type(exc).__qualname__, ctx, nic_at)
            raise
        end = clock.now_ns()
        try:
            call = call_of(self, args, kwargs, op, batch, end, end, None, None, nic_at)
            posted = {semconv.POST_S: (end - start) / 1e9}
            extra = call[CALL_EXTRA]
            emit(scope, ctx, call[:CALL_EXTRA] + ({**extra, **posted} if extra else posted,))
        except Exception:
            own_error("record a Mooncake call")
        return result

    inflight.register_wrapper(transfer.__code__, in_progress)  # the classic arguments: its bytes are readable
    return transfer
