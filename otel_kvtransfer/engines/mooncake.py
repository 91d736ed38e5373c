"""The Mooncake transfer engine (`mooncake.engine.TransferEngine`): time each transfer call, count its bytes.

Sync calls are one transfer each. An async submission is one transfer from submit until its completion is
observed through `transfer_check_status` or `get_batch_transfer_status` (`pending.PendingTransfers`), so its
duration is the real transfer time; the time inside the submitting call is its `kv_transfer.post_s`. Each
wrapper is a plain function set on the pybind class (the cheapest call path Python has); instrument() patches at
once when `mooncake.engine` is already imported, else when it is.

Mooncake 0.3.14 adds calls that take the same transfers in other shapes, each timed here with the same record:
8-byte integer arrays (`*_arrays`, sync and async), a pages x fields table the engine expands itself (`*_pages`),
and scatter lists (`submit_scatter_*`, `scatter_transfer_sync_*_with_ticket`), whose `ScatterTransferTicket` ends
the send when its `drain()` (or its `status`, `drained`) shows the end, as an async batch's poll does. Every CUDA build
also has the `*_on_cuda` calls, which only queue a transfer on the caller's CUDA stream (`_on_stream`).

`kv_transfer.nic`: the local device the caller named for the call (`nic_hint`, 0.3.14), else the one device the
engine was initialised with; `configured_devices()` lists every device given to initialize() in this process.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from time import monotonic_ns
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, List, Optional, Tuple, cast

from otel_kvtransfer import semconv
from otel_kvtransfer.recording import clock, compiled, inflight, integration, records, untimed
from otel_kvtransfer.recording.patching import (
    SUPPRESS_KEY,
    SUPPRESS_KEY_PLAIN,
    EngineSpec,
    Patch,
    Patcher,
    current_context,
    is_ours,
    own_error,
    safely,
)
from otel_kvtransfer.recording.pending import PendingTransfers
from otel_kvtransfer.recording.recorder import RECORDER
from otel_kvtransfer.recording.records import (
    CALL_BYTES,
    CALL_DESCRIPTORS,
    CALL_EXTRA,
    CALL_OP,
    CALL_PEER,
    CALL_PROTOCOL,
    RAW_MONOTONIC,
)
from otel_kvtransfer.wiring.activation import LazyPatcher

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from otel_kvtransfer.recording.integration import TransferScope

# A TransferEngine method as the class has it, and what replaces it (called with the engine as its first argument).
_Method = Callable[..., Any]
# (bytes, descriptors) read from a call's positional and keyword arguments, for calls whose lengths are no list
_Count = Callable[[Tuple[Any, ...], Dict[str, Any]], Tuple[Any, int]]
# What a send of an engine carries besides its call: (transport, the extra naming its one device, or None)
_Transport = Tuple[Optional[str], Optional[Dict[str, str]]]

_logger = logging.getLogger(__name__)

BACKEND = semconv.BACKEND_MOONCAKE  # SPEC's name (below), a global here because every call tuple carries it
WRITE, READ = semconv.OP_WRITE, semconv.OP_READ

# method -> (op, or None when the opcode argument decides; batch call?)
SYNC_METHODS = {
    "transfer_sync_write": (WRITE, False),
    "transfer_sync_read": (READ, False),
    "transfer_sync": (None, False),
    "batch_transfer_sync_write": (WRITE, True),
    "batch_transfer_sync_read": (READ, True),
    "batch_transfer_sync": (None, True),
}
ASYNC_METHODS = {
    "transfer_submit_write": (WRITE, False),
    "batch_transfer_async_write": (WRITE, True),
    "batch_transfer_async_read": (READ, True),
    "batch_transfer_async": (None, True),
}
# Every transfer method takes (target_hostname, buffer(s), peer address(es), length(s)[, opcode]).
_LENGTH_KW = {False: "length", True: "lengths"}
# 0.3.14: the same (target_hostname, buffers, peer_buffer_addresses, lengths) as contiguous 8-byte integer arrays.
# method -> (op, async?)
ARRAY_METHODS = {
    "batch_transfer_sync_write_arrays": (WRITE, False),
    "batch_transfer_sync_read_arrays": (READ, False),
    "batch_transfer_async_write_arrays": (WRITE, True),
    "batch_transfer_async_read_arrays": (READ, True),
}
# 0.3.14: (target_hostname, src_pages, dst_pages, fields, max_batch_size): a pages x fields table, expanded inside
# the engine into one descriptor per (field, page). method -> op
PAGE_METHODS = {
    "batch_transfer_sync_write_pages": WRITE,
    "batch_transfer_sync_read_pages": READ,
}
# 0.3.14: (endpoint, local bases, local capacities, remote bases, remote capacities, local offsets, remote offsets,
# lengths), the last three a list per base; each answers a ScatterTransferTicket. method -> (op, drained on return?)
SCATTER_METHODS = {
    "submit_scatter_write": (WRITE, False),
    "submit_scatter_read": (READ, False),
    "scatter_transfer_sync_write_with_ticket": (WRITE, True),
    "scatter_transfer_sync_read_with_ticket": (READ, True),
}
# Every CUDA build (only where SUPPORT_CUDA): the classic arguments and a CUDA stream; the call queues the transfer
# on that stream and returns. method -> (op, batch call?)
CUDA_STREAM_METHODS = {
    "transfer_write_on_cuda": (WRITE, False),
    "transfer_read_on_cuda": (READ, False),
    "batch_transfer_write_on_cuda": (WRITE, True),
    "batch_transfer_read_on_cuda": (READ, True),
}
# Where a call takes `nic_hint` positionally (0.3.14; by keyword too): after `transport_hint`, which follows the
# lengths, or the opcode (and a sync call's `notify`), a pages call's `max_batch_size`, a CUDA call's stream.
# tests/engines/test_mooncake_cuda13.py checks every position against the signatures of the real 0.3.14 engine.
NIC_HINT_AT = {
    **dict.fromkeys(("transfer_sync_write", "transfer_sync_read", "batch_transfer_sync_write",
                     "batch_transfer_sync_read", "transfer_submit_write", "batch_transfer_async_write",
                     "batch_transfer_async_read", *ARRAY_METHODS), 5),
    "transfer_sync": 7, "batch_transfer_sync": 7, "batch_transfer_async": 6,
    **dict.fromkeys((*PAGE_METHODS, *CUDA_STREAM_METHODS), 6),
}
# ScatterTransferCompletionStatus values (0.3.14)
SCATTER_COMPLETED, SCATTER_FAILED, SCATTER_UNKNOWN = 0, -1, -2

patcher = Patcher(BACKEND)
_pending = PendingTransfers(BACKEND)
_tickets = PendingTransfers(BACKEND)  # scatter tickets not yet seen ended, by id(ticket)
# id(ticket) -> a weak reference whose callback forgets the ticket when it dies unobserved
_ticket_refs: Dict[int, weakref.ref[Any]] = {}
# the ticket's own `status` getter (an observed ticket's status is read with it), once a ticket class is patched
_ticket_status: Dict[str, Any] = {"read": None}
# id(engine) -> (protocol given to initialize(), the call extra naming its one device, or None): one lookup per call
_engines: Dict[int, _Transport] = {}
# read on the hot path: (transport, extra) of engines initialised before us
_state: Dict[str, _Transport] = {"fallback": (None, None)}
_devices: List[str] = []  # every device given to initialize() in this process, in order (configured_devices())
_hinted: Dict[str, Dict[str, str]] = {}  # nic_hint's name -> its call extra, one constant dict per device named
MAX_DEVICES = 64


def peer_attributes(session: Any) -> Dict[str, Any]:
    """Mooncake's session name 'host:port' -> server.address / server.port."""
    if not isinstance(session, str):
        return {}
    host, sep, port = session.rpartition(":")
    if sep and port.isdigit():
        return {semconv.SERVER_ADDRESS: host.strip("[]")[:256], semconv.SERVER_PORT: int(port)}
    return {semconv.SERVER_ADDRESS: session[:256]}


