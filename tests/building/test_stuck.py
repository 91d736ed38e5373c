"""Stuck while it is stuck: a real Mooncake write into a receiver frozen with SIGSTOP is reported while it hangs,
with both builders (a thread of the engine process, and the helper process).

Real parts: the engine process runs under `opentelemetry-instrument` (spans to a span file, metrics to the console
exporter every 300 ms, through the standard OTEL_* variables) with OTEL_KVTRANSFER_STUCK_S=1. It opens a request,
freezes its receiver process with SIGSTOP, and starts a 48 MiB write inside the request's transfer scope (far more
than the sockets buffer: the call hangs inside the engine), either one sync write or an async batch of four
lengths waited on (open from its post until the wait answers; its report sums the lengths). It holds the receiver
frozen until the test has read the stuck reports in its output (bounded), then lets it go on (SIGCONT); the write
completes. Everything runs inside `unshare --net` with loopback up.
"""

import json
import os
import select
import signal
import sys
import threading

import pytest
from support import instrumented_app
from support.console import console_json_objects, console_points
from support.waiting import wait_until

ROOM = 777001
SIZE = 48 << 20
BLOCKS = 4  # the async batch's lengths: the report sums them
REPORTED_MAX_S = 120  # bounded: the reports come within the 1 s threshold, a scan and a 300 ms export


def engine_process(out_path: str) -> None:
    import numpy as np
    from opentelemetry import metrics, trace

    from otel_kvtransfer import integration as kvt
    from otel_kvtransfer.demo.loopback import Receiver, open_engine

    with Receiver(SIZE, env={"MC_FORCE_TCP": "1", "MC_TRANSFER_TIMEOUT": "60"}) as receiver:
        engine = open_engine()
        source = np.ones(SIZE, dtype=np.uint8)
        assert engine.register_memory(source.ctypes.data, SIZE) == 0
        assert engine.transfer_sync_write(receiver.session, source.ctypes.data, receiver.base_address, 4096) == 0
        result = {}

        def write():
            with kvt.transfer_scope(ROOM, chunk_index=0, is_last_chunk=True):
                if os.environ["KVT_TEST_CALL"] == "sync":
                    result["rc"] = engine.transfer_sync_write(receiver.session, source.ctypes.data,
                                                              receiver.base_address, SIZE)
                    return
                if os.environ["KVT_TEST_CALL"] == "sync_keywords":  # the wrapper's general path, not its fast one
                    result["rc"] = engine.transfer_sync_write(
                        target_hostname=receiver.session, buffer=source.ctypes.data,
                        peer_buffer_address=receiver.base_address, length=SIZE)
                    return
                # posted as one batch of BLOCKS lengths, then waited on: open as a pending transfer meanwhile
                block = SIZE // BLOCKS
                batch = engine.batch_transfer_async_write(
                    receiver.session, [source.ctypes.data + i * block for i in range(BLOCKS)],
                    [receiver.base_address + i * block for i in range(BLOCKS)], [block] * BLOCKS)
                result["rc"] = engine.get_batch_transfer_status([batch])

        kvt.begin_request(ROOM, backend="mooncake", framework="test")
        os.kill(receiver.process.pid, signal.SIGSTOP)
        thread = threading.Thread(target=write)
        thread.start()
        # frozen until the test saw the reports in this process's output (or its bound passed)
        result["told"] = bool(select.select([sys.stdin], [], [], REPORTED_MAX_S + 30)[0]) and sys.stdin.readline()
        result["hung"] = thread.is_alive()  # still inside the engine when the receiver is let go
        print("KVT-RESUME", flush=True)
        os.kill(receiver.process.pid, signal.SIGCONT)
        thread.join(60)
        kvt.end_request(ROOM)
        trace.get_tracer_provider().force_flush()
        metrics.get_meter_provider().force_flush()
        result["session"] = receiver.session
        with open(out_path, "w", encoding="utf-8") as handle:
            json.dump(result, handle)


