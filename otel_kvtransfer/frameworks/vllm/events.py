"""Connector events that are not transfers, counted: `kv_transfer.connector.events` ({event}).

Attributes: `kv_transfer.framework`, `kv_transfer.backend`, `kv_transfer.event` (one of the names below), and
`error.type` when the step raised. Low cardinality by construction (a fixed set of names). These steps happen
between requests (sleep mode) or before any byte moves (a layout resend), so there is no span they could end;
where a request is concerned, its spans say so too (a flagged send, a request attribute).
"""

import threading
from typing import Any, Dict, Optional

from otel_kvtransfer.frameworks.vllm.common import FRAMEWORK
from otel_kvtransfer.recording.patching import active, observe_call

METRIC = "kv_transfer.connector.events"
EVENT = "kv_transfer.event"

UNREGISTER = "kv_unregistered"  # sleep: the KV cache's memory registration was dropped
REREGISTER = "kv_reregistered"  # wake: the memory was registered again
LAYOUT_MISS = "layout_miss"  # Mooncake prefill: a pull named a KV layout it no longer holds
LAYOUT_RESEND = "layout_resend"  # Mooncake decode: the layout sent again after a LAYOUT_MISS
REHANDSHAKE = "rehandshake"  # NIXL decode: a remote registered anew (its generation grew): handshake again
PEER_DROPPED = "peer_dropped"  # Mooncake decode: prefill finished without a result for these requests

_lock = threading.Lock()
_counter: Dict[str, Any] = {}  # "c" -> the counter, made on first use (the meter provider may be set up after import)


def _instrument():
    with _lock:
        if "c" not in _counter:
            from opentelemetry import metrics

            _counter["c"] = metrics.get_meter("otel_kvtransfer").create_counter(
                METRIC, unit="{event}", description="vLLM connector events that are not transfers")
        return _counter["c"]


def count(event: str, backend: str, amount: int = 1, error_type: Optional[str] = None) -> None:
    """Count one connector event. Called from the wrappers' observers only: their guard counts a failure here
    (`wrapper_error`) and keeps it out of vLLM."""
    if amount <= 0 or not active():
        return
    attributes = {"kv_transfer.framework": FRAMEWORK, "kv_transfer.backend": backend, EVENT: event}
    if error_type:
        attributes["error.type"] = str(error_type)[:128]
    _instrument().add(int(amount), attributes)


def registration_wrapper(event: str, backend: str):
    """A wrapper for a connector's `unregister_kv_caches` / `restore_kv_caches`: counted when it changed the
    registration (`_kv_unregistered` flipped; both are no-ops when already in that state) or raised (with
    `error.type`; the exception passes through unchanged)."""

    def state(instance, args, kwargs):
        return bool(getattr(instance, "_kv_unregistered", False))

    def counted(instance, args, kwargs, before, result, error):
        if error is not None:
            count(event, backend, error_type=type(error).__qualname__)
        elif before is not None and state(instance, args, kwargs) != before:
            count(event, backend)

    return observe_call(f"count {event}", state, counted, when=None, on_raise=True)
