"""What the vllm-ascend wrappers share: names and the one Patcher."""

from otel_kvtransfer.frameworks.vllm import common as vllm_common
from otel_kvtransfer.recording.patching import Patcher

FRAMEWORK = "vllm-ascend"  # this backend (the start-up line, warnings)
# kv_transfer.framework on the spans: the serving framework is vLLM (vllm-ascend registers its connectors in vLLM's
# factory, under the names of vLLM's own), so dashboards and metrics keep one label for vLLM on any device.
SERVING = vllm_common.FRAMEWORK

patcher = Patcher(FRAMEWORK)
