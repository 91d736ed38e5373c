#!/usr/bin/env bash
# Runs the core of the test suite in a small virtualenv holding the DECLARED MINIMUM versions of the package's
# dependencies (pyproject.toml), so the minimums stay true: an API used from a newer OpenTelemetry release fails
# here, not on a user's machine.
#
#   bash scripts/test-minimums.sh [pytest args...]
#
# The virtualenv lives in $CACHE/min-venv (~/.cache/otel-kvtransfer/min-venv) and is rebuilt when the pins below,
# pyproject.toml or the python change. The package is installed into it editable (--no-deps), so its entry points
# (opentelemetry_instrumentor, ...) are registered as a user's install would register them. The tests chosen need
# no sglang, vLLM, NIXL, Prometheus, node or Phoenix: the core, the Mooncake engine (CPU wheel, libibverbs1 from
# scripts/setup.sh), the metrics, sampling, auto-instrumentation and the SDK canaries.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${OTEL_KVT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer}"
VENV="$CACHE/min-venv"
PYTHON="${PYTHON:-python3}"
# shellcheck source=venv-checks.sh
source "$ROOT/scripts/venv-checks.sh"

# The package's dependencies at exactly the minimums pyproject.toml declares (checked below), then what the
# chosen tests need. opentelemetry-instrument reaches spawn children from opentelemetry-instrumentation 0.63b0,
# which pins opentelemetry-semantic-conventions 0.63b0 and so opentelemetry-api 1.42.0 (pyproject.toml says why).
PINS=(
  "opentelemetry-api==1.42.0"
  "opentelemetry-sdk==1.42.0"
  "opentelemetry-instrumentation==0.63b0"
  "opentelemetry-exporter-otlp-proto-common==1.42.0"
  "wrapt==1.14.1"
  # extras and test needs, at the versions matching the minimums
  "opentelemetry-distro==0.63b0"
  "opentelemetry-exporter-otlp-proto-http==1.42.0"
  "opentelemetry-test-utils==0.63b0"
  "mooncake-transfer-engine-non-cuda==0.3.13.post1"
  "numpy==2.4.6"
  "pytest==9.0.3"
  "PyYAML==6.0.4"
)
TESTS=(
  tests/project/test_sdk_canary.py
  tests/project/test_config.py
  tests/building/test_aggregate_and_stitching.py
  tests/recording/test_recorder.py
  tests/building/test_builder.py
  tests/building/test_span_encoding.py
  tests/building/test_processor.py
  tests/recording/test_integration_api.py
  tests/building/test_request_spans.py
  tests/building/test_metrics_from_spans.py
  tests/recording/test_recorder_delivery.py
  tests/building/test_sampling.py
  tests/building/test_file_exporter.py
  tests/wiring/test_auto_instrumentation.py
  tests/offloading/test_builder_process.py
  tests/engines/test_mooncake_engine.py
  tests/recording/test_faults.py
)

quiet_pip() { "$VENV/bin/python" -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location" >&2 || true; }

stamp="$( { printf '%s\n' "${PINS[@]}"; "$PYTHON" --version 2>&1; cat "$ROOT/pyproject.toml"; } | sha256sum | cut -c1-16)"
if [ "$(cat "$VENV/.otel-kvtransfer-stamp" 2>/dev/null)" != "$stamp" ] \
   || ! "$VENV/bin/python" -c "import otel_kvtransfer, opentelemetry.sdk" >/dev/null 2>&1; then
  echo "test-minimums: building $VENV (the declared minimum versions)" >&2
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  quiet_pip --upgrade pip
  quiet_pip "${PINS[@]}"
  echo "$stamp" > "$VENV/.otel-kvtransfer-stamp"
fi
# This checkout itself, editable, unless the cached venv has it already (venv-checks.sh: one that points at a
# checkout since deleted would still import in this process, from the current directory, but not in the child
# processes the tests start).
install_checkout "$VENV" test-minimums

# The job means something only if the versions in force are the pins AND the pins are pyproject's minimums.
"$VENV/bin/python" - "$ROOT/pyproject.toml" "${PINS[@]}" <<'EOF'
import re, sys, tomllib
from importlib.metadata import version
pyproject, pins = sys.argv[1], dict(p.split("==", 1) for p in sys.argv[2:])
errors = [f"{name} is {version(name)}, pinned {want}" for name, want in pins.items() if version(name) != want]
with open(pyproject, "rb") as handle:
    dependencies = tomllib.load(handle)["project"]["dependencies"]
for requirement in dependencies:
    name = re.split(r"[ <>=!~;\[]", requirement, maxsplit=1)[0]
    minimum = re.search(r">=\s*([^,\s;]+)", requirement)
    if not minimum:
        errors.append(f"pyproject declares no minimum for {name}")
    elif pins.get(name) != minimum.group(1):
        errors.append(f"pyproject declares {name} >= {minimum.group(1)}, this job pins {pins.get(name)}")
if errors:
    sys.exit("test-minimums: " + "; ".join(errors))
print("test-minimums: " + ", ".join(f"{n}=={v}" for n, v in pins.items() if n.startswith(("opentelemetry-a",
      "opentelemetry-s", "opentelemetry-i", "wrapt"))))
EOF

cd "$ROOT"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@"