def _reported(app) -> bool:
    """Both stuck lines logged, and a metric export since that counts both and saw the send 1 s old: what the
    test asserts on (their exact values) is all in the output."""
    lines = [line for line in app.stderr().splitlines() if "is stuck" in line]
    if not (any("a send open" in line for line in lines) and any("a request open" in line for line in lines)):
        return False
    objects = console_json_objects(app.stdout())
    kinds = {a["kv_transfer.inflight.kind"] for a, _ in console_points(objects, "kv_transfer.stuck")}
    ages = [v for a, v in console_points(objects, "kv_transfer.inflight.oldest_age")
            if a["kv_transfer.inflight.kind"] == "send"]
    return {"send", "request"} <= kinds and bool(ages) and max(ages) >= 1.0


def _run(tmp_path, builder: str, call: str):
    app = instrumented_app.start(
        tmp_path, __file__, "engine_process", builder, own_user=True,
        env={"OTEL_METRICS_EXPORTER": "console", "OTEL_METRIC_EXPORT_INTERVAL": "300", "OTEL_KVTRANSFER_STUCK_S": "1",
             "MC_TRANSFER_TIMEOUT": "60", "KVT_TEST_CALL": call})
    try:
        wait_until(lambda: app.proc.poll() is not None or _reported(app), REPORTED_MAX_S, interval_s=0.2,
                   what="the stuck reports while the receiver is frozen")
        app.tell("resume")
        proc, result, spans_path = app.finish(120)
    finally:
        app.stop()
    spans = []
    with open(spans_path, encoding="utf-8") as handle:
        for line in handle:
            for rs in json.loads(line)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    spans.extend(ss["spans"])
    return proc, result, spans


def _attributes(span) -> dict:
    return {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", [])}


# A sync write hangs inside the engine call (its arguments positional, or by keyword); an async batch is open
# between its post and the wait's answer.
@pytest.mark.parametrize("builder, call", [("thread", "sync"), ("process", "sync"), ("thread", "sync_keywords"),
                                           ("thread", "async_batch")])
def test_a_write_into_a_frozen_receiver_is_reported_stuck_while_it_hangs(tmp_path, builder, call):
    proc, result, spans = _run(tmp_path, builder, call)
    assert result["told"] == "resume\n"  # held frozen until the test saw the reports (not past its own bound)
    assert result["hung"] is True and result["rc"] == 0  # it hung while reported, then completed
    before, _, _ = proc.stdout.partition("KVT-RESUME")
    while_stuck = console_json_objects(before)
    # While it hung: the gauges saw one send in flight, at least 1 s old, and the counters one stuck send and
    # one stuck request (open 1 s+).
    inflight = [v for a, v in console_points(while_stuck, "kv_transfer.inflight")
                if a["kv_transfer.inflight.kind"] == "send"]
    ages = [v for a, v in console_points(while_stuck, "kv_transfer.inflight.oldest_age")
            if a["kv_transfer.inflight.kind"] == "send"]
    assert 1 in inflight and max(ages) >= 1.0
    stuck = {a["kv_transfer.inflight.kind"]: v for a, v in console_points(while_stuck, "kv_transfer.stuck")}
    assert stuck.get("send") == 1 and stuck.get("request") == 1
    # One line each in the log, naming the request key, the peer and the bytes.
    lines = [line for line in proc.stderr.splitlines() if "is stuck" in line]
    send_lines = [line for line in lines if "a send open" in line]
    assert len(send_lines) == 1 and str(ROOM) in send_lines[0] and result["session"] in send_lines[0]
    assert str(SIZE) in send_lines[0]
    assert len([line for line in lines if "a request open" in line]) == 1
    # The request span carries both reports as events; the send is whole.
    (request,) = [s for s in spans if s["name"] == "kv_transfer.request"]
    events = {_attributes(e)["kv_transfer.inflight.kind"]: _attributes(e) for e in request.get("events", [])
              if e["name"] == "kv_transfer.stuck"}
    assert sorted(events) == ["request", "send"]
    assert int(events["send"]["kv_transfer.bytes"]) == SIZE
    sends = [s for s in spans if s["name"] == "kv_transfer.send" and _attributes(s).get("kv_transfer.request_key")]
    assert [int(_attributes(s)["kv_transfer.bytes"]) for s in sends] == [SIZE]
