"""Prefill side of sglang's PD transfer (Mooncake or NIXL): what each engine call is for.

The transfer worker threads run the manager's `transfer_worker` (bound at thread start, so it is never wrapped
itself); what it calls is:
- `FastQueue.put` (scheduler thread, inside `add_transfer_request`): the chunk is tagged with its 0-based index in
  its room and whether it is the cached-prefix early send (made inside sglang's `maybe_send_cached_prefix_chunk`).
- `FastQueue.get` (worker thread): the dequeued chunk becomes this thread's current chunk.
- `send_kvcache` / `send_kvcache_slice` / `send_kvcache_dcp` / `_do_staging_transfer` (payload kv),
  `maybe_send_extra` (state), `send_aux` (aux): each runs inside one transfer scope for (chunk x destination x
  payload); the executor it is handed is swapped for one that binds the scope on the executor's threads, so the
  per-layer engine calls of the sliced path join it too.
- NIXL: the same methods (plus `send_kvcache_mixed`) only post NIXL handles; the worker polls them to completion
  afterwards. The NIXL engine module remembers the scope current at each post, so every handle becomes one
  `kv_transfer.send` of this request, from its post until its completion is seen. `maybe_send_extra` is a
  generator there: the scope is entered around each of its steps.
- `send_aux_data_to_endpoint` (Mooncake's aux over ZMQ/TCP instead of the engine): one call of the aux scope per buffer.
- `conclude_transfer`: a destination skipped because its session already failed gets a 0-byte ERROR send.
- `update_status`: Success / Failed of a room ends its `kv_transfer.request`.
A staging chunk deferred by back-pressure (`_do_staging_transfer` -> (-1, True), re-queued) is not an error.
The request begins at the sender's `__init__` (bootstrap), under sglang's own request span when sglang's
tracing is on (`create_sender` hands us the Req). `Scheduler.run_batch` of a prefill scheduler gives the compute
intervals (on a CUDA device, from timing events on its streams: `_batch_started` says which). Every wrapper
passes return values and exceptions through unchanged; its own failures are counted (`wrapper_error` drops) and
logged at debug level.
"""

import inspect
import threading
from time import time_ns
from typing import Any, Dict

from otel_kvtransfer import semconv
from otel_kvtransfer.frameworks.sglang import client_ids
from otel_kvtransfer.frameworks.sglang.common import (
    FRAMEWORK,
    MOONCAKE,
    NIXL,
    backend_of,
    classes,
    error_type_of,
    learn_poll_states,
    patcher,
    peer_rank,
    poll_name,
    rank_attributes,
    register,
    room_attributes,
    sglang_parent,
)
from otel_kvtransfer.recording import device_clock, integration, records
from otel_kvtransfer.recording.clock import now_ns
from otel_kvtransfer.recording.patching import active, count_drop, observe_call, remember_argument, safely

_tls = threading.local()  # .chunk (worker), .enqueue / .early / .req (scheduler thread)
_TAG = "_otel_kvt"  # attribute set on a TransferKVChunk: (chunk_index, prefix_early_send)

# room -> next chunk index; bounded: entries of concluded rooms are removed, the rest capped.
_next_chunk: Dict[Any, int] = {}
_MAX_ROOMS = 65536


def forget_rooms() -> None:
    _next_chunk.clear()
    client_ids.forget_all()


def _backend(obj):
    """The transfer engine behind a manager or sender we instrument; None for any other backend."""
    return backend_of(obj, "sender" if hasattr(obj, "kv_mgr") else "manager")


def _is_prefill(mgr) -> bool:
    mode = getattr(mgr, "disaggregation_mode", None)
    return getattr(mode, "name", None) == "PREFILL"


# --- request lifecycle ----------------------------------------------------------------------------------------


# PrefillBootstrapQueue.create_sender(req, ...): the Req, so the sender's request gets its rid and parent.
_create_sender_wrapper = remember_argument(_tls, "req", 0, "req")


