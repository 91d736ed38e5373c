"""The `vllm.general_plugins` entry point: vLLM's own plugin loader switches the instrumentation on.

vLLM calls `load_general_plugins()` in every process that matters (API server, engine core, workers), so
`pip install otel_kvtransfer` alone instruments a `python -m vllm.entrypoints.openai.api_server` started without
`opentelemetry-instrument`. Under `opentelemetry-instrument` the instrumentor is already on and nothing happens
twice. `OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=kv_transfer` switches it off here too (vLLM's own
`VLLM_PLUGINS` can keep it from loading at all). Without an SDK set up yet, one is configured from the standard
OTEL_* variables, exactly as the sglang plugin does (the same functions).
"""

import logging

# The same activation rules as sglang's plugin: one implementation, not a copy.
from otel_kvtransfer.frameworks.sglang.plugin import _configure_sdk_if_absent, is_disabled

_logger = logging.getLogger(__name__)


def activate() -> None:
    """Entry point function (`vllm.general_plugins`); never raises into vLLM."""
    if is_disabled():
        return
    try:
        from otel_kvtransfer.instrumentor import KVTransferInstrumentor  # pylint: disable=import-outside-toplevel

        instrumentor = KVTransferInstrumentor()
        if instrumentor.is_instrumented_by_opentelemetry:
            return
        _configure_sdk_if_absent()
        instrumentor.instrument()
    except Exception:  # pylint: disable=broad-except
        _logger.warning("otel_kvtransfer: the vLLM plugin could not activate the instrumentation", exc_info=True)
