"""The SDK from the standard OTEL_* variables, for processes nobody set one up in: a framework's plugin in a
process not started under opentelemetry-instrument, and the builder process."""

import logging
import os

from otel_kvtransfer import sdk_internals

_logger = logging.getLogger(__name__)


NO_EXPORTER_MESSAGE = (
    "otel_kvtransfer: instrumenting %s, but no OpenTelemetry exporter is configured, so its spans and metrics go "
    "nowhere; set OTEL_TRACES_EXPORTER=otlp (with OTEL_EXPORTER_OTLP_ENDPOINT) or OTEL_TRACES_EXPORTER=kvtransfer_file "
    "(with OTEL_KVTRANSFER_SPAN_FILE=PATH), and OTEL_METRICS_EXPORTER, or start the server under "
    "opentelemetry-instrument")


def configure_sdk_if_absent(framework: str) -> None:
    """Set up the SDK from the standard OTEL_* variables when nobody has; say so when that means 'nowhere'."""
    from opentelemetry import trace

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return  # opentelemetry-instrument or the application already set one up
    if not os.environ.get("OTEL_TRACES_EXPORTER") and not os.environ.get("OTEL_METRICS_EXPORTER"):
        _logger.warning(NO_EXPORTER_MESSAGE, framework)
        return  # nothing asked for: do not invent an exporter
    Configurator: type  # the distro's, else the SDK's own
    try:
        from opentelemetry.distro import OpenTelemetryConfigurator as Configurator
    except ImportError:
        Configurator = sdk_internals.sdk_configurator_class()
    Configurator().configure()
