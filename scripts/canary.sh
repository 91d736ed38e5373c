#!/usr/bin/env bash
# The release canary: the newest release of vllm, vllm-ascend, sglang and every published build of Mooncake and NIXL (the
# engine modules' DISTRIBUTIONS) from the package registry, for any Python this package declares (requires-python:
# one `pip index versions --python-version X.Y` per Python and build, each with a timeout), every patch target of
# this package checked against its real source or compiled engine (read statically: wheels are downloaded with
# `pip download --no-deps --python-version X.Y`, unpacked, never installed; no CUDA stack). One line per library or
# build, naming the Pythons its release has wheels for. vllm-ascend publishes some releases as an sdist only: its
# newest is read from its sdist (pip runs its metadata step in a small build virtualenv of the canary's own).
#
#   bash scripts/canary.sh [--only NAME ...] [--version NAME==X.Y.Z ...]
#
# Cache: $KVT_CANARY_CACHE, default ${XDG_CACHE_HOME:-~/.cache}/otel-kvtransfer/canary/<distribution>/<version>/
# (outside the clone; a release is fetched once). Exit 1 when a target is missing; a registry that cannot be
# reached is one line, and a failure only under CI=true. The tests of the canary itself are
# tests/project/test_version_canary.py (part of scripts/test.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(bash "$ROOT/scripts/setup.sh" | tail -n 1)"
cd "$ROOT"
exec "$PY" tests/support/version_canary.py "$@"
