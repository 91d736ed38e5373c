"""The `sglang.srt.plugins` entry point: sglang's own plugin loader switches the instrumentation on.

sglang calls `load_plugins()` in every process that serves (engine, scheduler, detokenizer, DP controller), so
`pip install otel_kvtransfer` alone instruments a `python -m sglang.launch_server` started without
`opentelemetry-instrument`. With `opentelemetry-instrument` as well, the instrumentor is already on in that process
and nothing happens twice (KVTransferInstrumentor is a singleton that refuses a second instrument(), and the sglang
patches are idempotent). `OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=kv_transfer` switches it off here too, as
`SGLANG_PLUGINS` can keep sglang from loading it at all.

When no SDK is configured yet (no `opentelemetry-instrument`), it configures one from the standard OTEL_*
variables (OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT, ...), through opentelemetry-distro's configurator
when it is installed, else through the SDK's own. Exporting nothing stays possible: OTEL_TRACES_EXPORTER=none.
With no OTEL_TRACES_EXPORTER and no SDK set up by anyone, it logs one warning saying the spans go nowhere and how
to send them (activate() runs once per process: sglang's plugin loader is idempotent).
"""

import logging
import os

_logger = logging.getLogger(__name__)

ENTRY_POINT_NAME = "kv_transfer"


def is_disabled() -> bool:
    names = os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "")
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    return ENTRY_POINT_NAME in wanted or "*" in wanted


def _configure_sdk_if_absent() -> None:
    from opentelemetry import trace  # pylint: disable=import-outside-toplevel

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return  # someone (opentelemetry-instrument, the application) already set one up
    if not os.environ.get("OTEL_TRACES_EXPORTER"):
        return  # nothing asked for: do not invent an exporter
    try:
        from opentelemetry.distro import OpenTelemetryConfigurator as Configurator  # pylint: disable=import-outside-toplevel
    except ImportError:
        from opentelemetry.sdk._configuration import _OTelSDKConfigurator as Configurator  # pylint: disable=import-outside-toplevel
    Configurator().configure()


NOWHERE = ("otel_kvtransfer: sglang is instrumented but no OpenTelemetry SDK is configured, so kv_transfer spans "
           "and metrics go nowhere; to send them set OTEL_TRACES_EXPORTER=otlp (OTEL_EXPORTER_OTLP_ENDPOINT=...) or "
           "OTEL_TRACES_EXPORTER=kvtransfer_file (OTEL_KVTRANSFER_SPAN_FILE=...), or launch under "
           "opentelemetry-instrument")


def _say_if_nothing_exports() -> None:
    """ONE line (per process) when the spans would go to the API's no-op provider: work done, nothing delivered."""
    from opentelemetry import trace  # pylint: disable=import-outside-toplevel

    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        _logger.warning(NOWHERE)


def activate() -> None:
    """Entry point function (`sglang.srt.plugins`); never raises into sglang."""
    if is_disabled():
        return
    try:
        from otel_kvtransfer.instrumentor import KVTransferInstrumentor  # pylint: disable=import-outside-toplevel

        instrumentor = KVTransferInstrumentor()
        if instrumentor.is_instrumented_by_opentelemetry:
            return
        _configure_sdk_if_absent()
        instrumentor.instrument()
        _say_if_nothing_exports()
    except Exception:  # pylint: disable=broad-except
        _logger.warning("otel_kvtransfer: the sglang plugin could not activate the instrumentation", exc_info=True)
