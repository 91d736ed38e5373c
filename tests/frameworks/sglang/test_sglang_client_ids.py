"""The client's request id (`sglang.rid`) on both sides of a request, in process (no engine started; the deployment
test, tests/deployments/test_sglang_integrity.py, shows a router's retried request on real servers): the prefill's
request span and its sends, the decode's receive span. sglang's real classes, instrumented as a deployment is,
around stand-ins of the methods that need a running scheduler or a peer; the one engine call of the send is handed
to the integration API as the Mooncake wrapper hands its calls (no Mooncake peer here). The tests ask for
`monkeypatch` before `telemetry`: the stand-ins are undone after the instrumentation that wrapped them is, so
none is left on sglang's classes for the tests after."""

import importlib.util
from types import SimpleNamespace

import pytest
from support.parts import require_part

from otel_kvtransfer import semconv
from otel_kvtransfer.frameworks.sglang import client_ids
from otel_kvtransfer.recording import integration, records
from otel_kvtransfer.recording.clock import now_ns

ROOM = 6_200_000
RID = "client-request-7"


@pytest.fixture
def sglang_classes():
    require_part(importlib.util.find_spec("sglang") is not None, "sglang 0.5.23")
    from sglang.srt.disaggregation import decode as sg_decode
    from sglang.srt.disaggregation import prefill as sg_prefill
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common import conn as common_conn
    from sglang.srt.disaggregation.common import utils as common_utils
    from sglang.srt.disaggregation.mooncake import conn as mooncake_conn

    return SimpleNamespace(decode=sg_decode, prefill=sg_prefill, common=common_conn, utils=common_utils,
                           mooncake=mooncake_conn, poll=KVPoll)


@pytest.fixture
def telemetry():
    from support.telemetry import Telemetry

    made = []

    def instrument():
        made.append(Telemetry().instrument())
        return made[-1]

    yield instrument
    for each in made:
        each.uninstrument()


def _one(spans, name, room):
    found = [s for s in spans if s.name == name and s.attributes[semconv.REQUEST_KEY] == str(room)]
    assert len(found) == 1, (name, room, found)
    return found[0]


def _prefill_stand_ins(sg, monkeypatch):
    """sglang's prefill methods, in the part that matters here: the bootstrap queue makes the Req's sender; the
    worker's queue hands it the room's chunk; the manager sends the chunk (one engine call) and records the
    room's status."""
    sender_class, manager_class = sg.mooncake.MooncakeKVSender, sg.mooncake.MooncakeKVManager

    def sender_init(self, mgr, bootstrap_addr, bootstrap_room):
        self.kv_mgr, self.bootstrap_room, self.conclude_state = mgr, bootstrap_room, None

    def create_sender(self, req):
        self.sender = sender_class.__new__(sender_class)
        sg.common.CommonKVSender.__init__(self.sender, self.manager, "127.0.0.1:8998", req.bootstrap_room)
        return self.sender

    def send_kvcache(self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, executor=None):
        start = now_ns()
        integration.deliver(records.call(start, start + 1000, 4096, 1, semconv.OP_WRITE, "127.0.0.1:17000", "tcp",
                                         0, None, semconv.BACKEND_MOONCAKE))
        return 0

    def update_status(self, bootstrap_room, status):
        self.request_status[bootstrap_room] = status

    monkeypatch.setattr(sg.common.CommonKVSender, "__init__", sender_init)
    monkeypatch.setattr(sg.prefill.PrefillBootstrapQueue, "create_sender", create_sender)
    monkeypatch.setattr(manager_class, "send_kvcache", send_kvcache)
    monkeypatch.setattr(sg.common.CommonKVManager, "update_status", update_status)
    manager = manager_class.__new__(manager_class)
    manager.disaggregation_mode = SimpleNamespace(name="PREFILL")
    manager.transfer_infos, manager.request_status, manager.failure_records = {}, {}, {}
    return manager


def _work_queue(sg, chunks):
    """sglang's own FastQueue holding `chunks` (None: nothing more), for the worker's dequeues. The class is never
    monkeypatched: the instrumentation wraps its `get`, and undoing a patch under our wrapper would leave it behind."""
    work = sg.utils.FastQueue()
    for chunk in chunks:
        work.put(chunk)
    return work


def _chunk(sg, room):
    chunk = sg.utils.TransferKVChunk.__new__(sg.utils.TransferKVChunk)
    chunk.room, chunk.is_last_chunk = room, True
    return chunk


