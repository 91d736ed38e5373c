"""vLLM's MooncakeConnector (a push: prefill writes into decode's KV cache), request key = `transfer_id`.

Prefill side (initiator), in `MooncakeConnectorWorker`:
- `start_load_kv(metadata)`: a request in `metadata.reqs_to_send` with blocks has finished its prefill and its KV
  is ready to send: `kv_transfer.request` opens (role prefill, op write), under the client's traceparent when the
  request came with one (trace_context.py), else under its key's synthetic parent.
- `_build_transfer_params(ready_reqs, ...)` turns the requests one decode worker asked for into ONE descriptor
  list for ONE `batch_transfer_sync_write`. It builds the list request by request, so each request's share is
  what the same function builds for that request alone: the shares come from the connector's own block
  bookkeeping, never from guessing. They are kept with the list object until `_send_blocks` (executor thread)
  sends it inside `split_transfer_scope(shares)`: one `kv_transfer.send` per request, each with its own bytes.
  The decode worker's TP rank among the ranks this prefill rank serves is the destination index; with MLA (the
  same KV goes to every decode rank) their count is the replica factor.
- `fetch_finished_sending_reqs()` on the sender loop: the requests it returns have been sent to every decode
  rank (those already in `finished_sending_reqs` before the call) or expired unsent (added by the call): the
  request ends, ERROR `expired` (or `transfer_failed` when one of its sends failed).
Decode side (peer), same class:
- `start_load_kv(metadata)`: each request in `metadata.reqs_to_recv` with local blocks opens `kv_transfer.receive`
  (expected bytes: its blocks x this rank's bytes per block), `_handle_failed_recv` marks failures, and
  `fetch_finished_recving_reqs()` on the receiver loop ends them. A failure reported right after the prefill
  side's FINISH response (`process_pulling_result`) is a request that side dropped without a result (vLLM >= 0.33
  fails it instead of waiting forever): ERROR `peer_dropped`. A pull the prefill side refused because it had
  already freed that KV (vLLM >= 0.34, "KV expired on P side"): ERROR `expired`.
vLLM 0.33's peer-layout cache: a pull that names a layout the prefill side no longer holds is answered
LAYOUT_MISS (`_lookup_peer_layout` found nothing) and decode sends it again with its layout
(`_build_pull_metadata` a second time for the same pull): counted (`layout_miss`, `layout_resend`), and the send
that answers the resent pull carries `kv_transfer.resend` = true. Sleep mode's `unregister_kv_caches` /
`restore_kv_caches` are counted (`kv_unregistered`, `kv_reregistered`; events.py).
Every read of vLLM's state happens inside a wrapper's own guard: a renamed attribute costs a counted
`wrapper_error`, never an exception in vLLM's loops.
"""

import threading
from typing import Any, Dict

from otel_kvtransfer import semconv
from otel_kvtransfer.frameworks.vllm import events, trace_context
from otel_kvtransfer.frameworks.vllm.common import (
    EXPIRED,
    FRAMEWORK,
    PEER_DROPPED,
    RESEND,
    TRANSFER_FAILED,
    BoundedMap,
    bind,
    has_blocks,
    learn_ranks,
    patcher,
    request_attributes,
)
from otel_kvtransfer.recording import integration as kvt
from otel_kvtransfer.recording.patching import active, observe_call, own_error, safely

BACKEND = "mooncake"
MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"

_transfer_of_prefill = BoundedMap()  # prefill request id -> transfer_id (request span open)
_failed_sends = BoundedMap()  # transfer_id -> True when one of its sends failed
_transfer_of_decode = BoundedMap()  # decode request id -> transfer_id (receive span open)
_failed_recvs = BoundedMap()  # decode request id -> error.type
_shares = BoundedMap(1024)  # id(src_ptrs list) -> (the list, shares) between build and send
_layout_missed = BoundedMap()  # transfer_id -> True: its pull was answered LAYOUT_MISS, a resend is due
_pulls_built = BoundedMap(4096)  # id(pull_metas) -> pull_metas whose metadata was built once (decode)
_finished = threading.local()  # .pull_metas: the pull whose FINISH response was just processed (decode)


