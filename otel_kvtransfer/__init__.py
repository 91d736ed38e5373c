"""OpenTelemetry instrumentation for KV-cache transfers in prefill/decode-disaggregated LLM serving.

Every actual KV transfer becomes a `kv_transfer.send` span with its exact bytes, under a `kv_transfer.request`
span for its request; `KVTransferMetricsProcessor` derives the speed metrics from those spans.

Usage, with auto-instrumentation (standard OTEL_* variables only):

    opentelemetry-instrument python -m sglang.launch_server ...

or by hand:

    from otel_kvtransfer import KVTransferInstrumentor
    KVTransferInstrumentor().instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)

Names: `otel_kvtransfer.semconv`. Engine integration API: `otel_kvtransfer.integration`.
"""

from otel_kvtransfer.instrumentor import KVTransferInstrumentor
from otel_kvtransfer.processor import KVTransferMetricsProcessor
from otel_kvtransfer.sampler import RecordUnsampledSampler
from otel_kvtransfer.version import __version__

__all__ = ["KVTransferInstrumentor", "KVTransferMetricsProcessor", "RecordUnsampledSampler", "__version__"]
