"""vllm-ascend's Mooncake connectors in pull mode (the decode reads the prefill's KV), request key = the prefill
request id (`remote_request_id` on the decode side, the id the prefill side knows the request by).

Decode side (initiator), in `KVCacheRecvingThread` (the connector worker hands it one pull per prefill rank read
from, on its executor's threads):
- `add_request(request_id, remote_request_id, ..., remote_handshake_port, ...)`: the request's first pull opens
  `kv_transfer.request` (role decode, op read); `vllm.request_id` is the decode's own id. Each pull names the
  prefill rank's handshake port (its side-channel port plus the rank's device index), so the request's ports in
  order are its destinations in peer-rank order: the destination index.
- `_transfer_kv_cache_all_groups(req_meta)` (and the hybrid connector's `_transfer_kv_cache`) builds one
  descriptor list and calls `batch_transfer_sync_read` once: it runs inside a transfer scope of the request, so
  the Mooncake engine module's send is the request's. A pull that raises marks the request failed, as does
  `_mark_failed_recv_request` (a pull skipped after an earlier one failed, or a reformat that failed).
- `_get_remote_metadata(host, port)`: the first pull from a prefill rank asks its side channel for its KV layout
  and engine port: one `kv_transfer.connect` (`vllm_ascend_metadata`) under the request.
- `_handle_request(req_meta)` runs each pull; when `_mark_request_task_done` inside it says the request's last
  pull is done, the request ends (ERROR `transfer_failed` when a pull of it failed).
Prefill side (peer), in `KVCacheSendingThread`:
- `add_delayed_request(request_id, ...)`: the worker's `start_load_kv` hands it a finished request whose KV this
  rank holds for the decode to read (`requests_to_send`): `kv_transfer.serve` opens, unless the decode's done
  message already came.
- `get_and_clear_finished_requests()` (the worker's `get_finished`): the requests the decode reported done, and
  those `KVCacheTaskTracker._retrieve_expired_requests` freed unread (ERROR `expired`): the serve ends.
Every read of vllm-ascend's state happens inside a wrapper's own guard: a renamed attribute costs a counted
`wrapper_error`, never an exception in its threads.
"""

import inspect
import threading

from otel_kvtransfer import semconv
from otel_kvtransfer.frameworks.vllm.common import EXPIRED, REQUEST_ID, TRANSFER_FAILED, BoundedMap, bind
from otel_kvtransfer.frameworks.vllm_ascend.common import FRAMEWORK, SERVING, patcher
from otel_kvtransfer.recording import integration as kvt
from otel_kvtransfer.recording.clock import now_ns
from otel_kvtransfer.recording.patching import active, observe_call, safely
from otel_kvtransfer.wiring import startup

BACKEND = "mooncake"
METADATA_CONNECT = "vllm_ascend_metadata"  # kv_transfer.connect's operation: a prefill rank's layout, asked once

_key_of_decode = BoundedMap()  # decode request id -> prefill request id (request span open)
_ports = BoundedMap()  # decode request id -> the prefill handshake ports its pulls read from, as added
_failed = BoundedMap()  # decode request id -> True when one of its pulls failed
_serving = BoundedMap()  # prefill request id -> True (serve span open)
_expired = BoundedMap()  # prefill request id -> True: freed unread
_pull = threading.local()  # .concluded: the request whose last pull `_mark_request_task_done` just counted

_RANKS = "_otel_kvt_ranks"  # set on a connector thread: its rank attributes, read once


def _rank_attributes(thread, role) -> dict:
    """The thread's tensor-parallel rank (`kv_transfer.tp_rank`); the first read names the process's role and rank
    in the start-up line."""
    ranks = getattr(thread, _RANKS, None)
    if ranks is None:
        rank = getattr(thread, "tp_rank", None)
        ranks = {semconv.TP_RANK: rank} if isinstance(rank, int) and not isinstance(rank, bool) else {}
        setattr(thread, _RANKS, ranks)
        startup.role_known(FRAMEWORK, role, ranks)
    return ranks