def _bytes_per_block(worker) -> int:
    """Bytes one KV block of this rank occupies across its registered regions (all layers, K and V)."""
    return int(sum(getattr(worker, "block_len_per_layer", None) or ()))


def _on_start_load_kv(instance, args, kwargs) -> None:
    """The scheduler's metadata for this step: requests whose KV is ready to send (producer) or to receive."""
    metadata = args[0] if args else kwargs["metadata"]
    producer = bool(instance.is_kv_producer)
    consumer = bool(getattr(instance, "is_kv_consumer", not producer))  # kv_both is both
    if producer:
        for p_req_id, (transfer_id, block_ids) in metadata.reqs_to_send.items():
            if has_blocks(block_ids) and p_req_id not in _transfer_of_prefill:
                _transfer_of_prefill[p_req_id] = transfer_id
                kvt.begin_request(transfer_id, backend=BACKEND, framework=FRAMEWORK, role=semconv.ROLE_PREFILL,
                                  attributes=request_attributes(instance, p_req_id, with_model=True),
                                  parent=trace_context.parent_of(metadata, p_req_id))
    if consumer:
        per_block = _bytes_per_block(instance)
        for pull_metas in metadata.reqs_to_recv.values():
            for d_req_id, pull_meta in pull_metas.items():
                if not has_blocks(pull_meta.local_block_ids) or d_req_id in _transfer_of_decode:
                    continue
                _transfer_of_decode[d_req_id] = pull_meta.transfer_id
                blocks = sum(len(group) for group in pull_meta.local_block_ids)
                kvt.begin_receive(pull_meta.transfer_id, backend=BACKEND, framework=FRAMEWORK,
                                  expected_bytes=blocks * per_block if per_block else None,
                                  attributes=request_attributes(instance, d_req_id, with_model=True),
                                  parent=trace_context.parent_of(metadata, d_req_id))


_start_load_kv_wrapper = observe_call("read vLLM Mooncake connector metadata", _on_start_load_kv)
_worker_init_wrapper = observe_call("read a vLLM Mooncake worker's rank", after=learn_ranks, when=None)


_BUILD_PARAMS = ("ready_reqs", "agent_meta", "local_regions", "remote_regions")
_splittable: Dict[Any, bool] = {}  # the function -> True when it returns the five lists it is known to return


def _returns_five_lists(wrapped) -> bool:
    """vLLM's `_build_transfer_params` returns (src_ptrs, dst_ptrs, lengths, err_reqs, err_msg), built request by
    request: then calling it once per request gives the same lists, concatenated. A release whose annotation
    says otherwise is called once, whole, and its batches are not split by request."""
    function = getattr(wrapped, "__func__", wrapped)
    if function not in _splittable:
        text = str(getattr(function, "__annotations__", {}).get("return", "")).replace(" ", "")
        _splittable[function] = text.startswith("tuple[list[int],list[int],list[int],list[") and text.count(",") == 4
    return _splittable[function]


def _read_batch(wrapped, args, kwargs):
    params = bind(_BUILD_PARAMS, args, kwargs)
    ready = list(params["ready_reqs"])
    return params, ready, len(ready) > 1 and _returns_five_lists(wrapped)


def _build_transfer_params_wrapper(wrapped, instance, args, kwargs):
    if not active():
        return wrapped(*args, **kwargs)
    batch = safely("read a vLLM Mooncake batch", _read_batch, wrapped, args, kwargs)
    if batch is None:
        return wrapped(*args, **kwargs)
    params, ready, split = batch

    async def build():
        if not split:
            result = await wrapped(*args, **kwargs)
            parts = [(ready[0][1] if ready else None, result)] if len(ready) == 1 else []
        else:
            # Once per request, in order: the same descriptors vLLM builds for the batch, each request's own.
            parts = []
            for pair in ready:
                parts.append((pair[1], await wrapped([pair], params["agent_meta"], params["local_regions"],
                                                     params["remote_regions"])))
            result = (
                [p for _, part in parts for p in part[0]], [p for _, part in parts for p in part[1]],
                [n for _, part in parts for n in part[2]], [r for _, part in parts for r in part[3]],
                next((part[4] for _, part in parts if part[4] is not None), None))
        safely("split a vLLM Mooncake batch by request", _remember_shares, instance, params["agent_meta"],
               result[0], parts)
        return result

    return build()


