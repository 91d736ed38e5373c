"""How a backend is switched on: the one lazy patcher every engine and framework patches through
(`wiring.lazy_patcher.LazyPatcher`, named here too), and the frameworks' plugin hook.

- `activate_plugin()` is what a framework's plugin entry point calls in every process the framework starts: it
  respects OTEL_PYTHON_DISABLED_INSTRUMENTATIONS, sets up the SDK from the standard OTEL_* variables when nobody
  has (saying in one log line where spans go when no exporter is configured), and instruments once.
"""

import logging
import os

from otel_kvtransfer.building.sdk_setup import configure_sdk_if_absent

# re-exported: the frameworks and the tests name them here (the engines import the leaf itself)
from otel_kvtransfer.wiring.lazy_patcher import LazyPatcher as LazyPatcher
from otel_kvtransfer.wiring.lazy_patcher import bounds as bounds
from otel_kvtransfer.wiring.lazy_patcher import version_tuple as version_tuple

_logger = logging.getLogger(__name__)

ENTRY_POINT_NAME = "kv_transfer"  # the opentelemetry_instrumentor entry point, also the name to disable


def is_disabled() -> bool:
    names = os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "")
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    return ENTRY_POINT_NAME in wanted or "*" in wanted


def activate_plugin(framework: str) -> None:
    """What a framework's plugin entry point does; never raises into the framework."""
    if is_disabled():
        return
    try:
        from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor

        instrumentor = KVTransferInstrumentor()
        if instrumentor.is_instrumented_by_opentelemetry:
            return
        configure_sdk_if_absent(framework)
        instrumentor.instrument()
    except Exception:
        _logger.warning("otel_kvtransfer: the %s plugin could not activate the instrumentation", framework,
                        exc_info=True)
