"""vLLM's NixlConnector in pull mode (decode reads prefill's KV), request key = the prefill request id.

Decode side (initiator), in `NixlPullConnectorWorker`:
- `start_load_kv(metadata)`: each request in `metadata.reqs_to_recv` with local blocks opens
  `kv_transfer.request` (role decode, op read) under the prefill request id it reads from (`meta.remote.request_id`,
  the id the prefill side knows it by); `vllm.request_id` is decode's own id. Under the client's traceparent
  when the request came with one (trace_context.py; the prefill's serve span likewise).
- `_read_blocks(...)` posts one READ from one prefill rank (`make_prepped_xfer` + `transfer`): it runs inside a
  transfer scope of that request (destination index = the rank's position among the ranks read from), so the
  NIXL engine module's handle, completed when vLLM polls it, becomes a `kv_transfer.send` of the request.
- `get_transfer_results()`: requests in `finished_recving` end (ERROR `transfer_failed` when also in
  `failed_recving`).
- `_nixl_handshake(host, port, ...)` (on vLLM's handshake thread, before a request's first read from a new
  prefill): one `kv_transfer.connect`, `nixl_handshake`, towards the prefill's side channel.
Prefill side (peer), same class:
- `start_load_kv(metadata)`: a request in `metadata.reqs_to_send` has its KV ready to be read: `kv_transfer.serve`
  opens; `get_transfer_results()` ends it when decode's completion notification arrived (`finished_sending`),
  ERROR `expired` when `_reap_expired_send_leases` freed it unread. A decode that still reads that KV afterwards
  (its read outlived the lease, or no expiry reached it) notifies a request vLLM no longer knows:
  `NixlKVConnectorStats.record_notification_after_expiry`, called by `_get_new_notifs` with the request id in its
  local `req_id`, becomes a late arrival (`kv_transfer.late_completion` on the serve span while it is held).
vLLM 0.33: a remote whose `registration_generation` grew (it slept and registered its KV cache again) is dropped
and handshaken anew before the read (`_read_blocks_for_req`): the request span carries `kv_transfer.rehandshake`
= true and the re-handshake is counted (`rehandshake`); sleep mode's `unregister_kv_caches` / `restore_kv_caches`
are counted (`kv_unregistered`, `kv_reregistered`; events.py). Its strided (Nx5) descriptor rows are the NIXL
engine module's business (bytes = length x count per row).
Every read of vLLM's state happens inside a wrapper's own guard: a renamed attribute costs a counted
`wrapper_error`, never an exception in vLLM's loops.
Push mode (`NixlPushConnectorWorker`, prefill writes) is not instrumented at the framework level; its handles
still become raw `kv_transfer.send` spans through the NIXL engine module.
"""

import sys
from types import FrameType
from typing import Optional

from otel_kvtransfer import semconv
from otel_kvtransfer.frameworks.vllm import common, events, trace_context
from otel_kvtransfer.recording import inflight
from otel_kvtransfer.recording import integration as kvt
from otel_kvtransfer.recording.clock import now_ns
from otel_kvtransfer.recording.patching import active, observe_call, safely

BACKEND = "nixl"
PULL_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
STATS_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats"
NOTIFICATIONS_READER = "_get_new_notifs"  # the worker method that finds a notification with no lease
FRAMES_UP = 8  # the reader's frame lies this close above the wrapper's observer (wrapt, observe_call, safely)

_key_of_decode = common.BoundedMap()  # decode request id -> prefill request id (request span open)
_serving = common.BoundedMap()  # prefill request id -> True (serve span open)
_expired = common.BoundedMap()  # prefill request id -> True: its lease expired unread


def _is_pull(worker) -> bool:
    return getattr(worker, "_TRANSFER_MODE", "pull") == "pull"


def _rehandshake_due(worker, remote) -> bool:
    """vLLM >= 0.33 drops a loaded remote whose registration generation grew, and handshakes with it again."""
    known = getattr(worker, "_remote_registration_generations", None)
    generation = getattr(remote, "registration_generation", 0)
    if known is None or not generation:
        return False
    loaded = worker._remote_agents
    return known.get(remote.engine_id, 0) < generation and remote.engine_id in loaded