def _op_of(opcode: Any) -> str:
    name = getattr(opcode, "name", str(opcode))
    return READ if "read" in name.lower() else WRITE


def _call(engine: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], op: Optional[str], batch: bool, start: int,
          end: int, rc: Any, error_type: Optional[str], nic_at: int = 5,
          count: Optional[_Count] = None) -> records.Call:
    """The `records.call` of one transfer call, from its arguments (the sync wrapper's common call writes the same
    record inline: see `_sync`). `nic_at`: where the call takes `nic_hint`; `count(args, kwargs)`: (bytes,
    descriptors) of a call whose lengths are not a list.

    A batch call's lengths are summed here, as the engine was given them: 2,048 of them cost this thread ~10 us,
    where the list kept by reference cost the recorder's thread ~22 us to pickle (and its caller could reuse it
    before then).
    """
    if count is not None:
        session = args[0] if args else kwargs.get("target_hostname")
        lengths, descriptors = count(args, kwargs)
    else:
        if len(args) > 3 and not kwargs:  # how sglang and vLLM call it
            session, lengths = args[0], args[3]
        else:
            session = args[0] if args else kwargs.get("target_hostname")
            lengths = args[3] if len(args) > 3 else kwargs.get(_LENGTH_KW[batch], 0)
        if batch:
            descriptors = len(lengths)
            lengths = sum(lengths)
            if type(lengths) is not int:  # an array's integers
                lengths = int(lengths)
        else:
            lengths, descriptors = int(lengths), 1
    if op is None:
        op = _op_of(args[4] if len(args) > 4 else kwargs.get("opcode"))
    transport, extra = _engines.get(id(engine), _state["fallback"])
    hint = args[nic_at] if len(args) > nic_at else kwargs.get("nic_hint") if kwargs else None
    if hint:
        extra = (_hinted.get(hint) if type(hint) is str else None) or _hint_extra(hint)
    return records.call(start, end, lengths, descriptors, op, session, transport, rc, error_type, BACKEND, extra)


def _hint_extra(hint: Any) -> Dict[str, str]:
    """The call extra of a send whose caller named its device: one constant dict per name (the builder shares a
    shape's attributes between the sends that carry the same dict's items), kept by the name as it is shown, cut:
    never by the caller's object (a hint of a megabyte, or one whose hashing runs code of its own)."""
    name = str(hint)[:64]
    extra = _hinted.get(name)
    if extra is None:
        if len(_hinted) >= 256:  # a host has a few NICs; a caller inventing names costs a new dict each, no more
            _hinted.clear()
        extra = _hinted[name] = {semconv.NIC: name}
    return extra


_UNSET = object()  # an argument the caller did not pass


def _no_engine() -> None:
    return None


# The last engine a common sync call was made on and the forms of its calls (`records.call_form`: op, transport,
# backend, the extra naming its one device, the error of a failed call), as one tuple (a reader never sees one
# engine with another's forms): (weak reference to it, its writes' form, its reads' form). Most processes have one
# engine, and a weak reference's call and an identity test cost a call a tenth of what `_engines.get(id(engine),
# ...)` does; the same form object in every record lets pickle send it once a batch. Set afresh whenever what an
# engine's sends carry may change (initialize(), instrument(), uninstrument()).
_Forms = Tuple[Any, ...]  # (a weak reference to the engine, or _no_engine; its writes' form; its reads' form)
_NO_FORM = records.call_form(WRITE, None, BACKEND, None, "transfer_failed")
_NO_ENGINE: _Forms = (_no_engine, _NO_FORM, _NO_FORM)
_last_engine: List[_Forms] = [_NO_ENGINE]
FORM_AT = {WRITE: 1, READ: 2}  # op -> where a _Forms tuple holds that op's form


