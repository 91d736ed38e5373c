#!/usr/bin/env bash
# The wheels bench/gpu_check.py needs on a device machine with no network, fetched here (with network) into
# bench/device_wheels/, which git ignores (the folder's own .gitignore): the OpenTelemetry packages this package
# imports and one NIXL build (the `nixl` selector and `nixl-cu<major>`), for the device machine's Python and CUDA
# major (its torch's `torch.version.cuda`). About 61 MB with the CUDA 13 build for CPython 3.12: with the checkout
# (~3 MB) it fits a run's 64 MiB. numpy comes from the image (NIXL imports it).
#
#   PYTHON=.venv/bin/python bash bench/device_wheels.sh [--python 3.12] [--cuda 13] [--platform manylinux_2_28_x86_64]
#   # then, on the device machine, with bench/device_wheels carried:
#   python bench/gpu_check.py --wheels bench/device_wheels --out "$OUT/gpu_check.json"
set -euo pipefail

PY_VERSION=3.12
CUDA_MAJOR=13
PLATFORM=manylinux_2_28_x86_64
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY_VERSION="$2"; shift 2 ;;
    --cuda) CUDA_MAJOR="$2"; shift 2 ;;
    --platform) PLATFORM="$2"; shift 2 ;;
    *) echo "device_wheels.sh: unknown argument: ${1:0:100}" >&2; exit 2 ;;
  esac
done
case "$PY_VERSION" in 3.1[0-9]) ;; *) echo "device_wheels.sh: --python 3.10 .. 3.19" >&2; exit 2 ;; esac
case "$CUDA_MAJOR" in 12|13) ;; *) echo "device_wheels.sh: --cuda 12 or 13 (NIXL's builds)" >&2; exit 2 ;; esac

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="$HERE/device_wheels"
mkdir -p "$DIR"
printf '*\n' > "$DIR/.gitignore"  # nothing here is committed, the .gitignore itself included
ABI="cp${PY_VERSION/./}"

# The versions the test suite runs (scripts/setup.sh's environment); no dependency resolution: the list is whole.
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DIR" \
  --python-version "$PY_VERSION" --implementation cp --abi "$ABI" --abi abi3 --abi none --platform "$PLATFORM" \
  --platform any \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-instrumentation==0.66b2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-proto==1.45.2 protobuf==7.36.2 wrapt==2.5.2 typing_extensions==4.16.0 packaging==26.4 \
  nixl==1.5.1 "nixl-cu${CUDA_MAJOR}==1.5.1"
du -sh "$DIR"
ls "$DIR"
