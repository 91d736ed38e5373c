"""The `sglang.srt.plugins` entry point: sglang's own plugin loader switches the instrumentation on.

sglang calls `load_plugins()` in every process that serves (engine, scheduler, detokenizer, DP controller), so
`pip install otel_kvtransfer` alone instruments a `python -m sglang.launch_server` started without
`opentelemetry-instrument`. With `opentelemetry-instrument` as well, the instrumentor is already on in that process
and nothing happens twice. `OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=kv_transfer` switches it off here too, as
`SGLANG_PLUGINS` can keep sglang from loading it at all.

When no SDK is configured yet (no `opentelemetry-instrument`), it configures one from the standard OTEL_*
variables (OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT, ...); with none of them set it logs ONE line saying
the spans go nowhere and how to send them (otel_kvtransfer.wiring.activation, shared by every framework's plugin).
"""

from otel_kvtransfer.wiring.activation import ENTRY_POINT_NAME, activate_plugin, is_disabled

FRAMEWORK_NAME = "sglang"


def activate() -> None:
    """Entry point function (`sglang.srt.plugins`); never raises into sglang."""
    activate_plugin(FRAMEWORK_NAME)


__all__ = ["ENTRY_POINT_NAME", "activate", "is_disabled"]