def _remember_shares(instance, agent_meta, src_ptrs, parts) -> None:
    """Keep each request's share of the descriptor list until `_send_blocks` sends it."""
    if not src_ptrs or not parts:
        return
    ranks = sorted(instance.transfer_topo.handshake_target_ranks(agent_meta.remote_tp_size))
    peer = agent_meta.remote_tp_rank
    destination = ranks.index(peer) if peer in ranks else 0  # the one rule: position by peer rank
    replicas = len(ranks) if getattr(instance, "use_mla", False) else 1
    shares = []
    for meta, (_, _, lengths, errors, _) in parts:
        if errors or not lengths:
            continue
        share = {"key": meta.transfer_id, "bytes": sum(lengths), "descriptors": len(lengths), "chunk_index": 0,
                 "is_last_chunk": True, "destination_index": destination, "replica_factor": replicas,
                 "attributes": {semconv.PEER_RANK: peer}}
        if _layout_missed.pop(meta.transfer_id, None):
            share["attributes"][RESEND] = True
        shares.append(share)
    if sum(share["descriptors"] for share in shares) != len(src_ptrs):
        own_error("match a vLLM Mooncake batch to its requests")
        return
    _shares[id(src_ptrs)] = (src_ptrs, shares)


def _shares_of(args, kwargs):
    src_ptrs = args[1] if len(args) > 1 else kwargs.get("src_ptrs")
    entry = _shares.pop(id(src_ptrs), None)
    if entry is not None and entry[0] is not src_ptrs:
        return None  # a stale entry whose list was freed and its id reused
    return entry


def _send_blocks_wrapper(wrapped, instance, args, kwargs):
    entry = safely("find a vLLM Mooncake batch's requests", _shares_of, args, kwargs)
    if entry is None or not active():
        return wrapped(*args, **kwargs)
    with kvt.split_transfer_scope(entry[1]):
        ret = wrapped(*args, **kwargs)
    if ret != 0:
        for share in entry[1]:
            _failed_sends[share["key"]] = True
    return ret


def _end_requests(done, sent) -> None:
    for p_req_id in done:
        transfer_id = _transfer_of_prefill.pop(p_req_id, None)
        if transfer_id is None:
            continue
        failed = _failed_sends.pop(transfer_id, False)
        error = None if p_req_id in sent else (TRANSFER_FAILED if failed else EXPIRED)
        kvt.end_request(transfer_id, error_type=error)


def _sent_so_far(worker) -> set:
    """The requests sent completely; fetch_finished_sending_reqs adds the expired ones to the same set."""
    return set(worker.finished_sending_reqs)


def _fetch_sending_wrapper(wrapped, instance, args, kwargs):
    # A coroutine method: the observers run inside the coroutine that awaits vLLM's.
    async def fetch():
        sent = safely("read vLLM Mooncake finished sends", _sent_so_far, instance)
        done = await wrapped(*args, **kwargs)
        if sent is not None:
            safely("end vLLM Mooncake requests", _end_requests, done, sent)
        return done

    return fetch()


def _says_expired(reason) -> bool:
    """vLLM >= 0.34's prefill refuses a pull of KV it already freed ("KV expired on P side before the pull."):
    the reason it gives is all that tells that refusal from a failed read."""
    return isinstance(reason, str) and "expired" in reason[:256].lower()


def _on_failed_recv(instance, args, kwargs) -> None:
    params = bind(("pull_metas", "req_ids", "reason"), args, kwargs)
    pull_metas = params["pull_metas"]
    # Right after the FINISH response of this very pull: requests the prefill side never reported.
    error = PEER_DROPPED if getattr(_finished, "pull_metas", None) is pull_metas else TRANSFER_FAILED
    if error == TRANSFER_FAILED and _says_expired(params.get("reason")):
        error = EXPIRED
    _finished.pull_metas = None
    dropped = 0
    for req_id in params["req_ids"]:  # read before the call: vLLM >= 0.33 pops them from pull_metas
        pull_meta = pull_metas.get(req_id)
        if pull_meta is not None and not pull_meta.failed:
            _failed_recvs[req_id] = error
            dropped += 1
    if error == PEER_DROPPED:
        events.count(events.PEER_DROPPED, BACKEND, dropped)


