"""The record constructors put every argument at the position records.py names for it (a constructor and its
positions are written side by side, twice: this keeps them the same)."""

import pytest
from opentelemetry.context import Context

from otel_kvtransfer.recording import records as r

# constructor -> (kind or None for a part of a record, {argument: the position it must land on})
LAYOUTS = {
    r.send: (r.SEND, {"info": r.SEND_INFO, "calls": r.SEND_CALLS, "context": r.SEND_CONTEXT,
                      "error": r.SEND_ERROR, "scope_times": r.SEND_SCOPE_TIMES}),
    r.info: (None, {"key": r.INFO_KEY, "chunk": r.INFO_CHUNK, "payload": r.INFO_PAYLOAD,
                    "destination": r.INFO_DESTINATION, "replica": r.INFO_REPLICA, "is_last": r.INFO_IS_LAST,
                    "early": r.INFO_EARLY, "attributes": r.INFO_ATTRIBUTES}),
    r.call: (None, {"start": r.CALL_START, "end": r.CALL_END, "nbytes": r.CALL_BYTES,
                    "descriptors": r.CALL_DESCRIPTORS, "op": r.CALL_OP, "peer": r.CALL_PEER,
                    "protocol": r.CALL_PROTOCOL, "return_code": r.CALL_RETURN_CODE, "error": r.CALL_ERROR,
                    "backend": r.CALL_BACKEND, "extra": r.CALL_EXTRA}),
    r.begin_request: (r.BEGIN_REQUEST, {"key": r.KEY, "start_ns": r.TIME, "role": r.REQ_ROLE,
                                        "backend": r.REQ_BACKEND, "framework": r.REQ_FRAMEWORK,
                                        "attributes": r.REQ_ATTRIBUTES, "parent": r.REQ_PARENT}),
    r.begin_peer: (r.BEGIN_PEER, {"key": r.KEY, "start_ns": r.TIME, "span_name": r.PEER_SPAN_NAME,
                                  "role": r.PEER_ROLE, "backend": r.PEER_BACKEND, "framework": r.PEER_FRAMEWORK,
                                  "attributes": r.PEER_ATTRIBUTES, "parent": r.PEER_PARENT}),
    r.end_request: (r.END_REQUEST, {"key": r.KEY, "end_ns": r.TIME, "error": r.END_ERROR}),
    r.end_peer: (r.END_PEER, {"key": r.KEY, "end_ns": r.TIME, "error": r.END_ERROR, "pending": r.END_PENDING}),
    r.peer_outcome: (r.PEER_OUTCOME, {"key": r.KEY, "at_ns": r.TIME, "attributes": r.OUTCOME_ATTRIBUTES,
                                      "events": r.OUTCOME_EVENTS}),
    r.compute: (r.COMPUTE, {"keys": r.COMPUTE_KEYS, "start_ns": r.COMPUTE_START, "end_ns": r.COMPUTE_END,
                            "chunk": r.COMPUTE_CHUNK, "clock": r.COMPUTE_CLOCK}),
    r.inflight: (r.INFLIGHT, {"now_ns": r.INFLIGHT_AT, "count": r.INFLIGHT_COUNT, "oldest": r.INFLIGHT_OLDEST,
                              "stuck": r.INFLIGHT_STUCK, "connects": r.INFLIGHT_CONNECTS}),
    r.connect: (r.CONNECT, {"start": r.CONNECT_START, "end": r.CONNECT_END, "backend": r.CONNECT_BACKEND,
                            "operation": r.CONNECT_OPERATION, "peer": r.CONNECT_PEER, "error": r.CONNECT_ERROR,
                            "key": r.CONNECT_KEY, "context": r.CONNECT_CONTEXT,
                            "attributes": r.CONNECT_ATTRIBUTES}),
    r.raw_monotonic: (r.RAW_MONOTONIC, {"start": r.MONO_START, "end": r.MONO_END, "nbytes": r.MONO_BYTES,
                                        "descriptors": r.MONO_DESCRIPTORS, "peer": r.MONO_PEER,
                                        "return_code": r.MONO_RETURN_CODE, "form": r.MONO_FORM,
                                        "context": r.MONO_CONTEXT}),
    r.raw_async: (r.RAW_ASYNC, {"start": r.ASYNC_START, "duration": r.ASYNC_DURATION, "nbytes": r.ASYNC_BYTES,
                                "descriptors": r.ASYNC_DESCRIPTORS, "peer": r.ASYNC_PEER,
                                "return_code": r.ASYNC_RETURN_CODE, "error": r.ASYNC_ERROR, "form": r.ASYNC_FORM,
                                "context": r.ASYNC_CONTEXT, "seen_running": r.ASYNC_SEEN_RUNNING,
                                "post": r.ASYNC_POST}),
    r.call_form: (None, {"op": r.FORM_OP, "protocol": r.FORM_PROTOCOL, "backend": r.FORM_BACKEND,
                         "extra": r.FORM_EXTRA, "failed": r.FORM_FAILED}),
}