def _on_sender_init(instance, args, kwargs, token, result, error) -> None:
    backend = _backend(instance)
    if backend is None or instance.conclude_state is not None or not _is_prefill(instance.kv_mgr):
        return
    if getattr(instance.kv_mgr, "is_dummy_cp_rank", False):
        return
    req = getattr(_tls, "req", None)
    rid = getattr(req, "rid", None) if req is not None else None
    stats = getattr(req, "time_stats", None) if req is not None else None
    parent = sglang_parent(getattr(stats, "trace_ctx", None)) or sglang_parent(getattr(instance, "trace_ctx", None))
    room = instance.bootstrap_room
    client_ids.remember(room, rid)  # for its sends, which see only the room
    attributes = room_attributes(room, rid)
    attributes.update(rank_attributes(instance.kv_mgr))
    integration.begin_request(room, backend=backend, framework=FRAMEWORK, attributes=attributes, parent=parent)


_sender_init_wrapper = observe_call("sender init", after=_on_sender_init)


def _on_update_status(instance, args, kwargs, token, result, error) -> None:
    if _backend(instance) is None or not _is_prefill(instance):
        return
    room = args[0] if args else kwargs.get("bootstrap_room")
    name = poll_name(instance.request_status.get(room))
    if name == "Success":
        _conclude(room, None)
    elif name == "Failed":
        _conclude(room, error_type_of(instance.failure_records.get(room)))


_update_status_wrapper = observe_call("update_status", after=_on_update_status)


def _conclude(room, error_type) -> None:
    _next_chunk.pop(room, None)
    client_ids.forget(room)
    integration.end_request(room, error_type=error_type)


def _on_sender_clear(instance, args, kwargs) -> None:
    """A sender cleared before its room concluded (scheduler abort paths): end the request as failed."""
    if _backend(instance) is not None and _is_prefill(instance.kv_mgr):
        status = poll_name(instance.kv_mgr.request_status.get(instance.bootstrap_room))
        if status not in ("Success", "Failed"):
            _conclude(instance.bootstrap_room, "cleared")


_sender_clear_wrapper = observe_call("sender clear", _on_sender_clear)


# --- chunks: enqueue (scheduler thread) and dequeue (worker thread) -----------------------------------------


def _on_enqueue(instance, args, kwargs) -> None:
    """The chunk the scheduler enqueues now is the cached-prefix early send when made inside that send (and not
    the last chunk): remembered for `FastQueue.put`, which tags it."""
    is_last = args[3] if len(args) > 3 else kwargs.get("is_last_chunk", False)
    _tls.enqueue = (bool(getattr(_tls, "early", False)) and not is_last,)


def _enqueued(instance, args, kwargs, token, result, error) -> None:
    _tls.enqueue = None


_add_transfer_request_wrapper = observe_call("add_transfer_request", _on_enqueue, _enqueued, on_raise=True)


def _tag(chunk, early: bool) -> None:
    room = chunk.room
    index = _next_chunk.get(room, 0)
    if index == 0 and len(_next_chunk) >= _MAX_ROOMS:
        _next_chunk.pop(next(iter(_next_chunk)))  # oldest room: its later chunks restart at 0 (counted)
        count_drop("chunk_index_evicted")
    _next_chunk[room] = index + 1
    setattr(chunk, _TAG, (index, early))


def _enqueueing() -> bool:
    return getattr(_tls, "enqueue", None) is not None


def _on_queue_put(instance, args, kwargs) -> None:
    item = args[0] if args else kwargs.get("item")
    if isinstance(item, classes["chunk"]) and not hasattr(item, _TAG):
        _tag(item, _tls.enqueue[0])


# Only while the scheduler is inside add_transfer_request: sglang's other FastQueues pass straight through.
_queue_put_wrapper = observe_call("queue put", _on_queue_put, when=_enqueueing)


def _on_queue_get(instance, args, kwargs, token, item, error) -> None:
    cls = classes.get("chunk")
    if cls is not None and isinstance(item, cls):
        if not hasattr(item, _TAG):  # enqueued before we were instrumented
            _tag(item, False)
        _tls.chunk = item
    elif item is None:
        _tls.chunk = None


# Always, even while not recording: the worker's current chunk must follow its queue.
_queue_get_wrapper = observe_call("queue get", after=_on_queue_get, when=None)