# Ungated (this and the two below): a pull's bookkeeping follows vLLM's; `kvt` records only while recording.
_handle_failed_recv_wrapper = observe_call("read a vLLM Mooncake receive failure", _on_failed_recv, when=None)


def _on_pulling_result(instance, args, kwargs, token, result, error) -> None:
    _finished.pull_metas = None
    params = bind(("response", "pull_metas"), args, kwargs)
    # Only a vLLM that settles peer tasks (>= 0.33) fails what a FINISH left unreported; before, the marker
    # could outlive the pull and mislabel another peer's error on the same pull_metas.
    if (getattr(params["response"].status, "name", None) == "FINISH"
            and hasattr(type(instance), "_complete_pull_task")):
        _finished.pull_metas = params["pull_metas"]  # read by a _handle_failed_recv that follows at once


_process_pulling_result_wrapper = observe_call("read a vLLM Mooncake pull result", after=_on_pulling_result,
                                               when=None)


def _on_peer_layout(instance, args, kwargs, token, stored, error) -> None:
    if stored is None:
        meta = bind(("meta",), args, kwargs)["meta"]
        for transfer_id, _ in meta.req_blocks.values():
            _layout_missed[transfer_id] = True
        events.count(events.LAYOUT_MISS, BACKEND)


_lookup_peer_layout_wrapper = observe_call("read a vLLM Mooncake layout miss", after=_on_peer_layout)


def _on_build_pull_metadata(instance, args, kwargs) -> None:
    pull_metas = bind(("pull_metas",), args, kwargs)["pull_metas"]
    if _pulls_built.get(id(pull_metas)) is pull_metas:
        events.count(events.LAYOUT_RESEND, BACKEND)  # the same pull built again: after a LAYOUT_MISS
    else:
        _pulls_built[id(pull_metas)] = pull_metas


_build_pull_metadata_wrapper = observe_call("read a vLLM Mooncake pull", _on_build_pull_metadata, when=None)


def _end_receives(done) -> None:
    for d_req_id in done:
        transfer_id = _transfer_of_decode.pop(d_req_id, None)
        if transfer_id is not None:
            kvt.end_receive(transfer_id, error_type=_failed_recvs.pop(d_req_id, None))


def _fetch_recving_wrapper(wrapped, instance, args, kwargs):
    async def fetch():
        done = await wrapped(*args, **kwargs)
        safely("end vLLM Mooncake receives", _end_receives, done)
        return done

    return fetch()


def patch(module) -> None:
    worker = module.MooncakeConnectorWorker
    patcher.wrap(worker, "__init__", _worker_init_wrapper)
    patcher.wrap(worker, "start_load_kv", _start_load_kv_wrapper)
    patcher.wrap(worker, "_build_transfer_params", _build_transfer_params_wrapper)
    patcher.wrap(worker, "_send_blocks", _send_blocks_wrapper)
    patcher.wrap(worker, "fetch_finished_sending_reqs", _fetch_sending_wrapper)
    patcher.wrap(worker, "_handle_failed_recv", _handle_failed_recv_wrapper)
    patcher.wrap(worker, "fetch_finished_recving_reqs", _fetch_recving_wrapper)
    patcher.wrap(worker, "process_pulling_result", _process_pulling_result_wrapper)
    # vLLM >= 0.33 only (absent before: not wrapped, nothing else changes)
    patcher.wrap(worker, "_lookup_peer_layout", _lookup_peer_layout_wrapper)
    patcher.wrap(worker, "_build_pull_metadata", _build_pull_metadata_wrapper)
    patcher.wrap(worker, "unregister_kv_caches", events.registration_wrapper(events.UNREGISTER, BACKEND))
    patcher.wrap(worker, "restore_kv_caches", events.registration_wrapper(events.REREGISTER, BACKEND))


def forget() -> None:
    for table in (_transfer_of_prefill, _failed_sends, _transfer_of_decode, _failed_recvs, _shares, _layout_missed,
                  _pulls_built):
        table.clear()
    _finished.pull_metas = None
