"""The NIXL engine module on two real NIXL agents in two processes (UCX over the loopback device only).

The initiator agent lives in the test process (instrumented); the target agent lives in a spawned process
(otel_kvtransfer.demo.nixl_loopback.Receiver) that registers a buffer, answers checksums of it and reports the
notification messages that arrived. Each test asserts the exact bytes moved, the send span's attributes and, for
failures, the ERROR status with error.type.
"""

import os
import time

import pytest

from conftest import Telemetry, require_part

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX's TCP transport listens on every device it may use

BLOCK = 64 << 10
BLOCKS = 16
SIZE = BLOCK * BLOCKS


def _nixl_importable() -> bool:
    try:
        import nixl._api  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except Exception:  # pylint: disable=broad-except
        return False
    return True


@pytest.fixture(scope="module")
def receiver():
    require_part(_nixl_importable(), "NIXL (pip install --no-deps -r scripts/requirements-nixl.txt)")
    from otel_kvtransfer.demo.nixl_loopback import Receiver  # pylint: disable=import-outside-toplevel

    with Receiver(SIZE) as target:
        yield target


@pytest.fixture()
def telemetry():
    tel = Telemetry().instrument()
    yield tel
    tel.uninstrument()


class Initiator:
    """A NIXL agent in this process with a registered source buffer, connected to `receiver`."""

    def __init__(self, receiver):
        import numpy as np  # pylint: disable=import-outside-toplevel
        import nixl._api as api  # pylint: disable=import-outside-toplevel

        from otel_kvtransfer.demo.nixl_loopback import _peers  # pylint: disable=import-outside-toplevel

        self.np = np
        self.agent = api.nixl_agent(f"kvt-test-{os.getpid()}-{time.monotonic_ns()}",
                                    api.nixl_agent_config(backends=["UCX"]))
        self.buffer = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
        self.agent.register_memory(self.agent.get_reg_descs([(self.buffer.ctypes.data, SIZE, 0, "")], "DRAM"))
        self.peer = self.agent.add_remote_agent(_peers[receiver.session])
        self.receiver = receiver

    def local_blocks(self):
        return [(self.buffer.ctypes.data + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)]

    def remote_blocks(self):
        return [(self.receiver.base_address + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)]

    def wait(self, handle, timeout_s=30.0):
        state = self.agent.transfer(handle)
        deadline = time.monotonic() + timeout_s
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
            state = self.agent.check_xfer_state(handle)
        return state


def _digest(data):
    from otel_kvtransfer.demo.loopback import digest  # pylint: disable=import-outside-toplevel

    return digest(data)


def test_prepped_write_is_one_send_with_its_bytes_peer_and_notification(receiver, telemetry):
    init = Initiator(receiver)
    receiver.notifications()  # start from an empty notification queue
    local = init.agent.prep_xfer_dlist("NIXL_INIT_AGENT", init.local_blocks(), "DRAM")
    remote = init.agent.prep_xfer_dlist(init.peer, init.remote_blocks(), "DRAM")
    chosen = [1, 2, 3, 7, 8]
    handle = init.agent.make_prepped_xfer("WRITE", local, chosen, remote, chosen, notif_msg=b"req-42:1")
    assert init.wait(handle) == "DONE"
    init.agent.release_xfer_handle(handle)

    for i in chosen:  # the bytes arrived where they were sent
        assert receiver.digest(i * BLOCK, BLOCK) == _digest(init.buffer[i * BLOCK:(i + 1) * BLOCK])
    deadline = time.monotonic() + 10
    notes = receiver.notifications()
    while not notes and time.monotonic() < deadline:
        time.sleep(0.05)
        notes = receiver.notifications()
    assert notes == ["req-42:1"]

    sends = telemetry.spans("kv_transfer.send")
    assert len(sends) == 1
    attrs = dict(sends[0].attributes)
    assert attrs["kv_transfer.bytes"] == len(chosen) * BLOCK
    assert attrs["kv_transfer.descriptor_count"] == len(chosen)
    assert attrs["kv_transfer.op"] == "write"
    assert attrs["network.io.direction"] == "transmit"
    assert attrs["kv_transfer.backend"] == "nixl"
    assert attrs["kv_transfer.protocol"] == "ucx"
    assert attrs["nixl.remote_agent"] == receiver.session
    assert attrs["kv_transfer.notification"] == "req-42:1"
    assert "error.type" not in attrs
    assert sends[0].status.is_ok
    assert sends[0].end_time > sends[0].start_time