# --- transfers -----------------------------------------------------------------------------------------------


class _ScopedExecutor:
    """Stands in for the worker's ThreadPoolExecutor: each submitted function runs bound to the scope."""

    __slots__ = ("_executor", "_scope")

    def __init__(self, executor, scope):
        self._executor = executor
        self._scope = scope

    def submit(self, fn, *args, **kwargs):
        scope = self._scope

        def bound(*a, **kw):
            with scope.bind():
                return fn(*a, **kw)

        return self._executor.submit(bound, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._executor, name)


def _destination(mgr, room, session):
    """(destination_index, replica factor, the destination's rank or None).

    The index is the destination's position among the room's non-dummy destinations ordered by their ranks
    (sglang lists them in the order they registered, which differs between requests); when a rank is unknown,
    by sglang's own order. One pass over the room's few destinations, as before."""
    mine = peer_rank(mgr, session)
    by_rank = by_order = 0
    seen, all_known = False, mine is not None
    infos = mgr.transfer_infos.get(room) or {}
    for key, info in list(infos.items()):
        if getattr(info, "is_dummy", False):
            continue
        if key == session:
            seen = True
            continue
        if not seen:
            by_order += 1
        rank = peer_rank(mgr, key) if all_known else None
        if rank is None:
            all_known = False
        elif rank < mine or (rank == mine and not seen):
            by_rank += 1
    replica = getattr(mgr, "_kv_replica_factor", None) or 1
    return (by_rank if all_known else by_order), int(replica), mine


def _send_attributes(room, rank) -> dict:
    """A send's own attributes, with its request's client id (`sglang.rid`: the one id every attempt of a retried
    request shares); the sending rank comes from its request (the builder repeats it)."""
    attrs = room_attributes(room, client_ids.rid_of(room))
    if rank is not None:
        attrs[semconv.PEER_RANK] = rank
    return attrs


# How each backend names a destination: the argument of its send methods, and the attribute of its TransferInfo.
# The room's transfer_infos are keyed by it.
_SESSION_NAMES = {MOONCAKE: "mooncake_session_id", NIXL: "peer_name"}
_REQ_SESSION = {MOONCAKE: "mooncake_session_id", NIXL: "agent_name"}


def _session_of(backend, args, kwargs, session_pos, req_pos):
    if session_pos is not None:
        if len(args) > session_pos:
            return args[session_pos]
        return kwargs.get(_SESSION_NAMES[backend])
    req = args[req_pos] if len(args) > req_pos else kwargs.get("req")
    return getattr(req, _REQ_SESSION[backend], None)


def _scoped_steps(generator, scope):
    """A generator of NIXL handles (posted lazily, as the caller iterates): each step runs inside the scope, so
    the scope is never left entered on the thread while the caller holds the generator."""
    while True:
        with scope:
            try:
                item = next(generator)
            except StopIteration as stop:
                return stop.value
        yield item


def _transfer_wrapper(backend, payload, session_pos, req_pos, executor_pos):
    """A wrapper running one send method of a manager inside one transfer scope."""

    what = f"transfer scope {payload}"

    def scoped(instance, chunk, args, kwargs):
        """(scope, args, kwargs): the call's arguments with its executor bound to the scope."""
        index, early = getattr(chunk, _TAG, (0, False))
        session = _session_of(backend, args, kwargs, session_pos, req_pos)
        destination, replica, rank = _destination(instance, chunk.room, session)
        scope = integration.transfer_scope(
            chunk.room,
            chunk_index=index,
            payload=payload,
            destination_index=destination,
            replica_factor=replica,
            is_last_chunk=bool(chunk.is_last_chunk),
            prefix_early_send=early,
            attributes=_send_attributes(chunk.room, rank),
        )
        if executor_pos is not None:
            if len(args) > executor_pos:
                args = args[:executor_pos] + (_ScopedExecutor(args[executor_pos], scope),) + args[executor_pos + 1:]
            elif kwargs.get("executor") is not None:
                kwargs = dict(kwargs, executor=_ScopedExecutor(kwargs["executor"], scope))
        return scope, args, kwargs

    def wrapper(wrapped, instance, args, kwargs):
        chunk = getattr(_tls, "chunk", None)
        if chunk is None or not active() or integration.current_scope() is not None:
            return wrapped(*args, **kwargs)
        made = safely(what, scoped, instance, chunk, args, kwargs)
        if made is None:
            return wrapped(*args, **kwargs)
        scope, args, kwargs = made
        if payload == semconv.PAYLOAD_STATE and backend == NIXL:
            result = wrapped(*args, **kwargs)
            return _scoped_steps(result, scope) if inspect.isgenerator(result) else result
        with scope:
            result = wrapped(*args, **kwargs)
            safely("transfer result", _check_result, scope, payload, result)
            return result

    return wrapper


