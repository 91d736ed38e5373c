"""The NIXL engine module on two real NIXL agents in two processes (UCX over the loopback device only).

The initiator agent is instrumented; the target agent lives in a spawned process
(otel_kvtransfer.demo.nixl_loopback.Receiver) that registers a buffer, answers checksums of it and reports the
notification messages that arrived. Each test asserts the exact bytes moved, the send span's attributes and, for
failures, the ERROR status with error.type.

No NIXL agent ever lives in the pytest process (tests/support/nixl_agents.py says why): the scenarios run in ONE
child process (this file run as a script: `python tests/engines/test_nixl_engine.py OUT.json`) that writes what it saw
(spans, metric points, bytes checks) and leaves with os._exit; the tests below assert on that.
"""

import os
import subprocess
import sys
import time

import pytest
from support import nixl_agents
from support.nixl_agents import Initiator, result_of, spans_named
from support.waiting import wait_until

BLOCK = 64 << 10
BLOCKS = 16
SIZE = BLOCK * BLOCKS
# The scenarios that need a post still in flight when transfer() returns write this much to a peer frozen with
# SIGSTOP, over TCP: far more than the socket buffers, so it cannot finish inside the call (to a running peer
# even 64 MiB usually does).
BIG_BLOCK = 1 << 20
BIG = 64 * BIG_BLOCK


SCENARIOS = {}


def scenario(function):
    SCENARIOS[function.__name__] = function
    return function


# --- the child process -----------------------------------------------------------------------------------------


def _digest(data):
    from otel_kvtransfer.demo.loopback import digest

    return digest(data)


def _seen(tel) -> dict:
    """What the telemetry recorded, as plain data."""
    spans = [{"name": s.name, "span_id": s.context.span_id, "parent": s.parent.span_id if s.parent else None,
              "attributes": dict(s.attributes), "ok": s.status.is_ok} for s in tel.spans()]
    metrics = {name: [{"attributes": dict(p.attributes), "value": getattr(p, "value", None)} for p in points]
               for name, points in tel.metrics().items()}
    return {"spans": spans, "metrics": metrics}


def _telemetry():
    from support.telemetry import Telemetry

    return Telemetry().instrument()


@scenario
def prepped_write(receiver, _originals):
    tel = _telemetry()
    try:
        init = Initiator(receiver, SIZE, BLOCK)
        receiver.notifications()  # start from an empty notification queue
        local = init.agent.prep_xfer_dlist("NIXL_INIT_AGENT", init.local_blocks(), "DRAM")
        remote = init.agent.prep_xfer_dlist(init.peer, init.remote_blocks(), "DRAM")
        chosen = [1, 2, 3, 7, 8]
        handle = init.agent.make_prepped_xfer("WRITE", local, chosen, remote, chosen, notif_msg=b"req-42:1")
        state = init.wait(handle)
        init.agent.release_xfer_handle(handle)
        arrived = all(receiver.digest(i * BLOCK, BLOCK) == _digest(init.buffer[i * BLOCK:(i + 1) * BLOCK])
                      for i in chosen)
        notes = wait_until(receiver.notifications, 10, "the notification at the receiver")
        return dict(_seen(tel), state=state, arrived=arrived, notes=notes, chosen=len(chosen),
                    peer=receiver.session)
    finally:
        tel.uninstrument()


@scenario
def read_in_scope(receiver, _originals):
    from otel_kvtransfer import integration as kvt

    tel = _telemetry()
    try:
        init = Initiator(receiver, SIZE, BLOCK)
        receiver.fill(7)
        kvt.begin_request("prefill-req-1", backend="nixl", framework="test", role="decode")
        local, remote = init.descs(4)
        with kvt.transfer_scope("prefill-req-1", chunk_index=0, is_last_chunk=True):
            handle = init.agent.initialize_xfer("READ", local, remote, init.peer)
            init.agent.transfer(handle)
        # Completion is observed later, outside the scope, as vLLM's engine step does.
        state = init.wait(handle, post=False)
        init.agent.release_xfer_handle(handle)
        kvt.end_request("prefill-req-1")
        return dict(_seen(tel), state=state, read_back=bool((init.buffer[:4 * BLOCK] == 7).all()))
    finally:
        tel.uninstrument()


@scenario
def peer_gone(_receiver, _originals):
    from otel_kvtransfer.demo.nixl_loopback import Receiver

    tel = _telemetry()
    try:
        doomed = Receiver(SIZE)
        try:
            init = Initiator(doomed, SIZE, BLOCK)
            local, remote = init.descs()
            handle = init.agent.initialize_xfer("WRITE", local, remote, init.peer)
        finally:
            doomed.kill()  # the peer process is gone (SIGKILL) before the transfer is posted
        try:
            state = init.wait(handle)
        except Exception as exc:
            state = f"raised {type(exc).__name__}"
        return dict(_seen(tel), state=state)
    finally:
        tel.uninstrument()


