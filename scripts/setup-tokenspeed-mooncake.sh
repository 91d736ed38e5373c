#!/usr/bin/env bash
# Builds the virtualenv the TokenSpeed Mooncake tests run in (idempotent, fast when up to date): only
# tokenspeed-mooncake (TokenSpeed's fork: the same `mooncake` package, a CUDA 13 build), NVIDIA's CUDA 13 runtime
# wheel and numpy (scripts/requirements-tokenspeed-mooncake.txt), and this checkout with its `auto` extra, as a user
# installs it (`pip install '.[auto]'`; OpenTelemetry pinned by scripts/requirements-test.txt). No other Mooncake
# build: `opentelemetry-instrument` must switch the instrumentation on for this one alone.
#
# A CPU machine has no CUDA driver, and the engine links libcuda.so.1: a stand-in is built here
# (scripts/standin-cuda-driver.sh), one function per driver call the package's libraries import, each answering
# CUDA_ERROR_NO_DEVICE. The engine, its TCP transport and the CUDA runtime are the real ones. Every process of this
# venv needs the stand-in on LD_LIBRARY_PATH; the folders are written, as one line, to $VENV/kvt-ld-library-path:
#
#   LD_LIBRARY_PATH="$(cat "$VENV/kvt-ld-library-path")" "$VENV/bin/python" ...
#
# Location: $KVT_TOKENSPEED_VENV, default ${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer/tokenspeed-mooncake-venv.
# Rebuilt when missing, broken, or when its inputs change (a stamp file records their hash). Prints the venv's python
# on its last line.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVT_TOKENSPEED_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer/tokenspeed-mooncake-venv}"
PYTHON="${PYTHON:-python3}"
WHO=setup-tokenspeed-mooncake
# shellcheck source=venv-checks.sh
source "$ROOT/scripts/venv-checks.sh"
# shellcheck source=standin-cuda-driver.sh
source "$ROOT/scripts/standin-cuda-driver.sh"
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
quiet_pip() { "$VENV/bin/python" -m pip "$@" 2>&1 | grep -v "^WARNING: Location\|^  \|^$\|!!" >&2 || true; }

# What the engine links (`readelf -d mooncake/engine.so`): libibverbs.so.1, libmlx5.so.1 (Debian's ibverbs-providers),
# libnuma.so.1, libcurl.so.4; gcc, libc6-dev and binutils (nm) build the stand-in driver.
missing=()
for pkg in libibverbs1 ibverbs-providers libnuma1 libcurl4 gcc libc6-dev binutils; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "$WHO: installing ${missing[*]} (apt)" >&2
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

DRIVER="$VENV/standin-driver"
PATH_FILE="$VENV/kvt-ld-library-path"
check='import importlib.metadata as m, mooncake.engine, numpy, opentelemetry.distro, opentelemetry.sdk
m.version("tokenspeed-mooncake")'
# The engine imported with the venv's own library path (a venv that lost a piece fails it and is rebuilt).
engine_loads() {
  [ -f "$PATH_FILE" ] && [ -f "$DRIVER/libcuda.so.1" ] \
    && LD_LIBRARY_PATH="$(cat "$PATH_FILE")" "$VENV/bin/python" -c "$check" >/dev/null 2>&1
}

inputs=("$ROOT/scripts/requirements-tokenspeed-mooncake.txt" "$ROOT/scripts/requirements-test.txt"
        "$ROOT/scripts/setup-tokenspeed-mooncake.sh" "$ROOT/scripts/standin-cuda-driver.sh")
want="$(cat "${inputs[@]}" | sha256sum | cut -c1-16)-$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
have="$(cat "$VENV/.kvt-stamp" 2>/dev/null || true)"
if [ "$want" != "$have" ] || ! engine_loads; then
  echo "$WHO: building the virtualenv at $VENV (tokenspeed-mooncake, CUDA 13 build; ~1 minute) ..." >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  quiet_pip install -q --upgrade pip
  quiet_pip install -q -r "$ROOT/scripts/requirements-tokenspeed-mooncake.txt"
  # This checkout with the extra a user installs (`pip install '.[auto]'`), editable: the venv follows the clone.
  # The stamp is read first: a pyproject.toml edited while pip builds makes the next run install it again.
  stamp="$(checkout_stamp)"
  quiet_pip install -q -c "$ROOT/scripts/requirements-test.txt" -e "$ROOT[auto]"
  echo "$stamp" > "$VENV/.kvt-checkout"

  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  runtime="$site/nvidia/cu13/lib"
  [ -f "$site/mooncake/engine.so" ] || { echo "$WHO: no mooncake/engine.so in $site" >&2; exit 1; }
  [ -f "$runtime/libcudart.so.13" ] || { echo "$WHO: no libcudart.so.13 in $runtime" >&2; exit 1; }
  # Every library of the package: the engine, and the store and allocators it may load beside it.
  count="$(build_standin_driver "$DRIVER" "$WHO" "$site"/mooncake/*.so)"
  echo "$DRIVER:$runtime" > "$PATH_FILE"
  unresolved="$(LD_LIBRARY_PATH="$(cat "$PATH_FILE")" ldd "$site/mooncake/engine.so" | grep 'not found' || true)"
  [ -z "$unresolved" ] || { echo "$WHO: the engine still misses: $unresolved" >&2; exit 1; }
  engine_loads || { echo "$WHO: the virtualenv did not come out whole (see the output above)" >&2; exit 1; }
  echo "$WHO: stand-in driver with $count functions at $DRIVER" >&2
  echo "$want" > "$VENV/.kvt-stamp"
fi
# This checkout itself, unless the venv (maybe shared between checkouts: CI caches it) has it already.
install_checkout "$VENV" "$WHO"
echo "$WHO: its processes need LD_LIBRARY_PATH=$(cat "$PATH_FILE")" >&2
echo "$VENV/bin/python"
