"""The `vllm.general_plugins` entry point: vLLM's own plugin loader switches the instrumentation on.

vLLM calls `load_general_plugins()` in every process that matters (API server, engine core, workers), so
`pip install otel_kvtransfer` alone instruments a `python -m vllm.entrypoints.openai.api_server` started without
`opentelemetry-instrument`. Under `opentelemetry-instrument` the instrumentor is already on and nothing happens
twice. `OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=kv_transfer` switches it off here too (`VLLM_PLUGINS` can keep vLLM
from loading it at all). With no SDK configured yet, one is configured from the standard OTEL_* variables
(otel_kvtransfer.wiring.activation, shared by every framework's plugin).
"""

from otel_kvtransfer.wiring.activation import ENTRY_POINT_NAME, activate_plugin, is_disabled

FRAMEWORK_NAME = "vllm"


def activate() -> None:
    """Entry point function (`vllm.general_plugins`); never raises into vLLM."""
    activate_plugin(FRAMEWORK_NAME)


__all__ = ["ENTRY_POINT_NAME", "activate", "is_disabled"]
