"""What every wrapper of the wing shares: a call's record from its arguments (`call_of`), a finished call handed
over (`emit`, `deliver`), and what a call still inside the engine says of itself (`in_progress*`, read by
recording/inflight.py from the wrapper's frame).

The guard "record now?" is `patching.recording_context` for every family here but the two common calls (sync and
submission), which write it out: one Python frame fewer per transfer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from otel_kvtransfer import semconv
from otel_kvtransfer.engines.mooncake import forms
from otel_kvtransfer.engines.mooncake.methods import BACKEND, LENGTH_KW, READ, WRITE
from otel_kvtransfer.recording import clock, inflight, integration, records
from otel_kvtransfer.recording.recorder import RECORDER

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from otel_kvtransfer.recording.integration import TransferScope

# A TransferEngine method as the class has it, and what replaces it (called with the engine as its first argument).
Method = Callable[..., Any]
# (bytes, descriptors) read from a call's positional and keyword arguments, for calls whose lengths are no list
Count = Callable[[Tuple[Any, ...], Dict[str, Any]], Tuple[Any, int]]
# A wrapper for any call but the common one: (engine, its positional arguments, its keyword arguments) -> answer
General = Callable[[Any, Tuple[Any, ...], Dict[str, Any]], Any]

UNSET = object()  # an argument the caller did not pass


def peer_attributes(session: Any) -> Dict[str, Any]:
    """Mooncake's session name 'host:port' -> server.address / server.port."""
    if not isinstance(session, str):
        return {}
    host, sep, port = session.rpartition(":")
    if sep and port.isdigit():
        return {semconv.SERVER_ADDRESS: host.strip("[]")[:256], semconv.SERVER_PORT: int(port)}
    return {semconv.SERVER_ADDRESS: session[:256]}


def op_of(opcode: Any) -> str:
    name = getattr(opcode, "name", str(opcode))
    return READ if "read" in name.lower() else WRITE


def call_of(engine: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], op: Optional[str], batch: bool, start: int,
            end: int, rc: Any, error_type: Optional[str], nic_at: int = 5,
            count: Optional[Count] = None) -> records.Call:
    """The `records.call` of one transfer call, from its arguments (the common sync call writes the same record
    inline: see `sync.common`). `nic_at`: where the call takes `nic_hint`; `count(args, kwargs)`: (bytes,
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
            lengths = args[3] if len(args) > 3 else kwargs.get(LENGTH_KW[batch], 0)
        if batch:
            descriptors = len(lengths)
            lengths = sum(lengths)
            if type(lengths) is not int:  # an array's integers
                lengths = int(lengths)
        else:
            lengths, descriptors = int(lengths), 1
    if op is None:
        op = op_of(args[4] if len(args) > 4 else kwargs.get("opcode"))
    transport, extra = forms.engines.get(id(engine), forms.state["fallback"])
    hint = args[nic_at] if len(args) > nic_at else kwargs.get("nic_hint") if kwargs else None
    if hint:
        extra = (forms.hinted.get(hint) if type(hint) is str else None) or forms.hint_extra(hint)
    return records.call(start, end, lengths, descriptors, op, session, transport, rc, error_type, BACKEND, extra)


def deliver(engine: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], op: Optional[str], batch: bool, start: int,
            rc: Any, error_type: Optional[str], context: Optional[Context] = None, nic_at: int = 5,
            count: Optional[Count] = None) -> None:
    """A call that failed (raised, or refused a submission), ending now."""
    integration.deliver(call_of(engine, args, kwargs, op, batch, start, clock.now_ns(), rc, error_type, nic_at,
                                count), context)


def emit(scope: Optional[TransferScope], context: Optional[Context], call: records.Call) -> None:
    """One finished call: into the thread's transfer scope, else a raw send of its own (as `sync.common` does
    inline)."""
    if scope is not None:
        scope.calls.append(call)
    elif RECORDER.active:
        RECORDER.record(records.raw_call(call, context))


def in_progress(frame_locals: Dict[str, Any]) -> Optional[inflight.Item]:
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


POSITIONS = ("target_hostname", "buffer", "peer_buffer_address", "length")  # the common call's parameters


def in_progress_monotonic(frame_locals: Dict[str, Any]) -> Optional[inflight.Item]:
    """`in_progress` of a common call's frame: its `start` read from monotonic_ns(), brought onto the records'
    clock here; its four arguments by name."""
    start = frame_locals.get("start")
    if start is None or "end" in frame_locals:
        return None
    args = tuple(frame_locals.get(name) for name in POSITIONS)
    return inflight.describe_call(start + clock.BASE, frame_locals.get("scope"), args, BACKEND)


def in_progress_at_peer(frame_locals: Dict[str, Any]) -> Optional[inflight.Item]:
    """A call of a newer shape still inside the engine (inflight.py): its peer, its bytes left unread (an array or
    a table another thread may be refilling)."""
    start = frame_locals.get("start")
    if start is None or "end" in frame_locals:
        return None
    args, kwargs = frame_locals.get("args") or (), frame_locals.get("kwargs") or {}
    peer = args[0] if args else kwargs.get("target_hostname", kwargs.get("endpoint"))
    return inflight.describe_call(start, frame_locals.get("scope"), (peer,), BACKEND)
