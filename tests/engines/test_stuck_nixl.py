"""Stuck while it is stuck, on two real NIXL agents: a write posted to a peer agent whose process is frozen
(SIGSTOP) stays PROC while the initiator keeps polling `check_xfer_state`, and is reported stuck while it stays
so; then the peer either resumes (the write completes) or is killed (the write ends failed).

Real parts: two NIXL 1.5.1 agents with the UCX backend in two processes (otel_kvtransfer.demo.nixl_loopback's
Receiver is the peer), UCX over TCP on the loopback device only (UCX_TLS=tcp,self: with shared memory UCX
would write straight into the frozen peer's memory and nothing would ever wait), all inside `unshare --net`
with loopback up. The initiator is instrumented with OTEL_KVTRANSFER_STUCK_S=1 and in-memory SDK readers.

No NIXL agent lives in the pytest process (tests/support/nixl_agents.py says why): this file run as a script is
the initiator's process, writes what it saw to a JSON file and leaves with os._exit.
"""

import functools
import logging
import os
import signal
import sys
import time

import pytest
from support import netns, nixl_agents
from support.nixl_agents import Initiator, result_of
from support.paths import ROOT

HERE = os.path.dirname(os.path.abspath(__file__))
SIZE = 64 << 20  # far more than the TCP socket buffers: the write cannot finish while the peer is frozen
BLOCK = 1 << 20
REPORTED_MAX_S = 60.0  # bounded: the reports come within OTEL_KVTRANSFER_STUCK_S=1 and the watcher's 1 s scan
ROOM = "nixl-stuck-1"


# --- the initiator's process -----------------------------------------------------------------------------------


