"""Requests still open when the engine process exits end then, marked as such, with both builders.

Before, a request span that its framework never ended was dropped at exit without a word: no span, no count,
and its sends were exported under a parent that never arrived. Now the exit ends every request and peer wait
still open: ERROR, `error.type` and `kv_transfer.ended_by` = `process_exit`, with its aggregates over what it
sent. With the in-process builder the exit drain does it within its bound; with the builder process the helper
does it when its engine's end-of-file comes.

Real parts: the engine process runs under `opentelemetry-instrument` (spans to a span file through the standard
OTEL_* variables), makes real Mooncake writes to a receiver process on 127.0.0.1 in requests it opens and never
ends, opens a receive it never ends, and returns. The background drain runs once a minute, so only the exit path
can deliver. Everything runs inside `unshare --net` with loopback up (Mooncake's listener binds all interfaces).
"""

import json

import pytest
from support import instrumented_app

ROOMS = [7101, 7102, 7103, 7104, 7105]
RECEIVE_ROOM = 7199
WRITES = 2  # per request
SIZE = 64 << 10


# --- the engine process (run by instrumented_app) ---------------------------------------------------------


def engine_process(out_path: str) -> None:
    import numpy as np

    from otel_kvtransfer import integration as kvt
    from otel_kvtransfer.demo.loopback import Receiver, digest, open_engine

    total = len(ROOMS) * WRITES * SIZE
    with Receiver(total, env={"MC_FORCE_TCP": "1", "MC_TRANSFER_TIMEOUT": "5"}) as receiver:
        engine = open_engine()
        source = np.arange(total // 4, dtype=np.uint32).view(np.uint8).copy()
        assert engine.register_memory(source.ctypes.data, source.nbytes) == 0
        offset = 0
        for room in ROOMS:
            kvt.begin_request(room, backend="mooncake", framework="test")
            for i in range(WRITES):
                with kvt.transfer_scope(room, chunk_index=i, is_last_chunk=i == WRITES - 1):
                    rc = engine.transfer_sync_write(receiver.session, source.ctypes.data + offset,
                                                    receiver.base_address + offset, SIZE)
                    assert rc == 0, rc
                offset += SIZE
            # ... and never kvt.end_request(room): the process exits with the request open
        kvt.begin_receive(RECEIVE_ROOM, backend="mooncake", framework="test", expected_bytes=SIZE)
        arrived = receiver.digest(0, total) == digest(source)
    with open(out_path, "w", encoding="utf-8") as handle:
        json.dump({"arrived": arrived}, handle)


# --- the tests -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("builder", ["thread", "process"])
def test_requests_open_at_exit_end_as_ended_by_the_exit_with_their_sends(tmp_path, builder):
    _, outcome, spans_path = instrumented_app.run(
        tmp_path, __file__, "engine_process", builder, timeout_s=300,
        env={"OTEL_KVTRANSFER_FLUSH_INTERVAL_MS": "60000"})
    assert outcome["arrived"], outcome
    # The engine waits for its helper at exit at most a few seconds: the helper may still be writing.
    spans = instrumented_app.spans_when(spans_path, len(ROOMS) * (WRITES + 1) + 1)
    requests = {s.attributes.get("kv_transfer.request_key"): s for s in spans if s.name == "kv_transfer.request"}
    assert sorted(requests) == sorted(str(room) for room in ROOMS), f"{len(spans)} spans arrived"
    for key, request in requests.items():
        assert request.is_error and request.attributes["error.type"] == "process_exit", request.attributes
        assert request.attributes["kv_transfer.ended_by"] == "process_exit"
        assert request.attributes["kv_transfer.bytes"] == WRITES * SIZE  # its aggregates over what it sent
        sends = [s for s in spans if s.name == "kv_transfer.send" and s.attributes["kv_transfer.request_key"] == key]
        assert len(sends) == WRITES and all(s.parent_span_id == request.span_id for s in sends)
        assert all(s.attributes["kv_transfer.bytes"] == SIZE and not s.is_error for s in sends)
        assert request.end_time_unix_nano >= max(s.end_time_unix_nano for s in sends)
    receives = [s for s in spans if s.name == "kv_transfer.receive"]
    assert len(receives) == 1 and receives[0].attributes["kv_transfer.request_key"] == str(RECEIVE_ROOM)
    assert receives[0].is_error and receives[0].attributes["kv_transfer.ended_by"] == "process_exit"