@scenario
def bounded(receiver, _originals):
    os.environ["OTEL_KVTRANSFER_MAX_PENDING_ASYNC"] = "1"  # read by instrument()
    tel = _telemetry()
    try:
        init = Initiator(receiver, SIZE, BLOCK)
        local, remote = init.descs()
        handles = [init.agent.initialize_xfer("WRITE", local, remote, init.peer) for _ in range(3)]
        states = [init.agent.transfer(h) for h in handles]
        for handle in handles:
            init.wait(handle, post=False)
            init.agent.release_xfer_handle(handle)
        return dict(_seen(tel), states=states)
    finally:
        tel.uninstrument()
        del os.environ["OTEL_KVTRANSFER_MAX_PENDING_ASYNC"]


@scenario
def uninstrumented(receiver, originals):
    import nixl._api as api

    tel = _telemetry()
    wrapped = {name: api.nixl_agent.__dict__[name] is not original for name, original in originals.items()}
    tel.uninstrument()
    restored = {name: api.nixl_agent.__dict__[name] is original for name, original in originals.items()}
    init = Initiator(receiver, SIZE, BLOCK)  # and the agent still works, recording nothing
    local, remote = init.descs(1)
    state = init.wait(init.agent.initialize_xfer("WRITE", local, remote, init.peer))
    return dict(_seen(tel), wrapped=wrapped, restored=restored, state=state)