def _check_result(scope, payload, result) -> None:
    """A send method that failed before any engine call (an unreachable session): the scope is marked failed."""
    if not is_deferred(result):
        rc = result[0] if isinstance(result, tuple) else result
        if isinstance(rc, int) and rc != 0 and not scope.calls:
            scope.set_error(f"{payload}_send_failed")


def is_deferred(result) -> bool:
    """`_do_staging_transfer` answering (-1, True): the staging buffer is not ready, sglang re-queued the chunk
    (normal back-pressure). Nothing moved and nothing failed: no span now, the retry gets its own."""
    return isinstance(result, tuple) and len(result) == 2 and result[1] is True


# Aux over ZMQ/TCP (SGLANG_MOONCAKE_SEND_AUX_TCP=1, or a Mooncake NVLink pool): sglang sends each aux buffer with
# send_aux_data_to_endpoint, not through the engine, so the engine wrapper never sees it. Each such message is
# delivered as one call of the send_aux transfer scope, with the exact bytes of the buffer it carries.
AUX_TCP_PROTOCOL = "tcp"


def _in_scope() -> bool:
    return integration.current_scope() is not None and active()


def _started(instance, args, kwargs) -> int:
    return now_ns()  # the records' clock: this call goes to the builder as an engine call would


def _aux_sent(instance, args, kwargs, start, result, error) -> None:
    data = args[5] if len(args) > 5 else kwargs.get("data")
    remote = args[0] if args else kwargs.get("remote")
    port = args[1] if len(args) > 1 else kwargs.get("dst_port")
    rc, error_type = (0, None) if error is None else (-1, type(error).__qualname__)
    integration.deliver(records.call(start, now_ns(), len(data) if data is not None else 0, 1, semconv.OP_WRITE,
                                     f"{remote}:{port}", AUX_TCP_PROTOCOL, rc, error_type, MOONCAKE))


_aux_tcp_wrapper = observe_call("aux over tcp", _started, _aux_sent, when=_in_scope, on_raise=True)


def _on_conclude_transfer(instance, args, kwargs) -> None:
    """A destination skipped because its session is known dead: a 0-byte ERROR send for it."""
    chunk = getattr(_tls, "chunk", None)
    if chunk is None or integration.current_scope() is not None:
        return
    room = kwargs.get("bootstrap_room")
    reason = str(kwargs.get("failure_reason") or "")
    if (_backend(instance) is not None and room == chunk.room and poll_name(kwargs.get("status")) == "Failed"
            and ("is not alive" in reason or "layout" in reason)):
        failed = set(getattr(instance, "failed_sessions", ())) | set(getattr(instance, "state_layout_rejections", {}))
        session = next((s for s in (instance.transfer_infos.get(room) or {}) if s in failed), None)
        destination, replica, rank = _destination(instance, room, session)
        index, early = getattr(chunk, _TAG, (0, False))
        scope = integration.transfer_scope(
            room, chunk_index=index, payload=semconv.PAYLOAD_KV, destination_index=destination,
            replica_factor=replica, is_last_chunk=bool(chunk.is_last_chunk), prefix_early_send=early,
            attributes=_send_attributes(room, rank))
        scope.set_error(error_type_of(reason))
        with scope:
            pass


_conclude_transfer_wrapper = observe_call("conclude_transfer", _on_conclude_transfer)


