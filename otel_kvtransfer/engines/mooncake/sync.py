"""The sync calls' wrappers: one transfer each, timed around the engine's call.

The common call (four positional arguments, the op known from the method: how sglang and vLLM call it) takes them
as positional-only parameters and passes them on as they came, parsed and handed over inline, with no further
Python frame: packing and unpacking *args and **kwargs made a tuple and a dict per call, both ways, a quarter of
the wrapper's cost (wrapper_floor.py in bench/). Everything it uses is a local of its closure, its guard "record
now?" written out. Its records are `records.call` and `records.raw_monotonic` written out (a call to either would
be one more Python frame per transfer), as the recorder's contract lets it hand one over (`Recorder.queue`):
tests/project/test_backend_contract.py checks that each is what those constructors build. Per call it does only
what the call needs: the two clock readings as they are (a raw call's record takes them so, RAW_MONOTONIC), a
batch's lengths summed here (as vLLM's own statistics do: a list kept by reference would cost the recorder's
thread twice that to pickle, and keep the record in the GC's sight until then), the thread's transfer scope read
only while some thread is in one, the engine's transport in the form of the last engine's calls
(`forms.last_engine`).
Any other call (keywords, more or fewer arguments) goes to `general`'s wrapper with the very arguments it was
given; transfer_sync and batch_transfer_sync (their opcode to read) always do.
"""

from time import monotonic_ns
from typing import Any, Dict, Optional, Tuple

from otel_kvtransfer.engines.mooncake import forms
from otel_kvtransfer.engines.mooncake.calls import (
    UNSET,
    General,
    Method,
    call_of,
    deliver,
    in_progress,
    in_progress_monotonic,
)
from otel_kvtransfer.engines.mooncake.methods import BACKEND
from otel_kvtransfer.recording import clock, inflight, integration, records
from otel_kvtransfer.recording.patching import (
    SUPPRESS_KEY,
    SUPPRESS_KEY_PLAIN,
    current_context,
    own_error,
    recording_context,
    safely,
)
from otel_kvtransfer.recording.recorder import RECORDER
from otel_kvtransfer.recording.records import RAW_MONOTONIC, RawMonotonic


def wrap(original: Method, op: Optional[str], batch: bool, nic_at: int = 5) -> Method:
    """The wrapper of a sync call: `common` for the common call when the method says its op, else `general`."""
    fallback = general(original, op, batch, nic_at)  # any other call
    if op is None:
        def any_call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return fallback(self, args, kwargs)

        return any_call
    transfer = common(original, op, batch, fallback)
    inflight.register_wrapper(transfer.__code__, in_progress_monotonic)
    return transfer


def common(original: Method, op: str, batch: bool, fallback: General) -> Method:
    """The common call of the sync calls whose op is known: one descriptor, or a batch's lists (module docstring)."""
    recorder, context, thread, base, unset, entered, last, forms_of, suppress, suppress_plain, at = (
        RECORDER, current_context, integration.THREAD, clock.BASE, UNSET, integration.ENTERED, forms.last_engine,
        forms.forms_of, SUPPRESS_KEY, SUPPRESS_KEY_PLAIN, forms.FORM_AT[op])

    def transfer(self: Any, target_hostname: Any = unset, buffer: Any = unset, peer_buffer_address: Any = unset,
                 length: Any = unset, /, *rest: Any, **kwargs: Any) -> Any:
        if rest or kwargs or length is unset:
            given = tuple(arg for arg in (target_hostname, buffer, peer_buffer_address, length) if arg is not unset)
            return fallback(self, given + rest, kwargs)
        if not recorder.active:  # the guard, written out
            return original(self, target_hostname, buffer, peer_buffer_address, length)
        ctx = context()
        if ctx and (ctx.get(suppress) or ctx.get(suppress_plain)):  # inside suppress_instrumentation()
            return original(self, target_hostname, buffer, peer_buffer_address, length)
        scope = thread.scope if entered[0] else None  # read before the call: inflight.py reads it from this frame
        start = monotonic_ns()  # on the records' clock once clock.BASE is added (the builder adds it)
        try:
            rc = original(self, target_hostname, buffer, peer_buffer_address, length)
        except BaseException as exc:
            safely("record a failed Mooncake call", deliver, self, (target_hostname, buffer, peer_buffer_address,
                   length), {}, op, batch, start + base, None, type(exc).__qualname__, ctx)
            raise
        end = monotonic_ns()
        try:
            if batch:  # `length` is the batch's list of lengths
                descriptors, nbytes = len(length), sum(length)
            else:
                descriptors, nbytes = 1, length
            if type(nbytes) is not int:  # e.g. a numpy integer; int() itself costs a tenth of the wrapper
                nbytes = int(nbytes)
            forms_now = last[0]
            form: records.Form = (forms_now if forms_now[0]() is self else forms_of(self))[at]
            if scope is not None:  # records.call(...), written out
                scope.calls.append((start + base, end + base, nbytes, descriptors, op, target_hostname, form[1], rc,
                                    None if rc == 0 else "transfer_failed", BACKEND, form[3]))
            elif recorder.active:  # records.raw_monotonic(...), written out
                rec: RawMonotonic = (RAW_MONOTONIC, start, end, nbytes, descriptors, target_hostname, rc, form,
                                     ctx or None)
                queue = recorder.queue
                if len(queue) < recorder.capacity and not recorder.idle:
                    queue.append(rec)  # Recorder.record's common case, as its contract allows
                else:
                    recorder.record(rec)
        except Exception:
            own_error("record a Mooncake call")
        return rc

    return transfer


def general(original: Method, op: Optional[str], batch: bool, nic_at: int) -> General:
    """The sync wrapper for any call but the common one: its arguments parsed by `calls.call_of`."""
    recorder, thread, base, now = RECORDER, integration.THREAD, clock.BASE, recording_context

    def general_call(self: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        ctx = now()
        if ctx is None:
            return original(self, *args, **kwargs)
        scope = thread.scope
        start = monotonic_ns() + base
        try:
            rc = original(self, *args, **kwargs)
        except BaseException as exc:
            safely("record a failed Mooncake call", deliver, self, args, kwargs, op, batch, start, None,
                   type(exc).__qualname__, ctx, nic_at)
            raise
        end = monotonic_ns() + base
        try:
            call = call_of(self, args, kwargs, op, batch, start, end, rc, None if rc == 0 else "transfer_failed",
                           nic_at)
            if scope is not None:
                scope.calls.append(call)
            elif recorder.active:
                recorder.record(records.raw_call(call, ctx))
        except Exception:
            own_error("record a Mooncake call")
        return rc

    inflight.register_wrapper(general_call.__code__, in_progress)
    return general_call
