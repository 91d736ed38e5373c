#!/usr/bin/env bash
# The test command: sets up every real part the tests use, then runs the whole suite.
# With CI=true a missing real part fails its tests instead of skipping them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup.sh" | tail -n 1)"
bash "$ROOT/scripts/setup-observability.sh" >&2
bash "$ROOT/scripts/setup-timeline.sh" >&2
cd "$ROOT"
exec "$PY" -m pytest -q -p no:cacheprovider "$@" tests
