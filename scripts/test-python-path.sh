#!/usr/bin/env bash
# The Mooncake async send's wrappers in Python alone (OTEL_KVTRANSFER_HOT_PATH=python), where scripts/test.sh ran
# them compiled (the package's C part, otel_kvtransfer/engines/mooncake/compiled.py): every test module that makes
# one of the async calls, found by name here so a new one joins by itself. The rest of the suite never reaches those
# two wrappers (a second pass would run the same code again), and the whole deployments' async calls are made inside
# transfer scopes, which both paths hand to the same Python code. Runs after scripts/test.sh (its set-up scripts
# answer at once from their caches).
#
#   bash scripts/test-python-path.sh [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup.sh" | tail -n 1)"
KVT_VLLM_PYTHON="$(bash "$ROOT/scripts/setup-vllm.sh" | tail -n 1)"
KVT_MC14_PYTHON="$(bash "$ROOT/scripts/setup-mooncake-cuda13.sh" | tail -n 1)"
export KVT_VLLM_PYTHON KVT_MC14_PYTHON OTEL_KVTRANSFER_HOT_PATH=python
cd "$ROOT"
mapfile -t MODULES < <(grep -rlE --include='test_*.py' \
  'batch_transfer_async|transfer_submit_write|get_batch_transfer_status|transfer_check_status' tests \
  | grep -v '^tests/deployments/' | sort)
[ "${#MODULES[@]}" -gt 0 ] || { echo "test-python-path: no test module makes an async call" >&2; exit 1; }
echo "test-python-path: ${#MODULES[@]} modules with the async wrappers in Python" >&2
exec "$PY" -m pytest -q -p no:cacheprovider "$@" "${MODULES[@]}"
