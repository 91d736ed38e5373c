"""Decode side of sglang's Mooncake PD transfer: one `kv_transfer.receive` per (room, receiving rank).

It opens when the receiver asks for the KV (`send_metadata`, which hands prefill the destination pages) and ends
the first time `poll()` answers Success or Failed (or on `abort`). It is stitched into the prefill request's trace
by room (DESIGN), or goes under sglang's own request span when sglang's tracing is on.
"""

import threading

import wrapt
from opentelemetry.instrumentation.utils import is_instrumentation_enabled, unwrap

from otel_kvtransfer import integration
from otel_kvtransfer.sglang import prefill
from otel_kvtransfer.sglang.prefill import _own_error, _sglang_parent, error_type_of

_patched = []
_classes = {}
_DONE = "_otel_kvt_done"  # set on a receiver whose receive span was ended
_PARENT = "_otel_kvt_parent"  # sglang's span of the receiver's request, when sglang's tracing is on
_tls = threading.local()  # .req: the Req whose receiver DecodePreallocQueue is creating
_POLL = {}  # KVPoll value -> "Success" | "Failed"


def _active() -> bool:
    return integration.is_active() and is_instrumentation_enabled()


def _is_mooncake(receiver) -> bool:
    cls = _classes.get("receiver")
    return cls is not None and isinstance(receiver, cls)


def _expected_bytes(receiver, kv_indices, aux_index):
    mgr = receiver.kv_mgr
    total = len(kv_indices) * int(getattr(mgr, "kv_item_lens_sum", 0) or 0)
    if aux_index is not None:
        total += sum(int(x) for x in mgr.kv_args.aux_item_lens)
    return total


def _send_metadata_wrapper(wrapped, instance, args, kwargs):
    if not _active() or not _is_mooncake(instance):
        return wrapped(*args, **kwargs)
    try:
        kv_indices = args[0] if args else kwargs.get("kv_indices")
        aux_index = args[1] if len(args) > 1 else kwargs.get("aux_index")
        integration.begin_receive(
            instance.bootstrap_room,
            expected_bytes=_expected_bytes(instance, kv_indices, aux_index),
            parent=getattr(instance, _PARENT, None),
        )
    except Exception:  # pylint: disable=broad-except
        _own_error("send_metadata")
    return wrapped(*args, **kwargs)


def _create_receiver_wrapper(wrapped, instance, args, kwargs):
    """DecodePreallocQueue._create_receiver_and_enqueue(req): the receiver made inside belongs to this Req."""
    if not _active():
        return wrapped(*args, **kwargs)
    previous = getattr(_tls, "req", None)
    _tls.req = args[0] if args else kwargs.get("req")
    try:
        return wrapped(*args, **kwargs)
    finally:
        _tls.req = previous


def _receiver_init_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    req = getattr(_tls, "req", None)
    if req is not None and _active():
        try:
            parent = _sglang_parent(getattr(getattr(req, "time_stats", None), "trace_ctx", None))
            if parent is not None:
                setattr(instance, _PARENT, parent)
        except Exception:  # pylint: disable=broad-except
            _own_error("receiver init")
    return result


def _end(instance, status_name) -> None:
    if getattr(instance, _DONE, False):
        return
    setattr(instance, _DONE, True)
    error = None
    if status_name != "Success":
        with_records = getattr(instance.kv_mgr, "failure_records", {})
        error = error_type_of(with_records.get(instance.bootstrap_room)) if status_name == "Failed" else status_name
    integration.end_receive(instance.bootstrap_room, error_type=error)


def _poll_wrapper(wrapped, instance, args, kwargs):
    status = wrapped(*args, **kwargs)
    name = _POLL.get(status)
    if name is not None and not getattr(instance, _DONE, False) and _active():
        try:
            if _is_mooncake(instance):
                _end(instance, name)
        except Exception:  # pylint: disable=broad-except
            _own_error("receiver poll")
    return status


def _abort_wrapper(wrapped, instance, args, kwargs):
    if _active() and not getattr(instance, _DONE, False):
        try:
            if _is_mooncake(instance):
                _end(instance, "aborted")
        except Exception:  # pylint: disable=broad-except
            _own_error("receiver abort")
    return wrapped(*args, **kwargs)


def patch_common_conn(module) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll  # pylint: disable=import-outside-toplevel

    _POLL.update({KVPoll.Success: "Success", KVPoll.Failed: "Failed"})
    for attr, wrapper in (("__init__", _receiver_init_wrapper), ("send_metadata", _send_metadata_wrapper),
                          ("poll", _poll_wrapper), ("abort", _abort_wrapper)):
        _wrap(module, "CommonKVReceiver", attr, wrapper)


def patch_decode(module) -> None:
    _wrap(module, "DecodePreallocQueue", "_create_receiver_and_enqueue", _create_receiver_wrapper)


def _wrap(module, owner_name, attr, wrapper) -> None:
    owner = getattr(module, owner_name)
    current = owner.__dict__.get(attr)
    if current is None or hasattr(current, "__wrapped__"):
        return
    wrapt.wrap_function_wrapper(module, f"{owner_name}.{attr}", wrapper)
    _patched.append((owner, attr))


def patch_mooncake_conn(module) -> None:
    _classes["receiver"] = module.MooncakeKVReceiver


def unpatch() -> None:
    while _patched:
        owner, attr = _patched.pop()
        try:
            unwrap(owner, attr)
        except Exception:  # pylint: disable=broad-except
            prefill.ERRORS["count"] += 1
