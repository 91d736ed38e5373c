"""Every Mooncake TransferEngine call becomes one kv_transfer.send span with exact bytes; real engine, two
processes, TCP on 127.0.0.1. The async tests run on both paths of the async wrappers (`hot_path`: compiled and
Python)."""

import threading
import time

import pytest
from opentelemetry.trace import SpanKind, StatusCode
from support.waiting import wait_until

from otel_kvtransfer import semconv
from otel_kvtransfer.demo.loopback import Receiver, digest
from otel_kvtransfer.engines import mooncake
from otel_kvtransfer.recording.clock import now_ns


def _only(spans):
    assert len(spans) == 1, [dict(s.attributes) for s in spans]
    return spans[0]


def test_sync_write_span_has_exact_bytes_and_the_bytes_arrive(telemetry, engine, receiver):
    rc = engine.engine.transfer_sync_write(receiver.session, engine.base + 100, receiver.base_address + 4096, 123457)
    assert rc == 0
    assert receiver.digest(4096, 123457) == digest(engine.source[100:100 + 123457])
    span = _only(telemetry.spans(semconv.SPAN_SEND))
    host, port = receiver.session.split(":")
    assert span.kind is SpanKind.CLIENT
    assert span.status.status_code is StatusCode.UNSET
    duration = span.end_time - span.start_time
    assert dict(span.attributes) == {
        semconv.BYTES: 123457,
        semconv.DESCRIPTOR_COUNT: 1,
        semconv.ENGINE_CALLS: 1,
        semconv.OP: semconv.OP_WRITE,
        semconv.THROUGHPUT: pytest.approx(123457 * 1e9 / duration),
        semconv.NETWORK_IO_DIRECTION: semconv.DIRECTION_TRANSMIT,
        semconv.NETWORK_TRANSPORT: "tcp",
        semconv.SERVER_ADDRESS: host,
        semconv.SERVER_PORT: int(port),
        semconv.BACKEND: mooncake.BACKEND,
        semconv.PROTOCOL: "tcp",
        semconv.FIRST_TO_PEER: True,  # the first send to this peer since the instrumentation was turned on
    }


def test_the_first_send_to_each_new_peer_says_it_set_the_peer_up(telemetry, engine):
    """Mooncake opens a peer's segment inside the first call to it: that send, and only that one, is marked; a
    failed first call sets nothing up, so the next one is a first one again."""
    assert engine.engine.transfer_sync_write("127.0.0.1:1", engine.base, 0, 16) != 0  # nothing listens there
    with Receiver(1 << 20) as first, Receiver(1 << 20) as second:
        for peer in (first, first, second, first, second):
            assert engine.engine.transfer_sync_write(peer.session, engine.base, peer.base_address, 4096) == 0
    assert engine.engine.transfer_sync_write("127.0.0.1:1", engine.base, 0, 16) != 0
    sends = telemetry.spans(semconv.SPAN_SEND)
    assert [(s.attributes[semconv.SERVER_PORT], s.attributes.get(semconv.FIRST_TO_PEER, False)) for s in sends] == [
        (1, True),
        (int(first.session.rsplit(":", 1)[1]), True), (int(first.session.rsplit(":", 1)[1]), False),
        (int(second.session.rsplit(":", 1)[1]), True),
        (int(first.session.rsplit(":", 1)[1]), False), (int(second.session.rsplit(":", 1)[1]), False),
        (1, True),
    ]


def test_one_span_per_call_with_batch_bytes_summed(telemetry, engine, receiver):
    lengths = [4096, 1, 65536, 777]
    offsets = [0, 10000, 20000, 200000]
    rc = engine.engine.batch_transfer_sync_write(
        receiver.session, [engine.base + o for o in offsets], [receiver.base_address + o for o in offsets], lengths)
    assert rc == 0
    for offset, length in zip(offsets, lengths):
        assert receiver.digest(offset, length) == digest(engine.source[offset:offset + length])
    for n in range(5):
        assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 1000 + n) == 0
    spans = telemetry.spans(semconv.SPAN_SEND)
    assert [s.attributes[semconv.BYTES] for s in spans] == [sum(lengths)] + [1000 + n for n in range(5)]
    assert spans[0].attributes[semconv.DESCRIPTOR_COUNT] == 4