def test_read_in_a_transfer_scope_belongs_to_its_request(receiver, telemetry):
    from otel_kvtransfer import integration as kvt  # pylint: disable=import-outside-toplevel

    init = Initiator(receiver)
    receiver.fill(7)
    kvt.begin_request("prefill-req-1", backend="nixl", framework="test", role="decode")
    local = init.agent.get_xfer_descs(init.local_blocks()[:4], "DRAM")
    remote = init.agent.get_xfer_descs(init.remote_blocks()[:4], "DRAM")
    with kvt.transfer_scope("prefill-req-1", chunk_index=0, is_last_chunk=True):
        handle = init.agent.initialize_xfer("READ", local, remote, init.peer)
        init.agent.transfer(handle)
    # Completion is observed later, outside the scope, as vLLM's engine step does.
    deadline = time.monotonic() + 30
    while init.agent.check_xfer_state(handle) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
    init.agent.release_xfer_handle(handle)
    kvt.end_request("prefill-req-1")

    assert bool((init.buffer[:4 * BLOCK] == 7).all())  # READ brought the target's bytes here
    (send,) = telemetry.spans("kv_transfer.send")
    (request,) = telemetry.spans("kv_transfer.request")
    assert send.parent.span_id == request.context.span_id
    assert send.attributes["kv_transfer.op"] == "read"
    assert send.attributes["network.io.direction"] == "receive"
    assert send.attributes["kv_transfer.bytes"] == 4 * BLOCK
    assert send.attributes["kv_transfer.request_key"] == "prefill-req-1"
    assert request.attributes["kv_transfer.bytes"] == 4 * BLOCK
    assert request.attributes["kv_transfer.transfer_count"] == 1
    assert request.attributes["kv_transfer.role"] == "decode"


def test_transfer_to_a_peer_that_is_gone_is_a_failed_send(telemetry):
    require_part(_nixl_importable(), "NIXL (pip install --no-deps -r scripts/requirements-nixl.txt)")
    from otel_kvtransfer.demo.nixl_loopback import Receiver  # pylint: disable=import-outside-toplevel

    doomed = Receiver(SIZE)
    try:
        init = Initiator(doomed)
        local = init.agent.get_xfer_descs(init.local_blocks(), "DRAM")
        remote = init.agent.get_xfer_descs(init.remote_blocks(), "DRAM")
        handle = init.agent.initialize_xfer("WRITE", local, remote, init.peer)
    finally:
        doomed.kill()  # the peer process is gone (SIGKILL) before the transfer is posted
    try:
        state = init.wait(handle)
    except Exception:  # pylint: disable=broad-except
        state = "raised"
    assert state in ("ERR", "raised")

    (send,) = telemetry.spans("kv_transfer.send")
    assert not send.status.is_ok
    assert send.attributes["error.type"] in ("transfer_failed", "nixlBackendError", "nixlRemoteDisconnectError")
    assert send.attributes["kv_transfer.bytes"] == SIZE
    failures = telemetry.metrics().get("kv_transfer.failures", [])
    assert sum(p.value for p in failures) == 1


