#!/usr/bin/env bash
# Sets up everything the package, its demo and its core tests need, on a fresh Debian machine (idempotent):
#   - Debian libibverbs1 + libnuma1 (the Mooncake engine library links both)
#   - a virtualenv at $KVT_VENV (default: .venv in the checkout) with sglang 0.5.23 on CPU (pins in
#     scripts/requirements-sglang.txt, sglang itself with --no-deps), the Mooncake CPU wheel, and this package
#     with its test extras. The venv is rebuilt when those inputs change (a stamp file records their hash).
# Prints the venv's python on its last line.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVT_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
# shellcheck source=venv-checks.sh
source "$ROOT/scripts/venv-checks.sh"
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
# libibverbs1, libnuma1: the Mooncake engine links them; g++: torch compiles CPU kernels when an MLA server warms
# up, and its gcc builds this package's compiled part (pyproject.toml's ext-modules); iproute2: ip and ss in the
# deployments' network namespaces
for pkg in libibverbs1 libnuma1 g++ iproute2; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]} (apt)" >&2
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

stamp_of_inputs() {
  cat "$ROOT/scripts/requirements-sglang.txt" "$ROOT/scripts/requirements-test.txt" | sha256sum | cut -c1-16
}
want="$(stamp_of_inputs)-$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
have="$(cat "$VENV/.kvt-stamp" 2>/dev/null || true)"
if [ "$want" != "$have" ] || ! has_modules "$VENV" sglang mooncake.engine; then
  echo "setup: building the virtualenv at $VENV (sglang on CPU, Mooncake, OpenTelemetry; a few minutes) ..." >&2
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" >&2 || true
  "$VENV/bin/python" -m pip install -q -r "$ROOT/scripts/requirements-sglang.txt" 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
  "$VENV/bin/python" -m pip install -q --no-deps "sglang==0.5.23" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  "$VENV/bin/python" -m pip install -q -r "$ROOT/scripts/requirements-test.txt" 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
  "$VENV/bin/python" -c "import sglang, mooncake.engine, opentelemetry.sdk" \
    || { echo "setup: the virtualenv did not come out whole (see the pip output above)" >&2; exit 1; }
  echo "$want" > "$VENV/.kvt-stamp"
fi
# A real sglang server (launch_server) and sglang-router, for the end-to-end serving tests: added to the venv
# above without touching its pins (they are constraints here); skipped while the stamp matches.
server_want="$(cat "$ROOT/scripts/requirements-sglang-server.txt" "$ROOT/scripts/requirements-sglang.txt" \
  | sha256sum | cut -c1-16)-router-0.3.2"
server_have="$(cat "$VENV/.kvt-server-stamp" 2>/dev/null || true)"
if [ "$server_want" != "$server_have" ] \
  || ! has_modules "$VENV" fastapi uvicorn xgrammar sglang_router; then
  echo "setup: adding sglang's server dependencies and sglang-router to $VENV ..." >&2
  "$VENV/bin/python" -m pip install -q -r "$ROOT/scripts/requirements-sglang-server.txt" \
    -c "$ROOT/scripts/requirements-sglang.txt" "sglang-router==0.3.2" 2>&1 \
    | grep -v "^WARNING: Location\|^ERROR: pip's dependency resolver\|^sglang 0.5.23 requires" >&2 || true
  "$VENV/bin/python" -c "import fastapi, uvicorn, xgrammar, sglang_router" \
    || { echo "setup: sglang's server dependencies did not install" >&2; exit 1; }
  echo "$server_want" > "$VENV/.kvt-server-stamp"
fi
# NIXL for the NIXL engine tests and `demo --engine nixl` (scripts/requirements-nixl.txt, --no-deps: its wheels
# need nothing else on CPU); skipped while the stamp matches.
nixl_want="$(sha256sum < "$ROOT/scripts/requirements-nixl.txt" | cut -c1-16)"
if [ "$nixl_want" != "$(cat "$VENV/.kvt-nixl-stamp" 2>/dev/null || true)" ] \
  || ! has_modules "$VENV" nixl; then
  echo "setup: adding NIXL to $VENV ..." >&2
  "$VENV/bin/python" -m pip install -q --no-deps -r "$ROOT/scripts/requirements-nixl.txt" 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
  "$VENV/bin/python" -c "import nixl" || { echo "setup: NIXL did not install" >&2; exit 1; }
  echo "$nixl_want" > "$VENV/.kvt-nixl-stamp"
fi
# This checkout itself, editable, unless the venv (maybe shared between checkouts: CI caches it) has it already.
install_checkout "$VENV" setup
echo "$VENV/bin/python"
