"""OpenTelemetry instrumentation for KV-cache transfers in prefill/decode-disaggregated LLM serving.

Every actual KV transfer becomes a `kv_transfer.send` span with its exact bytes, under a `kv_transfer.request`
span for its request; the peer's wait is a `kv_transfer.receive` (push) or `kv_transfer.serve` (pull) span in the
same trace; the speed metrics are recorded from the same figures the spans carry.

Usage, with auto-instrumentation (standard OTEL_* variables only):

    opentelemetry-instrument python -m sglang.launch_server ...      # or vLLM's api_server, or any engine

or by hand:

    from otel_kvtransfer import KVTransferInstrumentor
    KVTransferInstrumentor().instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)

The folders say where code runs (`recording/` on the engine's threads, `building/` in the builder, `wiring/` at
start-up, `tools/` offline, `engines/` and `frameworks/` the wrappers); docs/architecture.md is the map of every
module. The API a serving framework calls: `otel_kvtransfer.integration`.
"""

from otel_kvtransfer.building.processor import KVTransferMetricsProcessor
from otel_kvtransfer.building.sampler import RecordUnsampledSampler
from otel_kvtransfer.recording import integration
from otel_kvtransfer.version import __version__
from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor

__all__ = ["KVTransferInstrumentor", "KVTransferMetricsProcessor", "RecordUnsampledSampler", "__version__",
           "integration"]