def test_read_ops_are_spans_with_op_read(telemetry, engine, receiver):
    receiver.fill(7)
    assert engine.engine.transfer_sync_read(receiver.session, engine.base, receiver.base_address, 5000) == 0
    assert digest(engine.source[:5000]) == receiver.digest(0, 5000)
    assert engine.engine.batch_transfer_sync_read(
        receiver.session, [engine.base, engine.base + 8192], [receiver.base_address, receiver.base_address + 8192],
        [10, 20]) == 0
    spans = telemetry.spans(semconv.SPAN_SEND)
    assert [(s.attributes[semconv.OP], s.attributes[semconv.BYTES]) for s in spans] == [("read", 5000), ("read", 30)]


def test_opcode_argument_decides_op(telemetry, engine, receiver):
    from mooncake.engine import TransferEngine

    opcode = TransferEngine.TransferOpcode
    assert engine.engine.transfer_sync(receiver.session, engine.base, receiver.base_address, 64, opcode.Write) == 0
    assert engine.engine.batch_transfer_sync(
        receiver.session, [engine.base], [receiver.base_address], [32], opcode.Read) == 0
    spans = telemetry.spans(semconv.SPAN_SEND)
    assert [(s.attributes[semconv.OP], s.attributes[semconv.BYTES]) for s in spans] == [("write", 64), ("read", 32)]


def test_async_submission_span_ends_when_completion_is_observed(hot_path, telemetry, engine, receiver):
    # Bounds on the records' clock, which the spans carry: the wall clock may drift from it by microseconds.
    submitted = now_ns()
    batch_id = engine.engine.transfer_submit_write(receiver.session, engine.base, receiver.base_address, 8 << 20)
    returned = now_ns()
    assert batch_id > 0
    deadline = time.monotonic() + 30
    status, polls = 0, []
    while status == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # the span must include this wait: it ends when completion is seen
        polled = now_ns()
        status = engine.engine.transfer_check_status(batch_id)
        polls.append((polled, now_ns(), status))
    observed = now_ns()
    assert status == 1
    span = _only(telemetry.spans(semconv.SPAN_SEND))
    assert span.attributes[semconv.BYTES] == 8 << 20
    # How late the observed end can be: since the last poll that saw it running (or since the submission when the
    # first poll already saw it done), and never more than that.
    running = [before for before, _, st in polls if st == 0]
    window_start = running[-1] if running else submitted
    uncertainty = span.attributes[semconv.END_UNCERTAINTY_S]
    assert 0 < uncertainty * 1e9 <= observed - window_start
    assert submitted <= span.start_time
    assert span.end_time <= observed
    assert span.end_time - span.start_time >= 10_000_000  # at least the first 10 ms poll interval
    assert receiver.digest(0, 8 << 20) == digest(engine.source[:8 << 20])
    # Post vs wire: the time inside the submitting call, within what the caller saw that call take.
    post = span.attributes[semconv.POST_S]
    assert 0 < post * 1e9 <= returned - submitted
    (point,) = telemetry.metrics()[semconv.METRIC_POST_DURATION]
    assert (point.count, point.sum) == (1, post)


def test_batch_async_span_ends_at_get_batch_transfer_status(hot_path, telemetry, engine, receiver):
    ids = [
        engine.engine.batch_transfer_async_write(
            receiver.session, [engine.base + i * 65536], [receiver.base_address + i * 65536], [65536])
        for i in range(3)
    ]
    assert all(i > 0 for i in ids)
    time.sleep(0.02)
    assert not telemetry.spans(semconv.SPAN_SEND)  # nothing ends before completion is observed
    assert engine.engine.get_batch_transfer_status(ids) == 0
    spans = telemetry.spans(semconv.SPAN_SEND)
    assert len(spans) == 3
    assert all(s.attributes[semconv.BYTES] == 65536 for s in spans)
    assert all(s.end_time - s.start_time >= 20_000_000 for s in spans)
    assert all(0 < s.attributes[semconv.POST_S] * 1e9 < 20_000_000 for s in spans)  # the submit, not the wait
    # No poll saw them running (they were done long before the wait began, 64 KiB on loopback): the window their
    # ends lie in is all of each send, not the wait.
    assert all(abs(s.attributes[semconv.END_UNCERTAINTY_S] * 1e9 - (s.end_time - s.start_time)) < 1_000
               for s in spans)