def _on_start_load_kv(instance, args, kwargs) -> None:
    """The scheduler's metadata for this step: reads to post (decode) and KV ready to be read (prefill)."""
    if not _is_pull(instance):
        return
    metadata = args[0] if args else kwargs["metadata"]
    for req_id, meta in metadata.reqs_to_recv.items():
        remote = getattr(meta, "remote", None)
        if remote is None or not common.has_blocks(meta.local_block_ids) or req_id in _key_of_decode:
            continue
        _key_of_decode[req_id] = remote.request_id
        attributes = common.request_attributes(instance, req_id, with_model=True)
        if _rehandshake_due(instance, remote):
            attributes[common.REHANDSHAKE] = True
        kvt.begin_request(remote.request_id, backend=BACKEND, framework=common.FRAMEWORK, role=semconv.ROLE_DECODE,
                          attributes=attributes, parent=trace_context.parent_of(metadata, req_id))
    for req_id in metadata.reqs_to_send:
        if req_id not in _serving:
            _serving[req_id] = True
            kvt.begin_serve(req_id, backend=BACKEND, framework=common.FRAMEWORK,
                            attributes=common.request_attributes(instance, req_id, with_model=True),
                            parent=trace_context.parent_of(metadata, req_id))


_start_load_kv_wrapper = observe_call("read vLLM NIXL connector metadata", _on_start_load_kv)
_worker_init_wrapper = observe_call("read a vLLM NIXL worker's rank", after=common.learn_ranks, when=None)


def _read_scope(instance, kwargs):
    """The transfer scope of one READ from one prefill rank: the rank's place among the ranks read from."""
    rank = kwargs["read_spec"].remote_rank
    ranks = sorted(instance.tp_mappings[kwargs["dst_engine_id"]].all_source_ranks)
    return kvt.transfer_scope(kwargs["remote_request_id"], chunk_index=0, is_last_chunk=True,
                              destination_index=ranks.index(rank) if rank in ranks else 0,
                              attributes={semconv.PEER_RANK: rank})


def _read_blocks_wrapper(wrapped, instance, args, kwargs):
    if not active():
        return wrapped(*args, **kwargs)
    scope = safely("scope a vLLM NIXL read", _read_scope, instance, kwargs)
    if scope is None:
        return wrapped(*args, **kwargs)
    with scope:
        return wrapped(*args, **kwargs)


def _sends_before(instance, args, kwargs):
    """(the done_sending set the call adds expired leases to, a copy of it before the call), or None."""
    done_sending = args[0] if args else kwargs.get("done_sending")
    return None if done_sending is None else (done_sending, set(done_sending))


def _on_reaped(instance, args, kwargs, sends, result, error) -> None:
    if sends is not None:
        done_sending, before = sends
        for req_id in set(done_sending) - before:
            _expired[req_id] = True


# Ungated: it only marks leases; the spans they end are recorded only while recording.
_reap_expired_wrapper = observe_call("read vLLM NIXL expiries", _sends_before, _on_reaped, when=None)


def _on_read_blocks_for_req(instance, args, kwargs) -> None:
    meta = common.bind(("req_id", "meta"), args, kwargs)["meta"]
    if _rehandshake_due(instance, meta.remote):
        events.count(events.REHANDSHAKE, BACKEND)


_read_blocks_for_req_wrapper = observe_call("read a vLLM NIXL remote's registration", _on_read_blocks_for_req)


def _on_transfer_results(instance, args, kwargs, token, results, error) -> None:
    if not _is_pull(instance):
        return
    failed = results.failed_recving or ()
    for req_id in results.finished_recving or ():
        key = _key_of_decode.pop(req_id, None)
        if key is not None:
            kvt.end_request(key, error_type=common.TRANSFER_FAILED if req_id in failed else None)
    for req_id in results.finished_sending or ():
        if _serving.pop(req_id, None):
            kvt.end_serve(req_id, error_type=common.EXPIRED if _expired.pop(req_id, None) else None)


# Ungated: its tables are emptied on uninstrument, and `kvt` records only while recording.
_transfer_results_wrapper = observe_call("end vLLM NIXL requests", after=_on_transfer_results, when=None)


