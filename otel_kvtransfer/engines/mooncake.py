"""The Mooncake transfer engine (`mooncake.engine.TransferEngine`): time each transfer call, count its bytes.

Sync calls are one transfer each. An async submission is one transfer from submit until its completion is
observed through `transfer_check_status` or `get_batch_transfer_status` (`pending.PendingTransfers`), so its
duration is the real transfer time; the time inside the submitting call is its `kv_transfer.post_s`. Each
wrapper is a plain function set on the pybind class (the cheapest call path Python has); instrument() patches at
once when `mooncake.engine` is already imported, else when it is.
"""

import logging
import os
from time import monotonic_ns

from otel_kvtransfer import semconv
from otel_kvtransfer.recording import clock, inflight, integration
from otel_kvtransfer.recording.patching import (
    SUPPRESS_KEY,
    SUPPRESS_KEY_PLAIN,
    LazyPatch,
    Patcher,
    active,
    current_context,
    own_error,
    safely,
)
from otel_kvtransfer.recording.pending import PendingTransfers
from otel_kvtransfer.recording.recorder import RECORDER
from otel_kvtransfer.recording.records import (
    CALL_BYTES,
    CALL_DESCRIPTORS,
    CALL_OP,
    CALL_PEER,
    CALL_PROTOCOL,
    RAW_CALL,
    raw_call,
)

_logger = logging.getLogger(__name__)

BACKEND = "mooncake"
SETUP_IN_FIRST_CALL = True  # the first transfer to a segment opens it (its send says kv_transfer.first_to_peer)
MODULE = "mooncake.engine"
DISTRIBUTIONS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")
SUPPORTED = ">=0.3"  # the releases whose TransferEngine has the calls wrapped here (0.3.13 tested)
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

patcher = Patcher(BACKEND)
_pending = PendingTransfers(BACKEND)
_transports = {}  # id(engine) -> protocol given to initialize()
_state = {"fallback_transport": None}  # read on the hot path: the transport of engines initialised before us


def peer_attributes(session) -> dict:
    """Mooncake's session name 'host:port' -> server.address / server.port."""
    if not isinstance(session, str):
        return {}
    host, sep, port = session.rpartition(":")
    if sep and port.isdigit():
        return {semconv.SERVER_ADDRESS: host.strip("[]")[:256], semconv.SERVER_PORT: int(port)}
    return {semconv.SERVER_ADDRESS: session[:256]}


def _op_of(opcode) -> str:
    name = getattr(opcode, "name", str(opcode))
    return READ if "read" in name.lower() else WRITE


def _call(engine, args, kwargs, op, batch, start, end, rc, error_type) -> tuple:
    """The `records.call` of one transfer call, from its arguments (the sync wrapper inlines the common
    positional case: tests/test_backend_contract.py checks that both build the same record).

    A batch call's bytes stay the list of lengths the engine was given, summed later by the builder thread: the
    engine copies that list into its own request and keeps no reference, and sglang and vLLM build a fresh list
    per call, so nothing changes it in between; summing 2,048 lengths here would cost the engine thread ~20 us.
    """
    if len(args) > 3 and not kwargs:  # how sglang and vLLM call it
        session, lengths = args[0], args[3]
    else:
        session = args[0] if args else kwargs.get("target_hostname")
        lengths = args[3] if len(args) > 3 else kwargs.get(_LENGTH_KW[batch], 0)
    if batch:
        descriptors = len(lengths)
        if type(lengths) is not list:  # e.g. a tuple or an array
            lengths = sum(lengths)
    else:
        lengths, descriptors = int(lengths), 1
    if op is None:
        op = _op_of(args[4] if len(args) > 4 else kwargs.get("opcode"))
    transport = _transports.get(id(engine), _state["fallback_transport"])
    # records.call(...), inline: this runs for every async submission too.
    return (start, end, lengths, descriptors, op, session, transport, rc, error_type, BACKEND, None)


_UNSET = object()  # an argument the caller did not pass