def test_a_blocking_batch_wait_ends_the_send_when_it_returns_not_when_it_is_called(hot_path, telemetry, engine,
                                                                                   receiver):
    """64 MiB over loopback TCP takes tens of ms: a wait made at once blocks until the batch is done, and the send
    ends when the wait saw it end, in the later half of the wait, not when the wait began."""
    from otel_kvtransfer.recording import clock

    batch = engine.engine.batch_transfer_async_write(receiver.session, [engine.base], [receiver.base_address],
                                                     [64 << 20])
    assert batch > 0
    called = clock.now_ns()
    assert engine.engine.get_batch_transfer_status([batch]) == 0
    returned = clock.now_ns()
    (span,) = telemetry.spans(semconv.SPAN_SEND)
    assert span.attributes[semconv.BYTES] == 64 << 20
    assert span.start_time < called
    assert called + (returned - called) // 2 < span.end_time <= returned


def test_an_async_submission_belongs_to_the_scope_or_span_current_at_its_submission(hot_path, telemetry, engine,
                                                                                     receiver):
    """Where it ends (the poll) is not where it began: a submission made in a transfer scope is that request's
    send, one made under a span is that span's child, wherever and whenever the completion is seen."""
    from otel_kvtransfer import integration

    tracer = telemetry.tracer_provider.get_tracer("test")
    with integration.transfer_scope(41, chunk_index=3):
        scoped = engine.engine.batch_transfer_async_write(receiver.session, [engine.base], [receiver.base_address],
                                                          [4096])
    with tracer.start_as_current_span("caller") as caller:
        under_span = engine.engine.batch_transfer_async_write(receiver.session, [engine.base + 4096],
                                                              [receiver.base_address + 4096], [2048])
    assert scoped > 0 and under_span > 0
    assert engine.engine.get_batch_transfer_status([scoped, under_span]) == 0
    sends = {s.attributes[semconv.BYTES]: s for s in telemetry.spans(semconv.SPAN_SEND)}
    assert sorted(sends) == [2048, 4096]
    assert sends[4096].attributes[semconv.CHUNK_INDEX] == 3
    assert sends[2048].parent.span_id == caller.get_span_context().span_id
    assert semconv.CHUNK_INDEX not in sends[2048].attributes


def test_zero_length_calls_are_zero_byte_spans(telemetry, engine, receiver):
    assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 0) == 0
    assert engine.engine.batch_transfer_sync_write(receiver.session, [], [], []) == 0
    spans = telemetry.spans(semconv.SPAN_SEND)
    assert [(s.attributes[semconv.BYTES], s.attributes[semconv.DESCRIPTOR_COUNT]) for s in spans] == [(0, 1), (0, 0)]
    assert all(s.attributes[semconv.THROUGHPUT] == 0.0 for s in spans)


def test_unreachable_session_is_an_error_span(telemetry, engine):
    rc = engine.engine.transfer_sync_write("127.0.0.1:1", engine.base, 0, 16)
    assert rc != 0
    span = _only(telemetry.spans(semconv.SPAN_SEND))
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes[semconv.RETURN_CODE] == rc
    assert span.attributes[semconv.ERROR_TYPE] == "transfer_failed"
    assert span.attributes[semconv.SERVER_PORT] == 1
    failures = telemetry.metrics()[semconv.METRIC_FAILURES]
    assert sum(p.value for p in failures) == 1


def test_failed_async_submission_is_an_error_span(hot_path, telemetry, engine):
    batch_id = engine.engine.transfer_submit_write("127.0.0.1:1", engine.base, 0, 16)
    assert batch_id in (0, -1)
    span = _only(telemetry.spans(semconv.SPAN_SEND))
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes[semconv.ERROR_TYPE] == "submit_failed"
    assert span.attributes[semconv.RETURN_CODE] == batch_id


