"""The async calls' wrappers: a submission is one transfer from submit until its completion is observed through
`transfer_check_status` or `get_batch_transfer_status` (`pending.PendingTransfers`, the table here), so its
duration is the real transfer time; the time inside the submitting call is its `kv_transfer.post_s`.

The common submission (four positional arguments, the op known from the method) is taken as `sync.common` takes
the common sync call: its guard written out, parsed and put in the pending table inline, no Python frame in
between; where the package was built with its compiled part (`compiled.py`), the common submission and the common
wait run there, and every other call goes to the Python wrapper here, which stays the reference.
"""

from time import monotonic_ns
from typing import Any, Dict, Optional, Tuple

from otel_kvtransfer.engines.mooncake import compiled, forms
from otel_kvtransfer.engines.mooncake.calls import UNSET, Count, General, Method, call_of, deliver
from otel_kvtransfer.engines.mooncake.methods import BACKEND
from otel_kvtransfer.recording import clock, integration, records
from otel_kvtransfer.recording.patching import (
    SUPPRESS_KEY,
    SUPPRESS_KEY_PLAIN,
    current_context,
    own_error,
    recording_context,
)
from otel_kvtransfer.recording.pending import Entry, PendingTransfers
from otel_kvtransfer.recording.recorder import RECORDER
from otel_kvtransfer.recording.records import (
    CALL_BYTES,
    CALL_DESCRIPTORS,
    CALL_EXTRA,
    CALL_OP,
    CALL_PEER,
    CALL_PROTOCOL,
)

pending = PendingTransfers(BACKEND)  # (id(engine), batch id) -> what its submission knew, until its end is seen


def wrap(original: Method, op: Optional[str], batch: bool, nic_at: int = 5, count: Optional[Count] = None) -> Method:
    """The wrapper of a submission. `count`: (bytes, descriptors) from the arguments of a submission whose lengths
    are an array (see `calls.call_of`)."""
    fallback = general(original, op, batch, nic_at, count)
    if op is None or count is not None:
        def any_submission(self: Any, *args: Any, **kwargs: Any) -> Any:
            return fallback(self, args, kwargs)

        return any_submission
    submit = common(original, op, batch, fallback)

    def refused(engine: Any, target_hostname: Any, buffer: Any, peer_buffer_address: Any, length: Any, start: int,
                batch_id: Any) -> None:
        deliver(engine, (target_hostname, buffer, peer_buffer_address, length), {}, op, batch, start, batch_id,
                "submit_failed")

    # The same common case without a Python frame where the compiled part is chosen; else `submit` itself.
    return compiled.submission(original, submit, refused, pending, forms.FORM_AT[op], batch) or submit


def common(original: Method, op: str, batch: bool, fallback: General) -> Method:
    """The common submission (module docstring)."""
    recorder, context, base, unset, entered = RECORDER, current_context, clock.BASE, UNSET, integration.ENTERED
    last, forms_of, suppress, suppress_plain, at, waiting, table = (
        forms.last_engine, forms.forms_of, SUPPRESS_KEY, SUPPRESS_KEY_PLAIN, forms.FORM_AT[op], pending.entries,
        pending)

    def submit(self: Any, target_hostname: Any = unset, buffer: Any = unset, peer_buffer_address: Any = unset,
               length: Any = unset, /, *rest: Any, **kwargs: Any) -> Any:
        if rest or kwargs or length is unset:
            given = tuple(arg for arg in (target_hostname, buffer, peer_buffer_address, length) if arg is not unset)
            return fallback(self, given + rest, kwargs)
        if not recorder.active:  # the guard, written out
            return original(self, target_hostname, buffer, peer_buffer_address, length)
        ctx = context()
        if ctx and (ctx.get(suppress) or ctx.get(suppress_plain)):  # inside suppress_instrumentation()
            return original(self, target_hostname, buffer, peer_buffer_address, length)
        start = monotonic_ns() + base  # clock.now_ns(), inline
        batch_id = original(self, target_hostname, buffer, peer_buffer_address, length)
        posted = monotonic_ns() + base
        try:
            if not batch_id or batch_id < 0:  # Mooncake answers a failed submission with 0 or -1
                deliver(self, (target_hostname, buffer, peer_buffer_address, length), {}, op, batch, start,
                        batch_id, "submit_failed")
                return batch_id
            if batch:  # `length` is the batch's list of lengths
                descriptors, nbytes = len(length), sum(length)
            else:
                descriptors, nbytes = 1, length
            if type(nbytes) is not int:
                nbytes = int(nbytes)
            forms_now = last[0]
            form: records.Form = (forms_now if forms_now[0]() is self else forms_of(self))[at]
            if entered[0] or len(waiting) >= recorder.settings.max_pending_async:  # a scope's, or a full table
                table.submit((id(self), batch_id), start, nbytes, descriptors, op, target_hostname, form[1],
                             form[3], posted_ns=posted)
            else:  # PendingTransfers.submit's common case, written out (pending.Entry)
                handle = (id(self), batch_id)
                made: Entry = (start, nbytes, descriptors, target_hostname, form, None, ctx or None, posted)
                earlier = waiting.setdefault(handle, made)
                if earlier is not made:  # an id still in the table, given out again
                    table.reused(handle, earlier, made)
        except Exception:
            own_error("record a Mooncake submission")
        return batch_id

    return submit