def _forms_of(engine: Any) -> _Forms:
    """The forms of `engine`'s writes and reads; the answer kept for the next call (`_last_engine`)."""
    transport, extra = _engines.get(id(engine), _state["fallback"])
    write = records.call_form(WRITE, transport, BACKEND, extra, "transfer_failed")
    read = records.call_form(READ, transport, BACKEND, extra, "transfer_failed")
    try:
        forms = (weakref.ref(engine), write, read)
    except TypeError:  # an engine no weak reference can name (a test's stand-in): looked up every call
        return (_no_engine, write, read)
    _last_engine[0] = forms
    return forms


# The sync wrapper. The common call (four positional arguments, the op known from the method: how sglang and vLLM
# call it) takes them as positional-only parameters and passes them on as they came, parsed and handed over
# inline, with no further Python frame: packing and unpacking *args and **kwargs made a tuple and a dict per call,
# both ways, a quarter of the wrapper's cost (wrapper_floor.py in bench/). Everything it uses is a local of its
# closure. Its records are `records.call` and `records.raw_monotonic` written out (a call to either would be one
# more Python frame per transfer), as the recorder's contract lets it hand one over (`Recorder.queue`):
# tests/project/test_backend_contract.py checks that each is what those constructors build. Per call it does only
# what the call needs: the two clock readings as they are (a raw call's record takes them so, RAW_MONOTONIC), a
# batch's lengths summed here (as vLLM's own statistics do: a list kept by reference would cost the recorder's
# thread twice that to pickle, and keep the record in the GC's sight until then), the thread's transfer
# scope read only while some thread is in one, the engine's transport in the form of the last engine's calls
# (`_last_engine`).
# Any other call (keywords, more or fewer arguments) goes to `_general`'s wrapper with the very arguments it was
# given; transfer_sync and batch_transfer_sync (their opcode to read) always do.
def _sync(original: _Method, op: Optional[str], batch: bool, nic_at: int = 5) -> _Method:
    general = _general(original, op, batch, nic_at)  # any other call
    if op is None:
        def any_call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return general(self, args, kwargs)

        return any_call
    transfer = _common(original, op, batch, general)
    inflight.register_wrapper(transfer.__code__, _in_progress_monotonic)
    return transfer


