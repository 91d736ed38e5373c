"""A child started with multiprocessing's fork method inherits the instrumentation without running instrument():
what it records last must still leave it, with both builders (a thread here, or a helper process).

Real parts: the engine process runs under `opentelemetry-instrument` (spans to a span file through the standard
OTEL_* variables), forks a multiprocessing child that makes real Mooncake writes to a receiver process on
127.0.0.1, and the child returns at once (multiprocessing then ends it with os._exit, which skips atexit). The
background drain is set to run only once a minute, so nothing but the child's exit path can deliver its records.
Everything runs inside `unshare --net` with loopback up: Mooncake's handshake listener binds all interfaces.
"""

import json
import multiprocessing

import pytest
from support import instrumented_app

ROOM = 424242  # the child's request key
WRITES = 3
SIZE = 256 << 10


# --- the engine process (run by instrumented_app) ---------------------------------------------------------


def _child(session: str, base_address: int) -> None:
    """The forked child: one request of WRITES real writes, then straight out."""
    import numpy as np

    from otel_kvtransfer import integration as kvt
    from otel_kvtransfer.demo.loopback import open_engine

    engine = open_engine()
    source = np.arange(WRITES * SIZE, dtype=np.uint32).view(np.uint8)[:WRITES * SIZE].copy()
    assert engine.register_memory(source.ctypes.data, source.nbytes) == 0
    kvt.begin_request(ROOM, backend="mooncake", framework="test")
    for i in range(WRITES):
        with kvt.transfer_scope(ROOM, chunk_index=i, is_last_chunk=i == WRITES - 1):
            rc = engine.transfer_sync_write(session, source.ctypes.data + i * SIZE, base_address + i * SIZE, SIZE)
            assert rc == 0, rc
    kvt.end_request(ROOM)


def engine_process(out_path: str) -> None:
    import numpy as np

    from otel_kvtransfer.demo.loopback import Receiver, digest

    with Receiver(WRITES * SIZE, env={"MC_FORCE_TCP": "1", "MC_TRANSFER_TIMEOUT": "5"}) as receiver:
        child = multiprocessing.get_context("fork").Process(target=_child, args=(receiver.session,
                                                                                  receiver.base_address))
        child.start()
        child.join(120)
        expected = np.arange(WRITES * SIZE, dtype=np.uint32).view(np.uint8)[:WRITES * SIZE]
        arrived = receiver.digest(0, WRITES * SIZE) == digest(expected)
        with open(out_path, "w", encoding="utf-8") as handle:
            json.dump({"exitcode": child.exitcode, "arrived": arrived, "child": child.pid}, handle)


# --- the tests -------------------------------------------------------------------------------------------------


def _run(tmp_path, builder: str):
    _, outcome, spans_path = instrumented_app.run(
        tmp_path, __file__, "engine_process", builder, timeout_s=300,
        env={"OTEL_KVTRANSFER_FLUSH_INTERVAL_MS": "60000"})
    assert outcome["exitcode"] == 0 and outcome["arrived"], outcome
    # The engine process waits for its helpers at exit, not for its child's: the child's helper may still write.
    spans = instrumented_app.spans_when(spans_path, WRITES + 1)
    return [s for s in spans if s.attributes.get("kv_transfer.request_key") == str(ROOM)]


@pytest.mark.parametrize("builder", ["thread", "process"])
def test_a_forked_child_delivers_its_last_records(tmp_path, builder):
    spans = _run(tmp_path, builder)
    requests = [s for s in spans if s.name == "kv_transfer.request"]
    assert len(requests) == 1, f"the child's request span is missing ({len(spans)} of its spans arrived)"
    request = requests[0]
    sends = sorted((s for s in spans if s.name == "kv_transfer.send"),
                   key=lambda s: s.attributes["kv_transfer.chunk_index"])
    assert [s.attributes["kv_transfer.bytes"] for s in sends] == [SIZE] * WRITES
    assert all(s.parent_span_id == request.span_id for s in sends)
    assert request.attributes["kv_transfer.bytes"] == WRITES * SIZE
    assert not request.is_error
