#!/usr/bin/env bash
# Jaeger v2 and the OpenTelemetry Collectors of collector/agent.yaml and collector/gateway.yaml, built with the Go
# toolchain from the Go module proxy: the checked-in modules collector/jaeger/, collector/otelcol-agent/ and
# collector/otelcol-gateway/ (their go.sum pin every dependency) into $CACHE/go-bin/<name>-<version>/, with the Go
# module and build caches under $CACHE/go (a rebuild after an edit compiles only what changed). Idempotent, 0.3 s
# when current; cold, the longest set-up step (docs/testing.md), so scripts/test.sh starts it first, in the
# background, beside the Python set-up. One build at a time (a lock): a second run waits for the first, then finds
# the binaries current. Called by scripts/setup-observability.sh; its last lines are `jaeger=<path>`,
# `otelcol=<path>` (the agent) and `otelcol-gateway=<path>`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${OTEL_KVT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer}"
mkdir -p "$CACHE"
exec 9>"$CACHE/go-bin.lock"
flock 9

command -v go >/dev/null 2>&1 || { echo "setup-go-binaries: go (>= 1.26) is needed to build Jaeger and the Collector" >&2; exit 1; }
GO_DIR="$CACHE/go"
JAEGER_VERSION=v1.75.0  # Jaeger 2.12.0 (the module's v1 tags carry the v2 program)

# go_build NAME VERSION MODULE_DIR PACKAGE [LDFLAGS]: prints the binary's path; builds it only when the module's
# files, the Go version or the flags changed since the build in the cache (a stamp beside the binary says which).
go_build() {
  local name=$1 version=$2 dir="$ROOT/$3" pkg=$4 ldflags="-s -w ${5:-}"
  local out="$CACHE/go-bin/$name-$version/$name" stamp
  stamp="$( (cd "$dir" && find . -type f \( -name '*.go' -o -name go.mod -o -name go.sum \) -print0 \
             | LC_ALL=C sort -z | xargs -0 sha256sum; go env GOVERSION; echo "$ldflags") | sha256sum | cut -c1-16)"
  if [ ! -x "$out" ] || [ "$(cat "$out.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$CACHE/go-bin/$name-"*  # older versions of this binary
    mkdir -p "$(dirname "$out")"
    echo "setup-go-binaries: building $name $version (cold: several minutes on 2 cores) ..." >&2
    # Static like the upstream releases; -mod=readonly: go.sum decides, nothing is resolved anew.
    (cd "$dir" && GOMODCACHE="$GO_DIR/mod" GOCACHE="$GO_DIR/build" GOTOOLCHAIN=local CGO_ENABLED=0 \
       GOFLAGS="-mod=readonly -buildvcs=false -trimpath" go build -ldflags="$ldflags" -o "$out.tmp" "$pkg" >&2)
    mv "$out.tmp" "$out"
    echo "$stamp" > "$out.stamp"
  fi
  echo "$out"
}
JAEGER="$(go_build jaeger "$JAEGER_VERSION" collector/jaeger github.com/jaegertracing/jaeger/cmd/jaeger \
  "-X github.com/jaegertracing/jaeger/internal/version.latestVersion=v2.12.0")"
OTELCOL="$(go_build otelcol-agent v0.162.0 collector/otelcol-agent .)"
OTELCOL_GATEWAY="$(go_build otelcol-gateway v0.161.0 collector/otelcol-gateway .)"

echo "jaeger=$JAEGER"
echo "otelcol=$OTELCOL"
echo "otelcol-gateway=$OTELCOL_GATEWAY"