# --- decode: the initiator ---------------------------------------------------------------------------------------

_ADD_PARAMS = ("request_id", "remote_request_id", "remote_handshake_port")
_signatures: dict = {}  # add_request's function -> its parameter names (the two connectors order them apart)


def _add_params(wrapped, args, kwargs) -> dict:
    function = getattr(wrapped, "__func__", wrapped)
    if function not in _signatures:
        _signatures[function] = tuple(inspect.signature(wrapped).parameters)
    params = dict(zip(_signatures[function], args))
    params.update(kwargs)
    return {name: params.get(name) for name in _ADD_PARAMS}


def _on_add_request(instance, params) -> None:
    request_id, key = str(params["request_id"])[:256], params["remote_request_id"]
    port = params["remote_handshake_port"]
    ports = _ports.get(request_id)
    if ports is None:
        ports = _ports[request_id] = []  # through __setitem__: the map stays bounded
    if isinstance(port, int) and port not in ports:
        ports.append(port)
    if request_id in _key_of_decode:
        return
    _key_of_decode[request_id] = key
    attributes = {REQUEST_ID: request_id, **_rank_attributes(instance, semconv.ROLE_DECODE)}
    kvt.begin_request(key, backend=BACKEND, framework=SERVING, role=semconv.ROLE_DECODE, attributes=attributes)


def _add_request_wrapper(wrapped, instance, args, kwargs):
    """A pull handed to the thread: the request's first opens its span. Ungated, as the bookkeeping wrappers
    below: a pull's ending must be seen even when it began before recording did; `kvt` records only while
    recording."""
    params = safely("read a vllm-ascend pull", _add_params, wrapped, args, kwargs)
    if params is not None:
        safely("read a vllm-ascend pull", _on_add_request, instance, params)
    return wrapped(*args, **kwargs)


def _pull_scope(args, kwargs):
    req_meta = bind(("req_meta",), args, kwargs)["req_meta"]
    request_id = str(req_meta["request_id"])[:256]
    key = _key_of_decode.get(request_id)
    if key is None:
        return request_id, None
    ports = sorted(_ports.get(request_id) or ())
    port = req_meta.get("remote_handshake_port")
    return request_id, kvt.transfer_scope(key, chunk_index=0, is_last_chunk=True,
                                          destination_index=ports.index(port) if port in ports else 0)


def _transfer_wrapper(wrapped, instance, args, kwargs):
    """One pull from one prefill rank: its engine read is a send of the request."""
    if not active():
        return wrapped(*args, **kwargs)
    found = safely("scope a vllm-ascend pull", _pull_scope, args, kwargs)
    if found is None or found[1] is None:
        return wrapped(*args, **kwargs)
    request_id, scope = found
    try:
        with scope:
            return wrapped(*args, **kwargs)
    except Exception:
        _failed[request_id] = True
        raise


def _on_failed_recv(instance, args, kwargs) -> None:
    _failed[str(bind(("request_id",), args, kwargs)["request_id"])[:256]] = True


_failed_recv_wrapper = observe_call("read a vllm-ascend failed pull", _on_failed_recv, when=None)


def _on_task_done(instance, args, kwargs, token, all_done, error) -> None:
    if all_done:
        _pull.concluded = str(bind(("request_id",), args, kwargs)["request_id"])[:256]


_task_done_wrapper = observe_call("count a vllm-ascend pull", after=_on_task_done, when=None)


def _conclude() -> None:
    request_id = getattr(_pull, "concluded", None)
    _pull.concluded = None
    if request_id is None:
        return
    _ports.pop(request_id, None)
    failed = _failed.pop(request_id, False)
    key = _key_of_decode.pop(request_id, None)
    if key is not None:
        kvt.end_request(key, error_type=TRANSFER_FAILED if failed else None)


