"""vLLM traffic that is not KV but moves through the engines this package times: recognised by the vLLM class that
makes the engine call. Each entry method below runs inside a payload scope (`integration.payload_scope`), so its
engine calls become `kv_transfer.send` spans of no request, labelled `kv_transfer.payload` = `encoder_cache` |
`expert_weights` | `offload` and `kv_transfer.framework` = `vllm`: the request figures, the per-peer throughput and
the tail stay the KV's, and the per-send metrics keep the payload label.

- Encoder cache over Mooncake: `MooncakeTransfer.write` (ec_connector/mooncake/transfer.py), one
  `batch_transfer_sync_write` per write.
- Encoder cache over NIXL: `NixlDataTransport.post_read` (ec_connector/cpu/data/nixl.py) makes and posts one READ
  handle; vLLM's scheduler polls it later, and the NIXL engine module keeps the scope with the handle.
- Expert weights over NIXL (EPLB): `NixlEplbCommunicator.add_recv` (eplb/eplb_communicator.py) makes and posts one
  READ per expert from its source rank; `execute()` polls them.
- KV offloaded to a peer's offload tier over NIXL: `NixlTransport.write_blocks` (v1/kv_offload/tiering/p2p/data/
  nixl.py) makes and posts one WRITE of the blocks; the tier's `poll()` sees it end.
- KV offloaded to an object store over NIXL's OBJ plugin: `ObjectStoreSecondaryTierManager._submit_transfer`
  (v1/kv_offload/tiering/obj/manager.py; `submit_store` and `submit_load` call it) posts one READ or WRITE per job.

vLLM 0.32, 0.33 and 0.34 have all five. Each module is patched when vLLM imports it; a class or method a release lacks
is not wrapped (optional targets in targets.py, never a reason to block the KV wrappers), and its bytes then show
as raw sends, as would any other non-KV caller of these engines (docs/support.md lists what was looked for).
"""

from otel_kvtransfer import semconv
from otel_kvtransfer.frameworks.vllm import targets
from otel_kvtransfer.frameworks.vllm.common import FRAMEWORK, patcher
from otel_kvtransfer.recording import integration as kvt
from otel_kvtransfer.recording.patching import active

# The class whose entry method (targets.PAYLOAD_TARGETS) makes the engine calls -> what its bytes are.
PAYLOAD_OF = {
    "MooncakeTransfer": semconv.PAYLOAD_ENCODER_CACHE,
    "NixlDataTransport": semconv.PAYLOAD_ENCODER_CACHE,
    "NixlEplbCommunicator": semconv.PAYLOAD_EXPERT_WEIGHTS,
    "NixlTransport": semconv.PAYLOAD_OFFLOAD,
    "ObjectStoreSecondaryTierManager": semconv.PAYLOAD_OFFLOAD,
}


def _scoped(payload: str):
    """A wrapper running the entry method inside a payload scope (which never raises, nor changes the call)."""

    def wrapper(wrapped, instance, args, kwargs):
        if not active():
            return wrapped(*args, **kwargs)
        with kvt.payload_scope(payload, framework=FRAMEWORK):
            return wrapped(*args, **kwargs)

    return wrapper


_WRAPPERS = {payload: _scoped(payload) for payload in semconv.NON_KV_PAYLOADS}


def _patch_for(module_name: str):
    """The patch function of one module: wraps each of its entry methods that the release has."""
    entries = [t for t in targets.PAYLOAD_TARGETS if t.module == module_name]

    def patch(module) -> None:
        for target in entries:
            cls = getattr(module, target.cls, None)
            if isinstance(cls, type) and target.method is not None:  # (each payload target names its method)
                patcher.wrap(cls, target.method, _WRAPPERS[PAYLOAD_OF[target.cls]])

    return patch


def patches() -> dict:
    """Module -> its patch function (the framework's `_patches`)."""
    return {module_name: _patch_for(module_name) for module_name in dict.fromkeys(
        t.module for t in targets.PAYLOAD_TARGETS)}
