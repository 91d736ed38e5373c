#!/usr/bin/env bash
# The main job: sets up what the demo needs, then runs `otel-kvtransfer demo` (arguments pass through).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup.sh" | tail -n 1)"
cd "$ROOT"
exec "$(dirname "$PY")/otel-kvtransfer" demo "$@"