def test_the_prefills_request_and_its_sends_carry_the_clients_rid(sglang_classes, monkeypatch, telemetry):
    sg = sglang_classes
    chunks = [_chunk(sg, ROOM), None]
    manager = _prefill_stand_ins(sg, monkeypatch)
    recorded = telemetry()
    queue = sg.prefill.PrefillBootstrapQueue.__new__(sg.prefill.PrefillBootstrapQueue)
    queue.manager = manager
    queue.create_sender(SimpleNamespace(rid=RID, bootstrap_room=ROOM, time_stats=None))
    assert client_ids.rid_of(ROOM) == RID
    work = _work_queue(sg, chunks)
    work.get()  # the worker dequeues the room's chunk
    assert manager.send_kvcache("127.0.0.1:17000", [1], [0], [1]) == 0
    work.get()  # and then nothing
    manager.update_status(ROOM, sg.poll.Success)
    assert client_ids.rid_of(ROOM) is None  # the room concluded: forgotten
    spans = recorded.spans()
    request = _one(spans, semconv.SPAN_REQUEST, ROOM)
    send = _one(spans, semconv.SPAN_SEND, ROOM)
    assert request.attributes["sglang.rid"] == RID and send.attributes["sglang.rid"] == RID
    assert send.parent.span_id == request.context.span_id
    assert send.attributes[semconv.BOOTSTRAP_ROOM] == ROOM and send.attributes[semconv.BYTES] == 4096


def test_a_request_made_without_a_req_sends_without_a_rid(sglang_classes, monkeypatch, telemetry):
    """A sender made outside the bootstrap queue (sglang's own tests, a fake transfer): no rid anywhere."""
    sg = sglang_classes
    chunks = [_chunk(sg, ROOM + 1), None]
    manager = _prefill_stand_ins(sg, monkeypatch)
    recorded = telemetry()
    sender = sg.mooncake.MooncakeKVSender.__new__(sg.mooncake.MooncakeKVSender)
    sg.common.CommonKVSender.__init__(sender, manager, "127.0.0.1:8998", ROOM + 1)
    work = _work_queue(sg, chunks)
    work.get()
    manager.send_kvcache("127.0.0.1:17000", [1], [0], [1])
    work.get()
    manager.update_status(ROOM + 1, sg.poll.Failed)
    spans = recorded.spans()
    for name in (semconv.SPAN_REQUEST, semconv.SPAN_SEND):
        assert "sglang.rid" not in _one(spans, name, ROOM + 1).attributes


def test_the_decodes_receive_carries_the_rid_of_the_req_it_serves(sglang_classes, monkeypatch, telemetry):
    sg = sglang_classes
    receiver_class = sg.mooncake.MooncakeKVReceiver

    def create_receiver_and_enqueue(self, req):
        """sglang's, in the part that matters here: it makes the receiver of `req` as it admits it."""
        self.receiver = receiver_class.__new__(receiver_class)
        sg.common.CommonKVReceiver.__init__(self.receiver)
        self.receiver.bootstrap_room, self.receiver.bootstrap_infos = req.bootstrap_room, None
        self.receiver.kv_mgr = SimpleNamespace(kv_item_lens_sum=64, kv_args=SimpleNamespace(aux_item_lens=[8]))

    monkeypatch.setattr(sg.common.CommonKVReceiver, "__init__", lambda self: None)
    monkeypatch.setattr(sg.common.CommonKVReceiver, "send_metadata", lambda self, kv_indices, aux_index=None: None)
    monkeypatch.setattr(sg.decode.DecodePreallocQueue, "_create_receiver_and_enqueue", create_receiver_and_enqueue)
    recorded = telemetry()
    queue = sg.decode.DecodePreallocQueue.__new__(sg.decode.DecodePreallocQueue)
    for room, rid in ((ROOM + 2, RID), (ROOM + 3, None)):
        queue._create_receiver_and_enqueue(SimpleNamespace(time_stats=None, rid=rid, bootstrap_room=room))
        queue.receiver.send_metadata([1, 2], 0)
        integration.end_receive(room)
    spans = recorded.spans()
    assert _one(spans, semconv.SPAN_RECEIVE, ROOM + 2).attributes["sglang.rid"] == RID
    assert "sglang.rid" not in _one(spans, semconv.SPAN_RECEIVE, ROOM + 3).attributes


def test_rooms_past_the_bound_let_the_oldest_go_and_count_it(monkeypatch, telemetry):
    recorded = telemetry()
    monkeypatch.setattr(client_ids, "MAX_ROOMS", 2)
    try:
        for room in (1, 2, 3):
            client_ids.remember(room, f"r{room}")
        client_ids.remember(3, "r3")  # a room already held takes no room of another
        assert [client_ids.rid_of(room) for room in (1, 2, 3)] == [None, "r2", "r3"]
        assert recorded.dropped() == {client_ids.EVICTED: 1}
        client_ids.remember(4, None)  # no rid: nothing held
        client_ids.remember(True, "not a room")
        assert client_ids.rid_of(4) is None and client_ids.rid_of(True) is None
        client_ids.remember(5, "x" * 1000)
        assert client_ids.rid_of(5) == "x" * 256
    finally:
        client_ids.forget_all()
