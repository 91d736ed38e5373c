"""Scatter calls (0.3.14): each answers a ScatterTransferTicket. A sync call's ticket has drained when it returns
(its status says how it ended): a sync send. Otherwise (a submission, or a sync call that gave up waiting) the send
stays pending until the ticket shows its end (its `drain()`, or its `status`, `drained`), as an async batch's does,
with the time inside the call as `kv_transfer.post_s`; a ticket that dies unobserved is counted as dropped
(`async_released`)."""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple, cast

from otel_kvtransfer.engines.mooncake.calls import Method, call_of, emit, in_progress_at_peer
from otel_kvtransfer.engines.mooncake.methods import BACKEND, SCATTER_ARGUMENTS, SCATTER_COMPLETED, SCATTER_UNKNOWN
from otel_kvtransfer.recording import clock, inflight, integration, records
from otel_kvtransfer.recording.patching import Patcher, is_ours, own_error, recording_context, safely
from otel_kvtransfer.recording.pending import PendingTransfers
from otel_kvtransfer.recording.records import CALL_BYTES, CALL_DESCRIPTORS, CALL_EXTRA, CALL_PEER, CALL_PROTOCOL

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from otel_kvtransfer.recording.integration import TransferScope

tickets = PendingTransfers(BACKEND)  # scatter tickets not yet seen ended, by id(ticket)
# id(ticket) -> a weak reference whose callback forgets the ticket when it dies unobserved
ticket_refs: Dict[int, weakref.ref[Any]] = {}
# the ticket's own `status` getter (an observed ticket's status is read with it), once a ticket class is patched
ticket_status: Dict[str, Any] = {"read": None}


def scatter(original: Method, op: str, drained_on_return: bool) -> Method:
    """A scatter call's wrapper (module docstring)."""
    thread, now = integration.THREAD, recording_context

    def scatter_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = now()
        if ctx is None:
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

    inflight.register_wrapper(scatter_call.__code__, in_progress_at_peer)
    return scatter_call


def scatter_count(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[int, int]:
    """(bytes, descriptors) of a scatter call: its length lists summed as it returns; one descriptor per length."""
    lengths = args[7] if len(args) > 7 else kwargs["lengths"]
    return sum(map(sum, lengths)), sum(map(len, lengths))


def _scatter_call(engine: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], op: str, start: int, end: int, rc: Any,
                  error_type: Optional[str]) -> records.Call:
    call = call_of(engine, args, kwargs, op, True, start, end, rc, error_type, SCATTER_ARGUMENTS, scatter_count)
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
        code = int(ticket_status["read"](ticket))
        if code != SCATTER_UNKNOWN:
            emit(scope, context, _scatter_call(engine, args, kwargs, op, start, end, code,
                                               None if code == SCATTER_COMPLETED else "transfer_failed"))
            return
    call = _scatter_call(engine, args, kwargs, op, start, start, None, None)
    key = id(ticket)
    tickets.submit(key, start, call[CALL_BYTES], call[CALL_DESCRIPTORS], op, call[CALL_PEER], call[CALL_PROTOCOL],
                   call[CALL_EXTRA], posted_ns=end)
    # Forgotten (counted) when the ticket dies unobserved, before its id can name another ticket.
    ticket_refs[key] = weakref.ref(ticket, functools.partial(_ticket_gone, key))


def _ticket_gone(key: int, _reference: object) -> None:
    ticket_refs.pop(key, None)
    tickets.forget(key)


def _ticket_seen(key: int, code: int) -> None:
    """What drain() just answered for a ticket: still running (it gave up waiting), or the end of its send."""
    if code == SCATTER_UNKNOWN:
        tickets.seen_running(key)
    elif tickets.complete(key, code, None if code == SCATTER_COMPLETED else "transfer_failed"):
        ticket_refs.pop(key, None)


def _ticket_ended(key: int, code: int) -> None:
    """A ticket's `status` as its caller read it: an end when it shows one. COMPLETION_UNKNOWN says nothing
    there: the status changes only when the ticket is drained (0.3.14 over TCP), so it is no sign of a transfer
    still running."""
    if code != SCATTER_UNKNOWN and tickets.complete(key, code,
                                                    None if code == SCATTER_COMPLETED else "transfer_failed"):
        ticket_refs.pop(key, None)


def _ticket_drain(original: Method) -> Method:
    # drain(timeout_ms) waits up to its timeout and answers the status: the end, or COMPLETION_UNKNOWN when the
    # transfer was still running as it gave up (a poll that saw it unfinished).
    def drain(self: Any, *args: Any, **kwargs: Any) -> Any:
        status = original(self, *args, **kwargs)
        if len(tickets):
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
        read = cast(Method, original.fget) if isinstance(original, property) else original

        def getter(self: Any, *args: Any, **kwargs: Any) -> Any:
            value = read(self, *args, **kwargs)
            if len(tickets):
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
        _ticket_ended(id(ticket), int(ticket_status["read"](ticket)))


def patch_ticket(patcher: Patcher, ticket: type) -> None:
    """Where a scatter ticket shows its end: drain(), and the `status` and `drained` properties."""
    status = ticket.__dict__.get("status")
    if status is None:
        return
    if not is_ours(status):  # the class's own getter, not our observer of it (instrument() twice patches once)
        ticket_status["read"] = status.fget if isinstance(status, property) else status
    patcher.replace(ticket, "drain", _ticket_drain)
    patcher.replace(ticket, "status", _observed_property(_seen_status))
    patcher.replace(ticket, "drained", _observed_property(_seen_drained))


def forget() -> None:
    tickets.abandon()
    ticket_refs.clear()