def general(original: Method, op: Optional[str], batch: bool, nic_at: int, count: Optional[Count]) -> General:
    """The async wrapper for any submission but the common one: its arguments parsed by `calls.call_of`."""
    base, now, submitted = clock.BASE, recording_context, pending.submit

    def general_submit(self: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if now() is None:
            return original(self, *args, **kwargs)
        start = monotonic_ns() + base  # clock.now_ns(), inline
        batch_id = original(self, *args, **kwargs)
        posted = monotonic_ns() + base
        try:
            if not batch_id or batch_id < 0:  # Mooncake answers a failed submission with 0 or -1
                deliver(self, args, kwargs, op, batch, start, batch_id, "submit_failed", None, nic_at, count)
            else:
                call = call_of(self, args, kwargs, op, batch, start, start, None, None, nic_at, count)
                submitted((id(self), batch_id), start, call[CALL_BYTES], call[CALL_DESCRIPTORS], call[CALL_OP],
                          call[CALL_PEER], call[CALL_PROTOCOL], call[CALL_EXTRA], posted_ns=posted)
        except Exception:
            own_error("record a Mooncake submission")
        return batch_id

    return general_submit


def check_status(original: Method) -> Method:
    waiting = pending.entries

    def transfer_check_status(self: Any, *args: Any, **kwargs: Any) -> Any:
        called = clock.now_ns()  # a submission posted after this, under the same id, is not this poll's
        rc = original(self, *args, **kwargs)
        if waiting:
            try:
                batch_id = args[0] if args else next(iter(kwargs.values()))
                # 1 completed, -1 failed (both free the batch id), -2 timed out, 0 still running.
                if rc == 1:
                    pending.complete((id(self), batch_id), rc, None, called)
                elif rc == 0:
                    pending.seen_running((id(self), batch_id))
                elif rc < 0:
                    pending.complete((id(self), batch_id), rc, "timeout" if rc == -2 else "transfer_failed", called)
            except Exception:
                own_error("observe a Mooncake completion")
        return rc

    return transfer_check_status


def batch_status(original: Method) -> Method:
    waiting, complete_all, base = pending.entries, pending.complete_all, clock.BASE

    def completed(self: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], rc: Any, called: int) -> None:
        # `called`: when the wait began; a submission posted after it under the same id is not this wait's
        engine = id(self)
        complete_all([(engine, batch_id) for batch_id in (args[0] if args else next(iter(kwargs.values())))],
                     rc, None if rc == 0 else "transfer_failed", called)

    def get_batch_transfer_status(self: Any, *args: Any, **kwargs: Any) -> Any:
        called = monotonic_ns() + base  # clock.now_ns(), inline
        rc = original(self, *args, **kwargs)  # blocks until the batches complete, fail or time out
        if waiting:
            try:
                completed(self, args, kwargs, rc, called)
            except Exception:
                own_error("observe a Mooncake completion")
        return rc

    # The common wait (one list of ids) ends its sends without a Python frame where the compiled part is chosen;
    # `completed` takes any other.
    return compiled.batch_wait(original, completed, pending) or get_batch_transfer_status
