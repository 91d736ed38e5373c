"""Instrumentation of NIXL's `nixl_agent` (the transfer library under vLLM's NIXL connector and NVIDIA Dynamo).

Every posted transfer handle is one `kv_transfer.send`, from `transfer()` until its completion is observed
(the time inside `transfer()` itself is the send's `kv_transfer.post_s`):
`check_xfer_state` answering DONE or ERR, or the handle being released (a release while still in progress is
a cancelled transfer), by `release()` or by the garbage collector (`__del__` frees it without `release()`:
sglang, for one, lets its handles go that way). Bytes and descriptor count come from the descriptor lists the
handle was made from (remembered when `prep_xfer_dlist` prepared them, or read from `initialize_xfer`'s lists);
op is the handle's READ or WRITE; the peer is the remote agent's name; the notification message travels as an
attribute. These wrappers only time and count: the call tuple goes to the transfer scope current when the handle
was posted, else to the one current when it was made (a handle posted from another thread), else it is a raw
send, through `PendingTransfers`, which bounds the handles waiting for completion and counts what it has to drop.
Set-up calls towards a peer (`add_remote_agent`, `make_connection`, a metadata fetch) are `kv_transfer.connect`
records of their own (below).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Dict, Hashable, Iterator, List, Optional, Sequence, Tuple, TypeVar

from otel_kvtransfer import semconv
from otel_kvtransfer.recording import inflight, records, untimed
from otel_kvtransfer.recording import integration as kvt
from otel_kvtransfer.recording.clock import now_ns
from otel_kvtransfer.recording.patching import (
    EngineSpec,
    Patch,
    Patcher,
    WraptWrapper,
    active,
    count_drop,
    current_context,
    observe_call,
    own_error,
    safely,
)
from otel_kvtransfer.recording.pending import PendingTransfers
from otel_kvtransfer.recording.recorder import RECORDER
from otel_kvtransfer.wiring.lazy_patcher import LazyPatcher

if TYPE_CHECKING:
    from opentelemetry.context import Context

_logger = logging.getLogger(__name__)

BACKEND = semconv.BACKEND_NIXL  # SPEC's name (below), a global here because every call tuple carries it
PEER_AGENT = "nixl.remote_agent"  # NIXL peers are agent names, not addresses

_LOCAL_AGENTS = ("", "NIXL_INIT_AGENT")
_UNKNOWN_HANDLE = (0, 0, semconv.OP_WRITE, None, None, None)  # a handle made where no wrapper saw it
_OPS = {"WRITE": semconv.OP_WRITE, "READ": semconv.OP_READ}
_MAX_DLISTS = 4096  # prepared descriptor lists remembered (vLLM prepares a handful per peer engine)
_MAX_HANDLES = 65536  # transfer handles made but not yet posted or released

patcher = Patcher(BACKEND)
_pending = PendingTransfers(BACKEND)
_Args = Tuple[Any, ...]  # a wrapped call's positional arguments
_Kwargs = Dict[str, Any]  # and its keyword arguments
# A handle's key: (id(bound agent), the handle NIXL gave it)
_Key = Tuple[int, Any]
# What a transfer handle was made with: (bytes, descriptors, op, peer, notification, scope made in)
_Handle = Tuple[int, int, str, Optional[str], Optional[str], Optional[kvt.TransferScope]]
_dlists: Dict[_Key, Tuple[Optional[List[int]], Optional[str]]] = {}  # dlist -> (lengths, remote agent name or None)
_handles: Dict[_Key, _Handle] = {}  # transfer handles made and not posted or released yet
_K = TypeVar("_K")
_V = TypeVar("_V")


def _key(handle: Any) -> _Key:
    """Handles are plain ints inside their Python wrappers; the bound agent keeps them apart across agents."""
    return (id(handle._agent), handle._handle)


def _lengths(xfer_list: Any) -> Optional[List[int]]:
    """Byte length of each descriptor of a transfer list in any form NIXL accepts; None when unknown."""
    shape = getattr(xfer_list, "shape", None)
    if shape is not None and len(shape) == 2 and shape[1] in (3, 5):  # numpy (addr, len, dev[, stride, count])
        lengths = xfer_list[:, 1]
        if shape[1] == 5:
            return [int(n) for n, count in zip(lengths, xfer_list[:, 4]) for _ in range(int(count))]
        return [int(n) for n in lengths]
    if hasattr(xfer_list, "descCount"):  # nixlXferDList: indexable (addr, len, dev) tuples
        return [int(xfer_list[i][1]) for i in range(xfer_list.descCount())]
    if hasattr(xfer_list, "element_size"):  # one contiguous tensor
        return [int(xfer_list.numel() * xfer_list.element_size())]
    if isinstance(xfer_list, (list, tuple)):
        return [int(d.numel() * d.element_size()) if hasattr(d, "element_size") else int(d[1]) for d in xfer_list]
    return None


def _text(value: Any) -> Optional[str]:
    """A notification message or agent name (NIXL hands out both as bytes or str), bounded."""
    if not value:
        return None
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value[:256]).decode("utf-8", "replace")
    return str(value)[:256]


def _remember(table: Dict[_K, _V], limit: int, key: _K, value: _V) -> None:
    if len(table) >= limit:
        table.pop(next(iter(table)))  # oldest first: dicts keep insertion order
    table[key] = value


# --- wrappers --------------------------------------------------------------------------------------------------


# Descriptor lists are prepared and released at set-up (vLLM: per peer engine), not per transfer: built with the
# shared helper. The per-transfer wrappers below keep their guards inline, one Python frame fewer per call.


def _on_prep_dlist(instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], token: None, dlist: Any,
                   error: None) -> None:
    agent_name = args[0] if args else kwargs.get("agent_name", "")
    xfer_list = args[1] if len(args) > 1 else kwargs.get("xfer_list")
    peer = None if agent_name in _LOCAL_AGENTS else _text(agent_name)
    _remember(_dlists, _MAX_DLISTS, _key(dlist), (_lengths(xfer_list), peer))


_prep_dlist_wrapper = observe_call("read a NIXL descriptor list", after=_on_prep_dlist)
def _forget_dlist(dlist: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    _dlists.pop(_key(dlist), None)


_release_dlist_wrapper = observe_call("forget a NIXL descriptor list", _forget_dlist, when=None)


def _make_prepped_wrapper(wrapped: Callable[..., Any], instance: Any, args: _Args, kwargs: _Kwargs) -> Any:
    handle = wrapped(*args, **kwargs)
    if active():
        try:
            params = _bind(("operation", "local_xfer_side", "local_indices", "remote_xfer_side", "remote_indices",
                            "notif_msg"), args, kwargs)
            lengths, _ = _dlists.get(_key(params["local_xfer_side"]), (None, None))
            _, peer = _dlists.get(_key(params["remote_xfer_side"]), (None, None))
            indices = params["local_indices"]
            nbytes = sum(lengths[int(i)] for i in indices) if lengths is not None else 0
            _describe(handle, params["operation"], nbytes, len(indices), peer, params.get("notif_msg"))
        except Exception:
            own_error("read a NIXL prepared transfer")
    return handle


def _initialize_wrapper(wrapped: Callable[..., Any], instance: Any, args: _Args, kwargs: _Kwargs) -> Any:
    handle = wrapped(*args, **kwargs)
    if active():
        try:
            params = _bind(("operation", "local_descs", "remote_descs", "remote_agent", "notif_msg"), args, kwargs)
            lengths = _lengths(params["local_descs"]) or []
            _describe(handle, params["operation"], sum(lengths), len(lengths), params["remote_agent"],
                      params.get("notif_msg"))
        except Exception:
            own_error("read a NIXL transfer")
    return handle


def _bind(names: Tuple[str, ...], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    params = dict(zip(names, args))
    params.update((name, kwargs[name]) for name in names if name in kwargs)
    return params


def _describe(handle: Any, operation: Any, nbytes: int, descriptors: int, peer: Any, notif_msg: Any) -> None:
    op = _OPS.get(str(operation).upper(), semconv.OP_WRITE)
    key = _key(handle)
    # A new handle at the address of one still pending: that one was freed where no wrapper saw it (NIXL's
    # binding called directly), so its end will never be seen. Counted now, before a release of the new handle
    # could end it as if it were this one.
    _pending.forget(key)
    # The transfer scope current where the handle is made: a handle posted from a thread outside any scope (vLLM
    # work moves posting to a receiver or reader thread) still belongs to the transfer it was made for.
    _remember(_handles, _MAX_HANDLES, key,
              (int(nbytes), int(descriptors), op, _text(peer), _text(notif_msg), kvt.THREAD.scope))


def _transfer_wrapper(wrapped: Callable[..., Any], instance: Any, args: _Args, kwargs: _Kwargs) -> Any:
    if not active():
        return wrapped(*args, **kwargs)
    start = now_ns()
    try:
        state = wrapped(*args, **kwargs)
    except Exception as exc:  # the post itself failed (e.g. the peer is gone): one failed send, then re-raised
        _posted(instance, args, kwargs, start, None, "ERR", type(exc).__qualname__)
        raise
    _posted(instance, args, kwargs, start, now_ns(), state, None if state in ("DONE", "PROC") else "transfer_failed")
    return state


def _posted(agent: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], start: int, posted: Optional[int], state: Any,
            error_type: Optional[str]) -> None:
    try:
        handle = args[0] if args else kwargs["handle"]
        key = _key(handle)
        nbytes, descriptors, op, peer, notification, made_in = _handles.get(key, _UNKNOWN_HANDLE)
        notification = _text(args[1] if len(args) > 1 else kwargs.get("notif_msg")) or notification
        extra: Optional[Dict[str, Any]] = {semconv.NOTIFICATION: notification} if notification else None
        protocol = _protocol(agent)
        _pending.forget(key)  # a transfer still pending under this key was never seen to end: counted, not lost
        posting = kvt.THREAD.scope  # the posting thread's scope, else the one the handle was made in
        if state == "PROC":
            _pending.submit(key, start, nbytes, descriptors, op, peer, protocol, extra, posting or made_in, posted)
        else:  # finished (or failed) within the call itself: all of it was the post
            if posted is None:  # the post raised
                end = now_ns()
            else:
                end = posted
                extra = {**(extra or {}), semconv.POST_S: (end - start) / 1e9}
            call = records.call(start, end, nbytes, descriptors, op, peer, protocol, state, error_type,
                                BACKEND, extra)
            if posting is None and made_in is not None:
                made_in.record_apart(call)
            else:
                kvt.deliver(call)
    except Exception:
        own_error("record a NIXL transfer")


def _check_state_wrapper(wrapped: Callable[..., Any], instance: Any, args: _Args, kwargs: _Kwargs) -> Any:
    try:
        state = wrapped(*args, **kwargs)
    except Exception as exc:  # e.g. the peer is gone (nixlRemoteDisconnectError): the transfer failed
        if len(_pending):
            safely("observe a failed NIXL transfer", _failed, args, kwargs, type(exc).__qualname__)
        raise
    if len(_pending):
        try:
            handle = args[0] if args else kwargs["handle"]
            if state == "PROC":  # still running: its end, when seen, lies after now
                _pending.seen_running(_key(handle))
            else:
                _pending.complete(_key(handle), state, None if state == "DONE" else "transfer_failed")
        except Exception:
            own_error("observe a NIXL completion")
    return state


def _failed(args: Tuple[Any, ...], kwargs: Dict[str, Any], error_type: str) -> None:
    """A status query that raised: the pending transfer ends as a failed send named after the error."""
    handle = args[0] if args else kwargs["handle"]
    _pending.complete(_key(handle), "ERR", error_type)


def _observe_release(handle: Any, *_call: Any) -> None:
    """The handle is about to be freed: the last chance to observe how its transfer ended (its call's arguments,
    when it is `release()`'s observer, say nothing more). A handle released before is done with: its address
    may already belong to a new handle, whose entries must stay (the garbage collector frees a released handle's
    wrapper when the name holding it is bound to the next handle)."""
    if handle._released:
        return
    key = _key(handle)
    _handles.pop(key, None)
    if len(_pending):
        try:
            state = _state_of(handle)
        except Exception as exc:  # the peer is gone: the transfer failed
            _pending.complete(key, "ERR", type(exc).__qualname__)
            return
        # Releasing a handle still in progress makes NIXL cancel it.
        _pending.complete(key, state, {"DONE": None, "PROC": "cancelled"}.get(state, "transfer_failed"))


# `nixl_xfer_handle.release()` (also behind `nixl_agent.release_xfer_handle`): as many Python frames per call as
# the wrapper of its own it replaces.
_release_handle_wrapper = observe_call("observe a released NIXL handle", _observe_release, when=None)


def _del_handle_wrapper(wrapped: Callable[..., Any], instance: Any, args: _Args, kwargs: _Kwargs) -> Any:
    """`nixl_xfer_handle.__del__`: the garbage collector frees the handle, NIXL's `release()` never runs."""
    try:
        if HOOKS.on:
            _observe_release(instance)
    except Exception:  # also at interpreter exit, when our modules are half gone
        try:
            own_error("observe a NIXL handle freed by the garbage collector")
        except Exception:
            pass
    return wrapped(*args, **kwargs)


def _state_of(handle: Any) -> str:
    bindings = _api_module().nixlBind
    status = handle._agent.getXferStatus(handle._handle)
    if status == bindings.NIXL_SUCCESS:
        return "DONE"
    return "PROC" if status == bindings.NIXL_IN_PROG else "ERR"


def _protocol(agent: Any) -> Optional[str]:
    """The backend NIXL moves bytes with (ucx, ...) when the agent has exactly one."""
    backends = getattr(agent, "backends", None)
    if backends and len(backends) == 1:
        return str(next(iter(backends))).lower()
    return None


# --- set-up calls ----------------------------------------------------------------------------------------------
# Each explicit set-up call towards a peer is one kv_transfer.connect: add_remote_agent (loads the peer's metadata;
# the peer is the name it returns) and make_connection, timed around the call; fetch_remote_metadata asks for the
# metadata without waiting, so its connect lasts until the first check_remote_metadata that finds it. While one is
# open it is in flight as kind `connect` (a sync call through its frame, a fetch through `_fetches`), and stuck
# past OTEL_KVTRANSFER_STUCK_S like a send.

def _connected(operation: str, start: int, peer: Any, error: Optional[str], key: Optional[records.Key]) -> None:
    RECORDER.record(records.connect(start, now_ns(), BACKEND, operation, _text(peer), error, key,
                                    None if key is not None else current_context()))


def _connect_wrapper(operation: str) -> WraptWrapper:
    def setup_call(wrapped: Callable[..., Any], instance: Any, args: _Args, kwargs: _Kwargs) -> Any:
        if not active():
            return wrapped(*args, **kwargs)
        key = kvt.current_key()
        start = now_ns()  # `start`, `key`, `operation`, `args` and `kwargs` are read by _setup_in_progress
        try:
            result = wrapped(*args, **kwargs)
        except Exception as exc:
            safely("record a NIXL set-up call", _connected, operation, start, _named_peer(operation, args, kwargs),
                   type(exc).__qualname__, key)
            raise
        peer = result if operation == "add_remote_agent" else _named_peer(operation, args, kwargs)
        safely("record a NIXL set-up call", _connected, operation, start, peer, None, key)
        return result

    return setup_call


def _named_peer(operation: Optional[str], args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """The remote agent a set-up call names (add_remote_agent names it only in its answer)."""
    if operation == "add_remote_agent":
        return None
    return args[0] if args else kwargs.get("remote_agent")


_SETUP_CALLS = ("add_remote_agent", "make_connection")
_SETUP_WRAPPERS = {operation: _connect_wrapper(operation) for operation in _SETUP_CALLS}


def _setup_in_progress(frame_locals: Dict[str, Any]) -> Optional[inflight.Item]:
    """A set-up call still inside NIXL, from its wrapper's frame (read by the in-flight scan)."""
    start = frame_locals.get("start")
    if not isinstance(start, int):
        return None
    peer = _named_peer(frame_locals.get("operation"), frame_locals.get("args") or (), frame_locals.get("kwargs") or {})
    return (start, frame_locals.get("key"), _text(peer), None, BACKEND, semconv.INFLIGHT_CONNECT)


inflight.register_wrapper(_SETUP_WRAPPERS[_SETUP_CALLS[0]].__code__, _setup_in_progress)  # one code for all


class _Fetches:
    """Metadata fetches asked for and not yet found: (id(agent), remote agent) -> (start_ns, key, context)."""

    LIMIT = 4096

    def __init__(self) -> None:
        # (id(agent), remote agent) -> (start_ns, key, context)
        self.open: Dict[Tuple[int, Optional[str]], Tuple[int, Optional[records.Key], Optional[Context]]] = {}

    def in_flight(self) -> Iterator[Tuple[Hashable, inflight.Item]]:
        for (agent, peer), (start, key, _context) in list(self.open.items()):
            yield (agent, peer), (start, key, peer, None, BACKEND, semconv.INFLIGHT_CONNECT)


_fetches = _Fetches()
inflight.register_pending(_fetches)


def _fetch_wrapper(wrapped: Callable[..., Any], instance: Any, args: _Args, kwargs: _Kwargs) -> Any:
    if not active():
        return wrapped(*args, **kwargs)
    start = now_ns()
    try:
        result = wrapped(*args, **kwargs)
    except Exception as exc:  # the ask itself failed: a failed set-up call now
        safely("record a NIXL set-up call", _connected, "fetch_remote_metadata", start,
               args[0] if args else kwargs.get("remote_agent"), type(exc).__qualname__, kvt.current_key())
        raise
    safely("record a NIXL metadata fetch", _asked, instance, args, kwargs, start)
    return result


def _asked(agent: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], start: int) -> None:
    peer = _text(args[0] if args else kwargs.get("remote_agent"))
    if peer is None:
        return
    key = (id(agent), peer)
    if key not in _fetches.open and len(_fetches.open) >= _Fetches.LIMIT:
        _fetches.open.pop(next(iter(_fetches.open)))  # the oldest ask, never answered: let go, counted
        count_drop("setup_pending_full")
    scope_key = kvt.current_key()
    _fetches.open.setdefault(key, (start, scope_key, None if scope_key is not None else current_context()))


def _check_metadata_wrapper(wrapped: Callable[..., Any], instance: Any, args: _Args, kwargs: _Kwargs) -> Any:
    found = wrapped(*args, **kwargs)
    if found is True and _fetches.open:
        safely("record a NIXL metadata fetch", _arrived, instance, args, kwargs)
    return found


def _arrived(agent: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    peer = _text(args[0] if args else kwargs.get("agent"))
    asked = _fetches.open.pop((id(agent), peer), None)
    if asked is not None:
        start, key, context = asked
        RECORDER.record(records.connect(start, now_ns(), BACKEND, "fetch_remote_metadata", peer, None, key,
                                        context))


# --- what the spec below names ---------------------------------------------------------------------------------


def peer_attributes(peer: Any) -> Dict[str, Any]:
    return {PEER_AGENT: str(peer)[:256]} if peer else {}


API_MODULE = "nixl._api"  # where nixl_agent and its handles live


def _api_module() -> Any:
    import nixl._api

    return nixl._api


def available() -> bool:
    """NIXL is installed (never imported here: vLLM sets UCX variables, UCX_RCACHE_MAX_UNRELEASED, before its own
    first import of NIXL, and an earlier import by us would keep them from applying)."""
    try:
        return importlib.util.find_spec("nixl") is not None
    except (ImportError, ValueError):
        return False


def _patch(_module: Optional[ModuleType] = None) -> None:
    """Wrap `nixl_agent` and its handles (run when `nixl` has been imported, by whoever imports it)."""
    try:
        api = sys.modules.get(API_MODULE) or _api_module()
        agent = api.nixl_agent
        patcher.wrap(agent, "prep_xfer_dlist", _prep_dlist_wrapper)
        patcher.wrap(agent, "make_prepped_xfer", _make_prepped_wrapper)
        patcher.wrap(agent, "initialize_xfer", _initialize_wrapper)
        patcher.wrap(agent, "transfer", _transfer_wrapper)
        patcher.wrap(agent, "check_xfer_state", _check_state_wrapper)
        patcher.wrap(api.nixl_xfer_handle, "release", _release_handle_wrapper)
        patcher.wrap(api.nixl_xfer_handle, "__del__", _del_handle_wrapper)
        patcher.wrap(api.nixl_prepped_dlist_handle, "release", _release_dlist_wrapper)
        for operation in _SETUP_CALLS:
            patcher.wrap(agent, operation, _SETUP_WRAPPERS[operation])
        patcher.wrap(agent, "fetch_remote_metadata", _fetch_wrapper)
        patcher.wrap(agent, "check_remote_metadata", _check_metadata_wrapper)
        untimed.wrap_unknown(patcher, agent, BACKEND, TIMED_CALLS, QUIET_CALLS)
    except Exception:
        own_error("patch NIXL")
        _logger.warning("otel_kvtransfer could not patch NIXL", exc_info=True)


# nixl_agent's calls that move no bytes: back-ends and memory registration, descriptor and metadata queries and
# exchange, notifications, telemetry, releases, and memory views (prep_mem_view only prepares memory that GPU
# kernels then move themselves: device-initiated transfers, which no Python call shows). Any public call neither
# here nor timed (TIMED_CALLS) is counted as untimed.
QUIET_CALLS = frozenset({
    "create_backend", "get_plugin_list", "get_plugin_mem_types", "get_plugin_params", "get_backend_mem_types",
    "get_backend_params", "query_xfer_backend", "register_memory", "deregister_memory", "query_memory",
    "get_reg_descs", "get_xfer_descs", "get_remote_descs", "get_serialized_descs", "deserialize_descs",
    "get_agent_metadata", "get_partial_agent_metadata", "send_local_metadata", "send_partial_agent_metadata",
    "invalidate_local_metadata", "remove_remote_agent", "get_new_notifs", "update_notifs", "send_notif",
    "check_remote_xfer_done", "get_xfer_telemetry", "estimate_xfer_cost", "release_xfer_handle",
    "release_dlist_handle", "prep_mem_view", "release_mem_view",
})
# nixl_agent's calls this module times or observes: transfers, the handles and lists they are made from, their
# completion, and the set-up calls that are `kv_transfer.connect` spans.
TIMED_CALLS = frozenset({
    "prep_xfer_dlist", "make_prepped_xfer", "initialize_xfer", "transfer", "check_xfer_state",
    "fetch_remote_metadata", "check_remote_metadata", *_SETUP_CALLS,
})


def _forget() -> None:
    untimed.forget(BACKEND)
    _pending.abandon()
    _dlists.clear()
    _handles.clear()
    _fetches.open.clear()


# --- the engine-module interface ------------------------------------------------------------------------------

SPEC = EngineSpec(
    name=BACKEND,
    # Every published build: `nixl` (which pulls in a CUDA build) and the CUDA 12 and CUDA 13 builds themselves;
    # each provides `nixl._api`. One list: wiring/package.py builds `instruments-any` from it.
    distributions=("nixl", "nixl-cu12", "nixl-cu13"),
    supported=">=1.5",  # the releases whose nixl_agent and handle classes have what is wrapped here (1.5.1 tested)
    # `nixl` chooses its build when imported, and its `_api` may be that build's module: patched once `nixl` is
    # imported, by whoever imports it.
    patches=(Patch("nixl", _patch),),
    modules=(API_MODULE,),
    available=available,
    forget=_forget,
    setup_in_first_call=False,  # set-up is add_remote_agent and friends, before any transfer
    peer_attributes=peer_attributes,
)

# The views of the spec the rest of the package, its tests and its docs use.
HOOKS = LazyPatcher(SPEC, patcher)
DISTRIBUTIONS, SUPPORTED, SETUP_IN_FIRST_CALL = SPEC.distributions, SPEC.supported, SPEC.setup_in_first_call
instrument, uninstrument, modules = HOOKS.instrument, HOOKS.uninstrument, HOOKS.modules
