"""vLLM-Ascend's own Mooncake connectors (vllm-ascend, vLLM's Ascend NPU plugin): request, transfer and peer-wait
records.

vllm-ascend registers its own `MooncakeConnectorV1` and `MooncakeHybridConnector` (kv_p2p/mooncake_connector.py,
kv_p2p/mooncake_hybrid_connector.py) in place of vLLM's; they call `mooncake.engine.TransferEngine` through their
`GlobalTE`, so without this package every read is a raw `kv_transfer.send` of no request. Both are pulls: the
decode reads the prefill's KV (op `read`, request role `decode`), the prefill waits in `kv_transfer.serve`; the
request key is the prefill request id (the id the decode reads from and reports done to), as for vLLM's own
NixlConnector. pull.py says which of their methods mark what.

Switched on like the vLLM package (`KVTransferInstrumentor`, or vLLM's plugin loader through it): nothing of
vllm-ascend is imported here; each connector module is patched when vLLM's connector factory imports it. Version
policy (otel_kvtransfer.wiring.activation): `SUPPORTED` is the range the tests ran on; a newer release is
instrumented when every target in targets.py is there as its module loads.

- pull.py: the two pull connectors' wrappers (decode: request, sends, metadata query; prefill: serve).
- targets.py: what the wrappers need from vllm-ascend (checked before patching, and by the release canary).
- common.py: names and the one Patcher. The spans say `kv_transfer.framework` = `vllm` (the serving framework;
  vllm-ascend's connectors take the names of vLLM's own in its connector factory); `vllm-ascend` names this backend
  on the start-up line and in its warnings.

Not instrumented at the framework level: the layerwise connector (a push, layer by layer, several requests per
engine call); its writes stay raw `kv_transfer.send` spans through the Mooncake engine module.
"""

from otel_kvtransfer.frameworks.vllm_ascend import targets
from otel_kvtransfer.frameworks.vllm_ascend.common import FRAMEWORK, patcher
from otel_kvtransfer.recording.patching import FrameworkSpec, Patch, deferred
from otel_kvtransfer.wiring.activation import LazyPatcher


def _forget() -> None:
    from otel_kvtransfer.frameworks.vllm_ascend import pull

    pull.forget()


SPEC = FrameworkSpec(
    name=FRAMEWORK,
    distributions=("vllm-ascend",),
    # The releases the tests ran on: 0.23.x (its connectors' real classes over the real engine, source checked).
    supported=">=0.23, <0.24",
    patches=(
        Patch(targets.CONNECTOR, deferred(__name__, "pull.patch_connector")),
        Patch(targets.HYBRID, deferred(__name__, "pull.patch_hybrid")),
    ),
    forget=_forget,
    targets=targets.by_module,
)

HOOKS = LazyPatcher(SPEC, patcher)
SUPPORTED, DISTRIBUTIONS = SPEC.supported, SPEC.distributions
is_supported = HOOKS.is_supported
instrument = HOOKS.instrument
uninstrument = HOOKS.uninstrument
modules = HOOKS.modules

__all__ = ["FRAMEWORK", "SPEC", "SUPPORTED", "DISTRIBUTIONS", "HOOKS", "instrument", "uninstrument",
           "is_supported", "modules", "patcher"]
