"""sglang's NIXL backend without a server, on sglang 0.5.23's real module (the deployment test,
MLA over NIXL to a TP2 decode, is in test_sglang_shapes.py).

- every NixlKVManager / NixlKVSender / NixlKVReceiver method the package patches is ours after instrument() and
  the very original after uninstrument();
- the state path: `NixlKVManager.maybe_send_extra` is a generator that posts each state handle as its caller
  iterates. State payloads come only with hybrid (mamba / SWA) models, which cannot run on this CPU machine, so
  that one method of the real, instrumented NixlKVManager is a stand-in with its shape; the package's wrapper
  around it (as installed), sglang's FastQueue handing the worker its chunk, the transfer scope, NIXL's
  pending-handle table and the recorder are real.
"""

import importlib.util
from types import SimpleNamespace

import pytest
from support.parts import require_part

from otel_kvtransfer import integration, semconv

NIXL_PATCHED = ["send_kvcache", "send_kvcache_slice", "send_kvcache_mixed", "send_kvcache_dcp",
                "_do_staging_transfer", "maybe_send_extra", "send_aux", "add_transfer_request"]


def test_nixl_manager_methods_are_wrapped_and_restored():
    require_part(importlib.util.find_spec("sglang") is not None, "sglang 0.5.23 (bash scripts/setup.sh)")
    from sglang.srt.disaggregation.nixl import conn
    from support.telemetry import Telemetry

    from otel_kvtransfer.frameworks.sglang import common
    from otel_kvtransfer.recording.patching import is_ours

    before = {name: conn.NixlKVManager.__dict__[name] for name in NIXL_PATCHED}
    telemetry = Telemetry().instrument()
    try:
        assert {name for name in NIXL_PATCHED if is_ours(conn.NixlKVManager.__dict__[name])} == set(NIXL_PATCHED)
        manager = conn.NixlKVManager.__new__(conn.NixlKVManager)
        assert common.backend_of(manager, "manager") == common.NIXL
        assert common.backend_of(conn.NixlKVReceiver.__new__(conn.NixlKVReceiver), "receiver") == common.NIXL
        assert common.backend_of(conn.NixlKVSender.__new__(conn.NixlKVSender), "sender") == common.NIXL
    finally:
        telemetry.uninstrument()
    assert all(conn.NixlKVManager.__dict__[name] is before[name] for name in NIXL_PATCHED)


class _StatePath:
    """sglang's NixlKVManager, instrumented as a deployment is, around a stand-in of its `maybe_send_extra` (see
    the module docstring): each manager made by `manager()` runs its own `steps` generator there. The worker's
    current chunk comes from sglang's own FastQueue, through the package's wrapper of its `get`, as on a
    transfer worker thread."""

    def __init__(self, monkeypatch):
        from sglang.srt.disaggregation.common.utils import FastQueue, TransferKVChunk
        from sglang.srt.disaggregation.nixl import conn
        from support.telemetry import Telemetry

        def maybe_send_extra(self, peer_name, *args):
            yield from self.steps(peer_name, *args)

        self.conn, self.queue, self.chunk_class = conn, FastQueue(), TransferKVChunk
        monkeypatch.setattr(conn.NixlKVManager, "maybe_send_extra", maybe_send_extra)
        self.telemetry = Telemetry().instrument()  # wraps the stand-in, as it would wrap sglang's own

    def manager(self, room, peer, steps):
        manager = self.conn.NixlKVManager.__new__(self.conn.NixlKVManager)
        manager.transfer_infos = {room: {peer: SimpleNamespace(is_dummy=False)}}
        manager._kv_replica_factor = 1
        manager.steps = steps
        return manager

    def take_chunk(self, room):
        """The worker dequeues the last chunk of `room`: its current chunk from now on."""
        self.queue.put(self.chunk_class(room=room, prefill_kv_indices=None, index_slice=slice(0, 1),
                                        is_last_chunk=True, prefill_aux_index=0, state_indices=[0]))
        self.queue.get()

    def idle(self):
        """The worker's queue hands it nothing (sglang's shutdown sentinel): no current chunk."""
        self.queue.put(None)
        self.queue.get()


@pytest.fixture
def state_path(monkeypatch):
    require_part(importlib.util.find_spec("sglang") is not None, "sglang 0.5.23 (bash scripts/setup.sh)")
    path = _StatePath(monkeypatch)
    yield path
    path.telemetry.uninstrument()


def test_nixl_state_generator_gives_one_send_per_handle_of_its_request(state_path):
    from otel_kvtransfer.engines.nixl import BACKEND
    from otel_kvtransfer.frameworks.sglang import common
    from otel_kvtransfer.recording.pending import PendingTransfers

    room, peer = 4711, "decode-agent-0"
    pending = PendingTransfers(BACKEND)
    between_steps = []  # the transfer scope current on this thread while the caller holds the generator

    def steps(peer_name, handles):
        for number in range(handles):
            # what the NIXL engine wrapper does when a posted handle answers PROC
            pending.submit(("handle", number), 0, 4096 * (number + 1), 2, semconv.OP_WRITE, peer_name, "ucx")
            yield number

    manager = state_path.manager(room, peer, steps)
    integration.begin_request(room, backend=BACKEND, framework=common.FRAMEWORK)
    state_path.take_chunk(room)
    try:
        posted = []
        for number in manager.maybe_send_extra(peer, 2):
            posted.append(number)
            between_steps.append(integration.current_scope())
    finally:
        state_path.idle()
    for number in posted:  # the worker polls the handles after the loop
        assert pending.complete(("handle", number), "DONE", None)
    integration.end_request(room)

    assert posted == [0, 1]
    assert between_steps == [None, None]  # the scope is never left entered on the worker thread
    telemetry = state_path.telemetry
    (request,) = telemetry.spans(semconv.SPAN_REQUEST)
    sends = sorted(telemetry.spans(semconv.SPAN_SEND), key=lambda s: s.attributes[semconv.BYTES])
    assert [s.attributes[semconv.BYTES] for s in sends] == [4096, 8192]
    for send in sends:
        assert send.parent.span_id == request.context.span_id
        assert send.attributes[semconv.PAYLOAD] == semconv.PAYLOAD_STATE
        assert send.attributes[semconv.REQUEST_KEY] == str(room)
        assert send.attributes[semconv.IS_LAST_CHUNK] is True
    assert request.attributes[semconv.BYTES] == 4096 + 8192


class Rejected(RuntimeError):
    """sglang's NIXL state path raises when the decode side rejected the state layout."""


def test_a_state_step_that_raises_is_a_failed_send_and_the_error_passes_through(state_path):
    from otel_kvtransfer.frameworks.sglang import common

    room = 4712

    def steps(peer_name):
        raise Rejected(f"NIXL state layout rejected for {peer_name}")
        yield

    manager = state_path.manager(room, "peer", steps)
    integration.begin_request(room, backend=common.NIXL, framework=common.FRAMEWORK)
    state_path.take_chunk(room)
    try:
        with pytest.raises(Rejected):
            list(manager.maybe_send_extra("peer"))
    finally:
        state_path.idle()
    integration.end_request(room, error_type="state_layout_rejected")
    (send,) = state_path.telemetry.spans(semconv.SPAN_SEND)
    assert send.attributes["error.type"] == "Rejected"
    assert send.attributes[semconv.PAYLOAD] == semconv.PAYLOAD_STATE
    assert integration.current_scope() is None
