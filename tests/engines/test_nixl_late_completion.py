"""A NIXL write that completes after its request was ended is reported as late: the span event
`kv_transfer.late_completion` on its send (under the ended request's span), the counter
`kv_transfer.late_completions`, one WARNING for the request. A write that completes before its request ends
reports nothing.

Real parts: two NIXL agents over UCX (TCP on the loopback device), the receiver in a process of its own
(otel_kvtransfer.demo.nixl_loopback), frozen with SIGSTOP while the late write is posted, so it is still in flight
when its request is ended (as an aborted request's transfer is), then let run to completion. Both pipelines
(spans and metric points built directly, or through the SDK). The scenarios run in ONE child process (this file
run as a script) that writes what it saw and leaves with os._exit (tests/support/nixl_agents.py says why).
"""

import os
import sys

import pytest
from support import nixl_agents
from support.logs import warnings_logged
from support.nixl_agents import Initiator, result_of, spans_named

BLOCK = 1 << 20
BLOCKS = 64
SIZE = BLOCK * BLOCKS  # more than loopback TCP's buffers hold: to a frozen peer it cannot finish in transfer()


# --- the child process -----------------------------------------------------------------------------------------


def _scenario(receiver, tel) -> dict:
    from otel_kvtransfer import integration as kvt

    with warnings_logged() as warnings:
        init = Initiator(receiver, SIZE, BLOCK, name=f"kvt-late-{os.environ['OTEL_KVTRANSFER_PIPELINE']}")
        assert init.write_all() == "DONE"  # connected before anything is measured
        out = {}
        # In time: posted, completed, then its request ends.
        kvt.begin_request("in-time", backend="nixl", framework="test")
        local, remote = init.descs()
        with kvt.transfer_scope("in-time", is_last_chunk=True):
            handle = init.agent.initialize_xfer("WRITE", local, remote, init.peer)
            out["in_time_final"] = init.wait(handle, timeout_s=120)
        init.agent.release_xfer_handle(handle)
        kvt.end_request("in-time")
        # Late: posted to the frozen peer, its request ended (aborted) while it is in flight, then it completes.
        kvt.begin_request("late", backend="nixl", framework="test")
        with kvt.transfer_scope("late", is_last_chunk=True):
            handle = init.agent.initialize_xfer("WRITE", local, remote, init.peer)
            with nixl_agents.frozen(receiver):
                out["late_posted"] = init.agent.transfer(handle)
                kvt.end_request("late", error_type="aborted")
            out["late_final"] = init.wait(handle, post=False, timeout_s=120)
        init.agent.release_xfer_handle(handle)
        spans = [{"name": s.name, "span_id": s.context.span_id, "parent": s.parent.span_id if s.parent else None,
                  "trace_id": s.context.trace_id, "start": s.start_time, "end": s.end_time,
                  "attributes": dict(s.attributes),
                  "events": [{"name": e.name, "attributes": dict(e.attributes), "timestamp": e.timestamp}
                             for e in s.events]}
                 for s in tel.spans()]
        late = [{"attributes": dict(p.attributes), "value": p.value}
                for p in tel.metrics().get("kv_transfer.late_completions", [])]
        return dict(out, spans=spans, late_metric=late,
                    warnings=[line for line in warnings if "late_completion" in line])


def _child(out_path: str) -> None:
    nixl_agents.run_in_each_pipeline(out_path, SIZE, _scenario)


# --- the tests -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return nixl_agents.loopback_outcomes(__file__, tmp_path_factory, "nixl_late")


def _of(result, name, key) -> list:
    return [s for s in spans_named(result, name) if s["attributes"].get("kv_transfer.request_key") == key]


@pytest.mark.parametrize("pipeline", nixl_agents.PIPELINES)
def test_a_write_completing_after_its_request_ended_is_reported_late_once(outcomes, pipeline):
    result = result_of(outcomes, pipeline)
    assert (result["late_posted"], result["late_final"]) == ("PROC", "DONE")  # in flight at the end, then done
    (request,) = _of(result, "kv_transfer.request", "late")
    assert request["attributes"]["error.type"] == "aborted"
    (send,) = _of(result, "kv_transfer.send", "late")  # under the ended request, no second request span
    assert (send["parent"], send["trace_id"]) == (request["span_id"], request["trace_id"])
    assert send["attributes"]["kv_transfer.bytes"] == SIZE and send["end"] > request["end"]
    (event,) = send["events"]
    assert event["name"] == "kv_transfer.late_completion" and event["timestamp"] == send["end"]
    assert event["attributes"]["kv_transfer.after_request_end_s"] == (send["end"] - request["end"]) / 1e9
    (point,) = result["late_metric"]
    assert point["value"] == 1
    assert {k: point["attributes"][k] for k in ("kv_transfer.backend", "kv_transfer.payload")} == {
        "kv_transfer.backend": "nixl", "kv_transfer.payload": "kv"}
    (warning,) = result["warnings"]
    print(warning)  # the line an operator reads, kept in the test's output
    assert "request late" in warning


@pytest.mark.parametrize("pipeline", nixl_agents.PIPELINES)
def test_a_write_completing_before_its_request_ends_reports_nothing_late(outcomes, pipeline):
    result = result_of(outcomes, pipeline)
    assert result["in_time_final"] == "DONE"
    (request,) = _of(result, "kv_transfer.request", "in-time")
    (send,) = _of(result, "kv_transfer.send", "in-time")
    assert send["parent"] == request["span_id"] and send["end"] <= request["end"]
    assert send["events"] == []
    assert all("in-time" not in line for line in result["warnings"])


if __name__ == "__main__":
    _child(sys.argv[1])
