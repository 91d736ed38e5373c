"""Instrumentation of Mooncake's `mooncake.engine.TransferEngine`.

Each wrapper times the engine call on the calling thread and hands one plain tuple to the recorder (or to the
transfer scope bound to this thread); it never builds a span. Call tuple:
(start_ns, end_ns, bytes, descriptors, op, session, transport, return_code, error_type or None).

Sync calls are one transfer each. An async submission is one transfer from submit until its completion is
observed through `transfer_check_status` or `get_batch_transfer_status`, so its duration is the real transfer
time; submissions whose completion is never observed are bounded by `max_pending_async` and counted as dropped.
"""

import logging
import os
from time import time_ns

import wrapt
from opentelemetry.instrumentation.utils import is_instrumentation_enabled

from otel_kvtransfer import integration, semconv
from otel_kvtransfer.recorder import RECORDER, SEND

_logger = logging.getLogger(__name__)

WRITE, READ = semconv.OP_WRITE, semconv.OP_READ

# method -> (op or None when the opcode argument decides, batch?, position of the opcode argument)
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

# Argument positions shared by every transfer method: (target_hostname, buffer(s), peer address(es),
# length(s), [opcode]).
_LENGTH_KW = {False: "length", True: "lengths"}

_transports = {}  # id(engine) -> protocol given to initialize()
# For engines initialised before instrument(): what the environment forces, else unknown.
_fallback_transport = {"value": None}
_pending = {}  # (id(engine), batch_id) -> (start_ns, bytes, descriptors, op, session, transport, scope info, ctx)
_originals = {}  # method name -> the class __dict__ entry it replaced
errors = {"count": 0}  # the wrappers' own failures, swallowed (never raised into the engine)


def _own_error(what: str) -> None:
    """A failure of the wrapper itself: counted (metric `wrapper_error` drops), logged at debug, never raised."""
    errors["count"] += 1
    RECORDER.drop("wrapper_error")
    _logger.debug("otel_kvtransfer could not %s", what, exc_info=True)


def _op_of(opcode) -> str:
    name = getattr(opcode, "name", str(opcode))
    return READ if "read" in name.lower() else WRITE


def _describe(args, kwargs, op, batch):
    """(session, bytes, descriptors, op) of a transfer call, from its arguments."""
    session = args[0] if args else kwargs.get("target_hostname")
    lengths = args[3] if len(args) > 3 else kwargs.get(_LENGTH_KW[batch], 0)
    if batch:
        nbytes, descriptors = sum(lengths), len(lengths)
    else:
        nbytes, descriptors = int(lengths), 1
    if op is None:
        op = _op_of(args[4] if len(args) > 4 else kwargs.get("opcode"))
    return session, nbytes, descriptors, op


def _deliver(call, scope_info=None, context=None):
    scope = integration.current_scope() if scope_info is None else None
    if scope is not None:
        scope.calls.append(call)
    else:
        RECORDER.record((SEND, scope_info, [call], context or integration.capture_context(), None))


def _sync_wrapper(op, batch):
    def wrapper(wrapped, instance, args, kwargs):
        if not RECORDER.active or not is_instrumentation_enabled():
            return wrapped(*args, **kwargs)
        start = time_ns()
        try:
            rc = wrapped(*args, **kwargs)
        except BaseException as exc:
            _record_sync(instance, args, kwargs, op, batch, start, None, type(exc).__qualname__)
            raise
        _record_sync(instance, args, kwargs, op, batch, start, rc, None)
        return rc

    return wrapper


def _record_sync(instance, args, kwargs, op, batch, start, rc, error_type):
    end = time_ns()
    try:
        session, nbytes, descriptors, op = _describe(args, kwargs, op, batch)
        if error_type is None and rc != 0:
            error_type = "transfer_failed"
        transport = _transports.get(id(instance), _fallback_transport["value"])
        _deliver((start, end, nbytes, descriptors, op, session, transport, rc, error_type))
    except Exception:  # pylint: disable=broad-except
        _own_error("record a Mooncake call")