class _Lines(logging.Handler):
    """The package's WARNING lines, with whether the peer was still frozen when each was logged."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.frozen = True
        self.lines = []

    def emit(self, record):
        self.lines.append({"text": record.getMessage(), "frozen": self.frozen})


def _points(tel, name) -> list:
    return [{"attributes": dict(p.attributes), "value": p.value} for p in tel.metrics().get(name, [])]


def _while_frozen(lines, tel):
    """What the metrics say once the send and its request are reported stuck and counted, with the send still in
    the gauges; None before."""
    texts = [line["text"] for line in lines.lines]
    if not (any("a send open" in t for t in texts) and any("a request open" in t for t in texts)):
        return None
    seen = {name: _points(tel, name) for name in
            ("kv_transfer.stuck", "kv_transfer.inflight", "kv_transfer.inflight.oldest_age")}
    counted = _stuck(seen["kv_transfer.stuck"], "send")
    open_now = [p["value"] for p in _stuck(seen["kv_transfer.inflight"], "send")]
    ages = [p["value"] for p in _stuck(seen["kv_transfer.inflight.oldest_age"], "send")]
    return seen if counted and open_now and open_now[0] >= 1 and ages and ages[0] >= 1.0 else None


def _scenario(end: str) -> dict:
    """Post a 64 MiB write to a frozen peer, poll it until it is reported stuck, then `end` it: resume or kill the
    peer."""
    import numpy as np
    from support.telemetry import Telemetry

    from otel_kvtransfer import integration as kvt
    from otel_kvtransfer.demo.nixl_loopback import Receiver

    lines = _Lines()
    logging.getLogger("otel_kvtransfer").addHandler(lines)
    tel = Telemetry().instrument()
    receiver = Receiver(SIZE)
    try:
        init = Initiator(receiver, SIZE, BLOCK, buffer=np.full(SIZE, 5, dtype=np.uint8), name=f"kvt-stuck-{end}")
        agent, peer, source = init.agent, init.peer, init.buffer
        local, remote = init.descs()
        assert init.write_all() == "DONE"  # connect first: the stuck write is the 2nd
        receiver.fill(0)

        kvt.begin_request(ROOM, backend="nixl", framework="test")
        handle = agent.initialize_xfer("WRITE", local, remote, peer)
        os.kill(receiver.pid, signal.SIGSTOP)
        with kvt.transfer_scope(ROOM, chunk_index=0, is_last_chunk=True):
            states = [agent.transfer(handle)]
        polls, frozen_at = 0, time.monotonic()
        while_frozen = None
        # frozen until reported (bounded); the poller keeps polling meanwhile, as an engine's step loop does
        while while_frozen is None and time.monotonic() < frozen_at + REPORTED_MAX_S:
            for _ in range(10):
                states.append(agent.check_xfer_state(handle))
                polls += 1
                time.sleep(0.01)  # the step loop's pace, not a wait
            while_frozen = _while_frozen(lines, tel)
        frozen_s = time.monotonic() - frozen_at
        lines.frozen = False
        if end == "resume":
            os.kill(receiver.pid, signal.SIGCONT)
        else:
            receiver.process.kill()
        final, deadline = states[-1], time.monotonic() + 60
        while final == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
            try:
                final = agent.check_xfer_state(handle)
            except Exception as exc:
                final = f"raised {type(exc).__name__}"
        agent.release_xfer_handle(handle)
        kvt.end_request(ROOM)
        arrived = False
        if end == "resume":
            from otel_kvtransfer.demo.loopback import digest

            arrived = receiver.digest(0, SIZE) == digest(source)
        spans = [{"name": s.name, "attributes": dict(s.attributes), "ok": s.status.is_ok,
                  "events": [{"name": e.name, "attributes": dict(e.attributes)} for e in s.events]}
                 for s in tel.spans()]
        return {"states_while_frozen": sorted(set(states)), "polls": polls, "final": final, "arrived": arrived,
                "while_frozen": while_frozen, "frozen_s": frozen_s, "lines": lines.lines, "spans": spans,
                "peer": receiver.session,
                "stuck_total": _points(tel, "kv_transfer.stuck")}
    finally:
        try:
            os.kill(receiver.pid, signal.SIGCONT)
        except OSError:
            pass
        receiver.kill()
        tel.uninstrument()
        logging.getLogger("otel_kvtransfer").removeHandler(lines)


def _child(out_path: str) -> None:
    sys.path.insert(0, HERE)
    nixl_agents.leave(out_path, nixl_agents.run_scenarios({end: functools.partial(_scenario, end)
                                                           for end in ("resume", "kill")}))


# --- the tests -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("nixl-stuck") / "outcomes.json")
    env = netns.with_pythonpath(dict(os.environ, UCX_NET_DEVICES="lo", UCX_TLS="tcp,self",
                                     OTEL_KVTRANSFER_STUCK_S="1"), ROOT)
    return nixl_agents.run_apart(__file__, out, env, timeout_s=300, private_net=True)


def _stuck(points, kind) -> list:
    return [p for p in points if p["attributes"]["kv_transfer.inflight.kind"] == kind]


def _assert_reported_while_frozen(result) -> None:
    """The send stayed PROC under steady polling, and was reported stuck (once) before the peer was let go."""
    assert result["states_while_frozen"] == ["PROC"] and result["polls"] > 10
    seen = result["while_frozen"]
    assert seen, f"not reported stuck within {REPORTED_MAX_S:g} s of the freeze"
    (send,) = _stuck(seen["kv_transfer.stuck"], "send")
    assert send["value"] == 1
    assert send["attributes"]["kv_transfer.backend"] == "nixl"
    assert send["attributes"]["kv_transfer.role"] == "prefill"
    assert [p["value"] for p in _stuck(seen["kv_transfer.inflight"], "send")] == [1]
    assert _stuck(seen["kv_transfer.inflight.oldest_age"], "send")[0]["value"] >= 1.0
    send_lines = [line for line in result["lines"] if "a send open" in line["text"]]
    assert len(send_lines) == 1 and send_lines[0]["frozen"]
    text = send_lines[0]["text"]
    assert "is stuck" in text and ROOM in text and result["peer"] in text and str(SIZE) in text
    # Reported once: the counter did not move after the peer was let go.
    assert [p["value"] for p in _stuck(result["stuck_total"], "send")] == [1]


def _request(result) -> dict:
    (request,) = [s for s in result["spans"] if s["name"] == "kv_transfer.request"]
    return request


def test_a_write_to_a_frozen_peer_is_stuck_while_it_stays_proc_and_whole_when_the_peer_resumes(outcomes):
    result = result_of(outcomes, "resume")
    _assert_reported_while_frozen(result)
    assert result["final"] == "DONE" and result["arrived"]  # every byte landed once the peer went on
    request = _request(result)
    events = [e["attributes"] for e in request["events"] if e["name"] == "kv_transfer.stuck"]
    assert sorted(e["kv_transfer.inflight.kind"] for e in events) == ["request", "send"]
    (send_event,) = [e for e in events if e["kv_transfer.inflight.kind"] == "send"]
    assert send_event["server.address"] == result["peer"] and send_event["kv_transfer.bytes"] == SIZE
    assert send_event["kv_transfer.stuck.age_s"] >= 1.0
    (send,) = [s for s in result["spans"] if s["name"] == "kv_transfer.send"
               and s["attributes"].get("kv_transfer.request_key") == ROOM]
    assert send["ok"] and send["attributes"]["kv_transfer.bytes"] == SIZE
    # Its end was seen by a poll: the window is bounded by the poll interval, not by the time it hung.
    assert 0 <= send["attributes"]["kv_transfer.end_uncertainty_s"] < result["frozen_s"]
    assert request["attributes"]["kv_transfer.bytes"] == SIZE


def test_a_write_to_a_frozen_peer_that_is_then_killed_was_reported_stuck(outcomes):
    """UCX over TCP does not fail a write to a frozen peer (it stays PROC: that is what is reported), but fails it
    at once when the peer's process dies: NIXL's status call then raises nixlRemoteDisconnectError."""
    result = result_of(outcomes, "kill")
    _assert_reported_while_frozen(result)
    assert result["final"] in ("ERR", "raised nixlRemoteDisconnectError")
    kinds = sorted(e["attributes"]["kv_transfer.inflight.kind"] for e in _request(result)["events"]
                   if e["name"] == "kv_transfer.stuck")
    assert kinds == ["request", "send"]


def test_a_write_whose_peer_died_is_one_failed_send(outcomes):
    """NIXL's status call raises nixlRemoteDisconnectError for a peer that died: the send ends failed, named
    after it (it once stayed pending until uninstrument counted it)."""
    result = result_of(outcomes, "kill")
    sends = [s for s in result["spans"] if s["name"] == "kv_transfer.send"
             and s["attributes"].get("kv_transfer.request_key") == ROOM]
    assert len(sends) == 1 and not sends[0]["ok"]
    assert sends[0]["attributes"]["kv_transfer.bytes"] == SIZE
    assert sends[0]["attributes"]["error.type"] in ("nixlRemoteDisconnectError", "transfer_failed")


if __name__ == "__main__":
    _child(sys.argv[1])
