#!/usr/bin/env bash
# The type checker: mypy, with the settings pyproject.toml's [tool.mypy] carries (strict on the package's core).
# Its own small virtualenv (outside the clone, rebuilt when the pinned version changes), so a new mypy release never
# changes what passes; it reads the installed libraries' types (OpenTelemetry, wrapt) from the project's test venv,
# the one scripts/setup.sh sets up and names on its last line (KVT_TYPECHECK_PYTHON: another python to read them from).
#
#   bash scripts/typecheck.sh              check the package, then the C part's stub against the built module
#                                          (mypy's stubtest; what CI runs)
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
if [ "$#" -gt 0 ]; then
  exec "$VENV/bin/mypy" --python-executable "$PY" --cache-dir "$CACHE" "$@"
fi
"$VENV/bin/mypy" --python-executable "$PY" --cache-dir "$CACHE"

# The Mooncake wing's C part: its .pyi held to the module built into the checkout (scripts/setup.sh builds it where
# a C compiler is). stubtest imports what it checks in its own interpreter, the checker's (the same python the venv
# was made from): the built module alone, as a top-level module of a folder of its own, so nothing of the package
# (nor OpenTelemetry) need be importable there.
WING="otel_kvtransfer/engines/mooncake"
SUFFIX="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
BUILT="$WING/_async_compiled$SUFFIX"
if [ ! -e "$BUILT" ]; then
  if command -v cc >/dev/null; then
    echo "typecheck: $BUILT is not built (bash scripts/setup.sh builds it): its stub cannot be checked" >&2
    exit 1
  fi
  echo "typecheck: no C compiler here, so no compiled part: its stub is not checked" >&2
  exit 0
fi
STUBS="$(mktemp -d)"
trap 'rm -rf "$STUBS"' EXIT
cp "$BUILT" "$WING/_async_compiled.pyi" "$STUBS/"
(cd "$STUBS" && PYTHONPATH="$STUBS" "$VENV/bin/python" -m mypy.stubtest _async_compiled)
