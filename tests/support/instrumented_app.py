"""A test's own app under `opentelemetry-instrument`, in a private network namespace, with the standard OTEL_*
variables only: spans go to a span file, what the app saw goes to a JSON file the test reads back.

The app is a function of a test module, `function(out_path)`, called in a fresh interpreter that the
`opentelemetry-instrument` launcher set up, as a user's process would be.
"""

import importlib.util
import json
import os
import sys

from conftest import mooncake_importable, require_part

from support import netns


def require_parts() -> None:
    require_part(mooncake_importable(), "the Mooncake engine (mooncake-transfer-engine-non-cuda + libibverbs1)")
    netns.require_tools()
    require_part(importlib.util.find_spec("opentelemetry.instrumentation.auto_instrumentation") is not None,
                 "opentelemetry-instrumentation")


def run(tmp_path, module: str, function: str, builder: str, env: dict, timeout_s: float, own_user: bool = False):
    """Run `module.function(out_path)` under opentelemetry-instrument with `builder` and the extra `env`.

    Returns (the finished process, the JSON the app wrote, the span file's path); a failed run fails the test
    with the end of its stderr."""
    require_parts()
    instrument = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    spans_path, out_path = str(tmp_path / "spans.jsonl"), str(tmp_path / "out.json")
    full_env = netns.with_pythonpath(
        {**os.environ, "OTEL_KVTRANSFER_BUILDER": builder, "OTEL_TRACES_EXPORTER": "kvtransfer_file",
         "OTEL_KVTRANSFER_SPAN_FILE": spans_path, "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
         "MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "ERROR", **env}, netns.ROOT)
    script = (f"import sys; sys.path.insert(0, {netns.TESTS!r}); import {module}; "
              f"{module}.{function}({out_path!r})")
    proc = netns.run([instrument, sys.executable, "-c", script], full_env, timeout_s, own_user=own_user,
                     cwd=str(tmp_path))
    assert proc.returncode == 0 and os.path.exists(out_path), proc.stderr[-3000:]
    with open(out_path, encoding="utf-8") as handle:
        return proc, json.load(handle), spans_path
