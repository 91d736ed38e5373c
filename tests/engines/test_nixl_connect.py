"""Connection set-up on real NIXL agents (UCX over TCP on loopback), both pipelines: each explicit set-up call is
one `kv_transfer.connect` span and one `kv_transfer.connect.duration` point, under the request whose transfer
scope it ran in; a request whose peer is already set up makes none; a failed call ends in error and raises as
NIXL raised; a metadata fetch nobody answers is open (kind `connect`) and reported stuck while it hangs.

The agents live in one child process (tests/support/nixl_agents.py says why): the module run as a script.
"""

import os
import sys

import pytest
from support import nixl_agents
from support.logs import warnings_logged
from support.nixl_agents import Initiator, result_of, spans_named
from support.waiting import wait_until

SIZE, BLOCK = 1 << 20, 1 << 16
STUCK_S = 1.0


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again when this returns: nobody listens there


def _scenario(receiver, tel) -> dict:
    from otel_kvtransfer import integration as kvt

    out = {}
    with warnings_logged() as warnings:
        # The first request sets its peer up inside its own transfer scope, then writes; the second only writes.
        kvt.begin_request("first", backend="nixl", framework="test")
        with kvt.transfer_scope("first", is_last_chunk=True):
            init = Initiator(receiver, SIZE, BLOCK, name=f"kvt-connect-{os.environ['OTEL_KVTRANSFER_PIPELINE']}")
            out["first_write"] = init.write_all()
        kvt.end_request("first")
        kvt.begin_request("second", backend="nixl", framework="test")
        with kvt.transfer_scope("second", is_last_chunk=True):
            out["second_write"] = init.write_all()
        kvt.end_request("second")
        out["peer"] = init.peer.decode() if isinstance(init.peer, bytes) else init.peer  # NIXL answers bytes
        # A raw set-up call outside any request: its own trace.
        init.agent.make_connection(init.peer)
        # Metadata that is not a NIXL agent's: NIXL refuses it, the exception reaches the caller unchanged.
        try:
            init.agent.add_remote_agent(b"not an agent's metadata")
            out["bad_metadata"] = "accepted"
        except Exception as exc:  # noqa: BLE001  whatever NIXL raises, it must be what the caller sees
            out["bad_metadata"] = type(exc).__qualname__
        # A metadata fetch from a port nobody listens on: never found, open until the scan reports it stuck.
        init.agent.fetch_remote_metadata("kvt-nobody", "127.0.0.1", _closed_port())
        wait_until(lambda: any("connect open for" in line for line in warnings), 30,
                   "the stuck line of the metadata fetch")
        out["found_nobody"] = init.agent.check_remote_metadata("kvt-nobody")
        metrics = tel.metrics()
        out["stuck"] = [{"attributes": dict(p.attributes), "value": p.value}
                        for p in metrics.get("kv_transfer.stuck", [])]
        out["inflight"] = [{"attributes": dict(p.attributes), "value": p.value}
                           for p in metrics.get("kv_transfer.inflight", [])]
        out["connect_metric"] = [{"attributes": dict(p.attributes), "count": p.count}
                                 for p in metrics.get("kv_transfer.connect.duration", [])]
        spans = tel.spans()
        ids = {s.context.span_id: s.name for s in spans}
        out["spans"] = [{"name": s.name, "attributes": dict(s.attributes), "status": s.status.status_code.name,
                         "parent_name": ids.get(s.parent.span_id) if s.parent else None,
                         "same_trace_as_parent": bool(s.parent) and s.parent.trace_id == s.context.trace_id,
                         "duration_ns": s.end_time - s.start_time} for s in spans]
        out["warnings"] = [line for line in warnings if "connect" in line]
        return out


def _child(out_path: str) -> None:
    os.environ["OTEL_KVTRANSFER_STUCK_S"] = str(STUCK_S)
    nixl_agents.run_in_each_pipeline(out_path, SIZE, _scenario)


# --- the tests -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return nixl_agents.loopback_outcomes(__file__, tmp_path_factory, "nixl_connect")


def _connects(result) -> list:
    return spans_named(result, "kv_transfer.connect")


