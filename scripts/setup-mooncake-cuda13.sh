#!/usr/bin/env bash
# Builds the virtualenv the tests on Mooncake 0.3.14 run in: only mooncake-transfer-engine-cuda13 0.3.14 (the one
# build of that release), NVIDIA's CUDA 13 runtime wheel, numpy and pytest (scripts/requirements-mooncake-cuda13.txt),
# and this checkout with its `auto` extra; a stand-in CUDA driver, the engine and runtime real
# (scripts/cuda13-engine-venv.sh says how, and which LD_LIBRARY_PATH its processes need).
#
# Location: $KVT_MC14_VENV, default ${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer/mooncake-cuda13-venv. Prints
# the venv's python on its last line.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=venv-checks.sh
source "$ROOT/scripts/venv-checks.sh"
# shellcheck source=cuda13-engine-venv.sh
source "$ROOT/scripts/cuda13-engine-venv.sh"

cuda13_engine_venv setup-mooncake-cuda13 \
  "${KVT_MC14_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/otel-kvtransfer/mooncake-cuda13-venv}" \
  "$ROOT/scripts/requirements-mooncake-cuda13.txt" \
  'import mooncake.engine, numpy, pytest, opentelemetry.distro, opentelemetry.sdk' \
  "Mooncake 0.3.14 CUDA 13 build" "${BASH_SOURCE[0]}"