@scenario
def demo_engine(receiver, _originals):
    import numpy as np

    from otel_kvtransfer import integration as kvt
    from otel_kvtransfer.demo.nixl_loopback import open_engine

    tel = _telemetry()
    try:
        engine = open_engine()
        src = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
        codes = [engine.register_memory(src.ctypes.data, src.nbytes)]
        kvt.begin_request(77, backend="nixl", framework="demo")
        half = BLOCKS // 2
        for chunk in range(2):
            offset = chunk * (SIZE // 2)
            with kvt.transfer_scope(77, chunk_index=chunk, is_last_chunk=chunk == 1):
                codes.append(engine.batch_transfer_sync_write(
                    receiver.session, [src.ctypes.data + offset + i * BLOCK for i in range(half)],
                    [receiver.base_address + offset + i * BLOCK for i in range(half)], [BLOCK] * half))
        kvt.end_request(77)
        return dict(_seen(tel), codes=codes, arrived=receiver.digest(0, SIZE) == _digest(src))
    finally:
        tel.uninstrument()


@scenario
def freed_by_gc(receiver, _originals):
    """Handles dropped with their transfer still pending: `nixl_xfer_handle.__del__` frees them, never `release()`
    (sglang lets its handles go this way)."""
    import gc

    tel = _telemetry()
    try:
        init = Initiator(receiver, BIG, BIG_BLOCK)
        local, remote = init.descs()
        states = [init.write_all()]  # connected before the peer stops
        with nixl_agents.frozen(receiver):
            for _ in range(2):  # still in flight when dropped: cancelled sends
                handle = init.agent.initialize_xfer("WRITE", local, remote, init.peer)
                states.append(init.agent.transfer(handle))
                del handle  # the last reference
            gc.collect()
        handle = init.agent.initialize_xfer("WRITE", local, remote, init.peer)
        states.append(init.wait(handle, timeout_s=60))  # done when dropped: a successful send
        del handle
        gc.collect()
        time.sleep(0.5)  # a cancelled write may still be landing: let it settle before the next scenario
        return dict(_seen(tel), states=states)
    finally:
        tel.uninstrument()


@scenario
def address_reused(receiver, _originals):
    """A pending handle freed behind the wrappers' back (NIXL's binding called directly), then a new handle that
    NIXL allocates at the same address: the first is counted as dropped, not overwritten silently."""
    tel = _telemetry()
    try:
        init = Initiator(receiver, BIG, BIG_BLOCK)
        local, remote = init.descs()
        done_first = int(init.write_all() == "DONE")  # a plain send, connected before the peer stops
        with nixl_agents.frozen(receiver):
            first = init.agent.initialize_xfer("WRITE", local, remote, init.peer)
            first_state = init.agent.transfer(first)
        raw = init.agent.agent  # the binding: nothing of ours sees these calls
        deadline = time.monotonic() + 30
        while raw.getXferStatus(first._handle) != 0 and time.monotonic() < deadline:  # 0: NIXL_SUCCESS
            time.sleep(0.001)
        address = first._handle
        raw.releaseXferReq(address)
        first._released = True  # so its __del__ frees nothing twice
        kept, second = [], None
        for _ in range(64):  # the allocator hands the freed block out again, usually at once
            candidate = init.agent.initialize_xfer("WRITE", local, remote, init.peer)
            if candidate._handle == address:
                second = candidate
                break
            kept.append(candidate)
        second_state = init.wait(second) if second is not None else None
        for handle in kept + [h for h in (second,) if h is not None]:
            init.agent.release_xfer_handle(handle)
        return dict(_seen(tel), first_state=first_state, second_state=second_state, reused=second is not None,
                    done_first=done_first)
    finally:
        tel.uninstrument()


@scenario
def released_then_rebound(receiver, _originals):
    """The usual loop: make a handle, post it, wait, release it, and bind the same name to the next handle. The
    released handle's wrapper is freed only when the name moves on, by then NIXL may have handed its address to
    the new handle: that one's description must survive the old wrapper's `__del__`."""
    tel = _telemetry()
    try:
        init = Initiator(receiver, BIG, BIG_BLOCK)
        local, remote = init.descs()
        states, addresses = [], []
        handle = None
        for _ in range(4):
            handle = init.agent.initialize_xfer("WRITE", local, remote, init.peer)  # the old one is freed here
            addresses.append(handle._handle)
            states.append(init.wait(handle, timeout_s=60))
            init.agent.release_xfer_handle(handle)
        del handle
        return dict(_seen(tel), states=states, reused=len(set(addresses)) < len(addresses))
    finally:
        tel.uninstrument()


def _child(out_path: str) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX's TCP transport listens on every device it may use
    # TCP only: over shared memory UCX writes straight into a frozen peer's memory, and nothing stays in flight
    os.environ.setdefault("UCX_TLS", "tcp,self")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import nixl._api as api

    originals = {name: api.nixl_agent.__dict__[name] for name in ("transfer", "check_xfer_state", "make_prepped_xfer")}
    # the scenarios write the receiver's first SIZE bytes, two of them all of it
    nixl_agents.run_with_receiver(out_path, BIG, SCENARIOS, originals)


# --- the tests -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return nixl_agents.loopback_outcomes(__file__, tmp_path_factory, "nixl")


def test_prepped_write_is_one_send_with_its_bytes_peer_and_notification(outcomes):
    result = result_of(outcomes, "prepped_write")
    assert result["state"] == "DONE"
    assert result["arrived"]  # the bytes arrived where they were sent
    assert result["notes"] == ["req-42:1"]
    (send,) = spans_named(result, "kv_transfer.send")
    attrs = send["attributes"]
    assert attrs["kv_transfer.bytes"] == result["chosen"] * BLOCK
    assert attrs["kv_transfer.descriptor_count"] == result["chosen"]
    assert attrs["kv_transfer.op"] == "write"
    assert attrs["network.io.direction"] == "transmit"
    assert attrs["kv_transfer.backend"] == "nixl"
    assert attrs["kv_transfer.protocol"] == "ucx"
    assert attrs["nixl.remote_agent"] == result["peer"]
    assert attrs["kv_transfer.notification"] == "req-42:1"
    assert "error.type" not in attrs
    assert send["ok"]


def test_read_in_a_transfer_scope_belongs_to_its_request(outcomes):
    result = result_of(outcomes, "read_in_scope")
    assert result["state"] == "DONE"
    assert result["read_back"]  # READ brought the target's bytes here
    (send,) = spans_named(result, "kv_transfer.send")
    (request,) = spans_named(result, "kv_transfer.request")
    assert send["parent"] == request["span_id"]
    assert send["attributes"]["kv_transfer.op"] == "read"
    assert send["attributes"]["network.io.direction"] == "receive"
    assert send["attributes"]["kv_transfer.bytes"] == 4 * BLOCK
    assert send["attributes"]["kv_transfer.request_key"] == "prefill-req-1"
    assert request["attributes"]["kv_transfer.bytes"] == 4 * BLOCK
    assert request["attributes"]["kv_transfer.transfer_count"] == 1
    assert request["attributes"]["kv_transfer.role"] == "decode"


def test_transfer_to_a_peer_that_is_gone_is_a_failed_send(outcomes):
    result = result_of(outcomes, "peer_gone")
    assert result["state"] == "ERR" or result["state"].startswith("raised")
    (send,) = spans_named(result, "kv_transfer.send")
    assert not send["ok"]
    assert send["attributes"]["error.type"] in ("transfer_failed", "nixlBackendError", "nixlRemoteDisconnectError")
    assert send["attributes"]["kv_transfer.bytes"] == SIZE
    assert sum(p["value"] for p in result["metrics"].get("kv_transfer.failures", [])) == 1


def test_pending_handles_are_bounded_and_drops_counted(outcomes):
    result = result_of(outcomes, "bounded")
    pending = sum(1 for state in result["states"] if state == "PROC")
    sends = spans_named(result, "kv_transfer.send")
    full = sum(p["value"] for p in result["metrics"].get("kv_transfer.instrumentation.dropped", [])
               if p["attributes"].get("kv_transfer.drop_reason") == "async_pending_full")
    # Every post is either a span or a counted drop: at most one handle waits at a time.
    assert len(sends) + full == 3
    assert full == max(pending - 1, 0)


def _dropped(result, reason) -> int:
    return sum(p["value"] for p in result["metrics"].get("kv_transfer.instrumentation.dropped", [])
               if p["attributes"].get("kv_transfer.drop_reason") == reason)


def test_handles_freed_by_the_garbage_collector_are_sends(outcomes):
    """Every handle posted is one send even when only the garbage collector frees it; one still in progress
    then is a cancelled send, one already done a successful one."""
    result = result_of(outcomes, "freed_by_gc")
    assert "PROC" in result["states"], result["states"]  # at least one was still pending when dropped
    sends = spans_named(result, "kv_transfer.send")
    assert len(sends) == len(result["states"]) >= 3
    for send in sends:
        assert send["attributes"]["kv_transfer.bytes"] == BIG
        assert send["ok"] or send["attributes"]["error.type"] in ("cancelled", "transfer_failed")
    assert not result["metrics"].get("kv_transfer.instrumentation.dropped")


def test_a_reused_handle_address_counts_the_unseen_transfer(outcomes):
    result = result_of(outcomes, "address_reused")
    assert result["reused"], "NIXL never handed the freed address out again"
    assert result["first_state"] == "PROC" and result["second_state"] == "DONE"
    sends = spans_named(result, "kv_transfer.send")
    assert len(sends) == 1 + result["done_first"] and all(s["ok"] for s in sends)  # the second handle's ...
    assert _dropped(result, "async_released") == 1  # ... and the first one, counted: 2 posts, 2 accounted for


def test_a_released_handles_late_free_leaves_the_next_handle_at_its_address_whole(outcomes):
    result = result_of(outcomes, "released_then_rebound")
    assert result["states"] == ["DONE"] * 4
    assert result["reused"], "NIXL never handed a released address out again"  # the case under test happened
    sends = spans_named(result, "kv_transfer.send")
    assert [(s["attributes"]["kv_transfer.bytes"], s["attributes"]["kv_transfer.descriptor_count"])
            for s in sends] == [(BIG, BIG // BIG_BLOCK)] * 4
    assert not result["metrics"].get("kv_transfer.instrumentation.dropped")


def test_uninstrument_restores_the_agent(outcomes):
    result = result_of(outcomes, "uninstrumented")
    assert all(result["wrapped"].values())
    assert all(result["restored"].values())
    assert result["state"] == "DONE"
    assert result["spans"] == []


def test_demo_loopback_engine_writes_are_sends_of_their_request(outcomes):
    """The NIXL loopback engine behind the demo's Mooncake-style calls: each call in a scope is one send."""
    result = result_of(outcomes, "demo_engine")
    assert result["codes"] == [0, 0, 0]
    assert result["arrived"]
    (request,) = spans_named(result, "kv_transfer.request")
    sends = sorted(spans_named(result, "kv_transfer.send"), key=lambda s: s["attributes"]["kv_transfer.chunk_index"])
    assert [s["attributes"]["kv_transfer.bytes"] for s in sends] == [SIZE // 2, SIZE // 2]
    assert all(s["parent"] == request["span_id"] for s in sends)
    assert request["attributes"]["kv_transfer.bytes"] == SIZE
    assert request["attributes"]["kv_transfer.chunk_count"] == 2


def test_instrument_never_imports_nixl_and_patches_it_on_import():
    """vLLM sets UCX variables before its first NIXL import; instrumenting first must not import NIXL early."""
    nixl_agents.require_nixl()
    probe = (
        "import sys\n"
        "from otel_kvtransfer.engines import nixl as engine\n"
        "from otel_kvtransfer.recording.patching import is_ours\n"
        "assert engine.instrument()\n"
        "assert 'nixl' not in sys.modules, 'imported too early'\n"
        "import nixl._api as api\n"
        "assert is_ours(api.nixl_agent.__dict__['transfer'])\n"
        "assert is_ours(api.nixl_xfer_handle.__dict__['release'])\n"
        "assert is_ours(api.nixl_xfer_handle.__dict__['__del__'])\n"
        "engine.uninstrument()\n"
        "assert not is_ours(api.nixl_agent.__dict__['transfer'])\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


if __name__ == "__main__":
    _child(sys.argv[1])
