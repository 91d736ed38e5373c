"""A client's traceparent from vLLM's connector scheduler to the worker that opens our spans (trace_context.py).

Runs in the main project venv, where vLLM is not installed: the scheduler's `Request` and the connector metadata
are stand-ins of ours holding only the attributes the hooks read (`request_id`, `kv_transfer_params`,
`trace_headers`; an object to carry the headers on), and the hooks are called as vLLM calls them. The real classes
and the whole path (API server, scheduler, worker, Jaeger) run in tests/deployments/test_vllm_serving.py; here,
what the headers may be: untrusted text, bounded, a bad one no parent.
"""

import pickle
import types

import pytest

from otel_kvtransfer import semconv
from otel_kvtransfer.building.stitching import key_span_id, key_trace_id
from otel_kvtransfer.frameworks.vllm import mooncake as vllm_mooncake
from otel_kvtransfer.frameworks.vllm import trace_context

CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


class Metadata:
    """Stand-in for a connector metadata object (vLLM's are plain classes, pickled to a worker in another process)."""


def _request(request_id, flag, headers):
    return types.SimpleNamespace(request_id=request_id, kv_transfer_params={flag: True, "transfer_id": "t"},
                                 trace_headers=headers)


def _schedule(requests, hook):
    """vLLM's scheduler: each request's hook, then the metadata of the step."""
    for request in requests:
        hook(lambda *a, **k: None, object(), (request, None, 0), {})
    return trace_context._build_wrapper(lambda *a, **k: Metadata(), object(), (None,), {})


def _trace_ids(context):
    from opentelemetry import trace

    span_context = trace.get_current_span(context).get_span_context()
    return f"{span_context.trace_id:032x}", f"{span_context.span_id:016x}"


@pytest.fixture(autouse=True)
def _empty():
    trace_context.forget()
    yield
    trace_context.forget()


def test_a_decode_requests_traceparent_reaches_the_worker_through_pickled_metadata(telemetry):
    metadata = _schedule([_request("d1", "do_remote_prefill", {"traceparent": TRACEPARENT, "tracestate": "a=b"})],
                         trace_context._allocated_wrapper)
    metadata = pickle.loads(pickle.dumps(metadata))  # a worker in another process
    assert _trace_ids(trace_context.parent_of(metadata, "d1")) == (CLIENT_TRACE, CLIENT_SPAN)
    assert trace_context.parent_of(metadata, "other") is None
    # carried once: the next step's metadata has nothing of it
    assert trace_context.parent_of(_schedule([], trace_context._allocated_wrapper), "d1") is None


def test_only_requests_with_kv_to_move_and_a_traceparent_are_carried(telemetry):
    requests = [_request("p1", "do_remote_decode", {"traceparent": TRACEPARENT}),
                _request("p2", "do_remote_prefill", {"traceparent": TRACEPARENT}),  # not the prefill side's flag
                _request("p3", "do_remote_decode", {"tracestate": "a=b"}),
                _request("p4", "do_remote_decode", None)]
    metadata = _schedule(requests, trace_context._finished_wrapper)
    assert set(getattr(metadata, trace_context.CARRIER)) == {"p1"}


@pytest.mark.parametrize("traceparent", [
    "", "garbage", "00-" + "0" * 32 + "-" + CLIENT_SPAN + "-01",  # an all-zero trace id is invalid
    f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01" + "x" * 300, 42, b"00-abc"])
def test_a_bad_or_oversized_traceparent_is_no_parent(telemetry, traceparent):
    metadata = _schedule([_request("d1", "do_remote_prefill", {"traceparent": traceparent})],
                         trace_context._allocated_wrapper)
    assert trace_context.parent_of(metadata, "d1") is None


def test_a_hook_that_cannot_read_the_request_is_counted_and_vllms_call_goes_on(telemetry):
    class Broken:
        request_id = "d1"

        @property
        def kv_transfer_params(self):
            raise RuntimeError("renamed")

    calls = []
    assert trace_context._allocated_wrapper(lambda *a: calls.append(a) or "kept", object(), (Broken(), None, 0),
                                            {}) == "kept"
    assert len(calls) == 1
    assert telemetry.dropped().get("wrapper_error") == 1


def _producer():
    return types.SimpleNamespace(is_kv_producer=True, is_kv_consumer=False, tp_rank=0, vllm_config=None)


def _send_metadata(carrier):
    metadata = types.SimpleNamespace(reqs_to_send={"p1": ("t1", [[1, 2]]), "p2": ("t2", [[3]])}, reqs_to_recv={})
    setattr(metadata, trace_context.CARRIER, carrier)
    return metadata


def test_the_mooncake_request_span_opens_under_the_clients_span_else_under_its_key(telemetry):
    metadata = _send_metadata({"p1": (TRACEPARENT, None)})
    vllm_mooncake._start_load_kv_wrapper(lambda *a, **k: None, _producer(), (metadata,), {})
    for key in ("t1", "t2"):
        vllm_mooncake.kvt.end_request(key)
    spans = {s.attributes[semconv.REQUEST_KEY]: s for s in telemetry.spans(semconv.SPAN_REQUEST)}
    traced, plain = spans["t1"], spans["t2"]
    assert (f"{traced.context.trace_id:032x}", f"{traced.parent.span_id:016x}") == (CLIENT_TRACE, CLIENT_SPAN)
    assert traced.context.trace_id == traced.parent.trace_id
    assert (plain.context.trace_id, plain.parent.span_id) == (key_trace_id("t2"), key_span_id("t2"))