# --- scheduler: early cached-prefix send and compute ---------------------------------------------------------


def _early_send_wrapper(wrapped, instance, args, kwargs):
    """sglang's maybe_send_cached_prefix_chunk: a chunk enqueued inside it is the cached-prefix early send."""
    previous = getattr(_tls, "early", False)
    _tls.early = True
    try:
        return wrapped(*args, **kwargs)
    finally:
        _tls.early = previous


def _batch_started(instance, args, kwargs):
    """The start of a prefill scheduler's batch; None (nothing recorded) on any other scheduler.

    On a CPU (or any device without timing events) the host's clock, as the forward runs inside the call. On a
    CUDA device sglang returns once the forward is enqueued (the overlap scheduler; the normal loop's forward
    also ends later, on the device), so the batch is bracketed by timing events instead (device_clock), on two
    streams: the scheduler thread's current stream (where sglang stages the batch's inputs, and where the normal
    loop runs the forward) and the model runner's `forward_stream` (where the overlap loop runs it, behind the
    previous batch's forward). The start is the later of the two start events: before both are reached the
    forward cannot begin (under overlap it first waits for the previous forward and, through `wait_stream`, for
    the staged inputs), and from then the batch's step holds the device; when the device then idles while the
    host still prepares and launches, that time is in the interval, as it was in the host's. The end is the
    later of the two end events, recorded as run_batch returns: every kernel it launched has run. (sglang's own
    `copy_done` is recorded a little later, after the result's copy to the host, and without timing.)"""
    if not _is_prefill(instance):
        return None
    clock = device_clock.for_device(getattr(instance, "device", None))
    if clock is None:
        return time_ns()
    streams = [clock.current_stream()]
    forward = getattr(instance, "forward_stream", None)
    if forward is not None and forward != streams[0]:
        streams.append(forward)
    return clock, streams, clock.begin(streams)


def _batch_ran(instance, args, kwargs, start, result, error) -> None:
    if start is None:
        return
    batch = args[0] if args else kwargs.get("batch")
    if isinstance(start, int):
        record_batch_compute(batch, start, time_ns())
        return
    clock, streams, token = start
    clock.end(token, streams, transferring_rooms(batch))  # even with no room: its events are let go there


# Scheduler.run_batch of a prefill scheduler: one compute interval for every room in the batch.
_run_batch_wrapper = observe_call("run_batch", _batch_started, _batch_ran)


def transferring_rooms(batch) -> list:
    """Rooms of the batch that really transfer. sglang's warm-up and health requests carry its fake bootstrap
    host (room 0, or the DP rank) and a fake sender: they make no compute record, whatever their room number."""
    fake = _fake_host()
    return [r.bootstrap_room for r in (getattr(batch, "reqs", None) or ())
            if getattr(r, "bootstrap_room", None) is not None
            and (fake is None or getattr(r, "bootstrap_host", None) != fake)]


def record_batch_compute(batch, start_ns: int, end_ns: int) -> None:
    """A batch's compute interval on the host's clock, for the rooms of it that really transfer."""
    rooms = transferring_rooms(batch)
    if rooms:
        integration.record_compute(rooms, start_ns, end_ns)


_FAKE_HOST = {"host": None}  # sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST, once sglang has loaded it


def _fake_host():
    if _FAKE_HOST["host"] is None:
        import sys

        module = sys.modules.get("sglang.srt.disaggregation.utils")  # loaded by every disaggregation scheduler
        _FAKE_HOST["host"] = getattr(module, "FAKE_BOOTSTRAP_HOST", None)
    return _FAKE_HOST["host"]


# --- patching, module by module (called by the post-import hooks of this package's __init__) -----------------


def patch_common_utils(module) -> None:
    classes["chunk"] = module.TransferKVChunk
    patcher.wrap(module.FastQueue, "put", _queue_put_wrapper)
    patcher.wrap(module.FastQueue, "get", _queue_get_wrapper)


