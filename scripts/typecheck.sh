#!/usr/bin/env bash
# The type checker: mypy, with the settings pyproject.toml's [tool.mypy] carries (strict on the package's core).
# Its own small virtualenv (outside the clone, rebuilt when the pinned version changes), so a new mypy release never
# changes what passes; it reads the installed libraries' types (OpenTelemetry, wrapt) from the project's test venv,
# the one scripts/setup.sh sets up and names on its last line (KVT_TYPECHECK_PYTHON: another python to read them from).
#
#   bash scripts/typecheck.sh              check the package (what CI runs)
#   bash scripts/typecheck.sh FILE ...     any mypy arguments instead (files, --strict, ...)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MYPY_VERSION="2.4.1"
VENV="${KVT_TYPECHECK_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer/typecheck-venv}"
# shellcheck source=venv-checks.sh
source "$ROOT/scripts/venv-checks.sh"
pinned_tool "$VENV" mypy "$MYPY_VERSION" typecheck
PY="${KVT_TYPECHECK_PYTHON:-$(bash "$ROOT/scripts/setup.sh" | tail -n 1)}"
cd "$ROOT"
# The cache outside the clone, one per checkout (checkouts share module names, and may check at once).
CACHE="$VENV/cache/$(printf '%s' "$ROOT" | sha256sum | cut -c1-16)"
exec "$VENV/bin/mypy" --python-executable "$PY" --cache-dir "$CACHE" "$@"
