"""The client's trace context, carried from vLLM's scheduler to the connector worker that opens our spans.

vLLM started with `--otlp-traces-endpoint` keeps a request's W3C headers (`traceparent`, `tracestate`) on the
scheduler's `Request` (`trace_headers`) and parents its own `llm_request` span on them; without that flag it drops
them, and so do we. Our spans are opened on the worker side (`start_load_kv`), which sees only the connector
metadata the scheduler side built. So:
- the connector scheduler's `update_state_after_alloc(request, ...)` (a decode that will receive or read) and
  `request_finished(request, ...)` (a prefill whose KV will be sent or read) remember the request's headers;
- its `build_connector_meta()` puts what it remembered on the metadata it returns (an attribute of ours: the
  metadata reaches a worker in another process pickled, attributes and all);
- the worker asks `parent_of(metadata, request_id)` for the request's parent.
A request with a traceparent then has its request, send and receive / serve spans in the client's trace, beside
vLLM's own span; one without keeps the synthetic per-request-key trace. The headers are untrusted text: bounded
here, parsed by OpenTelemetry's W3C propagator, and a malformed one is no parent.
"""

from typing import Optional

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_kvtransfer.frameworks.vllm.common import BoundedMap, bind, patcher
from otel_kvtransfer.recording.patching import observe_call

CARRIER = "_otel_kvt_trace_headers"  # on a connector metadata: request id -> (traceparent, tracestate or None)
TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
_MAX_TRACEPARENT = 256  # version 00 is 55 characters; a later version may add fields
_MAX_TRACESTATE = 512  # the W3C limit
_MAX_REQUEST_ID = 256

_pending = BoundedMap(4096)  # request id -> headers, from the scheduler's hook until the next metadata it builds
_PROPAGATOR = TraceContextTextMapPropagator()


def _headers_of(request):
    """(traceparent, tracestate) of a request that carries a traceparent, bounded; else None."""
    headers = getattr(request, "trace_headers", None)
    if not headers:
        return None
    parent = headers.get(TRACEPARENT)
    if not isinstance(parent, str) or not parent or len(parent) > _MAX_TRACEPARENT:
        return None
    state = headers.get(TRACESTATE)
    state = state if isinstance(state, str) and 0 < len(state) <= _MAX_TRACESTATE else None
    return parent, state


def _remember(request, flag: str) -> None:
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or not params.get(flag):
        return
    headers = _headers_of(request)
    if headers is not None:
        _pending[str(request.request_id)[:_MAX_REQUEST_ID]] = headers


def _on_allocated(instance, args, kwargs) -> None:
    """A decode request whose KV will be received (push) or read (pull): read before vLLM clears its flag."""
    _remember(bind(("request",), args, kwargs)["request"], "do_remote_prefill")


def _on_finished(instance, args, kwargs) -> None:
    """A prefill request whose KV will be sent (push) or read by its decode (pull)."""
    _remember(bind(("request",), args, kwargs)["request"], "do_remote_decode")


def _attach(instance, args, kwargs, token, metadata, error) -> None:
    """The headers remembered since the last metadata travel with this one (each request's hook runs before the
    metadata that first names it is built)."""
    if _pending and metadata is not None:
        carried = dict(_pending)
        _pending.clear()
        setattr(metadata, CARRIER, carried)


_allocated_wrapper = observe_call("remember a vLLM decode request's trace context", _on_allocated)
_finished_wrapper = observe_call("remember a vLLM prefill request's trace context", _on_finished)
_build_wrapper = observe_call("carry vLLM requests' trace context to the worker", after=_attach)


def parent_of(metadata, request_id) -> Optional[Context]:
    """The client's context of a request the worker reads from `metadata`, or None (no traceparent, or a bad one).
    Called inside the connector wrappers' own guards."""
    carried = getattr(metadata, CARRIER, None)
    if not isinstance(carried, dict):
        return None
    headers = carried.get(str(request_id)[:_MAX_REQUEST_ID])
    if not isinstance(headers, tuple) or len(headers) != 2:
        return None
    parent, state = headers
    carrier = {TRACEPARENT: parent} if state is None else {TRACEPARENT: parent, TRACESTATE: state}
    context = _PROPAGATOR.extract(carrier, context=Context())
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def _wrap_scheduler(scheduler, builder) -> None:
    patcher.wrap(scheduler, "update_state_after_alloc", _allocated_wrapper)
    patcher.wrap(scheduler, "request_finished", _finished_wrapper)
    patcher.wrap(builder, "build_connector_meta", _build_wrapper)


def patch_mooncake(module) -> None:
    """MooncakeConnectorScheduler (vLLM's mooncake_connector module)."""
    if hasattr(module, "MooncakeConnectorScheduler"):
        _wrap_scheduler(module.MooncakeConnectorScheduler, module.MooncakeConnectorScheduler)


def patch_nixl(module) -> None:
    """NixlPullConnectorScheduler (vLLM's nixl.pull_scheduler module); its base builds the metadata."""
    scheduler = getattr(module, "NixlPullConnectorScheduler", None)
    if scheduler is not None:
        base = getattr(module, "NixlBaseConnectorScheduler", scheduler.__mro__[1])
        _wrap_scheduler(scheduler, base)


def forget() -> None:
    _pending.clear()