def patch_common_conn(module) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    learn_poll_states(KVPoll)
    patcher.wrap(module.CommonKVManager, "update_status", _update_status_wrapper)
    patcher.wrap(module.CommonKVManager, "conclude_transfer", _conclude_transfer_wrapper)
    patcher.wrap(module.CommonKVSender, "__init__", _sender_init_wrapper)
    patcher.wrap(module.CommonKVSender, "clear", _sender_clear_wrapper)


# method -> (payload, position of the destination's session / peer name, position of req, position of
# executor); positions exclude self and were read from sglang 0.5.23's signatures.
TRANSFER_METHODS = {
    "send_kvcache": (semconv.PAYLOAD_KV, 0, None, 4),
    "send_kvcache_slice": (semconv.PAYLOAD_KV, 0, None, 7),
    "send_kvcache_dcp": (semconv.PAYLOAD_KV, 0, None, None),
    "_do_staging_transfer": (semconv.PAYLOAD_KV, None, 2, 5),
    "maybe_send_extra": (semconv.PAYLOAD_STATE, None, 0, 2),
    "send_aux": (semconv.PAYLOAD_AUX, None, 0, None),
}
# NixlKVManager's: each posts NIXL handles and returns them (maybe_send_extra yields them); no executor.
NIXL_TRANSFER_METHODS = {
    "send_kvcache": (semconv.PAYLOAD_KV, 0, None, None),
    "send_kvcache_slice": (semconv.PAYLOAD_KV, 0, None, None),
    "send_kvcache_mixed": (semconv.PAYLOAD_KV, 0, None, None),
    "send_kvcache_dcp": (semconv.PAYLOAD_KV, 0, None, None),
    "_do_staging_transfer": (semconv.PAYLOAD_KV, None, 3, None),
    "maybe_send_extra": (semconv.PAYLOAD_STATE, 0, None, None),
    "send_aux": (semconv.PAYLOAD_AUX, 0, None, None),
}


def _wrap_transfer_methods(manager, backend: str, methods: dict) -> None:
    for name, (payload, session_pos, req_pos, executor_pos) in methods.items():
        method = manager.__dict__.get(name)
        if method is None:
            continue
        params = list(inspect.signature(method).parameters)[1:]
        if "executor" in params:
            executor_pos = params.index("executor")
        patcher.wrap(manager, name, _transfer_wrapper(backend, payload, session_pos, req_pos, executor_pos))
    patcher.wrap(manager, "add_transfer_request", _add_transfer_request_wrapper)


def _on_manager_init(instance, args, kwargs, token, result, error) -> None:
    """A KV manager built (prefill or decode): its rank, read once, and the process's start-up line."""
    if error is None and backend_of(instance, "manager") is not None:
        rank_attributes(instance)


# Always: the start-up line must not depend on recording being on at that moment.
_manager_init_wrapper = observe_call("read a KV manager's rank", after=_on_manager_init, when=None)


def patch_mooncake_conn(module) -> None:
    register("manager", module.MooncakeKVManager, MOONCAKE)
    register("sender", module.MooncakeKVSender, MOONCAKE)
    patcher.wrap(module.MooncakeKVManager, "__init__", _manager_init_wrapper)
    _wrap_transfer_methods(module.MooncakeKVManager, MOONCAKE, TRANSFER_METHODS)
    patcher.wrap(module.MooncakeKVManager, "send_aux_data_to_endpoint", _aux_tcp_wrapper)


def patch_nixl_conn(module) -> None:
    register("manager", module.NixlKVManager, NIXL)
    register("sender", module.NixlKVSender, NIXL)
    patcher.wrap(module.NixlKVManager, "__init__", _manager_init_wrapper)
    _wrap_transfer_methods(module.NixlKVManager, NIXL, NIXL_TRANSFER_METHODS)


def patch_prefill(module) -> None:
    patcher.wrap(module.SchedulerDisaggregationPrefillMixin, "maybe_send_cached_prefix_chunk", _early_send_wrapper)
    patcher.wrap(module.PrefillBootstrapQueue, "create_sender", _create_sender_wrapper)


def patch_scheduler(module) -> None:
    patcher.wrap(module.Scheduler, "run_batch", _run_batch_wrapper)