def test_pending_handles_are_bounded_and_drops_counted(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_KVTRANSFER_MAX_PENDING_ASYNC", "1")  # read by instrument()
    tel = Telemetry().instrument()
    try:
        init = Initiator(receiver)
        local = init.agent.get_xfer_descs(init.local_blocks(), "DRAM")
        remote = init.agent.get_xfer_descs(init.remote_blocks(), "DRAM")
        handles = [init.agent.initialize_xfer("WRITE", local, remote, init.peer) for _ in range(3)]
        states = [init.agent.transfer(h) for h in handles]
        pending = sum(1 for s in states if s == "PROC")
        for h in handles:
            deadline = time.monotonic() + 30
            while init.agent.check_xfer_state(h) == "PROC" and time.monotonic() < deadline:
                time.sleep(0.001)
            init.agent.release_xfer_handle(h)
        sends = tel.spans("kv_transfer.send")
        dropped = tel.metrics().get("kv_transfer.instrumentation.dropped", [])
        full = sum(p.value for p in dropped if p.attributes.get("kv_transfer.drop_reason") == "async_pending_full")
        # Every post is either a span or a counted drop: at most one handle waits at a time.
        assert len(sends) + full == 3
        assert full == max(pending - 1, 0)
    finally:
        tel.uninstrument()


def test_uninstrument_restores_the_agent(receiver):
    import nixl._api as api  # pylint: disable=import-outside-toplevel

    originals = {name: api.nixl_agent.__dict__[name] for name in ("transfer", "check_xfer_state", "make_prepped_xfer")}
    tel = Telemetry().instrument()
    assert api.nixl_agent.__dict__["transfer"] is not originals["transfer"]
    tel.uninstrument()
    for name, original in originals.items():
        assert api.nixl_agent.__dict__[name] is original
    init = Initiator(receiver)  # and the agent still works, recording nothing
    local = init.agent.get_xfer_descs(init.local_blocks()[:1], "DRAM")
    remote = init.agent.get_xfer_descs(init.remote_blocks()[:1], "DRAM")
    assert init.wait(init.agent.initialize_xfer("WRITE", local, remote, init.peer)) == "DONE"
    assert tel.spans() == []



def test_instrument_never_imports_nixl_and_patches_it_on_import():
    """vLLM sets UCX variables before its first NIXL import; instrumenting first must not import NIXL early."""
    require_part(_nixl_importable(), "NIXL (pip install --no-deps -r scripts/requirements-nixl.txt)")
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    probe = (
        "import sys\n"
        "from otel_kvtransfer.engines import nixl as engine\n"
        "from otel_kvtransfer.patching import is_ours\n"
        "assert engine.instrument()\n"
        "assert 'nixl' not in sys.modules, 'imported too early'\n"
        "import nixl._api as api\n"
        "assert is_ours(api.nixl_agent.__dict__['transfer'])\n"
        "assert is_ours(api.nixl_xfer_handle.__dict__['release'])\n"
        "engine.uninstrument()\n"
        "assert not is_ours(api.nixl_agent.__dict__['transfer'])\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


def test_demo_loopback_engine_writes_are_sends_of_their_request(receiver, telemetry):
    """The NIXL loopback engine behind the demo's Mooncake-style calls: each call in a scope is one send."""
    from otel_kvtransfer import integration as kvt  # pylint: disable=import-outside-toplevel
    from otel_kvtransfer.demo.nixl_loopback import open_engine  # pylint: disable=import-outside-toplevel

    import numpy as np  # pylint: disable=import-outside-toplevel

    engine = open_engine()
    src = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
    assert engine.register_memory(src.ctypes.data, src.nbytes) == 0
    kvt.begin_request(77, backend="nixl", framework="demo")
    for chunk in range(2):
        offset = chunk * (SIZE // 2)
        with kvt.transfer_scope(77, chunk_index=chunk, is_last_chunk=chunk == 1):
            lens = [BLOCK] * (BLOCKS // 2)
            srcs = [src.ctypes.data + offset + i * BLOCK for i in range(BLOCKS // 2)]
            dsts = [receiver.base_address + offset + i * BLOCK for i in range(BLOCKS // 2)]
            assert engine.batch_transfer_sync_write(receiver.session, srcs, dsts, lens) == 0
    kvt.end_request(77)

    assert receiver.digest(0, SIZE) == _digest(src)
    (request,) = telemetry.spans("kv_transfer.request")
    sends = sorted(telemetry.spans("kv_transfer.send"), key=lambda s: s.attributes["kv_transfer.chunk_index"])
    assert [s.attributes["kv_transfer.bytes"] for s in sends] == [SIZE // 2, SIZE // 2]
    assert all(s.parent.span_id == request.context.span_id for s in sends)
    assert request.attributes["kv_transfer.bytes"] == SIZE
    assert request.attributes["kv_transfer.chunk_count"] == 2
