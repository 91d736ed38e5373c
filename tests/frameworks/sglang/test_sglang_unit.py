"""In-process checks of the sglang integration: version gate, patch/unpatch symmetry, failure naming, compute.

They import sglang's disaggregation modules (a few seconds) but start no engine.
"""

import importlib.util
import logging

import pytest
from support.parts import require_part

from otel_kvtransfer import semconv as sc
from otel_kvtransfer.frameworks import sglang as kvt_sglang
from otel_kvtransfer.frameworks.sglang import common, prefill
from otel_kvtransfer.recording.patching import is_ours
from otel_kvtransfer.recording.recorder import RECORDER
from otel_kvtransfer.wiring.activation import LazyPatcher
from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor


def _require_sglang():
    require_part(importlib.util.find_spec("sglang") is not None, "sglang 0.5.23")


def _wrapped(owner, attr) -> bool:
    return is_ours(owner.__dict__.get(attr))


def _targets():
    from sglang.srt.disaggregation import decode as sg_decode
    from sglang.srt.disaggregation import prefill as sg_prefill
    from sglang.srt.disaggregation.common import conn as common_conn
    from sglang.srt.disaggregation.common import utils as common_utils
    from sglang.srt.disaggregation.mooncake import conn as mooncake_conn
    from sglang.srt.managers import scheduler as sg_scheduler

    return [
        (common_utils.FastQueue, "put"),
        (common_utils.FastQueue, "get"),
        (common_conn.CommonKVManager, "update_status"),
        (common_conn.CommonKVSender, "__init__"),
        (common_conn.CommonKVReceiver, "poll"),
        (common_conn.CommonKVReceiver, "send_metadata"),
        (mooncake_conn.MooncakeKVManager, "send_kvcache"),
        (mooncake_conn.MooncakeKVManager, "send_kvcache_slice"),
        (mooncake_conn.MooncakeKVManager, "send_aux"),
        (mooncake_conn.MooncakeKVManager, "maybe_send_extra"),
        (common_conn.CommonKVReceiver, "__init__"),
        (sg_prefill.SchedulerDisaggregationPrefillMixin, "maybe_send_cached_prefix_chunk"),
        (sg_prefill.PrefillBootstrapQueue, "create_sender"),
        (sg_decode.DecodePreallocQueue, "_create_receiver_and_enqueue"),
        # sglang decorates run_batch with functools.wraps: it has __wrapped__ before we touch it.
        (sg_scheduler.Scheduler, "run_batch"),
    ]


@pytest.fixture
def spans():
    """Finished spans so far; with dropped=True the drop counts by reason instead."""
    from support.telemetry import Telemetry

    telemetry = Telemetry().instrument()

    def read(dropped=False):
        if dropped:
            return telemetry.dropped()
        return telemetry.spans()

    yield read
    telemetry.uninstrument()


@pytest.fixture
def patched_around(monkeypatch):
    """`patched_around(owner, attr, stand_in)`: the real sglang class, instrumented as a deployment is, around a
    stand-in of its own method (the real one needs a running engine): a call through the class runs the wrapper
    exactly as installed, then the stand-in. Returns the Telemetry reading what was recorded."""
    from support.telemetry import Telemetry

    _require_sglang()
    started = []

    def patch(*owner_attr_stand_in):
        for owner, attr, stand_in in zip(*[iter(owner_attr_stand_in)] * 3):
            monkeypatch.setattr(owner, attr, stand_in)  # before instrument(): the wrapper wraps the stand-in
        telemetry = Telemetry().instrument()
        started.append(telemetry)
        for owner, attr, _ in zip(*[iter(owner_attr_stand_in)] * 3):
            assert _wrapped(owner, attr)
        return telemetry

    yield patch
    for telemetry in started:
        telemetry.uninstrument()  # puts the stand-ins back; monkeypatch then the originals


def test_version_range():
    assert kvt_sglang.is_supported("0.5.23")
    assert kvt_sglang.is_supported("0.5.23.post1")
    assert kvt_sglang.is_supported("0.5.30rc1")
    assert not kvt_sglang.is_supported("0.5.22")
    assert not kvt_sglang.is_supported("0.6.0")
    assert not kvt_sglang.is_supported(None)


def test_instrument_and_uninstrument_mirror_each_other(spans):
    _require_sglang()
    targets = _targets()
    assert all(_wrapped(owner, attr) for owner, attr in targets), [t for t in targets if not _wrapped(*t)]
    KVTransferInstrumentor().uninstrument()
    assert not any(_wrapped(owner, attr) for owner, attr in targets)
    KVTransferInstrumentor().instrument()  # the fixture's uninstrument() runs after this
    assert all(_wrapped(owner, attr) for owner, attr in targets)


