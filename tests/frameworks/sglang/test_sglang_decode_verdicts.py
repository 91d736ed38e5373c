"""The decode side's two figures sglang alone knows, in process (no engine started; the deployment test,
tests/deployments/test_sglang_integrity.py, shows them on real servers): the allocation wait on the receive span,
and the KV checksum's verdict (`verified` | `mismatch`). sglang's real classes, instrumented as a deployment is,
around stand-ins of the methods that need a running scheduler."""

import importlib.util
from types import SimpleNamespace

import pytest
from support.parts import require_part

from otel_kvtransfer import semconv
from otel_kvtransfer.recording import integration
from otel_kvtransfer.recording.clock import now_ns

ROOM = 6_100_000


@pytest.fixture
def sglang_decode():
    require_part(importlib.util.find_spec("sglang") is not None, "sglang 0.5.23")
    from sglang.srt.disaggregation import decode as sg_decode
    from sglang.srt.disaggregation.common import conn as common_conn
    from sglang.srt.disaggregation.mooncake import conn as mooncake_conn

    return sg_decode, common_conn, mooncake_conn


def _receive(telemetry, room):
    (span,) = [s for s in telemetry.spans(semconv.SPAN_RECEIVE)
               if s.attributes[semconv.REQUEST_KEY] == str(room)]
    return span


def test_the_allocation_wait_is_the_time_from_admission_to_asking_for_the_kv(sglang_decode, monkeypatch):
    from support.telemetry import Telemetry

    from otel_kvtransfer.frameworks.sglang import decode

    sg_decode, common_conn, mooncake_conn = sglang_decode
    receiver_class = mooncake_conn.MooncakeKVReceiver

    def create_receiver_and_enqueue(self, req):
        """sglang's, in the part that matters here: it makes the receiver of `req` as it admits it."""
        self.receiver = receiver_class.__new__(receiver_class)
        common_conn.CommonKVReceiver.__init__(self.receiver)

    monkeypatch.setattr(common_conn.CommonKVReceiver, "__init__", lambda self: None)
    monkeypatch.setattr(common_conn.CommonKVReceiver, "send_metadata", lambda self, kv_indices, aux_index=None: None)
    monkeypatch.setattr(sg_decode.DecodePreallocQueue, "_create_receiver_and_enqueue", create_receiver_and_enqueue)
    admitted = now_ns()
    clock = iter((admitted, admitted + 2_500_000_000))  # admitted, then its KV pages reserved 2.5 s later
    monkeypatch.setattr(decode, "now_ns", lambda: next(clock))
    telemetry = Telemetry().instrument()
    try:
        queue = sg_decode.DecodePreallocQueue.__new__(sg_decode.DecodePreallocQueue)
        queue._create_receiver_and_enqueue(SimpleNamespace(time_stats=None))
        receiver = queue.receiver
        receiver.bootstrap_room = ROOM
        receiver.bootstrap_infos = None
        receiver.kv_mgr = SimpleNamespace(kv_item_lens_sum=64, kv_args=SimpleNamespace(aux_item_lens=[8],
                                                                                        engine_rank=0))
        receiver.send_metadata([1, 2, 3], 0)
        integration.end_receive(ROOM)
        span = _receive(telemetry, ROOM)
        assert span.attributes[semconv.ALLOCATION_WAIT_S] == 2.5
        assert span.attributes[semconv.EXPECTED_BYTES] == 3 * 64 + 8
    finally:
        telemetry.uninstrument()


def test_the_checksum_verdict_is_verified_or_mismatch_per_request(sglang_decode, monkeypatch):
    from support.telemetry import Telemetry

    sg_decode, _, _ = sglang_decode
    mixin = sg_decode.SchedulerDisaggregationDecodeMixin
    good, bad = ROOM + 1, ROOM + 2

    def verify(self, batch):
        """sglang's, in the part that matters here: each request verified once (its expected digest zeroed), a
        mismatch handed to the mismatch handler with sglang's message."""
        for req in batch.reqs:
            req.expected_kv_checksum, expected = 0, req.expected_kv_checksum
            if req.bootstrap_room == bad:
                self._handle_kv_checksum_mismatch(
                    req, f"KV checksum mismatch req={req.rid} bootstrap_room={bad} expected={expected:#x} got=0x11")

    monkeypatch.setattr(mixin, "_verify_kv_checksums", verify)
    monkeypatch.setattr(mixin, "_handle_kv_checksum_mismatch", lambda self, req, msg: None)
    telemetry = Telemetry().instrument()
    try:
        for room in (good, bad):
            integration.begin_receive(room, backend="mooncake", framework="sglang")
            integration.end_receive(room, outcome_pending=True)  # a decode that verifies: the span waits
        scheduler = mixin.__new__(mixin)
        scheduler.kv_checksum_computer = object()
        reqs = [SimpleNamespace(bootstrap_room=room, rid=f"r{room}", expected_kv_checksum=0x10,
                                bootstrap_host="127.0.0.1", bootstrap_port=8998) for room in (good, bad)]
        scheduler._verify_kv_checksums(SimpleNamespace(reqs=reqs))
        assert _receive(telemetry, good).attributes[semconv.INTEGRITY] == semconv.INTEGRITY_VERIFIED
        mismatch = _receive(telemetry, bad)
        assert mismatch.attributes[semconv.INTEGRITY] == semconv.INTEGRITY_MISMATCH
        (event,) = mismatch.events
        assert event.name == semconv.EVENT_INTEGRITY_MISMATCH
        assert event.attributes[semconv.INTEGRITY_COMPUTED_DIGEST] == "0x11"
    finally:
        telemetry.uninstrument()