@pytest.mark.parametrize("pipeline", nixl_agents.PIPELINES)
def test_the_first_requests_set_up_is_a_connect_span_under_it_and_the_second_has_none(outcomes, pipeline):
    result = result_of(outcomes, pipeline)
    assert result["first_write"] == result["second_write"] == "DONE"
    (first,) = [s for s in _connects(result) if s["attributes"].get("kv_transfer.request_key") == "first"]
    assert first["parent_name"] == "kv_transfer.request" and first["same_trace_as_parent"]
    assert first["status"] == "UNSET" and first["duration_ns"] > 0
    assert first["attributes"]["kv_transfer.connect.operation"] == "add_remote_agent"
    assert first["attributes"]["kv_transfer.connect.outcome"] == "ok"
    assert first["attributes"]["nixl.remote_agent"] == result["peer"]  # the name NIXL answered with
    assert first["attributes"]["kv_transfer.framework"] == "test"
    assert not [s for s in _connects(result) if s["attributes"].get("kv_transfer.request_key") == "second"]


@pytest.mark.parametrize("pipeline", nixl_agents.PIPELINES)
def test_a_set_up_call_outside_any_request_is_a_span_of_its_own(outcomes, pipeline):
    result = result_of(outcomes, pipeline)
    (made,) = [s for s in _connects(result) if s["attributes"]["kv_transfer.connect.operation"] == "make_connection"]
    assert made["parent_name"] is None and "kv_transfer.request_key" not in made["attributes"]
    assert made["attributes"]["nixl.remote_agent"] == result["peer"]


@pytest.mark.parametrize("pipeline", nixl_agents.PIPELINES)
def test_a_refused_set_up_call_ends_in_error_and_raises_unchanged(outcomes, pipeline):
    result = result_of(outcomes, pipeline)
    assert result["bad_metadata"] not in ("accepted", "")
    (failed,) = [s for s in _connects(result) if s["status"] == "ERROR"]
    assert failed["attributes"]["kv_transfer.connect.operation"] == "add_remote_agent"
    assert failed["attributes"]["error.type"] == result["bad_metadata"]
    assert failed["attributes"]["kv_transfer.connect.outcome"] == "error"
    assert "nixl.remote_agent" not in failed["attributes"]  # NIXL never named the agent


@pytest.mark.parametrize("pipeline", nixl_agents.PIPELINES)
def test_every_connect_span_is_a_point_of_the_connect_histogram(outcomes, pipeline):
    result = result_of(outcomes, pipeline)
    counts = {}
    for point in result["connect_metric"]:  # a point per (framework, outcome): the request's and the raw one
        outcome = point["attributes"].get("kv_transfer.connect.outcome")
        counts[outcome] = counts.get(outcome, 0) + point["count"]
    spans = _connects(result)
    assert counts == {"ok": sum(s["status"] != "ERROR" for s in spans), "error": 1}
    assert counts["ok"] == 2
    assert all(set(p["attributes"]) <= {"kv_transfer.backend", "kv_transfer.framework", "kv_transfer.connect.outcome"}
               for p in result["connect_metric"])


@pytest.mark.parametrize("pipeline", nixl_agents.PIPELINES)
def test_a_metadata_fetch_nobody_answers_is_reported_stuck_while_it_hangs(outcomes, pipeline):
    result = result_of(outcomes, pipeline)
    assert result["found_nobody"] is False  # still hanging when its report came
    (line,) = [line for line in result["warnings"] if "connect open for" in line]
    assert "peer kvt-nobody" in line
    (stuck,) = [p for p in result["stuck"] if p["attributes"].get("kv_transfer.inflight.kind") == "connect"]
    assert stuck["value"] == 1 and stuck["attributes"].get("kv_transfer.backend") == "nixl"
    (open_now,) = [p for p in result["inflight"] if p["attributes"].get("kv_transfer.inflight.kind") == "connect"]
    assert open_now["value"] == 1
    assert not [s for s in _connects(result) if s["attributes"].get("nixl.remote_agent") == "kvt-nobody"]


if __name__ == "__main__":
    _child(sys.argv[1])
