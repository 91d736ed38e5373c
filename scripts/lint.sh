#!/usr/bin/env bash
# The linter: ruff, with the rules and the few per-line exceptions that pyproject.toml and the code carry.
# Its own small virtualenv (outside the clone, rebuilt when the pinned version changes), so a new ruff release
# never changes what passes and the test venv's stamp is untouched.
#
#   bash scripts/lint.sh            check the whole checkout (what CI runs)
#   bash scripts/lint.sh --fix ...  any ruff check arguments
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUFF_VERSION="0.17.6"
VENV="${KVT_LINT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer/lint-venv}"
if [ "$(cat "$VENV/.kvt-stamp" 2>/dev/null || true)" != "$RUFF_VERSION" ]; then
  echo "lint: installing ruff $RUFF_VERSION into $VENV" >&2
  rm -rf "$VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "ruff==$RUFF_VERSION"
  echo "$RUFF_VERSION" > "$VENV/.kvt-stamp"
fi
cd "$ROOT"
exec "$VENV/bin/ruff" check "$@" .