def _sync(original, op, batch):
    # Everything the hot path uses is a local of this closure. The common call (four positional arguments, the op
    # known from the method: how sglang and vLLM call it) takes them as positional-only parameters and passes them
    # on as they came, parsed and handed over inline, with no further Python frame: packing and unpacking *args
    # and **kwargs made a tuple and a dict per call, both ways, a quarter of the wrapper's cost (wrapper_floor.py
    # in bench/). Any other call (keywords, more or fewer arguments, an opcode to read) goes to `general` with the
    # very arguments it was given.
    recorder, context = RECORDER, current_context
    thread = integration.THREAD  # its .scope: this thread's transfer scope
    transports, state, suppress, suppress_plain = _transports, _state, SUPPRESS_KEY, SUPPRESS_KEY_PLAIN
    base = clock.BASE  # times are monotonic_ns() + base: clock.now_ns(), inline
    unset = _UNSET

    def transfer(self, target_hostname=unset, buffer=unset, peer_buffer_address=unset, length=unset, /, *rest,
                 **kwargs):
        if rest or kwargs or length is unset or op is None:
            given = tuple(arg for arg in (target_hostname, buffer, peer_buffer_address, length) if arg is not unset)
            return general(self, given + rest, kwargs)
        if not recorder.active:
            return original(self, target_hostname, buffer, peer_buffer_address, length)
        ctx = context()
        if ctx and (ctx.get(suppress) or ctx.get(suppress_plain)):  # inside suppress_instrumentation()
            return original(self, target_hostname, buffer, peer_buffer_address, length)
        scope = thread.scope  # read before the call: while it runs, inflight.py reads it from this frame
        start = monotonic_ns() + base
        try:
            rc = original(self, target_hostname, buffer, peer_buffer_address, length)
        except BaseException as exc:
            safely("record a failed Mooncake call", _deliver, self,
                   (target_hostname, buffer, peer_buffer_address, length), {}, op, batch, start, None,
                   type(exc).__qualname__, ctx)
            raise
        end = monotonic_ns() + base
        try:
            error = None if rc == 0 else "transfer_failed"
            lengths = length
            if batch:
                descriptors = len(lengths)
                if type(lengths) is not list:  # see _call
                    lengths = sum(lengths)
            else:
                lengths, descriptors = int(lengths), 1
            transport = transports.get(id(self), state["fallback_transport"])
            # records.call(...) and records.raw_call(...), inline: a call to either would be one more Python frame
            # per transfer, and a raw call is one tuple, not a call tuple inside a send record.
            if scope is not None:
                scope.calls.append((start, end, lengths, descriptors, op, target_hostname, transport, rc, error,
                                    BACKEND, None))
            elif recorder.active:  # as integration.deliver, with the context already fetched
                rec = (RAW_CALL, start, end, lengths, descriptors, op, target_hostname, transport, rc, error, BACKEND,
                       None, ctx or None)
                queue = recorder._queue
                if len(queue) < recorder._capacity and not recorder._idle:
                    queue.append(rec)  # Recorder.record's common case, inline (see there)
                else:
                    recorder.record(rec)
        except Exception:
            own_error("record a Mooncake call")
        return rc

    def general(self, args, kwargs):
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
                   type(exc).__qualname__, ctx)
            raise
        end = monotonic_ns() + base
        try:
            call = _call(self, args, kwargs, op, batch, start, end, rc, None if rc == 0 else "transfer_failed")
            if scope is not None:
                scope.calls.append(call)
            elif recorder.active:
                recorder.record(raw_call(call, ctx))
        except Exception:
            own_error("record a Mooncake call")
        return rc

    inflight.register_wrapper(transfer.__code__, _in_progress)
    inflight.register_wrapper(general.__code__, _in_progress)
    return transfer


def _in_progress(frame_locals):
    """A sync call still inside the engine, from its wrapper's frame (inflight.py): None before it started."""
    start = frame_locals.get("start")
    if start is None or "end" in frame_locals:  # not started yet, or already returned
        return None
    args = frame_locals.get("args")
    if args is None:  # the common call's frame: its four arguments by name
        args = tuple(frame_locals.get(name) for name in _POSITIONS)
    elif len(args) < 4 and frame_locals.get("kwargs"):  # the peer or the length(s) given by keyword
        kwargs = frame_locals["kwargs"]
        args = (args[0] if args else kwargs.get("target_hostname"), None, None,
                kwargs.get("length", kwargs.get("lengths")))
    return inflight.describe_call(start, frame_locals.get("scope"), args or (), BACKEND)


_POSITIONS = ("target_hostname", "buffer", "peer_buffer_address", "length")  # the common call's parameters


def _deliver(engine, args, kwargs, op, batch, start, rc, error_type, context=None) -> None:
    """A call that failed (raised, or refused a submission), ending now."""
    integration.deliver(_call(engine, args, kwargs, op, batch, start, clock.now_ns(), rc, error_type), context)