def _handle_request_wrapper(wrapped, instance, args, kwargs):
    """A pull, from start to its done message: the request ends after its last one (its reformat included)."""
    _pull.concluded = None
    try:
        return wrapped(*args, **kwargs)
    finally:
        safely("end a vllm-ascend request", _conclude)


def _metadata_wrapper(wrapped, instance, args, kwargs):
    """`_get_remote_metadata(host, port)`: a prefill rank's side channel asked for its layout (a ZMQ round trip):
    one `kv_transfer.connect`, ERROR when it raised (a side channel that never answered)."""
    if not active():
        return wrapped(*args, **kwargs)
    start = now_ns()
    try:
        result = wrapped(*args, **kwargs)
    except Exception as exc:
        safely("record a vllm-ascend metadata query", _connected, args, kwargs, start, type(exc).__qualname__)
        raise
    safely("record a vllm-ascend metadata query", _connected, args, kwargs, start, None)
    return result


def _connected(args, kwargs, start, error_type) -> None:
    params = bind(("remote_host", "remote_handshake_port"), args, kwargs)
    kvt.record_connect(METADATA_CONNECT, start, backend=BACKEND, framework=SERVING,
                       address=params.get("remote_host"), port=params.get("remote_handshake_port"),
                       error_type=error_type)


# --- prefill: the peer -------------------------------------------------------------------------------------------

def _on_delayed(instance, args, kwargs) -> None:
    request_id = bind(("request_id",), args, kwargs)["request_id"]
    # Only a request still waiting for the decode's done message (the call ignores the others too).
    if request_id in instance.task_tracker.reqs_to_process and request_id not in _serving:
        _serving[request_id] = True
        attributes = {REQUEST_ID: str(request_id)[:256], **_rank_attributes(instance, semconv.ROLE_PREFILL)}
        kvt.begin_serve(request_id, backend=BACKEND, framework=SERVING, attributes=attributes)


_delayed_wrapper = observe_call("read a vllm-ascend request ready to be read", _on_delayed)


def _on_expired(instance, args, kwargs, token, expired, error) -> None:
    for request_id in expired or ():
        if request_id in _serving:
            _expired[request_id] = True


_expired_wrapper = observe_call("read vllm-ascend expiries", after=_on_expired, when=None)


def _on_finished_sending(instance, args, kwargs, token, done, error) -> None:
    for request_id in done or ():
        if _serving.pop(request_id, None):
            kvt.end_serve(request_id, error_type=EXPIRED if _expired.pop(request_id, None) else None)


_finished_sending_wrapper = observe_call("end vllm-ascend serves", after=_on_finished_sending, when=None)


def _patch(module, transfer_calls) -> None:
    recv, send = module.KVCacheRecvingThread, module.KVCacheSendingThread
    patcher.wrap(recv, "add_request", _add_request_wrapper)
    patcher.wrap(recv, "_handle_request", _handle_request_wrapper)
    patcher.wrap(recv, "_mark_request_task_done", _task_done_wrapper)
    for call in transfer_calls:
        patcher.wrap(recv, call, _transfer_wrapper)
    patcher.wrap(recv, "_get_remote_metadata", _metadata_wrapper)
    patcher.wrap(recv, "_mark_failed_recv_request", _failed_recv_wrapper)  # the connector's only
    patcher.wrap(send, "add_delayed_request", _delayed_wrapper)
    patcher.wrap(send, "get_and_clear_finished_requests", _finished_sending_wrapper)
    patcher.wrap(module.KVCacheTaskTracker, "_retrieve_expired_requests", _expired_wrapper)


def patch_connector(module) -> None:
    _patch(module, ("_transfer_kv_cache_all_groups",))


def patch_hybrid(module) -> None:
    _patch(module, ("_transfer_kv_cache_all_groups", "_transfer_kv_cache"))


def forget() -> None:
    for table in (_key_of_decode, _ports, _failed, _serving, _expired):
        table.clear()
    _pull.concluded = None