@pytest.mark.parametrize("constructor", list(LAYOUTS), ids=lambda f: f.__name__)
def test_each_argument_lands_on_its_named_position(constructor):
    kind, positions = LAYOUTS[constructor]
    values = {name: f"<{name}>" for name in positions}
    built = constructor(**values)
    assert isinstance(built, tuple)
    expected = [None] * (max(positions.values()) + 1)
    for name, position in positions.items():
        expected[position] = values[name]
    if kind is not None:
        assert r.KIND not in positions.values()
        expected[r.KIND] = kind
    assert list(built) == expected  # every position filled, none twice, nothing beyond them


def test_a_raw_call_is_its_calls_fields_between_its_kind_and_its_context():
    call = r.call(*(f"<{i}>" for i in range(r.CALL_EXTRA + 1)))
    built = r.raw_call(call, "<context>")
    assert built == (r.RAW_CALL,) + call + ("<context>",)
    assert built[r.RAW_CALL_FIELDS] == call and built[r.RAW_CONTEXT] == "<context>"
    assert r.raw_call(call, Context())[r.RAW_CONTEXT] is None  # no span current: nothing for the GC to follow


def test_a_monotonic_raw_call_holds_the_call_its_form_completes():
    form = r.call_form("read", "tcp", "mooncake", {"kv_transfer.nic": "mlx5_0"}, "transfer_failed")
    ok = r.raw_monotonic(100, 250, 4096, 2, "10.0.0.1:15001", 0, form, Context())
    assert ok[r.MONO_CONTEXT] is None  # no span current: nothing for the GC to follow
    # The builder's call: its times moved onto the records' clock, the form's fields in their places.
    assert r.monotonic_call(ok, 1000) == r.call(1100, 1250, 4096, 2, "read", "10.0.0.1:15001", "tcp", 0, None,
                                                "mooncake", {"kv_transfer.nic": "mlx5_0"})
    # A return code other than 0 is a failed call, with the form's error type.
    failed = r.raw_monotonic(100, 250, 4096, 2, "10.0.0.1:15001", -1, form, "<context>")
    assert failed[r.MONO_CONTEXT] == "<context>"
    assert r.monotonic_call(failed, 0) == r.call(100, 250, 4096, 2, "read", "10.0.0.1:15001", "tcp", -1,
                                                 "transfer_failed", "mooncake", {"kv_transfer.nic": "mlx5_0"})


def test_an_async_raw_call_holds_the_call_its_form_and_times_complete():
    from otel_kvtransfer import semconv

    form = r.call_form("write", "tcp", "mooncake", {"kv_transfer.nic": "mlx5_0"}, "transfer_failed")
    rec = r.raw_async(1_000, 8_000, 4096, 2, "10.0.0.1:15001", -2, "timeout", form, Context(), 4_000, 500)
    assert rec[r.ASYNC_CONTEXT] is None
    assert r.async_times(rec) == (1_000, 9_000, 5_000, 1_500)  # each time back on the records' clock
    # The window from the last poll that saw it running, and the time inside the submitting call, as attributes
    # beside the form's extra; the error the poll gave, not the form's.
    assert r.async_call(rec) == r.call(1_000, 9_000, 4096, 2, "write", "10.0.0.1:15001", "tcp", -2, "timeout",
                                       "mooncake", {"kv_transfer.nic": "mlx5_0", semconv.END_UNCERTAINTY_S: 4e-6,
                                                    semconv.POST_S: 5e-7})
    assert form[r.FORM_EXTRA] == {"kv_transfer.nic": "mlx5_0"}  # the shared form is left as it was
    # Posted after the end it was seen at (another thread's poll): posting took at most the whole send.
    late = r.raw_async(1_000, 8_000, 0, 1, "p", 0, None, r.call_form("read", None, "mooncake", None, "x"), None,
                       None, 11_000)
    assert r.async_times(late) == (1_000, 9_000, 1_000, 12_000)  # no poll saw it running: the window is all of it
    assert r.async_call(late)[r.CALL_EXTRA] == {semconv.END_UNCERTAINTY_S: 8e-6, semconv.POST_S: 8e-6}
    # Posting time unknown: no post_s.
    unknown = r.raw_async(1_000, 8_000, 0, 1, "p", 0, None, form, None, None, None)
    assert set(r.async_call(unknown)[r.CALL_EXTRA]) == {"kv_transfer.nic", semconv.END_UNCERTAINTY_S}


def test_the_kinds_are_distinct():
    kinds = [r.SEND, r.BEGIN_REQUEST, r.END_REQUEST, r.COMPUTE, r.BEGIN_PEER, r.END_PEER, r.INFLIGHT, r.CONNECT,
             r.LATE_ARRIVAL, r.RAW_CALL, r.PEER_OUTCOME, r.RAW_MONOTONIC, r.RAW_ASYNC]
    assert len(set(kinds)) == len(kinds)


def test_a_calls_bytes_and_descriptors_are_adjacent():
    # A split transfer scope replaces both in one slice of the call tuple.
    assert r.CALL_DESCRIPTORS == r.CALL_BYTES + 1
