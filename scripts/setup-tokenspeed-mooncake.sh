#!/usr/bin/env bash
# Builds the virtualenv the TokenSpeed Mooncake tests run in: only tokenspeed-mooncake (TokenSpeed's fork: the same
# `mooncake` package, a CUDA 13 build), NVIDIA's CUDA 13 runtime wheel and numpy
# (scripts/requirements-tokenspeed-mooncake.txt), and this checkout with its `auto` extra. No other Mooncake build:
# `opentelemetry-instrument` must switch the instrumentation on for this one alone. A stand-in CUDA driver, the
# engine and runtime real (scripts/cuda13-engine-venv.sh says how, and which LD_LIBRARY_PATH its processes need).
#
# Location: $KVT_TOKENSPEED_VENV, default ${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer/tokenspeed-mooncake-venv.
# Prints the venv's python on its last line.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=venv-checks.sh
source "$ROOT/scripts/venv-checks.sh"
# shellcheck source=cuda13-engine-venv.sh
source "$ROOT/scripts/cuda13-engine-venv.sh"

cuda13_engine_venv setup-tokenspeed-mooncake \
  "${KVT_TOKENSPEED_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer/tokenspeed-mooncake-venv}" \
  "$ROOT/scripts/requirements-tokenspeed-mooncake.txt" \
  'import importlib.metadata as m, mooncake.engine, numpy, opentelemetry.distro, opentelemetry.sdk
m.version("tokenspeed-mooncake")' \
  "tokenspeed-mooncake, CUDA 13 build" "${BASH_SOURCE[0]}"