def _common(original: _Method, op: str, batch: bool,
            general: Callable[[Any, Tuple[Any, ...], Dict[str, Any]], Any]) -> _Method:
    """The common call of the sync calls whose op is known (`_sync`): one descriptor, or a batch's lists."""
    recorder, context, thread, base, unset, entered = (RECORDER, current_context, integration.THREAD, clock.BASE,
                                                       _UNSET, integration.ENTERED)
    last, suppress, suppress_plain, at = _last_engine, SUPPRESS_KEY, SUPPRESS_KEY_PLAIN, FORM_AT[op]

    def transfer(self: Any, target_hostname: Any = unset, buffer: Any = unset, peer_buffer_address: Any = unset,
                 length: Any = unset, /, *rest: Any, **kwargs: Any) -> Any:
        if rest or kwargs or length is unset:
            given = tuple(arg for arg in (target_hostname, buffer, peer_buffer_address, length) if arg is not unset)
            return general(self, given + rest, kwargs)
        if not recorder.active:
            return original(self, target_hostname, buffer, peer_buffer_address, length)
        ctx = context()
        if ctx and (ctx.get(suppress) or ctx.get(suppress_plain)):  # inside suppress_instrumentation()
            return original(self, target_hostname, buffer, peer_buffer_address, length)
        scope = thread.scope if entered[0] else None  # read before the call: inflight.py reads it from this frame
        start = monotonic_ns()  # on the records' clock once clock.BASE is added (the builder adds it)
        try:
            rc = original(self, target_hostname, buffer, peer_buffer_address, length)
        except BaseException as exc:
            safely("record a failed Mooncake call", _deliver, self, (target_hostname, buffer, peer_buffer_address,
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
            forms = last[0]
            if forms[0]() is not self:
                forms = _forms_of(self)
            form: records.Form = forms[at]
            if scope is not None:  # records.call(...), written out
                scope.calls.append((start + base, end + base, nbytes, descriptors, op, target_hostname, form[1], rc,
                                    None if rc == 0 else "transfer_failed", BACKEND, form[3]))
            elif recorder.active:  # records.raw_monotonic(...), written out
                rec = (RAW_MONOTONIC, start, end, nbytes, descriptors, target_hostname, rc, form, ctx or None)
                queue = recorder.queue
                if len(queue) < recorder.capacity and not recorder.idle:
                    queue.append(rec)  # Recorder.record's common case, as its contract allows
                else:
                    recorder.record(rec)
        except Exception:
            own_error("record a Mooncake call")
        return rc

    return transfer


def _general(original: _Method, op: Optional[str], batch: bool,
             nic_at: int) -> Callable[[Any, Tuple[Any, ...], Dict[str, Any]], Any]:
    """The sync wrapper for any call but the common one: its arguments parsed by `_call`."""
    recorder, context, thread, base = RECORDER, current_context, integration.THREAD, clock.BASE
    suppress, suppress_plain = SUPPRESS_KEY, SUPPRESS_KEY_PLAIN

    def general(self: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if not recorder.active:
            return original(self, *args, **kwargs)
        ctx = context()
        if ctx and (ctx.get(suppress) or ctx.get(suppress_plain)):
            return original(self, *args, **kwargs)
        scope = thread.scope
        start = monotonic_ns() + base
        try:
            rc = original(self, *args, **kwargs)
        except BaseException as exc:
            safely("record a failed Mooncake call", _deliver, self, args, kwargs, op, batch, start, None,
                   type(exc).__qualname__, ctx, nic_at)
            raise
        end = monotonic_ns() + base
        try:
            call = _call(self, args, kwargs, op, batch, start, end, rc, None if rc == 0 else "transfer_failed",
                         nic_at)
            if scope is not None:
                scope.calls.append(call)
            elif recorder.active:
                recorder.record(records.raw_call(call, ctx))
        except Exception:
            own_error("record a Mooncake call")
        return rc

    inflight.register_wrapper(general.__code__, _in_progress)
    return general


def _in_progress(frame_locals: Dict[str, Any]) -> Optional[inflight.Item]:
    """A sync call still inside the engine, from its wrapper's frame (inflight.py): None before it started."""
    start = frame_locals.get("start")
    if start is None or "end" in frame_locals:  # not started yet, or already returned
        return None
    args = frame_locals.get("args") or ()
    if len(args) < 4 and frame_locals.get("kwargs"):  # the peer or the length(s) given by keyword
        kwargs = frame_locals["kwargs"]
        args = (args[0] if args else kwargs.get("target_hostname"), None, None,
                kwargs.get("length", kwargs.get("lengths")))
    return inflight.describe_call(start, frame_locals.get("scope"), args, BACKEND)


_POSITIONS = ("target_hostname", "buffer", "peer_buffer_address", "length")  # the common call's parameters


def _in_progress_monotonic(frame_locals: Dict[str, Any]) -> Optional[inflight.Item]:
    """`_in_progress` of a common call's frame: its `start` read from monotonic_ns(), brought onto the records'
    clock here; its four arguments by name."""
    start = frame_locals.get("start")
    if start is None or "end" in frame_locals:
        return None
    args = tuple(frame_locals.get(name) for name in _POSITIONS)
    return inflight.describe_call(start + clock.BASE, frame_locals.get("scope"), args, BACKEND)


def _deliver(engine: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], op: Optional[str], batch: bool, start: int,
             rc: Any, error_type: Optional[str], context: Optional[Context] = None, nic_at: int = 5,
             count: Optional[_Count] = None) -> None:
    """A call that failed (raised, or refused a submission), ending now."""
    integration.deliver(_call(engine, args, kwargs, op, batch, start, clock.now_ns(), rc, error_type, nic_at, count),
                        context)


def _async(original: _Method, op: Optional[str], batch: bool, nic_at: int = 5,
           count: Optional[_Count] = None) -> _Method:
    # `count`: (bytes, descriptors) from the arguments of a submission whose lengths are an array (see _call).
    general = _general_async(original, op, batch, nic_at, count)
    if op is None or count is not None:
        def any_submission(self: Any, *args: Any, **kwargs: Any) -> Any:
            return general(self, args, kwargs)

        return any_submission
    return _common_async(original, op, batch, general)


def _common_async(original: _Method, op: str, batch: bool,
                  general: Callable[[Any, Tuple[Any, ...], Dict[str, Any]], Any]) -> _Method:
    """The common submission (four positional arguments, the op known from the method), as `_common` takes the
    common sync call: parsed and put in the pending table inline, no Python frame in between."""
    recorder, context, base, unset, entered = RECORDER, current_context, clock.BASE, _UNSET, integration.ENTERED
    last, suppress, suppress_plain, at, waiting = _last_engine, SUPPRESS_KEY, SUPPRESS_KEY_PLAIN, FORM_AT[op], \
        _pending.entries

    def submit(self: Any, target_hostname: Any = unset, buffer: Any = unset, peer_buffer_address: Any = unset,
               length: Any = unset, /, *rest: Any, **kwargs: Any) -> Any:
        if rest or kwargs or length is unset:
            given = tuple(arg for arg in (target_hostname, buffer, peer_buffer_address, length) if arg is not unset)
            return general(self, given + rest, kwargs)
        if not recorder.active:
            return original(self, target_hostname, buffer, peer_buffer_address, length)
        ctx = context()
        if ctx and (ctx.get(suppress) or ctx.get(suppress_plain)):  # inside suppress_instrumentation()
            return original(self, target_hostname, buffer, peer_buffer_address, length)
        start = monotonic_ns() + base  # clock.now_ns(), inline
        batch_id = original(self, target_hostname, buffer, peer_buffer_address, length)
        posted = monotonic_ns() + base
        try:
            if not batch_id or batch_id < 0:  # Mooncake answers a failed submission with 0 or -1
                _deliver(self, (target_hostname, buffer, peer_buffer_address, length), {}, op, batch, start,
                         batch_id, "submit_failed")
                return batch_id
            if batch:  # `length` is the batch's list of lengths
                descriptors, nbytes = len(length), sum(length)
            else:
                descriptors, nbytes = 1, length
            if type(nbytes) is not int:
                nbytes = int(nbytes)
            forms = last[0]
            if forms[0]() is not self:
                forms = _forms_of(self)
            form: records.Form = forms[at]
            if entered[0] or len(waiting) >= recorder.settings.max_pending_async:  # a scope's, or a full table
                _pending.submit((id(self), batch_id), start, nbytes, descriptors, op, target_hostname, form[1],
                                form[3], posted_ns=posted)
            else:  # PendingTransfers.submit's common case, written out
                handle, entry = (id(self), batch_id), (start, nbytes, descriptors, target_hostname, form, None,
                                                       ctx or None, posted)
                earlier = waiting.setdefault(handle, entry)
                if earlier is not entry:  # an id still in the table, given out again
                    _pending.reused(handle, earlier, entry)
        except Exception:
            own_error("record a Mooncake submission")
        return batch_id

    built = compiled.chosen()
    if built is None:
        return submit

    def refused(engine: Any, target_hostname: Any, buffer: Any, peer_buffer_address: Any, length: Any, start: int,
                batch_id: Any) -> None:
        _deliver(engine, (target_hostname, buffer, peer_buffer_address, length), {}, op, batch, start, batch_id,
                 "submit_failed")

    # The same common case without a Python frame; every other call goes to `submit` before the engine is called.
    return cast(_Method, built.Submission(
        original, submit, refused, own_error, recorder, context, integration.ENTERED, last, waiting, _pending.reused,
        suppress, suppress_plain, base, at, batch))


def _general_async(original: _Method, op: Optional[str], batch: bool, nic_at: int,
                   count: Optional[_Count]) -> Callable[[Any, Tuple[Any, ...], Dict[str, Any]], Any]:
    """The async wrapper for any submission but the common one: its arguments parsed by `_call`."""
    recorder, context, base = RECORDER, current_context, clock.BASE
    suppress, suppress_plain, submitted = SUPPRESS_KEY, SUPPRESS_KEY_PLAIN, _pending.submit

    def general_submit(self: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if not recorder.active:
            return original(self, *args, **kwargs)
        ctx = context()
        if ctx and (ctx.get(suppress) or ctx.get(suppress_plain)):  # inside suppress_instrumentation()
            return original(self, *args, **kwargs)
        start = monotonic_ns() + base  # clock.now_ns(), inline
        batch_id = original(self, *args, **kwargs)
        posted = monotonic_ns() + base
        try:
            if not batch_id or batch_id < 0:  # Mooncake answers a failed submission with 0 or -1
                _deliver(self, args, kwargs, op, batch, start, batch_id, "submit_failed", None, nic_at, count)
            else:
                call = _call(self, args, kwargs, op, batch, start, start, None, None, nic_at, count)
                submitted((id(self), batch_id), start, call[CALL_BYTES], call[CALL_DESCRIPTORS], call[CALL_OP],
                          call[CALL_PEER], call[CALL_PROTOCOL], call[CALL_EXTRA], posted_ns=posted)
        except Exception:
            own_error("record a Mooncake submission")
        return batch_id

    return general_submit


def _check_status(original: _Method) -> _Method:
    waiting = _pending.entries

    def transfer_check_status(self: Any, *args: Any, **kwargs: Any) -> Any:
        called = clock.now_ns()  # a submission posted after this, under the same id, is not this poll's
        rc = original(self, *args, **kwargs)
        if waiting:
            try:
                batch_id = args[0] if args else next(iter(kwargs.values()))
                # 1 completed, -1 failed (both free the batch id), -2 timed out, 0 still running.
                if rc == 1:
                    _pending.complete((id(self), batch_id), rc, None, called)
                elif rc == 0:
                    _pending.seen_running((id(self), batch_id))
                elif rc < 0:
                    _pending.complete((id(self), batch_id), rc, "timeout" if rc == -2 else "transfer_failed",
                                      called)
            except Exception:
                own_error("observe a Mooncake completion")
        return rc

    return transfer_check_status


def _batch_status(original: _Method) -> _Method:
    waiting, complete_all, base = _pending.entries, _pending.complete_all, clock.BASE

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

    built = compiled.chosen()
    if built is None:
        return get_batch_transfer_status
    # The common wait (one list of ids) ends its sends without a Python frame; `completed` takes any other.
    return cast(_Method, built.BatchWait(original, completed, _pending.ended, _pending.reclaim, own_error, RECORDER,
                                         waiting, _pending.running_seen, records.RAW_ASYNC, base))


# --- 0.3.14's other shapes of the same transfers, and the CUDA stream's calls -------------------------------------
# Their bytes and descriptors are exact, read without a copy. Arrays and pages tables are counted on the calling
# thread once the call returned: a caller may well refill the same arrays for its next call (not having to build
# them per call is what they are for), so a reference kept for the builder could read the next call's lengths.
# numpy sums an array of thousands in a few microseconds; a pages table's lengths are one column of F rows (F
# fields, a few to a few hundred). Scatter lists are summed the same way: a scatter's caller may refill its lists
# before it drains the ticket, so the send's bytes are read as the call returns, never later.


def _array_total(array: Any) -> Tuple[int, int]:
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


def _arrays_count(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[int, int]:
    """(bytes, descriptors) of an *_arrays call: its lengths array, summed."""
    return _array_total(args[3] if len(args) > 3 else kwargs["lengths"])


_EIGHT_BYTE_INTEGERS = frozenset("qQlL")


def _pages_count(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[int, int]:
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


def _scatter_count(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[int, int]:
    """(bytes, descriptors) of a scatter call: its length lists summed as it returns; one descriptor per length."""
    lengths = args[7] if len(args) > 7 else kwargs["lengths"]
    return sum(map(sum, lengths)), sum(map(len, lengths))


def _emit(scope: Optional[TransferScope], context: Optional[Context], call: records.Call) -> None:
    """One finished call: into the thread's transfer scope, else a raw send of its own (as `_sync` does inline)."""
    if scope is not None:
        scope.calls.append(call)
    elif RECORDER.active:
        RECORDER.record(records.raw_call(call, context))


def _counted(original: _Method, op: str, count: _Count, nic_at: int) -> _Method:
    """A sync call whose lengths come as arrays or a pages table: timed as `_sync`'s general path, its bytes and
    descriptors from `count(args, kwargs)` once it returned (see above). A family of its own, so `_sync`'s common
    call stays as it is."""
    recorder, context, thread, base = RECORDER, current_context, integration.THREAD, clock.BASE
    suppress, suppress_plain = SUPPRESS_KEY, SUPPRESS_KEY_PLAIN

    def transfer(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not recorder.active:
            return original(self, *args, **kwargs)
        ctx = context()
        if ctx and (ctx.get(suppress) or ctx.get(suppress_plain)):
            return original(self, *args, **kwargs)
        scope = thread.scope
        start = monotonic_ns() + base
        try:
            rc = original(self, *args, **kwargs)
        except BaseException as exc:
            safely("record a failed Mooncake call", _deliver, self, args, kwargs, op, True, start, None,
                   type(exc).__qualname__, ctx, nic_at, count)
            raise
        end = monotonic_ns() + base
        try:
            _emit(scope, ctx, _call(self, args, kwargs, op, True, start, end, rc,
                                    None if rc == 0 else "transfer_failed", nic_at, count))
        except Exception:
            own_error("record a Mooncake call")
        return rc

    inflight.register_wrapper(transfer.__code__, _in_progress_at_peer)
    return transfer


def _on_stream(original: _Method, op: str, batch: bool) -> _Method:
    """A `*_on_cuda` call: it queues the transfer on the caller's CUDA stream and returns None (it raises when it
    cannot); Mooncake moves the bytes when the stream gets there, in a driver callback where no Python runs (and
    ends the process if that transfer fails). Its send is the moment it was queued, a send of no duration (so it
    claims no throughput and no busy time) with exact bytes and descriptors, `kv_transfer.post_s` the time inside
    the call."""
    recorder, context, thread = RECORDER, current_context, integration.THREAD
    suppress, suppress_plain = SUPPRESS_KEY, SUPPRESS_KEY_PLAIN
    nic_at = NIC_HINT_AT["transfer_write_on_cuda"]

    def transfer(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not recorder.active:
            return original(self, *args, **kwargs)
        ctx = context()
        if ctx and (ctx.get(suppress) or ctx.get(suppress_plain)):
            return original(self, *args, **kwargs)
        scope = thread.scope
        start = clock.now_ns()
        try:
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            safely("record a failed Mooncake call", _deliver, self, args, kwargs, op, batch, start, None,
                   type(exc).__qualname__, ctx, nic_at)
            raise
        end = clock.now_ns()
        try:
            call = _call(self, args, kwargs, op, batch, end, end, None, None, nic_at)
            posted = {semconv.POST_S: (end - start) / 1e9}
            extra = call[CALL_EXTRA]
            _emit(scope, ctx, call[:CALL_EXTRA] + ({**extra, **posted} if extra else posted,))
        except Exception:
            own_error("record a Mooncake call")
        return result

    inflight.register_wrapper(transfer.__code__, _in_progress)  # the classic arguments: its bytes are readable
    return transfer


def _scatter(original: _Method, op: str, drained_on_return: bool) -> _Method:
    """A scatter call: it answers a ScatterTransferTicket. A sync call's ticket has drained when it returns (its
    status says how it ended): a sync send. Otherwise (a submission, or a sync call that gave up waiting) the send
    stays pending until the ticket shows its end (`_ticket_drain`), as an async batch's does, with the time inside
    the call as `kv_transfer.post_s`; a ticket that dies unobserved is counted as dropped (`async_released`)."""
    recorder, context, thread = RECORDER, current_context, integration.THREAD
    suppress, suppress_plain = SUPPRESS_KEY, SUPPRESS_KEY_PLAIN

    def scatter(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not recorder.active:
            return original(self, *args, **kwargs)
        ctx = context()
        if ctx and (ctx.get(suppress) or ctx.get(suppress_plain)):
            return original(self, *args, **kwargs)
        scope = thread.scope
        start = clock.now_ns()
        try:
            ticket = original(self, *args, **kwargs)
        except BaseException as exc:
            safely("record a failed Mooncake call", _deliver_scatter, self, args, kwargs, op, start,
                   type(exc).__qualname__, ctx)
            raise
        end = clock.now_ns()
        try:
            _scattered(self, ticket, args, kwargs, op, drained_on_return, start, end, scope, ctx)
        except Exception:
            own_error("record a Mooncake scatter")
        return ticket

    inflight.register_wrapper(scatter.__code__, _in_progress_at_peer)
    return scatter


_SCATTER_ARGUMENTS = 8  # a scatter call takes eight and no nic_hint: `_call` finds none past them


def _scatter_call(engine: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], op: str, start: int, end: int, rc: Any,
                  error_type: Optional[str]) -> records.Call:
    call = _call(engine, args, kwargs, op, True, start, end, rc, error_type, _SCATTER_ARGUMENTS, _scatter_count)
    if not args:  # the peer by keyword: a scatter call names it `endpoint`
        call = call[:CALL_PEER] + (kwargs.get("endpoint"),) + call[CALL_PEER + 1:]
    return call


def _deliver_scatter(engine: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], op: str, start: int,
                     error_type: Optional[str], context: Optional[Context]) -> None:
    integration.deliver(_scatter_call(engine, args, kwargs, op, start, clock.now_ns(), None, error_type), context)


def _scattered(engine: Any, ticket: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], op: str,
               drained_on_return: bool, start: int, end: int, scope: Optional[TransferScope],
               context: Optional[Context]) -> None:
    if drained_on_return:
        code = int(_ticket_status["read"](ticket))
        if code != SCATTER_UNKNOWN:
            _emit(scope, context, _scatter_call(engine, args, kwargs, op, start, end, code,
                                                None if code == SCATTER_COMPLETED else "transfer_failed"))
            return
    call = _scatter_call(engine, args, kwargs, op, start, start, None, None)
    key = id(ticket)
    _tickets.submit(key, start, call[CALL_BYTES], call[CALL_DESCRIPTORS], op, call[CALL_PEER], call[CALL_PROTOCOL],
                    call[CALL_EXTRA], posted_ns=end)
    # Forgotten (counted) when the ticket dies unobserved, before its id can name another ticket.
    _ticket_refs[key] = weakref.ref(ticket, functools.partial(_ticket_gone, key))


def _ticket_gone(key: int, _reference: object) -> None:
    _ticket_refs.pop(key, None)
    _tickets.forget(key)


def _ticket_seen(key: int, code: int) -> None:
    """What drain() just answered for a ticket: still running (it gave up waiting), or the end of its send."""
    if code == SCATTER_UNKNOWN:
        _tickets.seen_running(key)
    elif _tickets.complete(key, code, None if code == SCATTER_COMPLETED else "transfer_failed"):
        _ticket_refs.pop(key, None)


def _ticket_ended(key: int, code: int) -> None:
    """A ticket's `status` as its caller read it: an end when it shows one. COMPLETION_UNKNOWN says nothing
    there: the status changes only when the ticket is drained (0.3.14 over TCP), so it is no sign of a transfer
    still running."""
    if code != SCATTER_UNKNOWN and _tickets.complete(key, code,
                                                     None if code == SCATTER_COMPLETED else "transfer_failed"):
        _ticket_refs.pop(key, None)


def _ticket_drain(original: _Method) -> _Method:
    # drain(timeout_ms) waits up to its timeout and answers the status: the end, or COMPLETION_UNKNOWN when the
    # transfer was still running as it gave up (a poll that saw it unfinished).
    def drain(self: Any, *args: Any, **kwargs: Any) -> Any:
        status = original(self, *args, **kwargs)
        if len(_tickets):
            try:
                _ticket_seen(id(self), int(status))
            except Exception:
                own_error("observe a Mooncake scatter ticket")
        return status

    return drain


class _ObservedProperty(property):
    """A ticket's property read through an observer (a subclass of property only so the patcher can mark it)."""


def _observed_property(observe: Callable[[Any, Any], None]) -> Callable[[Any], Any]:
    """`make` for Patcher.replace of a ticket property: the same property with `observe(ticket, value)` after each
    read (a plain callable in its place, as the contract test installs, is observed as a method)."""

    def make(original: Any) -> Any:
        # (a ticket's properties are readable: a property's getter is never None here)
        read = cast(_Method, original.fget) if isinstance(original, property) else original

        def getter(self: Any, *args: Any, **kwargs: Any) -> Any:
            value = read(self, *args, **kwargs)
            if len(_tickets):
                try:
                    observe(self, value)
                except Exception:
                    own_error("observe a Mooncake scatter ticket")
            return value

        return _ObservedProperty(getter, doc=original.__doc__) if isinstance(original, property) else getter

    return make


def _seen_status(ticket: Any, status: Any) -> None:
    _ticket_ended(id(ticket), int(status))


def _seen_drained(ticket: Any, drained: Any) -> None:
    if drained:
        _ticket_ended(id(ticket), int(_ticket_status["read"](ticket)))


def _in_progress_at_peer(frame_locals: Dict[str, Any]) -> Optional[inflight.Item]:
    """A call of a newer shape still inside the engine (inflight.py): its peer, its bytes left unread (an array or
    a table another thread may be refilling)."""
    start = frame_locals.get("start")
    if start is None or "end" in frame_locals:
        return None
    args, kwargs = frame_locals.get("args") or (), frame_locals.get("kwargs") or {}
    peer = args[0] if args else kwargs.get("target_hostname", kwargs.get("endpoint"))
    return inflight.describe_call(start, frame_locals.get("scope"), (peer,), BACKEND)


def _remember_engine(engine: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """What initialize() (and initialize_ext()) said of the engine: its protocol, and its devices (the 4th
    argument, a comma-separated list; empty: the engine finds its own): with exactly one, every send of this
    engine carries it as kv_transfer.nic unless the call names another."""
    protocol = _forced_transport() or (args[2] if len(args) > 2 else kwargs.get("protocol"))
    named = args[3] if len(args) > 3 else kwargs.get("device_name")
    devices = [d.strip()[:64] for d in named.split(",") if d.strip()] if isinstance(named, str) else []
    for device in devices:
        if device not in _devices and len(_devices) < MAX_DEVICES:
            _devices.append(device)
    transport = str(protocol)[:32] if protocol else _state["fallback"][0]
    _engines[id(engine)] = (transport, {semconv.NIC: devices[0]} if len(devices) == 1 else None)
    _last_engine[0] = _NO_ENGINE


def configured_devices() -> Tuple[str, ...]:
    """The device names given to TransferEngine.initialize() / initialize_ext() in this process while instrumented
    (each once, in the order given; at most MAX_DEVICES), for the start-up line: empty before any engine is
    initialised, and where engines find their devices themselves."""
    return tuple(_devices)


def _initialize(original: _Method) -> _Method:
    # Once per engine: its guard is the shared helper's.
    def initialize(self: Any, *args: Any, **kwargs: Any) -> Any:
        rc = original(self, *args, **kwargs)
        safely("read the transport and devices of initialize()", _remember_engine, self, args, kwargs)
        return rc

    return initialize


def _forced_transport() -> Optional[str]:
    if os.environ.get("MC_FORCE_TCP", "").strip().lower() in ("1", "true", "yes", "on"):
        return "tcp"
    return (os.environ.get("MOONCAKE_PROTOCOL") or "")[:32] or None


# TransferEngine's calls that move no bytes: set-up, registration, the engine's own local buffer, queries,
# notifications, a reachability probe. Any public call neither here nor timed (TIMED_CALLS) is counted as untimed.
QUIET_CALLS = frozenset({
    "initialize", "initialize_ext", "get_rpc_port", "get_local_topology", "get_engine", "get_engine_ptr",
    "register_memory", "unregister_memory", "batch_register_memory", "batch_unregister_memory",
    "allocate_managed_buffer", "free_managed_buffer", "get_first_buffer_address",
    "write_bytes_to_buffer", "read_bytes_from_buffer",  # copies within this process's own buffer
    "get_notifies", "send_probe", "warmup_efa_segment",
})


def timed_calls() -> FrozenSet[str]:
    """Every TransferEngine call this module times or observes (a send, or the completion of one)."""
    return (frozenset(SYNC_METHODS) | frozenset(ASYNC_METHODS) | COMPLETION_CALLS | frozenset(ARRAY_METHODS)
            | frozenset(PAGE_METHODS) | frozenset(SCATTER_METHODS) | frozenset(CUDA_STREAM_METHODS))


COMPLETION_CALLS = frozenset({"transfer_check_status", "get_batch_transfer_status"})


def _patch(module: ModuleType) -> None:
    engine = module.TransferEngine
    for name, (op, batch) in SYNC_METHODS.items():
        patcher.replace(engine, name, lambda original, op=op, batch=batch, at=NIC_HINT_AT[name]:
                        _sync(original, op, batch, at))
    for name, (op, batch) in ASYNC_METHODS.items():
        patcher.replace(engine, name, lambda original, op=op, batch=batch, at=NIC_HINT_AT[name]:
                        _async(original, op, batch, at))
    # The newer shapes and the CUDA stream's calls: each patched where the build has it.
    for name, (op, is_async) in ARRAY_METHODS.items():
        if is_async:
            patcher.replace(engine, name, lambda original, op=op, at=NIC_HINT_AT[name]:
                            _async(original, op, True, at, _arrays_count))
        else:
            patcher.replace(engine, name, lambda original, op=op, at=NIC_HINT_AT[name]:
                            _counted(original, op, _arrays_count, at))
    for name, op in PAGE_METHODS.items():
        patcher.replace(engine, name, lambda original, op=op, at=NIC_HINT_AT[name]:
                        _counted(original, op, _pages_count, at))
    for name, (op, batch) in CUDA_STREAM_METHODS.items():
        patcher.replace(engine, name, lambda original, op=op, batch=batch: _on_stream(original, op, batch))
    ticket = getattr(module, "ScatterTransferTicket", None)
    if ticket is not None and isinstance(ticket, type):
        _patch_ticket(ticket)
        for name, (op, drained) in SCATTER_METHODS.items():
            patcher.replace(engine, name, lambda original, op=op, drained=drained: _scatter(original, op, drained))
    patcher.replace(engine, "transfer_check_status", _check_status)
    patcher.replace(engine, "get_batch_transfer_status", _batch_status)
    patcher.replace(engine, "initialize", _initialize)
    patcher.replace(engine, "initialize_ext", _initialize)
    untimed.wrap_unknown(patcher, engine, BACKEND, timed_calls(), QUIET_CALLS)


def _patch_ticket(ticket: type) -> None:
    """Where a scatter ticket shows its end: drain(), and the `status` and `drained` properties."""
    status = ticket.__dict__.get("status")
    if status is None:
        return
    if not is_ours(status):  # the class's own getter, not our observer of it (instrument() twice patches once)
        _ticket_status["read"] = status.fget if isinstance(status, property) else status
    patcher.replace(ticket, "drain", _ticket_drain)
    patcher.replace(ticket, "status", _observed_property(_seen_status))
    patcher.replace(ticket, "drained", _observed_property(_seen_drained))


def _prepare() -> None:
    _state["fallback"] = (_forced_transport(), None)  # for engines initialised before instrument()
    _last_engine[0] = _NO_ENGINE


def _forget() -> None:
    untimed.forget(BACKEND)
    _pending.abandon()  # completions that will now never be observed: counted, not silently lost
    _tickets.abandon()
    _ticket_refs.clear()
    _engines.clear()
    _last_engine[0] = _NO_ENGINE
    _devices.clear()


# --- the engine-module interface ------------------------------------------------------------------------------

MODULE = "mooncake.engine"
SPEC = EngineSpec(
    name=BACKEND,
    # Every published build (each installs the same `mooncake` package): CUDA 12 (the plain name), CPU, CUDA 13, AWS
    # EFA (three), ROCm, Ascend NPU, Moore Threads MUSA, and TokenSpeed's fork (CUDA 13). One list: wiring/package.py
    # builds `instruments-any` from it.
    distributions=(
        "mooncake-transfer-engine",
        "mooncake-transfer-engine-non-cuda",
        "mooncake-transfer-engine-cuda13",
        "mooncake-transfer-engine-efa",
        "mooncake-transfer-engine-efa-cuda13",
        "mooncake-transfer-engine-efa-non-cuda",
        "mooncake-transfer-engine-rocm",
        "mooncake-transfer-engine-npu",
        "mooncake-transfer-engine-musa",
        "tokenspeed-mooncake",
    ),
    supported=">=0.3",  # the releases whose TransferEngine has the calls wrapped here (0.3.13 tested)
    patches=(Patch(MODULE, _patch),),  # now if `mooncake.engine` is imported, else as soon as it is
    prepare=_prepare,
    forget=_forget,
    setup_in_first_call=True,  # the first transfer to a segment opens it (its send says kv_transfer.first_to_peer)
    peer_attributes=peer_attributes,
)

# The views of the spec the rest of the package, its tests and its docs use.
HOOKS = LazyPatcher(SPEC, patcher)
DISTRIBUTIONS, SUPPORTED, SETUP_IN_FIRST_CALL = SPEC.distributions, SPEC.supported, SPEC.setup_in_first_call
instrument, uninstrument, modules = HOOKS.instrument, HOOKS.uninstrument, HOOKS.modules