def test_unsupported_version_patches_nothing_and_warns_once(monkeypatch, caplog):
    _require_sglang()
    targets = _targets()
    hooks = LazyPatcher(kvt_sglang.SPEC, kvt_sglang.patcher)  # a fresh gate: the process-wide one warned already
    monkeypatch.setattr(hooks, "installed_version", lambda: "0.4.9")
    with caplog.at_level(logging.WARNING, logger="otel_kvtransfer.wiring.activation"):
        assert hooks.instrument() is False
        assert hooks.instrument() is False
    assert not any(_wrapped(owner, attr) for owner, attr in targets)
    warnings = [r for r in caplog.records if "outside the supported range" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize(
    "reason, kind",
    [
        ("Request 5 timed out after 300.0s in KVPoll.Bootstrapping", "bootstrap_timeout"),
        ("Aborted by AbortReq.", "aborted"),
        ("Decode instance could be dead, remote mooncake session 127.0.0.1:1 is not alive",
         "decode_session_failed"),
        ("Failed to send kv chunk of 5 to 127.0.0.1:9", "kv_send_failed"),
        ("Failed to send aux data of 5", "aux_send_failed"),
        (None, "transfer_failed"),
    ],
)
def test_error_type_of_sglang_failure_reasons(reason, kind):
    assert common.error_type_of(reason) == kind


def test_prefill_batch_compute_becomes_compute_spans_and_overlap(spans):
    from otel_kvtransfer import integration

    class Req:
        def __init__(self, room):
            self.bootstrap_room = room

    class Batch:
        reqs = [Req(11), Req(12), Req(None)]

    integration.begin_request(11, backend="mooncake", start_ns=1_000)
    prefill.record_batch_compute(Batch(), 2_000, 5_000)  # room 12 never transfers (a warm-up): no span
    with integration.transfer_scope(11, chunk_index=0, payload="kv"):
        pass  # no engine call: no span
    integration.end_request(11, end_ns=9_000)
    integration.end_request(12, end_ns=9_000)
    got = spans()
    compute = sorted(s.attributes[sc.REQUEST_KEY] for s in got if s.name == sc.SPAN_COMPUTE)
    assert compute == ["11"]
    assert not [s for s in got if s.name == sc.SPAN_SEND]
    assert [s.attributes[sc.REQUEST_KEY] for s in got if s.name == sc.SPAN_REQUEST] == ["11"]


def test_run_batch_only_times_prefill_schedulers(patched_around):
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler import Scheduler

    from otel_kvtransfer import integration

    calls = []

    def run_batch(self, batch):
        calls.append((self, batch))
        return "result"

    def scheduler(mode):
        made = Scheduler.__new__(Scheduler)  # a real Scheduler, without the model it would load
        made.disaggregation_mode = SimpleNamespace(name=mode)
        return made

    telemetry = patched_around(Scheduler, "run_batch", run_batch)
    batch = SimpleNamespace(reqs=[SimpleNamespace(bootstrap_room=21)])
    decode_sched, prefill_sched = scheduler("DECODE"), scheduler("PREFILL")
    integration.begin_request(21, backend="mooncake")
    assert decode_sched.run_batch(batch) == "result"
    assert prefill_sched.run_batch(batch) == "result"
    integration.end_request(21)
    got = telemetry.spans()
    assert [s.attributes[sc.REQUEST_KEY] for s in got if s.name == sc.SPAN_COMPUTE] == ["21"]
    assert calls == [(decode_sched, batch), (prefill_sched, batch)]


def test_wrapper_errors_are_swallowed_and_counted(patched_around):
    from types import SimpleNamespace

    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    raises = []

    def update_status(self, bootstrap_room, status):
        if raises:
            raise ValueError("sglang's own error")
        return "original"

    telemetry = patched_around(CommonKVManager, "update_status", update_status)

    class Broken(MooncakeKVManager):
        disaggregation_mode = SimpleNamespace(name="PREFILL")

        @property
        def request_status(self):
            raise RuntimeError("boom")

    manager = Broken.__new__(Broken)  # a manager whose state our wrapper cannot read
    before = RECORDER.pending()
    assert manager.update_status(5, 4) == "original"
    assert RECORDER.pending() == before  # nothing recorded for it ...
    assert telemetry.dropped() == {"wrapper_error": 1}  # ... and the failure is counted
    raises.append(True)
    with pytest.raises(ValueError, match="sglang's own error"):
        manager.update_status(5, 4)


def test_decode_receiver_takes_sglangs_request_span_as_parent(patched_around):
    from types import SimpleNamespace

    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    from otel_kvtransfer.frameworks.sglang import decode

    def receiver_init(self):
        pass

    def create_receiver_and_enqueue(self, req):
        """What sglang's does, in the part that matters here: it makes the receiver of `req`."""
        self.receiver = CommonKVReceiver.__new__(CommonKVReceiver)
        CommonKVReceiver.__init__(self.receiver)
        return "decode_req"

    patched_around(CommonKVReceiver, "__init__", receiver_init,
                   DecodePreallocQueue, "_create_receiver_and_enqueue", create_receiver_and_enqueue)
    sglang_ctx = trace.set_span_in_context(NonRecordingSpan(SpanContext(
        trace_id=0xABC, span_id=0xDEF, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))))
    req = SimpleNamespace(time_stats=SimpleNamespace(
        trace_ctx=SimpleNamespace(tracing_enable=True, root_span_context=sglang_ctx)))
    queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
    assert queue._create_receiver_and_enqueue(req) == "decode_req"
    assert getattr(queue.receiver, decode._PARENT) is sglang_ctx
    untraced = CommonKVReceiver.__new__(CommonKVReceiver)
    CommonKVReceiver.__init__(untraced)  # a receiver made outside a request's creation
    assert not hasattr(untraced, decode._PARENT)
