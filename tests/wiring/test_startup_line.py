"""The start-up line (otel_kvtransfer.wiring.startup), in real Python processes: one INFO line per instrumented
process, through the logging configuration the engine set up, or straight to stderr where nobody configured any.

Each test runs a short script in its own interpreter (the line is once per process) with the real instrumentor,
an SDK TracerProvider and sglang installed, as in the engines' processes; what a framework learns from its KV
manager is handed over through `startup.role_known`, the call sglang's and vLLM's hooks make (their real managers
make it in tests/frameworks/sglang/test_ranks.py and on the real servers in test_sglang_shapes.py /
test_vllm_serving.py).
"""

import os
import subprocess
import sys
import textwrap

from support.paths import ROOT

PRELUDE = """
import logging, sys
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otel_kvtransfer.wiring import startup
from otel_kvtransfer.wiring.instrumentor import KVTransferInstrumentor
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
instrumentor = KVTransferInstrumentor()
"""


def _run(body: str, **env):
    script = PRELUDE + textwrap.dedent(body)
    environment = dict(os.environ, PYTHONPATH=ROOT, **env)
    environment.pop("OTEL_TRACES_EXPORTER", None)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=environment, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _lines(text: str):
    return [line for line in text.splitlines() if "otel_kvtransfer: on (" in line]


def test_with_no_logging_configured_the_line_goes_to_stderr_once_with_role_and_rank():
    proc = _run("""
        instrumentor.instrument(tracer_provider=provider)
        startup.role_known("sglang", "decode", {"kv_transfer.tp_rank": 1})
        startup.role_known("sglang", "prefill", {"kv_transfer.tp_rank": 0})  # a second manager: no second line
    """)
    (line,) = _lines(proc.stderr)
    assert " INFO otel_kvtransfer: on (otel_kvtransfer " in line
    assert "; role decode, kv_transfer.tp_rank 1 (sglang); " in line
    assert "patched: sglang 0.5.23" in line and "engines: mooncake " in line
    assert "builder: thread" in line and "spans: unset (InMemorySpanExporter)" in line
    assert not _lines(proc.stdout)


def test_through_the_engines_root_logging_config_in_its_format_and_only_there():
    # sglang's configure_logger: basicConfig on the root logger, "[time] message", at --log-level.
    proc = _run("""
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s TP0] %(message)s", stream=sys.stdout, force=True)
        instrumentor.instrument(tracer_provider=provider)
        startup.role_known("sglang", "prefill", {"kv_transfer.tp_rank": 0})
    """)
    (line,) = _lines(proc.stdout)
    assert line.startswith("[") and " TP0] otel_kvtransfer: on (" in line
    assert not _lines(proc.stderr)  # not printed a second time beside the engine's handler


def test_an_engine_logging_at_warning_keeps_the_line_out():
    proc = _run("""
        logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout, force=True)
        instrumentor.instrument(tracer_provider=provider)
        startup.role_known("sglang", "prefill", {"kv_transfer.tp_rank": 0})
    """)
    assert not _lines(proc.stdout) and not _lines(proc.stderr)


def test_a_process_that_never_learns_a_role_says_so_at_exit():
    proc = _run("""
        instrumentor.instrument(tracer_provider=provider)
        print("exiting", flush=True)
    """)
    (line,) = _lines(proc.stderr)
    assert "; no role in this process (no KV manager or connector worker seen); " in line


def test_uninstrumented_before_the_role_is_known_prints_nothing():
    proc = _run("""
        instrumentor.instrument(tracer_provider=provider)
        instrumentor.uninstrument()
        startup.role_known("sglang", "prefill", {"kv_transfer.tp_rank": 0})
    """)
    assert not _lines(proc.stderr)


def test_the_exporters_named_by_otel_variables_and_held_by_the_providers():
    proc = _run("""
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        instrumentor.instrument(tracer_provider=provider, meter_provider=MeterProvider([InMemoryMetricReader()]))
        startup.role_known("vllm", "prefill and decode", {"kv_transfer.tp_rank": 0})
    """, OTEL_METRICS_EXPORTER="prometheus")
    (line,) = _lines(proc.stderr)
    assert "; role prefill and decode, kv_transfer.tp_rank 0 (vllm); " in line
    assert line.endswith("; metrics: prometheus (InMemoryMetricReader)")


def test_a_forked_child_is_a_process_of_its_own_and_says_so_once():
    # vLLM may fork its engine core from the API server: the child inherits the instrumentation, not its line.
    proc = _run("""
        import os
        instrumentor.instrument(tracer_provider=provider)
        startup.role_known("sglang", "prefill", {"kv_transfer.tp_rank": 0})
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            startup.role_known("sglang", "decode", {"kv_transfer.tp_rank": 1})
            startup.role_known("sglang", "decode", {"kv_transfer.tp_rank": 2})
            sys.stderr.flush()
            os._exit(0)
        os.waitpid(pid, 0)
    """)
    said = sorted(next(part for part in line.split("; ") if part.startswith("role ")) for line in _lines(proc.stderr))
    assert said == ["role decode, kv_transfer.tp_rank 1 (sglang)", "role prefill, kv_transfer.tp_rank 0 (sglang)"]


def test_the_devices_configured_are_named_escaped_and_bounded():
    """The framework's device option (sglang's --disaggregation-ib-device, as its KV manager hands it over) and
    UCX_NET_DEVICES: named on the line; a value with control characters (a forged log line, a terminal escape)
    stays on the line, escaped, and bounded."""
    proc = _run("""
        instrumentor.instrument(tracer_provider=provider)
        startup.role_known("sglang", "prefill", {"kv_transfer.tp_rank": 0},
                           {"--disaggregation-ib-device": "mlx5_0,mlx5_1\\n2026-01-01 CRITICAL forged\\x1b[2J"})
    """, UCX_NET_DEVICES="mlx5_2:1," + "x" * 300)
    (line,) = _lines(proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1  # nothing the values held started a line of its own
    part = next(p for p in line.split("; ") if p.startswith("devices: "))
    assert part.startswith("devices: sglang --disaggregation-ib-device mlx5_0,mlx5_1\\x0a2026-01-01 CRITICAL "
                           "forged\\x1b[2J, UCX_NET_DEVICES mlx5_2:1,xxx")
    assert part.endswith("x... (309 characters)") and len(part) < 300


def test_no_device_configured_says_so():
    proc = _run("""
        instrumentor.instrument(tracer_provider=provider)
        startup.role_known("sglang", "prefill", {"kv_transfer.tp_rank": 0})
    """, UCX_NET_DEVICES="")  # other tests of the session may have set it in this process's environment
    (line,) = _lines(proc.stderr)
    assert "; devices: none named; untimed calls: none; role prefill" in line
