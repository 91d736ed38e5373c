"""A NIXL peer names itself: its agent name comes from its own metadata, and a request key from a client. Neither
may forge a line of the engine's log. A real peer agent whose name holds a newline, a forged `CRITICAL` line, a
clear-screen escape and U+2028 (and is longer than a log line shows), and a request key that holds the same: the
stuck line (the write to the frozen peer) and the late-completion line (its request aborted while the write was in
flight) each stay one line, with those characters escaped and the values bounded.

Real parts: two NIXL agents over UCX (TCP on the loopback device), the peer in a process of its own, frozen with
SIGSTOP while the write is in flight so it is reported stuck and completes after its request ended. The agents
live in ONE child process (this file run as a script) that writes what it saw and leaves with os._exit
(tests/support/nixl_agents.py says why).
"""

import multiprocessing
import os
import sys
import time
from types import SimpleNamespace

import pytest
from support import nixl_agents
from support.logs import warnings_logged
from support.nixl_agents import Initiator, result_of

BLOCK = 1 << 20
SIZE = 64 * BLOCK  # more than loopback TCP's buffers hold: to a frozen peer it cannot finish in transfer()
FORGED = "\n2026-01-01 00:00:00 CRITICAL otel_kvtransfer: the KV cache is corrupt, restart every engine"
PEER_NAME = "kvt-peer" + FORGED + "\x1b[2J\x1b]0;owned\x07\u2028" + "p" * 80  # longer than a line shows
KEY = "req-1\n2026-01-01 00:00:00 CRITICAL forged\r\x1b[31m\u202eevil"  # short enough to be shown whole
STUCK_S = 1.0


# --- the child process -----------------------------------------------------------------------------------------


def _peer_main(conn, name: str, size: int) -> None:
    """A NIXL agent called `name` with `size` registered bytes: answers its metadata, then waits to be told to go."""
    import nixl._api as api
    import numpy as np

    agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    buffer = np.zeros(size, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(buffer.ctypes.data, size, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), buffer.ctypes.data))
    conn.recv()
    os._exit(0)


def _scenario() -> dict:
    from support.telemetry import Telemetry

    from otel_kvtransfer import integration as kvt

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=_peer_main, args=(theirs, PEER_NAME, SIZE), daemon=True)
    process.start()
    tel = Telemetry().instrument()
    try:
        metadata, address = ours.recv()
        peer = SimpleNamespace(session=PEER_NAME, base_address=address, pid=process.pid)
        init = Initiator(peer, SIZE, BLOCK, name="kvt-names", metadata=metadata)
        out = {"peer": init.peer.decode() if isinstance(init.peer, bytes) else init.peer,
               "connected": init.write_all()}
        with warnings_logged() as lines:
            kvt.begin_request(KEY, backend="nixl", framework="test")
            local, remote = init.descs()
            with kvt.transfer_scope(KEY, is_last_chunk=True):
                handle = init.agent.initialize_xfer("WRITE", local, remote, init.peer)
                with nixl_agents.frozen(peer):
                    out["posted"] = init.agent.transfer(handle)
                    kvt.end_request(KEY, error_type="aborted")
                    deadline = time.monotonic() + 60  # the scan reports it within STUCK_S and a second
                    while time.monotonic() < deadline and not any("is stuck" in line for line in lines):
                        init.agent.check_xfer_state(handle)
                        time.sleep(0.01)
                out["final"] = init.wait(handle, post=False, timeout_s=120)
            init.agent.release_xfer_handle(handle)
            late = tel.spans("kv_transfer.send")  # drains the recorder: the late send is built, its line logged
            out["late_sends"] = sum(1 for s in late if any(e.name == "kv_transfer.late_completion"
                                                           for e in s.events))
            out["lines"] = list(lines)
        return out
    finally:
        tel.uninstrument()
        ours.send("go")
        process.join(30)


def _child(out_path: str) -> None:
    os.environ["OTEL_KVTRANSFER_STUCK_S"] = str(STUCK_S)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_TLS", "tcp,self")
    nixl_agents.leave(out_path, nixl_agents.run_scenarios({"names": _scenario}))


# --- the tests -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    return result_of(nixl_agents.loopback_outcomes(__file__, tmp_path_factory, "nixl_names"), "names")


def test_the_peer_really_named_itself_so(outcome):
    assert outcome["peer"] == PEER_NAME  # NIXL hands the name out as the peer chose it, newline and all
    assert (outcome["connected"], outcome["posted"], outcome["final"]) == ("DONE", "PROC", "DONE")
    assert outcome["late_sends"] == 1


def test_a_peer_name_and_a_request_key_never_forge_a_log_line(outcome):
    lines = outcome["lines"]
    (stuck,) = [line for line in lines if "a send open" in line]
    (late,) = [line for line in lines if "completed" in line and "after the request had ended" in line]
    for line in (stuck, late):
        assert len(line.splitlines()) == 1 and line.isprintable(), repr(line)
        assert "CRITICAL" in line  # the forged text is there, escaped inside the value, never a line of its own
        assert "req-1\\x0a2026-01-01 00:00:00 CRITICAL forged\\x0d\\x1b[31m\\u202eevil" in line  # the key, whole
    # The peer's name: escaped, and cut at 120 characters with its length said (its tail is not shown).
    assert "kvt-peer\\x0a2026-01-01 00:00:00 CRITICAL" in stuck and f"({len(PEER_NAME)} characters)" in stuck
    assert "to kvt-peer\\x0a2026-01-01" in late and "pppp" not in late
    assert all(len(line) < 700 for line in lines)
    assert all(line.isprintable() for line in lines), [line for line in lines if not line.isprintable()]


if __name__ == "__main__":
    _child(sys.argv[1])