def _async_wrapper(op, batch):
    def wrapper(wrapped, instance, args, kwargs):
        if not RECORDER.active or not is_instrumentation_enabled():
            return wrapped(*args, **kwargs)
        start = time_ns()
        batch_id = wrapped(*args, **kwargs)
        try:
            session, nbytes, descriptors, op_ = _describe(args, kwargs, op, batch)
            transport = _transports.get(id(instance), _fallback_transport["value"])
            scope = integration.current_scope()
            info = scope.info if scope is not None else None
            if not batch_id or batch_id < 0:  # Mooncake answers a failed submission with 0 or -1
                call = (start, time_ns(), nbytes, descriptors, op_, session, transport, batch_id, "submit_failed")
                RECORDER.record((SEND, info, [call], integration.capture_context(), None))
            elif len(_pending) >= RECORDER.settings.max_pending_async:
                RECORDER.drop("async_pending_full")
            else:
                _pending[(id(instance), batch_id)] = (
                    start, nbytes, descriptors, op_, session, transport, info, integration.capture_context())
        except Exception:  # pylint: disable=broad-except
            _own_error("record a Mooncake submission")
        return batch_id

    return wrapper


def _complete(instance, batch_id, rc, error_type):
    pending = _pending.pop((id(instance), batch_id), None)
    if pending is None:
        return
    start, nbytes, descriptors, op, session, transport, info, context = pending
    call = (start, time_ns(), nbytes, descriptors, op, session, transport, rc, error_type)
    RECORDER.record((SEND, info, [call], context, None))


def _check_status_wrapper(wrapped, instance, args, kwargs):
    rc = wrapped(*args, **kwargs)
    if _pending:
        try:
            batch_id = args[0] if args else next(iter(kwargs.values()))
            # 1 completed, -1 failed (both free the batch id), -2 timed out, 0 still running.
            if rc == 1:
                _complete(instance, batch_id, rc, None)
            elif rc < 0:
                _complete(instance, batch_id, rc, "timeout" if rc == -2 else "transfer_failed")
        except Exception:  # pylint: disable=broad-except
            _own_error("observe a Mooncake completion")
    return rc


def _batch_status_wrapper(wrapped, instance, args, kwargs):
    rc = wrapped(*args, **kwargs)  # blocks until the batches complete, fail or time out
    if _pending:
        try:
            batch_ids = args[0] if args else next(iter(kwargs.values()))
            for batch_id in batch_ids:
                _complete(instance, batch_id, rc, None if rc == 0 else "transfer_failed")
        except Exception:  # pylint: disable=broad-except
            _own_error("observe a Mooncake completion")
    return rc


def _initialize_wrapper(wrapped, instance, args, kwargs):
    rc = wrapped(*args, **kwargs)
    try:
        protocol = _forced_transport() or (args[2] if len(args) > 2 else None)
        if protocol:
            _transports[id(instance)] = str(protocol)
    except Exception:  # pylint: disable=broad-except
        _own_error("read the transport of initialize()")
    return rc


def _forced_transport():
    if os.environ.get("MC_FORCE_TCP", "").strip().lower() in ("1", "true", "yes", "on"):
        return "tcp"
    return os.environ.get("MOONCAKE_PROTOCOL") or None


def _engine_class():
    from mooncake.engine import TransferEngine  # pylint: disable=import-outside-toplevel

    return TransferEngine


def available() -> bool:
    try:
        _engine_class()
    except Exception:  # pylint: disable=broad-except
        return False
    return True


def instrument() -> bool:
    """Wrap the engine's transfer methods; False when Mooncake is not importable."""
    try:
        engine = _engine_class()
    except Exception as exc:  # pylint: disable=broad-except
        _logger.debug("otel_kvtransfer: Mooncake engine not importable (%s); not instrumented", exc)
        return False
    _fallback_transport["value"] = _forced_transport()
    if hasattr(engine.transfer_sync_write, "__wrapped__"):
        return True  # already wrapped
    wrappers = {name: _sync_wrapper(op, batch) for name, (op, batch) in SYNC_METHODS.items()}
    wrappers.update({name: _async_wrapper(op, batch) for name, (op, batch) in ASYNC_METHODS.items()})
    wrappers.update(transfer_check_status=_check_status_wrapper, get_batch_transfer_status=_batch_status_wrapper,
                    initialize=_initialize_wrapper, initialize_ext=_initialize_wrapper)
    for name, wrapper in wrappers.items():
        if name in engine.__dict__:
            # Keep the class __dict__ entry itself: pybind11 stores an instancemethod there, and what
            # getattr(class, name).__wrapped__ gives back is the bare function, which would lose `self`.
            _originals[name] = engine.__dict__[name]
            wrapt.wrap_function_wrapper(engine, name, wrapper)
    return True


def uninstrument() -> None:
    try:
        engine = _engine_class()
    except Exception:  # pylint: disable=broad-except
        return
    for name, original in list(_originals.items()):
        setattr(engine, name, original)
    _originals.clear()
    if _pending:  # submissions whose completion will now never be observed: counted, not silently lost
        RECORDER.drop("async_uninstrumented", len(_pending))
    _pending.clear()