def _unleased_request_id():
    """The request id `_get_new_notifs` is looking at: its local `req_id`, a few frames up; None elsewhere."""
    frame: Optional[FrameType] = sys._getframe(1)
    for _ in range(FRAMES_UP):
        if frame is None:
            return None
        if frame.f_code.co_name == NOTIFICATIONS_READER:
            req_id = frame.f_locals.get("req_id")
            return req_id if isinstance(req_id, str) else None
        frame = frame.f_back
    return None


def _on_notification_after_expiry(instance, args, kwargs) -> None:
    req_id = _unleased_request_id()
    if req_id is not None:
        kvt.late_arrival(req_id, backend=BACKEND)


_after_expiry_wrapper = observe_call("read a vLLM NIXL notification after expiry", _on_notification_after_expiry)


def _handshake_wrapper(wrapped, instance, args, kwargs):
    """`_nixl_handshake(host, port, ...)`: the decode asks a prefill's side channel for its agents' metadata and loads
    it (NIXL's add_remote_agent, a connect of its own inside this one): one `kv_transfer.connect`
    (`nixl_handshake`, framework vllm), its peer the side channel's address, ERROR when it raised (a peer that
    never answered: zmq's timeout)."""
    if not active():
        return wrapped(*args, **kwargs)
    start = now_ns()  # `start`, `args` and `kwargs` are read by _handshake_in_progress
    try:
        result = wrapped(*args, **kwargs)
    except Exception as exc:
        safely("record a vLLM NIXL handshake", _handshaken, args, kwargs, start, type(exc).__qualname__)
        raise
    safely("record a vLLM NIXL handshake", _handshaken, args, kwargs, start, None)
    return result


def _handshaken(args, kwargs, start, error_type) -> None:
    params = common.bind(("host", "port"), args, kwargs)
    kvt.record_connect("nixl_handshake", start, backend=BACKEND, framework=common.FRAMEWORK,
                       address=params.get("host"), port=params.get("port"), error_type=error_type)


def _handshake_in_progress(frame_locals):
    """A handshake still waiting for its peer, from its wrapper's frame (read by the in-flight scan)."""
    start = frame_locals.get("start")
    if not isinstance(start, int):
        return None
    params = common.bind(("host", "port"), frame_locals.get("args") or (), frame_locals.get("kwargs") or {})
    peer = f"{params.get('host')}:{params.get('port')}"[:256]
    return (start, None, peer, None, BACKEND, semconv.INFLIGHT_CONNECT)


inflight.register_wrapper(_handshake_wrapper.__code__, _handshake_in_progress)


def patch(module) -> None:
    worker = module.NixlPullConnectorWorker
    base = getattr(module, "NixlBaseConnectorWorker", worker.__mro__[1])  # owns the completion bookkeeping
    common.patcher.wrap(worker, "__init__", _worker_init_wrapper)
    common.patcher.wrap(worker, "start_load_kv", _start_load_kv_wrapper)
    common.patcher.wrap(worker, "_read_blocks", _read_blocks_wrapper)
    common.patcher.wrap(base, "_reap_expired_send_leases", _reap_expired_wrapper)
    common.patcher.wrap(base, "get_transfer_results", _transfer_results_wrapper)
    common.patcher.wrap(base, "_nixl_handshake", _handshake_wrapper)
    # vLLM >= 0.33 only (absent before: not wrapped, nothing else changes)
    common.patcher.wrap(worker, "_read_blocks_for_req", _read_blocks_for_req_wrapper)
    common.patcher.wrap(base, "unregister_kv_caches", events.registration_wrapper(events.UNREGISTER, BACKEND))
    common.patcher.wrap(base, "restore_kv_caches", events.registration_wrapper(events.REREGISTER, BACKEND))


def patch_stats(module) -> None:
    if hasattr(module, "NixlKVConnectorStats"):  # optional: a release without it keeps the other wrappers
        common.patcher.wrap(module.NixlKVConnectorStats, "record_notification_after_expiry", _after_expiry_wrapper)


def forget() -> None:
    for table in (_key_of_decode, _serving, _expired):
        table.clear()
