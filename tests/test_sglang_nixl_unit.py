"""sglang's NIXL backend without a server, on sglang 0.5.23's real module (the deployment test,
MLA over NIXL to a TP2 decode, is in test_sglang_shapes.py).

- every NixlKVManager / NixlKVSender / NixlKVReceiver method the package patches is ours after instrument() and
  the very original after uninstrument();
- the state path: `NixlKVManager.maybe_send_extra` is a generator that posts each state handle as its caller
  iterates. State payloads come only with hybrid (mamba / SWA) models, which cannot run on this CPU machine, so
  the manager below is a stand-in with that method's shape; the wrapper, the transfer scope, NIXL's pending-handle
  table and the recorder are the package's own.
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


def _state_wrapper():
    """The wrapper the package puts on NixlKVManager.maybe_send_extra (peer name first, no executor)."""
    from otel_kvtransfer.frameworks.sglang import common, prefill

    method = prefill.NIXL_TRANSFER_METHODS["maybe_send_extra"]
    return prefill._transfer_wrapper(common.NIXL, *method)


class _Manager:
    """Stand-in for NixlKVManager's state path (see the module docstring)."""

    def __init__(self, room, peer, pending):
        self.transfer_infos = {room: {peer: SimpleNamespace(is_dummy=False)}}
        self._kv_replica_factor = 1
        self._pending = pending
        self.between_steps = []  # the transfer scope current on this thread while the caller holds the generator

    def maybe_send_extra(self, peer_name, handles):
        for number in range(handles):
            # what the NIXL engine wrapper does when a posted handle answers PROC
            self._pending.submit(("handle", number), 0, 4096 * (number + 1), 2, semconv.OP_WRITE, peer_name, "ucx")
            yield number


def test_nixl_state_generator_gives_one_send_per_handle_of_its_request(telemetry):
    from otel_kvtransfer.engines.nixl import BACKEND
    from otel_kvtransfer.frameworks.sglang import common, prefill
    from otel_kvtransfer.recording.pending import PendingTransfers

    room, peer = 4711, "decode-agent-0"
    pending = PendingTransfers(BACKEND)
    manager = _Manager(room, peer, pending)
    wrapper = _state_wrapper()
    integration.begin_request(room, backend=BACKEND, framework=common.FRAMEWORK)
    prefill._tls.chunk = SimpleNamespace(room=room, is_last_chunk=True)
    try:
        steps = wrapper(manager.maybe_send_extra, manager, (peer, 2), {})
        posted = []
        for number in steps:
            posted.append(number)
            manager.between_steps.append(integration.current_scope())
    finally:
        prefill._tls.chunk = None
    for number in posted:  # the worker polls the handles after the loop
        assert pending.complete(("handle", number), "DONE", None)
    integration.end_request(room)

    assert posted == [0, 1]
    assert manager.between_steps == [None, None]  # the scope is never left entered on the worker thread
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


def test_a_state_step_that_raises_is_a_failed_send_and_the_error_passes_through(telemetry):
    from otel_kvtransfer.frameworks.sglang import common, prefill

    room = 4712

    def maybe_send_extra(peer_name):
        raise Rejected(f"NIXL state layout rejected for {peer_name}")
        yield

    manager = SimpleNamespace(transfer_infos={room: {"peer": SimpleNamespace(is_dummy=False)}})
    wrapper = _state_wrapper()
    integration.begin_request(room, backend=common.NIXL, framework=common.FRAMEWORK)
    prefill._tls.chunk = SimpleNamespace(room=room, is_last_chunk=True)
    try:
        with pytest.raises(Rejected):
            list(wrapper(maybe_send_extra, manager, ("peer",), {}))
    finally:
        prefill._tls.chunk = None
    integration.end_request(room, error_type="state_layout_rejected")
    (send,) = telemetry.spans(semconv.SPAN_SEND)
    assert send.attributes["error.type"] == "Rejected"
    assert send.attributes[semconv.PAYLOAD] == semconv.PAYLOAD_STATE
    assert integration.current_scope() is None