def test_unregistered_remote_address_is_an_error_span(telemetry, engine, receiver):
    rc = engine.engine.transfer_sync_write(receiver.session, engine.base, 12345, 16)
    assert rc != 0
    span = _only(telemetry.spans(semconv.SPAN_SEND))
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes[semconv.RETURN_CODE] == rc


def test_receiver_killed_mid_transfer_gives_error_span(telemetry, engine):
    failures = 0
    for _ in range(3):
        doomed = Receiver(64 << 20, env={"MC_FORCE_TCP": "1", "MC_TRANSFER_TIMEOUT": "5"})
        try:
            assert engine.engine.transfer_sync_write(doomed.session, engine.base, doomed.base_address, 4096) == 0
            result = {}
            step = 1 << 20
            offsets = list(range(0, 64 << 20, step))

            def send(result=result, doomed=doomed, offsets=offsets, step=step):
                # 64 MiB, sent 8 times over: long enough for the kill to land mid-transfer.
                for _ in range(8):
                    result.setdefault("rcs", []).append(engine.engine.batch_transfer_sync_write(
                        doomed.session, [engine.base + o for o in offsets],
                        [doomed.base_address + o for o in offsets], [step] * len(offsets)))
                    if result["rcs"][-1] != 0:
                        return

            thread = threading.Thread(target=send)
            thread.start()
            # the first 64 MiB went through: the kill lands while the next ones are on the wire
            wait_until(lambda result=result, thread=thread: result.get("rcs") or not thread.is_alive(), 60,
                       interval_s=0.001, what="the first call to return")
            doomed.kill()
            thread.join(60)
            assert not thread.is_alive()
        finally:
            doomed.kill()
        rcs = result["rcs"]
        assert rcs[0] == 0  # the peer was alive and whole for the first call: the kill came after it
        spans = telemetry.spans(semconv.SPAN_SEND)[-len(rcs):]
        # Whatever the engine returned, the span says the same: ERROR exactly when the code is non-zero.
        assert [s.status.status_code is StatusCode.ERROR for s in spans] == [rc != 0 for rc in rcs]
        assert [s.attributes.get(semconv.RETURN_CODE) for s in spans] == [rc if rc != 0 else None for rc in rcs]
        failures += sum(1 for rc in rcs if rc != 0)
        if failures:
            break
    assert failures >= 1


def test_return_values_and_exceptions_pass_through_unchanged(telemetry, engine, receiver):
    assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 8) == 0
    with pytest.raises(TypeError):
        engine.engine.transfer_sync_write(receiver.session, "not an address", receiver.base_address, 8)
    spans = telemetry.spans(semconv.SPAN_SEND)
    assert len(spans) == 2
    assert spans[1].attributes[semconv.ERROR_TYPE] == "TypeError"


def test_both_suppression_keys_are_honoured_raw_and_in_a_scope(telemetry, engine, receiver):
    """The wrapper reads the suppress keys from the context itself: both the keyed one that
    suppress_instrumentation() sets and the plain string key older instrumentations set."""
    from opentelemetry import context
    from opentelemetry.instrumentation.utils import (
        is_instrumentation_enabled,
        suppress_instrumentation,
    )

    from otel_kvtransfer import integration
    from otel_kvtransfer.recording.patching import active, current_context

    def write():
        return engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 8)

    token = context.attach(context.set_value("suppress_instrumentation", True))
    try:
        assert not is_instrumentation_enabled() and not active()
        assert current_context() is context.get_current()
        assert write() == 0
        with integration.transfer_scope(5):
            assert write() == 0
    finally:
        context.detach(token)
    with suppress_instrumentation():
        assert not active()
        with integration.transfer_scope(6):
            assert write() == 0
    assert telemetry.spans(semconv.SPAN_SEND) == []
    assert active() and current_context() is context.get_current()
    assert write() == 0
    assert len(telemetry.spans(semconv.SPAN_SEND)) == 1


def test_a_raw_call_is_parented_to_the_context_current_at_the_call(telemetry, engine, receiver):
    tracer = telemetry.tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("caller") as caller:
        assert engine.engine.transfer_sync_write(receiver.session, engine.base, receiver.base_address, 8) == 0
    send = _only(telemetry.spans(semconv.SPAN_SEND))
    assert send.parent is not None and send.parent.span_id == caller.get_span_context().span_id
