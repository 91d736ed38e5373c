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
# shellcheck source=venv-checks.sh
source "$ROOT/scripts/venv-checks.sh"
pinned_tool "$VENV" ruff "$RUFF_VERSION" lint
cd "$ROOT"
exec "$VENV/bin/ruff" check "$@" .
