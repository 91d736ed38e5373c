#!/usr/bin/env bash
# Installs the real parts that the observability tests use (idempotent; safe to run again):
#   - Debian `prometheus` (server + promtool) for tests/deployments/test_prometheus_dashboard.py
#   - npm `@grafana/schema` + `typescript` (versions from dashboards/typecheck/package.json) into a cache dir
#     outside the repo, for tests/project/test_dashboard_schema.py; reinstalled when that package.json changes
#   - PyPI `arize-phoenix` in its OWN virtualenv under the same cache dir, for tests/deployments/test_trace_store.py
#   - Debian `iproute2` (the `ip` tool that brings loopback up inside `unshare --net`), util-linux (unshare,
#     nsenter), python3-venv where the python lacks ensurepip
#   - Jaeger v2 and the OpenTelemetry Collectors of collector/agent.yaml and collector/gateway.yaml, built with the
#     Go toolchain from the Go module proxy: the checked-in modules collector/jaeger/, collector/otelcol-agent/ and
#     collector/otelcol-gateway/ (their go.sum pin every dependency) into $CACHE/go-bin/<name>-<version>/, with the
#     Go module and build caches under $CACHE/go (a rebuild after an edit compiles only what changed)
# Works as root on a fresh Debian machine. Prints the paths the tests look at; the last lines are
# `jaeger=<path>`, `otelcol=<path>` (the agent) and `otelcol-gateway=<path>`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${OTEL_KVT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer}"
NODE_DIR="$CACHE/node"
PHOENIX_VENV="$CACHE/phoenix-venv"
PHOENIX_REQ="arize-phoenix==20.26.1"
PYTHON="${PYTHON:-python3}"

# shellcheck source=venv-checks.sh
source "$ROOT/scripts/venv-checks.sh"
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# --- Debian packages -------------------------------------------------------------------------------
need_apt=()
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v tc >/dev/null 2>&1 || need_apt+=(iproute2)  # the rate-limited link of the peer alert test
command -v unshare >/dev/null 2>&1 || need_apt+=(util-linux)
command -v npm >/dev/null 2>&1 || need_apt+=(nodejs npm)
command -v nsenter >/dev/null 2>&1 || need_apt+=(util-linux)
# Phoenix gets its own venv: Debian's python3 needs python3-venv for that (ensurepip).
"$PYTHON" -c "import ensurepip, venv" >/dev/null 2>&1 || need_apt+=(python3-venv)
if [ "${#need_apt[@]}" -gt 0 ]; then
  as_root apt-get update
  # The Debian service would start a Prometheus on :9090 (all interfaces); tests start their own.
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    $(printf '%s\n' "${need_apt[@]}" | sort -u)
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
    as_root systemctl stop prometheus || true
  fi
fi
# Debian's postinst may start prometheus through the init script where there is no systemd: stop only that one.
if [ -f /run/prometheus.pid ] && kill -0 "$(cat /run/prometheus.pid)" 2>/dev/null; then
  as_root kill "$(cat /run/prometheus.pid)" || true
fi

# --- npm: @grafana/schema + typescript -------------------------------------------------------------
mkdir -p "$NODE_DIR"
PKG="$ROOT/dashboards/typecheck/package.json"
if ! cmp -s "$PKG" "$NODE_DIR/package.json" || [ ! -x "$NODE_DIR/node_modules/.bin/tsc" ] \
   || [ ! -d "$NODE_DIR/node_modules/@grafana/schema" ]; then
  rm -rf "$NODE_DIR/node_modules" "$NODE_DIR/package-lock.json"
  cp "$PKG" "$NODE_DIR/package.json"
  (cd "$NODE_DIR" && npm install --no-audit --no-fund --ignore-scripts)
fi

# --- arize-phoenix in its own venv -----------------------------------------------------------------
stamp="$PHOENIX_VENV/.otel-kvtransfer-req"
if [ ! -x "$PHOENIX_VENV/bin/phoenix" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$PHOENIX_REQ" ] \
   || ! has_modules "$PHOENIX_VENV" phoenix; then
  rm -rf "$PHOENIX_VENV"
  "$PYTHON" -m venv "$PHOENIX_VENV"
  "$PHOENIX_VENV/bin/python" -m pip install --quiet --upgrade pip
  "$PHOENIX_VENV/bin/python" -m pip install --quiet "$PHOENIX_REQ"
  echo "$PHOENIX_REQ" > "$stamp"
fi

echo "prometheus: $(command -v prometheus)"
echo "promtool:   $(command -v promtool)"
echo "tsc:        $NODE_DIR/node_modules/.bin/tsc"
echo "phoenix:    $PHOENIX_VENV/bin/phoenix"

# --- Jaeger and the Collectors, from the Go module proxy (scripts/setup-go-binaries.sh) ---------------
bash "$ROOT/scripts/setup-go-binaries.sh"