def _async(original, op, batch):
    def submit(self, *args, **kwargs):
        if not active():
            return original(self, *args, **kwargs)
        start = clock.now_ns()
        batch_id = original(self, *args, **kwargs)
        posted = clock.now_ns()
        try:
            if not batch_id or batch_id < 0:  # Mooncake answers a failed submission with 0 or -1
                _deliver(self, args, kwargs, op, batch, start, batch_id, "submit_failed")
            else:
                call = _call(self, args, kwargs, op, batch, start, start, None, None)
                _pending.submit((id(self), batch_id), start, call[CALL_BYTES], call[CALL_DESCRIPTORS], call[CALL_OP],
                                call[CALL_PEER], call[CALL_PROTOCOL], posted_ns=posted)
        except Exception:
            own_error("record a Mooncake submission")
        return batch_id

    return submit


def _check_status(original):
    def transfer_check_status(self, *args, **kwargs):
        rc = original(self, *args, **kwargs)
        if len(_pending):
            try:
                batch_id = args[0] if args else next(iter(kwargs.values()))
                # 1 completed, -1 failed (both free the batch id), -2 timed out, 0 still running.
                if rc == 1:
                    _pending.complete((id(self), batch_id), rc, None)
                elif rc == 0:
                    _pending.seen_running((id(self), batch_id))
                elif rc < 0:
                    _pending.complete((id(self), batch_id), rc, "timeout" if rc == -2 else "transfer_failed")
            except Exception:
                own_error("observe a Mooncake completion")
        return rc

    return transfer_check_status


def _batch_status(original):
    def get_batch_transfer_status(self, *args, **kwargs):
        if len(_pending):  # the wait starts with the batches unfinished: their ends lie after this moment
            try:
                for batch_id in (args[0] if args else next(iter(kwargs.values()))):
                    _pending.seen_running((id(self), batch_id))
            except Exception:
                own_error("observe a Mooncake wait")
        rc = original(self, *args, **kwargs)  # blocks until the batches complete, fail or time out
        if len(_pending):
            try:
                batch_ids = args[0] if args else next(iter(kwargs.values()))
                for batch_id in batch_ids:
                    _pending.complete((id(self), batch_id), rc, None if rc == 0 else "transfer_failed")
            except Exception:
                own_error("observe a Mooncake completion")
        return rc

    return get_batch_transfer_status


def _remember_transport(engine, args, kwargs) -> None:
    protocol = _forced_transport() or (args[2] if len(args) > 2 else kwargs.get("protocol"))
    if protocol:
        _transports[id(engine)] = str(protocol)[:32]


def _initialize(original):
    # Once per engine: its guard is the shared helper's.
    def initialize(self, *args, **kwargs):
        rc = original(self, *args, **kwargs)
        safely("read the transport of initialize()", _remember_transport, self, args, kwargs)
        return rc

    return initialize


def _forced_transport():
    if os.environ.get("MC_FORCE_TCP", "").strip().lower() in ("1", "true", "yes", "on"):
        return "tcp"
    return (os.environ.get("MOONCAKE_PROTOCOL") or "")[:32] or None


def _patch(module) -> None:
    engine = module.TransferEngine
    for name, (op, batch) in SYNC_METHODS.items():
        patcher.replace(engine, name, lambda original, op=op, batch=batch: _sync(original, op, batch))
    for name, (op, batch) in ASYNC_METHODS.items():
        patcher.replace(engine, name, lambda original, op=op, batch=batch: _async(original, op, batch))
    patcher.replace(engine, "transfer_check_status", _check_status)
    patcher.replace(engine, "get_batch_transfer_status", _batch_status)
    patcher.replace(engine, "initialize", _initialize)
    patcher.replace(engine, "initialize_ext", _initialize)


def modules() -> tuple:
    """The module instrument() patches (now if imported, else when it is)."""
    return (MODULE,)


_lazy = LazyPatch(MODULE, _patch)


def instrument() -> bool:
    """Patch the engine now if `mooncake.engine` is imported, else as soon as it is."""
    _state["fallback_transport"] = _forced_transport()  # for engines initialised before instrument()
    _lazy.instrument()
    return True


def uninstrument() -> None:
    _lazy.uninstrument()
    patcher.unwrap_all()
    _pending.abandon()  # completions that will now never be observed: counted, not silently lost
    _transports.clear()
