"""Decode side of sglang's PD bootstrap: the set-up steps a decode makes before its first receive from a prefill,
each one `kv_transfer.connect` (integration.record_connect).

sglang makes them once per prefill (their answers are cached: `prefill_info_table` per bootstrap address, the
manager's `connection_pool` per (address, ranks)), so a deployment's first request towards a prefill carries its
set-up and the next ones do not:
- `try_ensure_parallel_info(bootstrap_addr)` (the manager, decode scheduler thread, inside the prealloc queue's
  `_ensure_prefill_info(addr_to_reqs)`): asks the prefill's bootstrap server for its parallel layout;
  `fetch_parallel_info`, timed only when the address was not known yet (a cached answer is no set-up), under the
  key of the first request waiting for that prefill (it is made for all of them).
- `_get_bootstrap_info_from_server(...)` (the receiver, in its `__init__`): asks where one prefill rank listens;
  `fetch_bootstrap_info`, under the receiving request's key (stitched into its trace).
- `_register_kv_args()` (the receiver): hands the prefill ranks this decode's KV layout over ZMQ;
  `register_kv_args`, under the request's key.
sglang answers a failed step with a return value (None, False) and records the failure itself; the span is
then ERROR `bootstrap_failed`, or the exception's class when one is raised. The peer is the prefill's bootstrap
address. These steps are bounded by sglang's own timeouts (5 s per HTTP query, ZMQ's send timeout), so they are
not tracked as in flight.
"""

import threading
from typing import Optional

from otel_kvtransfer.frameworks.sglang import common
from otel_kvtransfer.recording import integration
from otel_kvtransfer.recording.clock import now_ns
from otel_kvtransfer.recording.patching import observe_call, remember_argument

FAILED = "bootstrap_failed"  # error.type of a step sglang answered with a failure value
_tls = threading.local()  # .waiting: the prealloc queue's {bootstrap address: [DecodeRequest]} being ensured


def _peer(address):
    """(host, port) of a bootstrap address "host:port" (an IPv6 host in brackets), or (the text, None)."""
    text = str(address or "")[:256]
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit():
        return host.strip("[]"), int(port)
    return text, None


def _record(operation, backend, manager, address, start, result, error, key=None) -> None:
    error_type: Optional[str]
    if error is not None:
        error_type = type(error).__qualname__
    else:
        error_type = FAILED if result is None or result is False else None
    host, port = _peer(address)
    integration.record_connect(operation, start, backend=backend, framework=common.FRAMEWORK, address=host,
                               port=port, error_type=error_type, key=key,
                               attributes=common.rank_attributes(manager))


def _before_parallel_info(instance, args, kwargs):
    address = args[0] if args else kwargs.get("bootstrap_addr")
    if address in (getattr(instance, "prefill_info_table", None) or {}):
        return None  # known: sglang answers from its cache
    backend = common.backend_of(instance, "manager")
    return None if backend is None else (now_ns(), backend, address)


def _first_waiting_room(address):
    """The room of the first request waiting for this prefill's layout, or None."""
    waiting = (getattr(_tls, "waiting", None) or {}).get(address) or ()
    for decode_req in waiting:
        room = getattr(getattr(decode_req, "req", None), "bootstrap_room", None)
        if isinstance(room, int) and not isinstance(room, bool):
            return room
    return None


def _after_parallel_info(instance, args, kwargs, token, result, error) -> None:
    if token is not None:
        start, backend, address = token
        _record("fetch_parallel_info", backend, instance, address, start, result, error,
                key=_first_waiting_room(address))


_parallel_info_wrapper = observe_call("time sglang's parallel-info query", _before_parallel_info,
                                      _after_parallel_info, on_raise=True)
# DecodePreallocQueue._ensure_prefill_info(addr_to_reqs): which requests wait for each prefill's layout.
_ensure_prefill_info_wrapper = remember_argument(_tls, "waiting", 0, "addr_to_reqs")


def _before_receiver_step(instance, args, kwargs):
    backend = common.backend_of(instance, "receiver")
    return None if backend is None else (now_ns(), backend)


def _receiver_step(operation):
    def after(instance, args, kwargs, token, result, error) -> None:
        if token is not None:
            start, backend = token
            _record(operation, backend, instance.kv_mgr, instance.bootstrap_addr, start, result, error,
                    key=instance.bootstrap_room)

    return observe_call(f"time sglang's {operation}", _before_receiver_step, after, on_raise=True)


_bootstrap_info_wrapper = _receiver_step("fetch_bootstrap_info")
_register_kv_args_wrapper = _receiver_step("register_kv_args")


def patch_decode(module) -> None:
    common.patcher.wrap(module.DecodePreallocQueue, "_ensure_prefill_info", _ensure_prefill_info_wrapper)


def patch_common_conn(module) -> None:
    common.patcher.wrap(module.CommonKVManager, "try_ensure_parallel_info", _parallel_info_wrapper)
    common.patcher.wrap(module.CommonKVReceiver, "_get_bootstrap_info_from_server", _bootstrap_info_wrapper)
    common.patcher.wrap(module.CommonKVReceiver, "_register_kv_args", _register_kv_args_wrapper)
