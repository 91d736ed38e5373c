"""Where spans are built when nobody said: in a helper process when it can set up the same SDK as this process,
in this process otherwise.

The helper (`offloading/`) sets up its SDK from the same OTEL_* variables, so it can stand in for
this process only when this process's SDK came from them too: every span processor a BatchSpanProcessor around
an exporter named by OTEL_TRACES_EXPORTER, every metric reader a periodic one around an exporter named by
OTEL_METRICS_EXPORTER (what `opentelemetry-instrument` and the sglang / vLLM plugins set up). An application
that made its providers in code (its own processors, an in-memory exporter), or passed a provider to
`instrument()`, keeps building in process, where its own processors see the spans. OTEL_KVTRANSFER_BUILDER=
process or thread decides instead (with OTEL_KVTRANSFER_HELPER_SETUP naming how a helper sets up its SDK).
A helper that can never start (its interpreter gone) is not waited for: after the link's bounded tries, this
process builds in process after all, assembled as the thread builder is (`in_process.assemble`).
"""

import logging
import os
from importlib.metadata import entry_points
from typing import Any, Set

from otel_kvtransfer import config, sdk_internals
from otel_kvtransfer.offloading import lifecycle

_logger = logging.getLogger(__name__)


def choose(settings: config.Settings, tracer_provider: object, meter_provider: object, provider_given: bool) -> str:
    """'process' or 'thread'."""
    if settings.builder == "thread":
        return "thread"
    why_not = lifecycle.unavailable_reason()
    if settings.builder == "process":
        if why_not is None:
            return "process"
        _logger.warning("otel_kvtransfer: %s=process, but %s; building spans in this process instead",
                        config.BUILDER, why_not)
        return "thread"
    if why_not is not None or provider_given:
        return "thread"
    if os.environ.get(lifecycle.SETUP_ENV, "").strip():
        return "process"
    return "process" if sdk_from_environment(tracer_provider, meter_provider) else "thread"


def _exporter_classes(group: str, variable: str) -> Set[Any]:
    classes = set()
    for name in os.environ.get(variable, "").split(","):
        name = name.strip()
        if not name or name == "none":
            continue
        # "otlp" is whichever OTLP exporter OTEL_EXPORTER_OTLP_*PROTOCOL picks: accept either.
        names = (name, "otlp_proto_grpc", "otlp_proto_http") if name == "otlp" else (name,)
        for entry in (e for n in names for e in entry_points(group=group, name=n)):
            try:
                classes.add(entry.load())
            except Exception:
                _logger.debug("otel_kvtransfer: could not load exporter %s", name, exc_info=True)
    return classes


def _ours(processor: object) -> bool:
    return type(processor).__module__.startswith("otel_kvtransfer.")


def sdk_from_environment(tracer_provider: object, meter_provider: object) -> bool:
    """True when both providers are SDK providers holding exactly what OTEL_* asks for (nothing made in code)."""
    processors = sdk_internals.span_processors(tracer_provider)
    if processors is None:
        return False
    span_exporters = _exporter_classes("opentelemetry_traces_exporter", "OTEL_TRACES_EXPORTER")
    for processor in processors:
        if _ours(processor):
            continue
        exporter = getattr(processor, "span_exporter", None)
        if type(processor).__name__ != "BatchSpanProcessor" or type(exporter) not in span_exporters:
            return False
    readers = sdk_internals.metric_readers(meter_provider)
    if readers is None:
        return not os.environ.get("OTEL_METRICS_EXPORTER", "").strip() or \
            os.environ.get("OTEL_METRICS_EXPORTER", "").strip() == "none"
    metric_exporters = _exporter_classes("opentelemetry_metrics_exporter", "OTEL_METRICS_EXPORTER")
    for reader in readers:
        exporter = sdk_internals.reader_exporter(reader)
        if type(reader).__name__ != "PeriodicExportingMetricReader" or type(exporter) not in metric_exporters:
            return False
    return True
