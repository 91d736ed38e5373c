"""Decode side of sglang's PD transfer (Mooncake or NIXL): one `kv_transfer.receive` per (room, receiving rank).

It opens when the receiver asks for the KV (`send_metadata`, which hands prefill the destination pages) and ends
the first time `poll()` answers Success or Failed (or on `abort`). It is stitched into the prefill request's trace
by room (building/stitching.py), or goes under sglang's own request span when sglang's tracing is on. It carries
the request's `sglang.rid` (the prefill's request span and sends carry the same): a router's retry of the request
is a new room with the client's same rid.

Allocation wait: `DecodePreallocQueue.add` makes the request's receiver as it admits the request; the receiver
asks for its KV (`send_metadata`) only once the queue has reserved its KV pages (`pop_preallocated`: it waits while
the pool cannot hold it). The time between the two is `kv_transfer.allocation_wait_s` on the receive span; it
includes the receiver's bootstrap towards the prefill (sglang's own `kv_transfer_bootstrap_ms`, short once the
prefill is known), and with `--disaggregation-decode-allocation-policy prefill_complete`, the prefill itself.
A receive ending in Success on a decode that verifies its KV checksum waits for that verdict (integrity.py).
"""

import threading

from otel_kvtransfer import semconv
from otel_kvtransfer.frameworks.sglang import common, integrity
from otel_kvtransfer.recording import integration
from otel_kvtransfer.recording.clock import now_ns
from otel_kvtransfer.recording.patching import observe_call, remember_argument

_DONE = "_otel_kvt_done"  # set on a receiver whose receive span was ended
_PARENT = "_otel_kvt_parent"  # sglang's span of the receiver's request, when sglang's tracing is on
_ADMITTED = "_otel_kvt_admitted_ns"  # when the prealloc queue made the receiver (admitted its request)
_RID = "_otel_kvt_rid"  # the client's request id (sglang's rid) of the receiver's request
_tls = threading.local()  # .req: the Req whose receiver DecodePreallocQueue is creating


def _senders(receiver) -> int:
    """How many prefill ranks send to this receiver: its non-dummy bootstrap infos (one per prefill rank it
    asked; with prefill TP > decode TP several, each sending its own head slice and its own aux)."""
    infos = getattr(receiver, "bootstrap_infos", None) or ()
    return max(sum(1 for info in infos if not (isinstance(info, dict) and info.get("is_dummy"))), 1)


def _expected_bytes(receiver, kv_indices, aux_index):
    """Every payload every sending rank sends here: this rank's pages in full (the prefill ranks' head slices
    add up to them), and one aux per sending rank."""
    mgr = receiver.kv_mgr
    total = len(kv_indices) * int(getattr(mgr, "kv_item_lens_sum", 0) or 0)
    if aux_index is not None:
        total += _senders(receiver) * sum(int(x) for x in mgr.kv_args.aux_item_lens)
    return total


def _on_send_metadata(instance, args, kwargs) -> None:
    backend = common.backend_of(instance, "receiver")
    if backend is None:
        return
    kv_indices = args[0] if args else kwargs.get("kv_indices")
    aux_index = args[1] if len(args) > 1 else kwargs.get("aux_index")
    room = instance.bootstrap_room
    attributes = common.room_attributes(room, getattr(instance, _RID, None))
    attributes.update(common.rank_attributes(instance.kv_mgr))
    admitted = getattr(instance, _ADMITTED, None)
    if admitted is not None:
        attributes[semconv.ALLOCATION_WAIT_S] = max(now_ns() - admitted, 0) / 1e9
    integration.begin_receive(
        room, backend=backend, framework=common.FRAMEWORK,
        expected_bytes=_expected_bytes(instance, kv_indices, aux_index),
        attributes=attributes, parent=getattr(instance, _PARENT, None))


_send_metadata_wrapper = observe_call("send_metadata", _on_send_metadata)

# DecodePreallocQueue._create_receiver_and_enqueue(req): the receiver made inside belongs to this Req.
_create_receiver_wrapper = remember_argument(_tls, "req", 0, "req")


def _admitted(instance, args, kwargs):
    """A receiver the prealloc queue makes: its request is being admitted now."""
    return now_ns() if getattr(_tls, "req", None) is not None else None


def _on_receiver_init(instance, args, kwargs, token, result, error) -> None:
    req = getattr(_tls, "req", None)
    if req is not None:
        setattr(instance, _ADMITTED, token)
        rid = getattr(req, "rid", None)
        if rid is not None:  # the body's rid: the prefill got the same one (the router sends both one body)
            setattr(instance, _RID, rid)
        parent = common.sglang_parent(getattr(getattr(req, "time_stats", None), "trace_ctx", None))
        if parent is not None:
            setattr(instance, _PARENT, parent)


_receiver_init_wrapper = observe_call("receiver init", _admitted, _on_receiver_init)


def _end(instance, status_name) -> None:
    if getattr(instance, _DONE, False) or not common.is_instance(instance, "receiver"):
        return
    setattr(instance, _DONE, True)
    error, pending = None, False
    if status_name != "Success":
        records = getattr(instance.kv_mgr, "failure_records", {})
        error = common.error_type_of(records.get(instance.bootstrap_room)) if status_name == "Failed" else status_name
    elif integrity.awaits_verdict(instance):
        pending = True
        setattr(instance, integrity.PENDING, True)
    integration.end_receive(instance.bootstrap_room, error_type=error, outcome_pending=pending)


def _on_poll(instance, args, kwargs, token, status, error) -> None:
    name = common.poll_name(status)
    if name is not None:
        _end(instance, name)


_poll_wrapper = observe_call("receiver poll", after=_on_poll)


def _on_abort(instance, args, kwargs) -> None:
    _end(instance, "aborted")


_abort_wrapper = observe_call("receiver abort", _on_abort)


def patch_common_conn(module) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    common.learn_poll_states(KVPoll)
    for attr, wrapper in (("__init__", _receiver_init_wrapper), ("send_metadata", _send_metadata_wrapper),
                          ("poll", _poll_wrapper), ("abort", _abort_wrapper)):
        common.patcher.wrap(module.CommonKVReceiver, attr, wrapper)


def patch_decode(module) -> None:
    common.patcher.wrap(module.DecodePreallocQueue, "_create_receiver_and_enqueue", _create_receiver_wrapper)
    integrity.patch_decode(module)


def patch_mooncake_conn(module) -> None:
    common.register("receiver", module.MooncakeKVReceiver, common.MOONCAKE)


def patch_nixl_conn(module) -> None:
    common.register("receiver", module.NixlKVReceiver, common.NIXL)
