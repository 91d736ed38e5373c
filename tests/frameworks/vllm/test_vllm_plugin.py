"""vLLM's own plugin loader switches the instrumentation on (no `opentelemetry-instrument`), in the vLLM venv.

`load_general_plugins()` is what vLLM runs in its API server, engine-core and worker processes; here it runs in
one plain process of the vLLM virtualenv, which then imports the connector modules and NIXL as a worker would.
"""

import subprocess

from support.parts import require_part
from vllm_serving import harness

PROBE = """
import os, sys
from vllm.plugins import load_general_plugins
load_general_plugins()
from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor
from otel_kvtransfer.recording.patching import is_ours
assert KVTransferInstrumentor().is_instrumented_by_opentelemetry, "not instrumented"
import vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector as mooncake
import vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker as pull
import nixl._api
assert is_ours(mooncake.MooncakeConnectorWorker.__dict__["_send_blocks"]), "Mooncake connector not patched"
assert is_ours(pull.NixlPullConnectorWorker.__dict__["_read_blocks"]), "NIXL connector not patched"
assert is_ours(nixl._api.nixl_agent.__dict__["transfer"]), "NIXL not patched"
print("instrumented" if os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS") is None else "?")
"""


def _probe(extra_env):
    import os

    python = harness.vllm_python()
    require_part(harness.vllm_ready(python),
                 f"the vLLM virtualenv at {python} (run `bash scripts/setup-vllm.sh`, or set KVT_VLLM_PYTHON)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.pop("PYTHONPATH", None)  # no sitecustomize of opentelemetry-instrument: the plugin alone
    env.update({"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"})
    env.update(extra_env)
    return subprocess.run([python, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600, check=False)


def test_vllm_plugin_loader_instruments_connectors_and_nixl():
    done = _probe({})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "instrumented"


def test_disabled_instrumentation_is_respected_by_the_plugin():
    done = _probe({"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "kv_transfer"})
    assert done.returncode != 0
    assert "not instrumented" in done.stderr
