"""vLLM's MooncakeConnector (a push: prefill writes into decode's KV cache), request key = `transfer_id`.

Prefill side (initiator), in `MooncakeConnectorWorker`:
- `start_load_kv(metadata)`: a request in `metadata.reqs_to_send` with blocks has finished its prefill and its KV
  is ready to send: `kv_transfer.request` opens (role prefill, op write).
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
  `fetch_finished_recving_reqs()` on the receiver loop ends them.
"""

from otel_kvtransfer import integration as kvt
from otel_kvtransfer import semconv
from otel_kvtransfer.frameworks.vllm.common import (
    EXPIRED,
    FRAMEWORK,
    TRANSFER_FAILED,
    BoundedMap,
    has_blocks,
    patcher,
    request_attributes,
)
from otel_kvtransfer.patching import active, observe_call, own_error

BACKEND = "mooncake"
MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"

_transfer_of_prefill = BoundedMap()  # prefill request id -> transfer_id (request span open)
_failed_sends = BoundedMap()  # transfer_id -> True when one of its sends failed
_transfer_of_decode = BoundedMap()  # decode request id -> transfer_id (receive span open)
_failed_recvs = BoundedMap()  # decode request id -> error.type
_shares = BoundedMap(1024)  # id(src_ptrs list) -> (the list, shares) between build and send


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
                                  attributes=request_attributes(instance, p_req_id, with_model=True))
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
                                  attributes=request_attributes(instance, d_req_id, with_model=True))


_start_load_kv_wrapper = observe_call(_on_start_load_kv, "read vLLM Mooncake connector metadata")


def _build_transfer_params_wrapper(wrapped, instance, args, kwargs):
    async def build():
        result = await wrapped(*args, **kwargs)
        if active():
            try:
                await _remember_shares(wrapped, instance, args, kwargs, result)
            except Exception:  # pylint: disable=broad-except
                own_error("split a vLLM Mooncake batch by request")
        return result

    return build()


async def _remember_shares(wrapped, instance, args, kwargs, result) -> None:
    names = ("ready_reqs", "agent_meta", "local_regions", "remote_regions")
    params = dict(zip(names, args))
    params.update((k, v) for k, v in kwargs.items() if k in names)
    src_ptrs, _, lengths, err_reqs, _ = result
    if not src_ptrs:
        return
    failed = set(err_reqs or ())
    ready = [(d_req_id, meta) for d_req_id, meta in params["ready_reqs"] if d_req_id not in failed]
    if len(ready) == 1:
        per_request = [(ready[0][1], len(lengths), sum(lengths))]
    else:
        # The same function, one request at a time: exactly that request's descriptors, in the same order.
        per_request = []
        for pair in ready:
            _, _, own_lengths, own_errors, _ = await wrapped(
                [pair], params["agent_meta"], params["local_regions"], params["remote_regions"])
            if not own_errors and own_lengths:
                per_request.append((pair[1], len(own_lengths), sum(own_lengths)))
        if sum(n for _, n, _ in per_request) != len(lengths):
            own_error("match a vLLM Mooncake batch to its requests")
            return
    agent_meta = params["agent_meta"]
    ranks = list(instance.transfer_topo.handshake_target_ranks(agent_meta.remote_tp_size))
    destination = ranks.index(agent_meta.remote_tp_rank) if agent_meta.remote_tp_rank in ranks else 0
    replicas = len(ranks) if getattr(instance, "use_mla", False) else 1
    _shares[id(src_ptrs)] = (src_ptrs, [
        {"key": meta.transfer_id, "bytes": nbytes, "descriptors": descriptors, "chunk_index": 0,
         "is_last_chunk": True, "destination_index": destination, "replica_factor": replicas}
        for meta, descriptors, nbytes in per_request if descriptors])


def _send_blocks_wrapper(wrapped, instance, args, kwargs):
    entry = None
    try:
        src_ptrs = args[1] if len(args) > 1 else kwargs.get("src_ptrs")
        entry = _shares.pop(id(src_ptrs), None)
        if entry is not None and entry[0] is not src_ptrs:
            entry = None  # a stale entry whose list was freed and its id reused
    except Exception:  # pylint: disable=broad-except
        own_error("find a vLLM Mooncake batch's requests")
    if entry is None or not active():
        return wrapped(*args, **kwargs)
    with kvt.split_transfer_scope(entry[1]):
        ret = wrapped(*args, **kwargs)
    if ret != 0:
        for share in entry[1]:
            _failed_sends[share["key"]] = True
    return ret


def _fetch_sending_wrapper(wrapped, instance, args, kwargs):
    async def fetch():
        sent = set(instance.finished_sending_reqs)  # completed sends; the call adds the expired ones
        done = await wrapped(*args, **kwargs)
        try:
            for p_req_id in done:
                transfer_id = _transfer_of_prefill.pop(p_req_id, None)
                if transfer_id is None:
                    continue
                failed = _failed_sends.pop(transfer_id, False)
                error = None if p_req_id in sent else (TRANSFER_FAILED if failed else EXPIRED)
                kvt.end_request(transfer_id, error_type=error)
        except Exception:  # pylint: disable=broad-except
            own_error("end vLLM Mooncake requests")
        return done

    return fetch()


def _handle_failed_recv_wrapper(wrapped, instance, args, kwargs):
    try:
        names = ("pull_metas", "req_ids", "reason")
        params = dict(zip(names, args))
        params.update((k, v) for k, v in kwargs.items() if k in names)
        for req_id in params["req_ids"]:
            pull_meta = params["pull_metas"].get(req_id)
            if pull_meta is not None and not pull_meta.failed:
                _failed_recvs[req_id] = TRANSFER_FAILED
    except Exception:  # pylint: disable=broad-except
        own_error("read a vLLM Mooncake receive failure")
    return wrapped(*args, **kwargs)


def _fetch_recving_wrapper(wrapped, instance, args, kwargs):
    async def fetch():
        done = await wrapped(*args, **kwargs)
        try:
            for d_req_id in done:
                transfer_id = _transfer_of_decode.pop(d_req_id, None)
                if transfer_id is not None:
                    kvt.end_receive(transfer_id, error_type=_failed_recvs.pop(d_req_id, None))
        except Exception:  # pylint: disable=broad-except
            own_error("end vLLM Mooncake receives")
        return done

    return fetch()


def patch(module) -> None:
    worker = module.MooncakeConnectorWorker
    patcher.wrap(worker, "start_load_kv", _start_load_kv_wrapper)
    patcher.wrap(worker, "_build_transfer_params", _build_transfer_params_wrapper)
    patcher.wrap(worker, "_send_blocks", _send_blocks_wrapper)
    patcher.wrap(worker, "fetch_finished_sending_reqs", _fetch_sending_wrapper)
    patcher.wrap(worker, "_handle_failed_recv", _handle_failed_recv_wrapper)
    patcher.wrap(worker, "fetch_finished_recving_reqs", _fetch_recving_wrapper)


def forget() -> None:
    for table in (_transfer_of_prefill, _failed_sends, _transfer_of_decode, _failed_recvs, _shares):
        table.clear()
